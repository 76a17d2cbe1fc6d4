"""Token shards: a corpus tokenized once (``pipeoptim prepare-data``), read by index at training time.

Text tokenized inside the training run costs every rank the whole corpus in memory (and the tokenizer's time at
every start); users pretrain on tens of GB. So, as nanoGPT's ``.bin`` files, torchtitan's and Megatron's indexed
datasets do, ``prepare_data.prepare`` tokenizes a source once, in parallel, into flat binary shards of token ids
(``uint16`` when every id fits, else ``uint32``, little-endian: ``np.memmap(path, dtype)`` reads one whole) and a small
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
from dataclasses import dataclass
from pathlib import Path

from .text import VAL_FRACTION, DataError


class _Numpy:
    """numpy, imported at its first use: ``pipeoptim train`` reads a manifest among its configuration checks, which
    answer a wrong flag before anything heavy is imported (tests/test_cli_args.py)."""

    def __getattr__(self, name):
        import numpy
        return getattr(numpy, name)


np = _Numpy()
_ITEMSIZE = {"uint16": 2, "uint32": 4}  # the dtypes prepare-data writes (``dtype_for``)

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
