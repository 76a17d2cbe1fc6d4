"""Training text for the examples, the tests and ``pipeoptim train``: on every machine, never downloaded.

- `stdlib_corpus`: the Python standard library's own source files as bytes (a real text corpus, a few
  tens of MB), split deterministically into train and validation by file (every 20th file held out).
- `text_corpus`: the user's own text (one file, or a folder of them), the last 5% of every file held out.
  `check_text` checks such a source from its file sizes alone (no torch), so a wrong ``--data`` fails at once.
- Both are byte-level (vocabulary 256) unless given ``encode``, a tokenizer's text -> ids function.
- `digits`: scikit-learn's bundled 8×8 handwritten digits (1,797 images), if scikit-learn is present.
"""
from __future__ import annotations

import errno
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch

VOCAB_SIZE = 256  # byte-level language modelling
VAL_FRACTION = 0.05  # held out: every 20th stdlib file; the last 5% of every file of a text source
_BINARY_PROBE = 8192  # a file with a NUL byte in its first 8 KiB is binary, not text


class DataError(ValueError):
    """A text source that cannot train a model: missing, empty, or too short for one window."""


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


@dataclass
class Corpus:
    train: "torch.Tensor"  # uint8 bytes, or int32 token ids
    val: "torch.Tensor"

    def batch(self, split: str, batch_size: int, seq_len: int, gen: "torch.Generator") -> tuple["torch.Tensor", "torch.Tensor"]:
        """Random windows: inputs (B, T) and next-token targets (B, T), both int64."""
        import torch
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise ValueError(f"the {split} split has {data.numel()} tokens, too few for seq_len={seq_len}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]


def _to_tensor(parts: Sequence[bytes], encode: Callable[[str], list[int]] | None) -> "torch.Tensor":
    import torch
    joined = b"\n".join(parts)
    if encode is None:
        return torch.frombuffer(bytearray(joined), dtype=torch.uint8)
    return torch.tensor(encode(joined.decode("utf-8", errors="replace")), dtype=torch.int32)


def stdlib_corpus(max_bytes: int = 8 << 20, val_fraction: float = VAL_FRACTION,
                  encode: Callable[[str], list[int]] | None = None) -> Corpus:
    """The standard library's source as bytes; every 1/val_fraction-th file goes to validation."""
    files = _stdlib_files()
    if not files:
        raise RuntimeError(f"no Python source files found under {sysconfig.get_paths()['stdlib']}")
    every = max(2, round(1 / val_fraction))
    train, val, total = [], [], 0
    for i, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % every == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return Corpus(train=_to_tensor(train, encode), val=_to_tensor(val, encode))


# ---- the user's own text --------------------------------------------------------------------------------
def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(_BINARY_PROBE)


def text_files(path: str | os.PathLike) -> list[Path]:
    """The files of a text source: ``path`` itself, or every file under the folder ``path`` (sorted; hidden
    files and folders, and binary files, skipped). DataError if there is none."""
    root = Path(path)
    if not root.exists():
        if root.is_symlink():
            raise DataError(_broken_link(root))
        raise DataError(f"{root} does not exist")
    if root.is_file():
        if not _is_text(root):
            raise DataError(f"{root} is a binary file (a NUL byte in its first {_BINARY_PROBE // 1024} KiB), not "
                            "text: give a text file, a folder of text files, or a folder made by pipeoptim "
                            "prepare-data")
        return [root]
    if not root.is_dir():
        raise DataError(f"{root} is neither a file nor a folder")
    files = [p for p in sorted(root.rglob("*")) if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    text = [p for p in files if _is_text(p)]
    if not text:
        what = f"only binary files ({len(files)})" if files else "no files"
        raise DataError(f"the folder {root} holds {what}: give a text file or a folder of text files")
    return text


def _broken_link(link: Path) -> str:
    """Why the symbolic link ``link`` leads nowhere: a loop (it points back to itself), or a missing target."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (f"{link} is a symbolic link that leads back to itself (a loop: {link} -> "
                    f"{os.readlink(link)}); point it at a text file or folder")
    return f"{link} is a symbolic link to {os.readlink(link)}, which does not exist"


def held_out_bytes(size: int, val_fraction: float = VAL_FRACTION) -> int:
    """How many bytes at the end of a file of ``size`` bytes go to validation."""
    return int(size * val_fraction)


def check_text(path: str | os.PathLike, seq_len: int, val_fraction: float = VAL_FRACTION) -> tuple[int, int]:
    """(training bytes, validation bytes) of the text source ``path``, from file sizes alone; DataError
    naming the problem if it is empty or too short for one window of ``seq_len`` + 1 bytes in each split."""
    files = text_files(path)
    sizes = [p.stat().st_size for p in files]
    if not sum(sizes):
        raise DataError(f"{path} is empty" if len(files) == 1 else f"every file under {path} is empty")
    held = [held_out_bytes(s, val_fraction) for s in sizes]
    seps = len(files) - 1  # the files are joined with a newline
    train, val = sum(sizes) - sum(held) + seps, sum(held) + seps
    need = seq_len + 2
    if min(train, val) < need:
        total = max(need * 2, int(need / val_fraction) + 1)
        raise DataError(f"{path} holds {sum(sizes)} bytes: {train} for training and {val} held out for validation "
                        f"(the last {val_fraction:.0%} of every file), too short for one window of {seq_len} "
                        f"bytes and its next byte ({need} needed in each); give at least about {total} bytes")
    return train, val


def text_corpus(path: str | os.PathLike, val_fraction: float = VAL_FRACTION,
                encode: Callable[[str], list[int]] | None = None) -> Corpus:
    """The text source ``path`` (a file, or a folder of files: see ``text_files``); the last
    ``val_fraction`` of every file's bytes goes to validation, the rest to training."""
    train, val = [], []
    for p in text_files(path):
        data = p.read_bytes()
        cut = len(data) - held_out_bytes(len(data), val_fraction)
        train.append(data[:cut])
        val.append(data[cut:])
    return Corpus(train=_to_tensor(train, encode), val=_to_tensor(val, encode))


_CODE_FILES = ("tokenizer_config.json", "config.json")  # where transformers reads an auto_map


def _custom_code_message(where: str, why: str) -> str:
    return (f"{where} asks to run code of its own ({why}), and pipeoptim never runs code from a folder or the "
            "cache (trust_remote_code=False): give a tokenizer.json file, or a folder whose tokenizer class is "
            "built into transformers")


def refuse_custom_code(folder: str | os.PathLike, what: str = "tokenizer") -> None:
    """DataError if a Hugging Face folder asks for code of its own (an ``auto_map`` in its tokenizer_config.json
    or config.json): such a folder is refused before transformers reads it, never run."""
    for name in _CODE_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # not ours to judge: transformers names a damaged file itself
        if auto_map:
            refs = [v if isinstance(v, str) else next((x for x in v if x), "") for v in auto_map.values()]
            modules = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs if r})
            raise DataError(_custom_code_message(f"the {what} folder {str(folder)!r}",
                                                 f"its {name} has an auto_map naming {', '.join(modules)}"))


