"""pipeoptim.data.batches with `pipeoptim train --data` on a prepare-data folder: only the ranks holding the first
or the last stage open the data (a 4-process run, every open recorded by an audit hook); a rank's memory does not
grow with the corpus (RSS with a 1 GiB prepared corpus against a 1 MiB one); a run resumed from a checkpoint reads
the batches the uninterrupted run read (per-step losses equal); a resume on changed data or with another tokenizer
is refused naming what changed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeoptim.data import prepare_data as prep
from pipeoptim.data import token_shards as ts
from pipeoptim.cli.train import main
from pipeoptim.data.batches import ShapeOnly, ShardBatches, TextBatches, for_rank

TINY = ["--model", "tiny", "--stages", "2", "--microbatches", "4", "--microbatch-size", "1", "--emulate",
        "--no-progress", "--eval-every", "0"]


def _text() -> bytes:
    import json as json_module
    from pathlib import Path
    return (Path(json_module.__file__).parent / "encoder.py").read_bytes()  # ~16 kB of real text


def _fake_pipe(stages_held, num_stages=4, dp_rank=0):
    from collections import namedtuple
    chunk = namedtuple("Chunk", "stage")
    return SimpleNamespace(workers=[SimpleNamespace(stages={chunk(s): None for s in stages_held})], dp_rank=dp_rank,
                           schedule=SimpleNamespace(num_stages=num_stages))


def test_a_middle_rank_gets_shapes_only_and_opens_nothing(tmp_path):
    cfg = {"seq_len": 16, "seed": 0, "dp": 2, "shards": str(tmp_path / "absent")}
    never = lambda: pytest.fail("a middle rank read the text")  # noqa: E731
    middle = for_rank(_fake_pipe([1, 2]), rank=1, corpus=never, **cfg)
    assert isinstance(middle, ShapeOnly)
    x, y = middle.train(8)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long  # this replica's share of 8 rows
    with pytest.raises(ts.DataError, match="absent"):  # the first stage does open it (and finds nothing here)
        for_rank(_fake_pipe([0]), rank=2, corpus=never, **cfg)
    assert isinstance(for_rank(_fake_pipe([3]), rank=3, corpus=lambda: "text", **{**cfg, "shards": None}),
                      TextBatches)


def test_a_replica_reads_only_its_rows_of_the_global_batch(tmp_path):
    src = tmp_path / "t.txt"
    src.write_bytes(_text())
    prep.prepare(src, tmp_path / "p", progress=False)
    both = [ShardBatches(str(tmp_path / "p"), seed=3, seq_len=8, dp_rank=q, dp=2) for q in range(2)]
    whole = ShardBatches(str(tmp_path / "p"), seed=3, seq_len=8, dp_rank=0, dp=1)
    for _ in range(3):
        x, y = whole.train(6)
        parts = [b.train(6) for b in both]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert whole.state()["sampler"]["position"] == 3


_RSS_PROBE = textwrap.dedent("""
    import sys
    from pipeoptim.data.batches import ShardBatches
    batches = ShardBatches(sys.argv[1], seed=0, seq_len=64, dp_rank=0, dp=1)
    for _ in range(200):
        x, y = batches.train(32)
    assert x.shape == (32, 64)
    print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")))
""")


def _prepared_by_hand(folder, train_tokens: int) -> None:
    """A prepared folder whose train shard has ``train_tokens`` uint16 ids: random in its first and last MiB, a
    sparse hole between (zeros, costing no disk), written in a second."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    with open(folder / "train-00000.bin", "wb") as f:
        block = rng.integers(0, 50_000, size=min(train_tokens, 1 << 19), dtype=np.uint16)
        f.write(block.tobytes())
        f.truncate(2 * train_tokens)
        f.seek(2 * train_tokens - block.nbytes)
        f.write(block.tobytes())
    (folder / "val-00000.bin").write_bytes(rng.integers(0, 50_000, size=4096, dtype=np.uint16).tobytes())
    shard = lambda name, n: {"file": name, "tokens": n, "sha256": "not computed"}  # noqa: E731
    (folder / ts.MANIFEST).write_text(json.dumps({
        "format": ts.FORMAT, "version": ts.FORMAT_VERSION, "dtype": "uint16",
        "tokenizer": {"name": "made up", "sha256": None, "vocab_size": 50_000, "separator": []},
        "splits": {"train": {"tokens": train_tokens, "shards": [shard("train-00000.bin", train_tokens)]},
                   "val": {"tokens": 4096, "shards": [shard("val-00000.bin", 4096)]}}}))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_a_ranks_memory_does_not_grow_with_the_corpus(tmp_path):
    rss = {}
    for name, tokens in (("1MiB", 1 << 19), ("1GiB", 1 << 29)):
        _prepared_by_hand(tmp_path / name, tokens)
        out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(tmp_path / name)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        rss[name] = int(out.stdout.split()[-1])  # KiB
        shutil.rmtree(tmp_path / name)
    assert abs(rss["1GiB"] - rss["1MiB"]) < 4 * 1024, rss  # within 4 MiB, where a tensor of the corpus costs 1 GiB


def _prepare(tmp_path, name, text: bytes, tokenizer=None):
    src = tmp_path / f"{name}.txt"
    src.write_bytes(text)
    prep.prepare(src, tmp_path / name, tokenizer, overwrite=True, progress=False)
    return str(tmp_path / name)


