"""Real training data that is on every machine, so examples, tests and benchmarks never download.

- `stdlib_corpus`: the Python standard library's own source files as bytes (a real text corpus, a few
  tens of MB), split deterministically into train and validation by file.
- `digits`: scikit-learn's bundled 8×8 handwritten digits (1,797 images), if scikit-learn is present.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # byte-level language modelling


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 byte stream
    val: torch.Tensor

    def batch(self, split: str, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (B, T) and next-byte targets (B, T), both int64."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise ValueError(f"the {split} split has {data.numel()} bytes, too few for seq_len={seq_len}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]


def stdlib_corpus(max_bytes: int = 8 << 20, val_fraction: float = 0.05) -> Corpus:
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
    to_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)  # noqa: E731
    return Corpus(train=to_tensor(train), val=to_tensor(val))


def digits(test_fraction: float = 0.2, seed: int = 0):
    """((x_train, y_train), (x_test, y_test)): 1×8×8 float images scaled to [0, 1], int64 labels."""
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
