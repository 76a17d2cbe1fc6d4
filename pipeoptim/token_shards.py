"""Token shards: a corpus tokenized once (``pipeoptim prepare-data``), read by index at training time.

Text tokenized inside the training run costs every rank the whole corpus in memory (and the tokenizer's time at
every start); users pretrain on tens of GB. So, as nanoGPT's ``.bin`` files, torchtitan's and Megatron's indexed
datasets do, ``prepare`` tokenizes a source once, in parallel, into flat binary shards of token ids (``uint16``
when every id fits, else ``uint32``, little-endian: ``np.memmap(path, dtype)`` reads one whole) and a small
``manifest.json`` saying what they hold. A training rank then reads only the windows it draws (``os.pread`` at
an index, no mapping: its memory stays flat whatever the corpus size, where a memmap's touched pages would count
in its RSS).

Sources: a text file or a folder of text files (as ``pipeoptim.data.text_files``: the last 5% of every file's
bytes held out, files joined by a newline: byte-level shards hold exactly ``text_corpus``'s bytes); JSONL or
Parquet files (or a folder of one kind), or a Hugging Face ``datasets`` folder written by ``save_to_disk``, each
record's ``text_field``; a record is held out when the hash of its text says so (1 in 20: independent of the
order and of how the work is split, and a record repeated in the source lands on one side only).

The manifest names the tokenizer (``bytes`` without one) with a hash of its files, the vocabulary size, dtype,
each shard's token count and sha256, the held-out rule and the source. ``data_sha256`` (a hash of what the
tokens are: tokenizer, dtype, every shard's hash) is what a checkpoint records, so a resume on other data is
refused. Nothing here imports torch.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator



class _Numpy:
    """numpy, imported at its first use: ``pipeoptim train`` reads a manifest among its configuration checks, which
    answer a wrong flag before anything heavy is imported (tests/test_cli_args.py)."""

    def __getattr__(self, name):
        import numpy
        return getattr(numpy, name)


np = _Numpy()
_ITEMSIZE = {"uint16": 2, "uint32": 4}  # the dtypes prepare-data writes (``dtype_for``)
from .data import VAL_FRACTION, DataError, held_out_bytes, text_files

FORMAT = "pipeoptim-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
BYTES = "bytes"  # the tokenizer name of byte-level shards (vocabulary 256)
HELD_OUT_EVERY = round(1 / VAL_FRACTION)  # records: 1 in 20 held out, by the hash of its text
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 Mi tokens: 512 MiB of uint16 per shard
CHUNK_BYTES = 4 << 20  # the unit of work of one worker: a text file is cut into pieces of about this size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model")
_RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


# ---- what the shards hold -------------------------------------------------------------------------------
def dtype_for(vocab_size: int) -> str:
    """The narrowest little-endian dtype holding every id below ``vocab_size`` (as nanoGPT: uint16 for GPT-2's)."""
    return "uint16" if vocab_size - 1 <= 0xFFFF else "uint32"


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that ``prepare`` wrote (it holds a manifest)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def tokenizer_sha256(name_or_path: str) -> str:
    """A hash of a tokenizer's files: the tokenizer.json given, or the tokenizer files of a folder (or of the
    Hugging Face cache's snapshot of a model name); a file's name and bytes both count."""
    if os.path.isfile(name_or_path):
        paths = [Path(name_or_path)]
    else:
        folder = Path(name_or_path)
        if not folder.is_dir():
            try:
                from huggingface_hub import snapshot_download
                folder = Path(snapshot_download(name_or_path, local_files_only=True))
            except Exception as e:  # the hub library raises its own types for a name not in the cache
                raise DataError(f"no tokenizer files found for {name_or_path!r} ({type(e).__name__})") from None
        paths = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if not paths:
            raise DataError(f"{folder} holds none of the tokenizer files ({', '.join(TOKENIZER_FILES)})")
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def data_sha256(manifest: dict) -> str:
    """What the tokens are, in one hash: tokenizer (name and files), dtype and every shard's count and sha256;
    not the source path or the folder (a moved or copied folder is the same data)."""
    what = {"tokenizer": manifest["tokenizer"], "dtype": manifest["dtype"],
            "splits": {s: [(sh["tokens"], sh["sha256"]) for sh in manifest["splits"][s]["shards"]] for s in SPLITS}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def read_manifest(folder: str | os.PathLike) -> dict:
    """The manifest of the prepared folder ``folder``, checked against its shard files' sizes (not their
    hashes: that would read the whole corpus); DataError naming what is wrong and the fix."""
    path = os.path.join(folder, MANIFEST)
    again = "prepare it again with pipeoptim prepare-data"
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} cannot be read as a manifest ({type(e).__name__}: {e}); {again}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"{path} is not a manifest of pipeoptim prepare-data (no \"format\": \"{FORMAT}\"); give the "
                        f"folder prepare-data wrote, or a text file or folder")
    if m.get("version") != FORMAT_VERSION:
        raise DataError(f"{path} is format version {m.get('version')!r}; this pipeoptim reads version "
                        f"{FORMAT_VERSION}: {again}")
    try:
        itemsize = _ITEMSIZE[m["dtype"]]
        for split in SPLITS:
            for shard in m["splits"][split]["shards"]:
                name = shard["file"]
                if os.path.basename(name) != name or name in ("", ".", ".."):
                    raise DataError(f"{path} names the shard {name!r}, which is not a file inside the folder; {again}")
                size = os.path.getsize(os.path.join(folder, name)) if os.path.isfile(os.path.join(folder, name)) \
                    else None
                want = int(shard["tokens"]) * itemsize
                if size != want:
                    what = "is missing" if size is None else f"holds {size} bytes"
                    raise DataError(f"the shard {os.path.join(folder, name)} {what}, but the manifest says "
                                    f"{shard['tokens']} tokens of {m['dtype']} ({want} bytes): the folder is "
                                    f"incomplete or was changed; {again}")
        int(m["tokenizer"]["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path} lacks a field or has a wrong one ({type(e).__name__}: {e}); {again}") from None
    return m


# ---- reading windows ----------------------------------------------------------------------------------
class TokenShards:
    """A prepared folder, read by index: ``window(split, start, length)`` reads tokens ``start .. start+length-1``
    of a split (its shards one after the other) with ``os.pread``; files open on the first read."""

    def __init__(self, folder: str | os.PathLike):
        self._fds: dict[str, int] = {}
        self.folder = str(folder)
        self.manifest = read_manifest(folder)
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.data_sha256 = data_sha256(self.manifest)
        self._shards = {s: [sh for sh in self.manifest["splits"][s]["shards"] if sh["tokens"]] for s in SPLITS}
        self._starts = {s: np.cumsum([0] + [sh["tokens"] for sh in self._shards[s]]).tolist() for s in SPLITS}

    def tokens(self, split: str) -> int:
        return self._starts[split][-1]

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(os.path.join(self.folder, name), os.O_RDONLY)
        return self._fds[name]

    def window(self, split: str, start: int, length: int) -> np.ndarray:
        starts, shards = self._starts[split], self._shards[split]
        if start < 0 or start + length > starts[-1]:
            raise IndexError(f"tokens {start}..{start + length - 1} are outside the {split} split's {starts[-1]}")
        i = bisect.bisect_right(starts, start) - 1
        size = self.dtype.itemsize
        if start + length <= starts[i + 1]:  # within one shard: one read
            return np.frombuffer(os.pread(self._fd(shards[i]["file"]), length * size, (start - starts[i]) * size),
                                 dtype=self.dtype)
        parts, at = [], start
        while at < start + length:
            n = min(start + length, starts[i + 1]) - at
            parts.append(np.frombuffer(os.pread(self._fd(shards[i]["file"]), n * size, (at - starts[i]) * size),
                                       dtype=self.dtype))
            at, i = at + n, i + 1
        return np.concatenate(parts)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        self.close()


@dataclass
class WindowSampler:
    """Random windows of a prepared split, drawn from the counter-based generator ``(seed, split, position)``:
    draw number ``position`` is the same whatever came before, so ``state()`` (the seed and the position) in a
    checkpoint makes a resumed run read exactly the batches the uninterrupted run would. ``starts`` needs only
    the token count: a rank that feeds no data advances the position without opening a file."""
    seed: int
    position: int = 0

    def starts(self, split: str, tokens: int, rows: int, seq_len: int, position: int | None = None) -> np.ndarray:
        if tokens <= seq_len + 1:
            raise ValueError(f"the {split} split has {tokens} tokens, too few for seq_len={seq_len}")
        where = self.position if position is None else position
        rng = np.random.default_rng([self.seed % (1 << 64), SPLITS.index(split), where])
        return rng.integers(0, tokens - seq_len - 1, size=rows)

    def state(self) -> dict:
        return {"seed": self.seed, "position": self.position}


def read_windows(shards: TokenShards, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """(len(starts), seq_len + 1) int64: each window and its next token."""
    out = np.empty((len(starts), seq_len + 1), dtype=np.int64)
    for row, s in enumerate(starts.tolist()):
        out[row] = shards.window(split, s, seq_len + 1)
    return out


# ---- sources ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unit:
    """One worker's piece: ``kind`` text (bytes a..b of a file, all in ``split``), jsonl (the lines starting in
    bytes a..b), parquet (row group a), arrow (rows a..b of a datasets file)."""
    kind: str
    path: str
    a: int
    b: int
    split: str = ""
    new_document: bool = True  # a separator goes before it (text: a file's first piece of a split)


def _source_kind(src: Path) -> tuple[str, list[Path]]:
    """('text' | 'jsonl' | 'parquet' | 'arrow', its files) for the source ``src``; DataError if none fits."""
    if not src.exists():
        raise DataError(f"{src} does not exist")
    if src.is_dir() and (src / "dataset_dict.json").is_file():
        splits = _json(src / "dataset_dict.json").get("splits", [])
        raise DataError(f"{src} is a Hugging Face DatasetDict ({', '.join(splits)}): give one split's folder, e.g. "
                        f"{src / (splits[0] if splits else 'train')}")
    if src.is_dir() and (src / "state.json").is_file():
        return "arrow", _arrow_files(src)
    if src.is_file() and src.suffix in _RECORD_SUFFIXES:
        return _RECORD_SUFFIXES[src.suffix], [src]
    if src.is_dir():
        files = [p for p in sorted(src.rglob("*")) if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(src).parts)]
        kinds = {_RECORD_SUFFIXES.get(p.suffix, "text") for p in files}
        if len(kinds) > 1 and kinds & set(_RECORD_SUFFIXES.values()):
            raise DataError(f"the folder {src} mixes {' and '.join(sorted(kinds))} files: give a folder of one kind "
                            "(text, .jsonl or .parquet)")
        if kinds and kinds <= set(_RECORD_SUFFIXES.values()):
            return kinds.pop(), files
    return "text", text_files(src)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} holds no JSON object")
    return value


