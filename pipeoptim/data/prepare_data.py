"""``pipeoptim prepare-data``: a source tokenized once, in parallel, into the shards ``token_shards`` reads.

The source is cut into units of about ``CHUNK_BYTES`` (a piece of a text file, a slice of JSONL, Parquet or Arrow
records); worker processes tokenize units and hand back each split's tokens; one writer fills fixed-size shards in
source order and records every shard's token count and sha256; the manifest is written last and the finished folder
swapped in whole, so an interrupted run leaves no folder that looks prepared. What the shards and the manifest hold,
and how a record is held out, is ``token_shards``'s docstring. Nothing here imports torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .text import VAL_FRACTION, DataError, held_out_bytes, text_files
from .token_shards import (BYTES, CHUNK_BYTES, DEFAULT_SHARD_TOKENS, FORMAT, FORMAT_VERSION, HELD_OUT_EVERY, MANIFEST,
                           SPLITS, data_sha256, dtype_for, is_prepared, np, tokenizer_sha256)

_RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


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
        from .text import load_tokenizer
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
        from .text import load_tokenizer
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
