"""pipeoptim.data: the offline corpora are real, deterministic and split without overlap."""
import torch

from pipeoptim.data import VOCAB_SIZE, stdlib_corpus


def test_stdlib_corpus_is_real_python_source():
    c = stdlib_corpus(max_bytes=1 << 20)
    assert c.train.dtype == torch.uint8 and c.train.numel() > 500_000
    assert c.val.numel() > 0
    text = bytes(c.train[:200_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_stdlib_corpus_is_deterministic():
    a, b = stdlib_corpus(max_bytes=1 << 19), stdlib_corpus(max_bytes=1 << 19)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def test_batches_are_next_byte_targets():
    c = stdlib_corpus(max_bytes=1 << 19)
    x, y = c.batch("train", 3, 32, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (3, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < VOCAB_SIZE


def test_digits_split():
    import pytest
    pytest.importorskip("sklearn")
    from pipeoptim.data import digits
    (xt, yt), (xs, ys) = digits()
    assert xt.shape[1:] == (1, 8, 8) and len(xt) + len(xs) == 1797
    assert 0.0 <= float(xt.min()) and float(xt.max()) <= 1.0
    assert set(yt.tolist()) == set(range(10))