def _arrow_files(folder: Path) -> list[Path]:
    try:
        import datasets  # noqa: F401  (the folder's format; its files are read with pyarrow, no code runs)
    except ImportError:
        raise DataError(f"{folder} is a Hugging Face datasets folder (save_to_disk); reading it needs the datasets "
                        "package: pip install datasets") from None
    names = [f.get("filename") for f in _json(folder / "state.json").get("_data_files", [])]
    if not names or any(not isinstance(n, str) or os.path.basename(n) != n for n in names):
        raise DataError(f"{folder / 'state.json'} lists no data files inside the folder: save it again with "
                        "save_to_disk")
    return [folder / n for n in names]


def _pyarrow(what: str):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(f"{what} needs the pyarrow package: pip install pyarrow") from None
    return pyarrow


def _open_arrow(path: str):
    pa = _pyarrow("a datasets folder")
    return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()


def _line_end(f, at: int, size: int) -> int:
    """The offset just past the first newline at or after ``at`` (``size`` if none)."""
    f.seek(at)
    while at < size:
        block = f.read(1 << 16)
        if not block:
            return size
        i = block.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(block)
    return size


def _text_units(files: list[Path], chunk: int, byte_level: bool) -> Iterator[Unit]:
    """Every file's training bytes, then in a second pass its held-out bytes (so that each split's tokens come
    in file order), in pieces of about ``chunk`` bytes; a tokenizer's pieces end at a newline, where a cut
    changes no token but those of the line break itself."""
    for split in SPLITS:
        for p in files:
            size = p.stat().st_size
            cut = size - held_out_bytes(size)
            lo, hi = (0, cut) if split == "train" else (cut, size)
            first = True
            with open(p, "rb") as f:
                while first or lo < hi:
                    end = min(hi, lo + chunk)
                    if end < hi and not byte_level:
                        end = min(hi, _line_end(f, end, hi))
                    yield Unit("text", str(p), lo, end, split, first)
                    lo, first = end, False


