"""Where ``pipeoptim prepare-data``'s text comes from, cut into units of work: text files (pieces of about
``CHUNK_BYTES`` ending at a line), JSONL slices, Parquet row groups and the Arrow files a ``datasets`` folder holds;
and each unit's records as bytes. Its own module so that the tokenizing workers and the shard writer
(``prepare_data``) read a source without knowing its format. Nothing here imports torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .text import DataError, held_out_bytes, text_files
from .token_shards import SPLITS

__all__ = ["Unit"]

_RECORD_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


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
