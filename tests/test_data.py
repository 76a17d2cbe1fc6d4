"""pipeoptim.data: the offline corpora are real, deterministic and split without overlap; a text source that
cannot train (binary, a link loop) and a tokenizer folder that asks to run its own code are refused by name."""
import json
import os
import subprocess
import sys

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


# ---- the user's own text (pipeoptim train --data) ------------------------------------------------------
import pytest  # noqa: E402

from pipeoptim.data import DataError, check_text, text_corpus, text_files  # noqa: E402


def test_a_folder_of_text_files_skips_hidden_and_binary_files(tmp_path):
    (tmp_path / "b.txt").write_text("b" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.md").write_text("a" * 100)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / ".hidden.txt").write_text("x")
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    assert [p.relative_to(tmp_path).as_posix() for p in text_files(tmp_path)] == ["b.txt", "sub/a.md"]
    assert text_files(tmp_path / "b.txt") == [tmp_path / "b.txt"]


def test_the_last_twentieth_of_every_file_is_held_out(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"A" * 190 + b"a" * 10)
    (tmp_path / "b.txt").write_bytes(b"B" * 380 + b"b" * 20)
    c = text_corpus(tmp_path)
    assert bytes(c.train.tolist()) == b"A" * 190 + b"\n" + b"B" * 380
    assert bytes(c.val.tolist()) == b"a" * 10 + b"\n" + b"b" * 20
    assert check_text(tmp_path, seq_len=8) == (c.train.numel(), c.val.numel())  # sizes without reading


def test_text_sources_that_cannot_train_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        check_text(tmp_path / "nope.txt", 32)
    (tmp_path / "empty.txt").touch()
    with pytest.raises(DataError, match="empty.txt is empty"):
        check_text(tmp_path / "empty.txt", 32)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match=r"holds only binary files \(1\)"):
        check_text(tmp_path / "bin", 32)
    (tmp_path / "short.txt").write_bytes(b"x" * 600)  # 30 bytes held out: < 32 + 2
    with pytest.raises(DataError, match=r"570 for training and 30 held out .* give at least about 681 bytes"):
        check_text(tmp_path / "short.txt", 32)
    (tmp_path / "enough.txt").write_bytes(b"x" * 681)
    assert check_text(tmp_path / "enough.txt", 32) == (647, 34)


def test_a_binary_data_file_is_refused_as_binary(tmp_path):
    # issue 44: the binary check covered folders only; a binary --data file trained silently
    (tmp_path / "weights.bin").write_bytes(b"PK\3\4" + bytes(range(256)) * 40)
    with pytest.raises(DataError, match=r"weights.bin is a binary file \(a NUL byte in its first 8 KiB\), not text"):
        check_text(tmp_path / "weights.bin", 32)


def test_a_link_to_itself_is_named_as_a_loop_and_a_broken_link_as_broken(tmp_path):
    # issue 44: a link to itself said "does not exist"
    loop = tmp_path / "loop.txt"
    loop.symlink_to(loop)
    with pytest.raises(DataError, match=r"loop.txt is a symbolic link that leads back to itself \(a loop"):
        check_text(loop, 32)
    broken = tmp_path / "broken.txt"
    broken.symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataError, match=r"broken.txt is a symbolic link to .*gone.txt, which does not exist"):
        check_text(broken, 32)


def _planted_tokenizer_folder(folder, marker):
    """A tokenizer folder whose tokenizer_config.json maps AutoTokenizer to a module of its own, which writes
    ``marker`` when it is imported: what an attacker sends as 'a tokenizer'."""
    folder.mkdir()
    (folder / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PlantedTokenizer", "auto_map": {"AutoTokenizer": [None, "planted.PlantedTokenizer"]}}))
    # no config.json: with one naming a built-in model type, transformers would take its own class instead


def test_a_tokenizer_folder_asking_to_run_its_own_code_is_refused_and_nothing_runs(tmp_path):
    # issue 44.1: with stdin answering "y" to transformers' "trust remote code?", the folder's module ran in the
    # launcher; with stdin closed the refusal said "that folder holds no tokenizer"
    pytest.importorskip("transformers")
    marker = tmp_path / "marker"
    _planted_tokenizer_folder(tmp_path / "tok", marker)
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x\n" * 400)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home")}  # where transformers would copy the module
    done = subprocess.run([sys.executable, "-m", "pipeoptim.cli", "train", "--model", "hf-gpt2", "--emulate",
                           "--steps", "1", "--no-progress", "--data", str(text), "--tokenizer", str(tmp_path / "tok"),
                           "--run-dir", str(tmp_path / "run")],
                          input="y\ny\n", capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert not marker.exists(), "the tokenizer folder's module ran"
    assert "asks to run code of its own (its tokenizer_config.json has an auto_map naming planted.py)" in done.stderr
    assert "trust_remote_code=False" in done.stderr and "holds no tokenizer" not in done.stderr
    assert not list((tmp_path / "hf-home").rglob("planted.py"))  # nor copied into the modules cache


def test_refuse_custom_code_reads_both_files_and_lets_plain_folders_through(tmp_path):
    from pipeoptim.data import refuse_custom_code
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))
    refuse_custom_code(plain)  # nothing to refuse
    (plain / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "acme--modeling.AcmeConfig"}}))
    with pytest.raises(DataError, match=r"its config.json has an auto_map naming modeling.py"):
        refuse_custom_code(plain)