def _record_units(kind: str, files: list[Path], chunk: int) -> Iterator[Unit]:
    for p in files:
        if kind == "jsonl":
            size = p.stat().st_size
            with open(p, "rb") as f:
                lo = 0
                while lo < size:
                    end = _line_end(f, min(size, lo + chunk), size) if lo + chunk < size else size
                    yield Unit(kind, str(p), lo, end)
                    lo = end
        elif kind == "parquet":
            import pyarrow.parquet as pq
            for g in range(pq.ParquetFile(str(p)).num_row_groups):
                yield Unit(kind, str(p), g, g + 1)
        else:
            rows = _open_arrow(str(p)).num_rows
            step = 8192
            for lo in range(0, rows, step):
                yield Unit(kind, str(p), lo, min(rows, lo + step))


def _check_field(kind: str, files: list[Path], field: str) -> None:
    """DataError before anything is written when the records have no ``field`` (naming the fields they have)."""
    if kind == "jsonl":
        with open(files[0], "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{files[0]} line {n} is not JSON ({e}): every line of a .jsonl file is one "
                                        "JSON object") from None
                    have = list(rec) if isinstance(rec, dict) else []
                    break
            else:
                return
    elif kind == "parquet":
        _pyarrow("a Parquet file")
        import pyarrow.parquet as pq
        have = pq.ParquetFile(str(files[0])).schema_arrow.names
    else:
        have = _open_arrow(str(files[0])).schema.names
    if field not in have:
        raise DataError(f"the records of {files[0]} have no field {field!r} (they have: {', '.join(map(str, have))}); "
                        "name the text's field with --text-field")


