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
from pathlib import Path
from typing import Callable

from .sources import Unit, _check_field, _pyarrow, _record_texts, _record_units, _source_kind, _text_units
from .text import VAL_FRACTION, DataError
from .token_shards import (BYTES, CHUNK_BYTES, DEFAULT_SHARD_TOKENS, FORMAT, FORMAT_VERSION, HELD_OUT_EVERY, MANIFEST,
                           SPLITS, data_sha256, dtype_for, is_prepared, np, tokenizer_sha256)

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