def load_tokenizer(name_or_path: str) -> tuple[Callable[[str], list[int]], int]:
    """(encode, vocabulary size) of a tokenizer present on this machine: a ``tokenizer.json`` file, a folder
    written by ``save_pretrained``, or a model name already in the Hugging Face cache. Nothing is
    downloaded; DataError says what was looked for."""
    if os.path.isfile(name_or_path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer file needs the tokenizers package: pip install 'pipeoptim[hf]'") from None
        try:
            tok = Tokenizer.from_file(name_or_path)
        except Exception as e:  # the tokenizers library raises its own exception type for a bad file
            raise DataError(f"{name_or_path} is not a tokenizer.json file that the tokenizers package reads: {e}"
                            ) from None
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.get_vocab_size(with_added_tokens=True)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--tokenizer needs the transformers package: pip install 'pipeoptim[hf]'") from None
    if os.path.isdir(name_or_path):
        refuse_custom_code(name_or_path, "tokenizer")
    try:
        # never code from the folder or the cache (an auto_map would otherwise ask to run it), never a download
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):  # a cached name whose files ask for custom code
            raise DataError(_custom_code_message(f"the tokenizer {name_or_path!r} in the Hugging Face cache",
                                                 "its files have an auto_map")) from None
        where = "that folder holds no tokenizer" if os.path.isdir(name_or_path) else \
            "it is no file or folder here and no model of that name is in the Hugging Face cache"
        raise DataError(f"no tokenizer found at {name_or_path!r}: {where} (nothing is downloaded). Give a "
                        f"tokenizer.json file or a folder saved with save_pretrained ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # fast tokenizer: no warning about texts longer than the model's context
        return (lambda text: backend.encode(text, add_special_tokens=False).ids), len(tok)
    return (lambda text: tok.encode(text, add_special_tokens=False)), len(tok)


def digits(test_fraction: float = 0.2, seed: int = 0):
    """((x_train, y_train), (x_test, y_test)): 1×8×8 float images scaled to [0, 1], int64 labels."""
    import torch
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise RuntimeError("the digits data set ships with scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])