# ---- the workers --------------------------------------------------------------------------------------
_encode: Callable[[str], list[int]] | None = None  # this worker's tokenizer (None: bytes)


def _init_worker(tokenizer: str | None) -> None:
    global _encode
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    if tokenizer is None:
        _encode = None
    else:
        from .data import load_tokenizer
        _encode = load_tokenizer(tokenizer)[0]


def _tokens(text: bytes) -> np.ndarray:
    if _encode is None:
        return np.frombuffer(text, dtype=np.uint8)
    return np.asarray(_encode(text.decode("utf-8", errors="replace")), dtype=np.int64)


def _held_out(text: bytes) -> bool:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") % HELD_OUT_EVERY == 0


def _record_texts(unit: Unit, field: str) -> Iterator[bytes]:
    if unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(unit.a)
            block = f.read(unit.b - unit.a)
        at = unit.a
        for line in block.split(b"\n"):
            if line.strip():
                try:
                    value = json.loads(line)[field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(f"{unit.path}: the line at byte {at} is no JSON object with a field {field!r} "
                                    f"({type(e).__name__}: {e})") from None
                yield _text_bytes(value, unit, field)
            at += len(line) + 1
    else:
        if unit.kind == "parquet":
            import pyarrow.parquet as pq
            column = pq.ParquetFile(unit.path).read_row_group(unit.a, columns=[field]).column(field)
        else:
            column = _open_arrow(unit.path).slice(unit.a, unit.b - unit.a).column(field)
        for value in column.to_pylist():
            yield _text_bytes(value, unit, field)


def _text_bytes(value, unit: Unit, field: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise DataError(f"{unit.path}: field {field!r} holds a {type(value).__name__}, not text; name the text's "
                        "field with --text-field")
    return value.encode("utf-8")


def _work(job: tuple[Unit, str, list[int]]) -> tuple[Unit, dict[str, list[np.ndarray]], int]:
    """Tokenize one unit: ({split: [token arrays, each one document or piece]}, bytes read)."""
    unit, field, sep = job
    if unit.kind == "text":
        with open(unit.path, "rb") as f:
            f.seek(unit.a)
            data = f.read(unit.b - unit.a)
        return unit, {unit.split: [_tokens(data)]}, len(data)
    out: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    read = 0
    for text in _record_texts(unit, field):
        read += len(text)
        if text:
            out["val" if _held_out(text) else "train"].append(_tokens(text))
    return unit, out, read


# ---- writing ------------------------------------------------------------------------------------------
class _ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` each, hashing as it goes."""

    def __init__(self, folder: str, split: str, dtype: str, shard_tokens: int, vocab_size: int):
        self.folder, self.split, self.dtype, self.limit = folder, split, np.dtype(dtype).newbyteorder("<"), shard_tokens
        self.vocab_size = vocab_size
        self.shards: list[dict] = []
        self._f = None
        self._hash = None
        self.total = 0
        self.documents = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})
        self._f = open(os.path.join(self.folder, name), "wb")
        self._hash = hashlib.sha256()

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
            self.shards[-1]["sha256"] = self._hash.hexdigest()
            self._f = None

    def write(self, tokens: np.ndarray) -> None:
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise DataError(f"the tokenizer gave id {int(tokens.max())}, beyond its vocabulary of {self.vocab_size}")
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._f is None or self.shards[-1]["tokens"] == self.limit:
                self._close()
                self._open()
            room = self.limit - self.shards[-1]["tokens"]
            piece, tokens = tokens[:room], tokens[room:]
            raw = piece.tobytes()
            self._f.write(raw)
            self._hash.update(raw)
            self.shards[-1]["tokens"] += len(piece)
            self.total += len(piece)

    def finish(self) -> dict:
        self._close()
        if not self.shards:  # an empty split still has a (empty) shard: the manifest always lists one per split
            self._open()
            self._close()
        return {"tokens": self.total, "shards": self.shards}


def check_output(out: Path, src: Path, overwrite: bool) -> None:
    """DataError, before anything is read or written, when ``out`` may not receive a prepared folder."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file: give a folder path (a new one, or an earlier prepared folder with "
                        "--overwrite)")
    resolved_out, resolved_src = out.resolve(), src.resolve()
    if resolved_out == resolved_src or resolved_out in resolved_src.parents:
        raise DataError(f"{out} holds the source {src}: give the prepared data a path of its own")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise DataError(f"{out} exists and is not empty: give --overwrite to replace it (an earlier prepared "
                            "folder), or another path")
        if not is_prepared(out):
            raise DataError(f"--overwrite replaces a folder that prepare-data wrote (it holds {MANIFEST}); {out} holds "
                            "other files, which it would delete: give another path")


def prepare(source: str | os.PathLike, out: str | os.PathLike, tokenizer: str | None = None, *,
            text_field: str = "text", workers: int = 1, overwrite: bool = False, progress: bool = True,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Tokenize ``source`` into the folder ``out`` (see the module docstring); returns the manifest. The folder
    is written under a temporary name beside ``out`` and renamed at the end: ``out`` is never half-written."""
    src, out = Path(source), Path(out)
    check_output(out, src, overwrite)
    kind, files = _source_kind(src)
    if kind == "parquet":
        _pyarrow("a Parquet file")
    if kind != "text":
        _check_field(kind, files, text_field)
    if tokenizer is None:
        vocab, sep, tok_hash = 256, [10], None
    else:
        from .data import load_tokenizer
        encode, vocab = load_tokenizer(tokenizer)
        sep, tok_hash = list(encode("\n")), tokenizer_sha256(tokenizer)
    dtype = dtype_for(vocab)
    units = list(_text_units(files, chunk_bytes, tokenizer is None) if kind == "text"
                 else _record_units(kind, files, chunk_bytes))
    total_bytes = sum(p.stat().st_size for p in files)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    try:
        writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens, vocab) for s in SPLITS}
        separator = np.asarray(sep, dtype=np.int64)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data", file=sys.stderr,
                       dynamic_ncols=True) if kind == "text" else \
                tqdm(total=len(units), unit="piece", desc="prepare-data", file=sys.stderr, dynamic_ncols=True)
        jobs = ((u, text_field, sep) for u in units)
        for unit, parts, read in _run(jobs, workers, tokenizer):
            for split, arrays in parts.items():
                w = writers[split]
                for k, tokens in enumerate(arrays):
                    if unit.new_document or k:
                        if w.documents:  # documents joined by the separator, as text_corpus joins files
                            w.write(separator)
                        w.documents += 1
                    w.write(tokens)
            if bar is not None:
                bar.update(read if kind == "text" else 1)
        if bar is not None:
            bar.close()
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "tokenizer": {"name": tokenizer or BYTES, "sha256": tok_hash, "vocab_size": vocab, "separator": sep},
            "dtype": dtype,
            "splits": {s: w.finish() for s, w in writers.items()},
            "held_out": ({"rule": "the last 5% of every file's bytes", "fraction": VAL_FRACTION} if kind == "text" else
                         {"rule": f"a record whose text's blake2b hash is 0 modulo {HELD_OUT_EVERY}",
                          "fraction": 1 / HELD_OUT_EVERY}),
            "source": {"path": str(src.resolve()), "kind": "datasets" if kind == "arrow" else kind, "files": len(files), "bytes": total_bytes,
                       **({"text_field": text_field} if kind != "text" else {})},
        }
        manifest["data_sha256"] = data_sha256(manifest)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _run(jobs, workers: int, tokenizer: str | None):
    """The units' results in order, from ``workers`` processes (or this one)."""
    if workers <= 1:
        _init_worker(tokenizer)
        yield from map(_work, jobs)
        return
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # no torch or tokenizer state forked into the workers
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap(_work, jobs, chunksize=1)


def _swap_in(tmp: str, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; an earlier prepared ``out`` (--overwrite) is moved aside
    first and deleted after."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent)
        os.rename(out, os.path.join(old, "data"))
    elif out.is_dir():
        out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