def test_a_resumed_run_reads_the_batches_the_uninterrupted_run_read(tmp_path, capsys, one_thread):
    data = _prepare(tmp_path, "p", _text())
    common = [*TINY, "--data", data, "--save-every", "2", "--steps", "4"]
    assert main([*common, "--run-dir", str(tmp_path / "on")]) == 0, capsys.readouterr().err
    shutil.copytree(tmp_path / "on", tmp_path / "re")
    shutil.rmtree(tmp_path / "re" / "checkpoint" / "step-00000004")  # resume from the mid-run checkpoint
    assert main([*common, "--resume", "--run-dir", str(tmp_path / "re")]) == 0, capsys.readouterr().err
    went_on, resumed = (json.loads((tmp_path / d / "history.json").read_text())["history"] for d in ("on", "re"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in went_on]  # bit for bit, steps 3 and 4 included
    meta = torch.load(tmp_path / "re" / "checkpoint" / "step-00000004" / "meta.pt", weights_only=True)
    sampler = meta["extra"]["sampler"]
    assert sampler["position"] == 4 and sampler["data_sha256"] == ts.TokenShards(data).data_sha256
    assert meta["extra"]["config"]["data"]["data_sha256"] == sampler["data_sha256"] and "gen" not in meta["extra"]

    # the folder prepared again from other text: refused, naming what changed
    _prepare(tmp_path, "p", _text()[::-1])
    capsys.readouterr()
    assert main([*common, "--steps", "6", "--resume", "--run-dir", str(tmp_path / "re")]) == 2
    err = capsys.readouterr().err
    assert f"was trained on the prepared data {data}, and in --data {data} its tokens changed (same tokenizer, " \
           "other text" in err and "Resume with --data" in err, err
    src = tmp_path / "plain.txt"
    src.write_bytes(_text())
    assert main([*common, "--steps", "6", "--resume", "--data", str(src), "--run-dir", str(tmp_path / "re")]) == 2
    assert f"was trained on the prepared data {data} and this run's --data is plain text" in capsys.readouterr().err


def test_a_tokenized_folder_needs_a_model_that_reads_its_ids_and_refuses_another_tokenizer(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.test_token_shards import local_tokenizer
    text = _text()
    local_tokenizer(tmp_path / "a.json", text.decode(), vocab=300)
    local_tokenizer(tmp_path / "b.json", text.decode()[::-1], vocab=290)
    data = _prepare(tmp_path, "p", text, str(tmp_path / "a.json"))
    assert main([*TINY, "--data", data, "--steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "holds token ids of the tokenizer" in err and "--model tiny reads bytes" in err, err
    hf = ["--model", "hf-gpt2", *TINY[2:], "--data", data, "--steps", "1", "--run-dir", str(tmp_path / "r")]
    assert main([*hf, "--tokenizer", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert f"was prepared with the tokenizer {tmp_path / 'a.json'}" in err and "is another" in err, err
    bytes_data = _prepare(tmp_path, "bytes", text)
    assert main([*hf, "--data", bytes_data, "--tokenizer", str(tmp_path / "a.json")]) == 2  # the last --data counts
    assert "holds bytes (prepared without --tokenizer): drop --tokenizer" in capsys.readouterr().err


def test_the_folder_trains_a_hugging_face_model_at_its_vocabulary_and_a_new_tokenizer_is_refused_on_resume(
        tmp_path, capsys, one_thread):
    pytest.importorskip("transformers")
    from tests.test_token_shards import local_tokenizer
    text = _text()
    vocab = local_tokenizer(tmp_path / "a.json", text.decode(), vocab=300)
    local_tokenizer(tmp_path / "b.json", text.decode()[::-1], vocab=290)
    data = _prepare(tmp_path, "p", text, str(tmp_path / "a.json"))
    run = ["--model", "hf-gpt2", *TINY[2:], "--data", data, "--run-dir", str(tmp_path / "r")]
    assert main([*run, "--steps", "1"]) == 0, capsys.readouterr().err  # no --tokenizer needed: the folder says
    part = torch.load(tmp_path / "r" / "checkpoint" / "step-00000001" / "part-0.pt", weights_only=True)
    assert any(v.shape == (vocab, 64) for v in part["params"].values())  # one embedding row per token id
    _prepare(tmp_path, "p", text, str(tmp_path / "b.json"))
    capsys.readouterr()
    assert main([*run, "--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer changed: {tmp_path / 'a.json'}" in err and f"{tmp_path / 'b.json'}" in err, err


_RECORD_OPENS = textwrap.dedent("""
    import os, sys
    def _hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].endswith(".bin"):
            with open(os.environ["PIPEOPTIM_TEST_OPENS"], "a") as f:
                f.write(os.environ.get("RANK", "launcher") + " " + args[0] + chr(10))
    sys.addaudithook(_hook)
""")


@pytest.mark.slow
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "plain-text"])
def test_only_the_ranks_of_the_first_and_last_stage_open_the_data(tmp_path, prepared):
    """4 stages as 4 processes: ranks 1 and 2 (the middle stages) never open a shard file, nor the plain text
    (which the launcher opens too, to check it)."""
    if prepared:
        data = _prepare(tmp_path, "p", _text())
    else:
        data = str(tmp_path / "plain.txt.bin")  # (the hook below records the files ending in .bin)
        with open(data, "wb") as f:
            f.write(_text())
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_RECORD_OPENS)
    log = tmp_path / "opens.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]),
           "PIPEOPTIM_TEST_OPENS": str(log), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "pipeoptim.cli", "train", "--model", "tiny", "--stages", "4",
                          "--microbatches", "4", "--microbatch-size", "1", "--steps", "2", "--no-progress",
                          "--data", data, "--run-dir", str(tmp_path / "r")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    opened = {line.split()[0] for line in log.read_text().splitlines()}
    assert opened == ({"0", "3"} if prepared else {"launcher", "0", "3"}), log.read_text()
