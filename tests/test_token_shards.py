"""pipeoptim.data.token_shards: prepared byte-level shards hold exactly the bytes `text_corpus` trains on (shards and
workers changing nothing); a tokenizer's shards, JSONL, Parquet and datasets folders, each record's field; the
held-out split; a wrong field, output or manifest refused before anything is written, and never a half-written
folder; windows read by index across shard boundaries; the sampler's draws depend on its position only."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeoptim.data import prepare_data as prep
from pipeoptim.data import token_shards as ts
from pipeoptim.data import DataError, text_corpus


def _text_folder(root):
    root.mkdir()
    (root / "a.txt").write_bytes(b"def f(x):\n    return x + 1\n" * 200)
    (root / "b.txt").write_bytes(b"tiny")  # its held-out share is empty: the separator is still there
    (root / "sub").mkdir()
    (root / "sub" / "c.txt").write_text("caf\u00e9 au lait\n" * 300, encoding="utf-8")
    return root


def local_tokenizer(path, text: str, vocab: int = 300) -> int:
    """A byte-level BPE tokenizer trained here on ``text``, saved as one tokenizer.json; its vocabulary size."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return tok.get_vocab_size()


def test_byte_level_shards_hold_exactly_the_text_corpus_bytes_whatever_the_shards_and_workers(tmp_path):
    src = _text_folder(tmp_path / "src")
    corpus = text_corpus(src)
    for workers, shard_tokens, chunk in ((1, ts.DEFAULT_SHARD_TOKENS, ts.CHUNK_BYTES), (2, 1000, 700)):
        out = tmp_path / f"out-{workers}"
        m = prep.prepare(src, out, workers=workers, shard_tokens=shard_tokens, chunk_bytes=chunk, progress=False)
        data = ts.TokenShards(out)
        for split, want in (("train", corpus.train), ("val", corpus.val)):
            assert data.tokens(split) == want.numel() == m["splits"][split]["tokens"]
            assert np.array_equal(data.window(split, 0, data.tokens(split)), want.numpy())
        assert m["dtype"] == "uint16" and m["tokenizer"] == {"name": "bytes", "sha256": None, "vocab_size": 256,
                                                              "separator": [10]}
        assert m["held_out"]["fraction"] == 0.05 and m["source"]["kind"] == "text" and m["source"]["files"] == 3
    small = json.loads((tmp_path / "out-2" / ts.MANIFEST).read_text())["splits"]["train"]["shards"]
    assert len(small) > 3 and all(s["tokens"] <= 1000 for s in small)
    import hashlib
    assert small[0]["sha256"] == hashlib.sha256((tmp_path / "out-2" / small[0]["file"]).read_bytes()).hexdigest()
    # the same tokens in other shards are the same data: the hash a checkpoint records is of the tokens' shards
    assert [f for f in os.listdir(tmp_path) if f.startswith(".")] == []  # no temporary folder left behind


def test_a_tokenizers_shards_hold_each_files_ids_with_its_hash_and_vocabulary(tmp_path):
    src = _text_folder(tmp_path / "src")
    vocab = local_tokenizer(tmp_path / "tok.json", (src / "a.txt").read_text() + (src / "sub" / "c.txt").read_text())
    m = prep.prepare(src, tmp_path / "out", str(tmp_path / "tok.json"), workers=2, progress=False)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "tok.json"))
    sep = tok.encode("\n").ids
    want = []
    for k, p in enumerate(sorted(p for p in src.rglob("*.txt"))):
        raw = p.read_bytes()
        want += (sep if k else []) + tok.encode(raw[:len(raw) - int(len(raw) * 0.05)].decode()).ids
    data = ts.TokenShards(tmp_path / "out")
    assert data.window("train", 0, data.tokens("train")).tolist() == want
    assert m["tokenizer"]["vocab_size"] == vocab and m["tokenizer"]["sha256"] == ts.tokenizer_sha256(
        str(tmp_path / "tok.json")) and m["tokenizer"]["separator"] == sep
    assert data.data_sha256 == m["data_sha256"] != prep.prepare(src, tmp_path / "bytes", progress=False)["data_sha256"]
    assert ts.dtype_for(65536) == "uint16" and ts.dtype_for(65537) == "uint32" and ts.dtype_for(128_256) == "uint32"


def test_jsonl_records_by_field_held_out_by_their_hash_and_a_wrong_field_refused_first(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    texts = [f"document {i}: " + "word " * (i % 13) for i in range(400)]
    for part in range(2):
        with open(src / f"part-{part}.jsonl", "w") as f:
            for t in texts[part * 200:(part + 1) * 200]:
                f.write(json.dumps({"id": 1, "body": t}) + "\n\n")  # blank lines are skipped
    with pytest.raises(DataError, match=r"have no field 'text' \(they have: id, body\).*--text-field"):
        prep.prepare(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    m = prep.prepare(src, tmp_path / "out", text_field="body", workers=2, chunk_bytes=2000, progress=False)
    held = [t for t in texts if prep._held_out(t.encode())]
    assert 0 < len(held) < len(texts) / 10  # about 1 in 20
    data = ts.TokenShards(tmp_path / "out")
    val = bytes(data.window("val", 0, data.tokens("val")).astype(np.uint8)).decode()
    train = bytes(data.window("train", 0, data.tokens("train")).astype(np.uint8)).decode()
    assert val == "\n".join(held) and train == "\n".join(t for t in texts if t not in held)
    assert m["source"] == {"path": str(src), "kind": "jsonl", "files": 2, "bytes": m["source"]["bytes"],
                           "text_field": "body"}
    (src / "part-1.jsonl").write_text(json.dumps({"body": 3}) + "\n")
    with pytest.raises(DataError, match="field 'body' holds a int, not text"):
        prep.prepare(src, tmp_path / "again", text_field="body", workers=2, progress=False)
    assert not (tmp_path / "again").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".again")]


def test_parquet_and_a_datasets_folder_read_their_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = [f"row {i} " * (i % 5 + 1) for i in range(300)]
    pq.write_table(pa.table({"content": texts, "n": list(range(300))}), tmp_path / "t.parquet", row_group_size=64)
    prep.prepare(tmp_path / "t.parquet", tmp_path / "pq", text_field="content", workers=2, progress=False)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "ds"))
    m = prep.prepare(tmp_path / "ds", tmp_path / "dsout", text_field="content", progress=False)
    assert m["source"]["kind"] == "datasets"
    a, b = ts.TokenShards(tmp_path / "pq"), ts.TokenShards(tmp_path / "dsout")
    for split in ts.SPLITS:  # the same records in either container: the same tokens
        assert a.tokens(split) > 0 and np.array_equal(a.window(split, 0, a.tokens(split)),
                                                      b.window(split, 0, b.tokens(split)))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"is a Hugging Face DatasetDict \(train\): give one split's folder"):
        prep.prepare(tmp_path / "dd", tmp_path / "x", progress=False)
    (tmp_path / "ds" / "state.json").write_text("{not json")
    with pytest.raises(DataError, match=r"state.json cannot be read as JSON"):
        prep.prepare(tmp_path / "ds", tmp_path / "x", text_field="content", progress=False)
    assert not (tmp_path / "x").exists()


def test_an_output_that_holds_something_is_refused_and_overwrite_replaces_only_a_prepared_folder(tmp_path):
    src = _text_folder(tmp_path / "src")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="mine exists and is not empty: give --overwrite to replace it"):
        prep.prepare(src, tmp_path / "mine", progress=False)
    with pytest.raises(DataError, match="holds other files, which it would delete: give another path"):
        prep.prepare(src, tmp_path / "mine", overwrite=True, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(DataError, match="holds the source"):
        prep.prepare(src / "a.txt", src, overwrite=True, progress=False)
    (tmp_path / "empty").mkdir()
    prep.prepare(src / "a.txt", tmp_path / "empty", progress=False)  # an empty folder is fine
    first = ts.TokenShards(tmp_path / "empty").tokens("train")
    prep.prepare(src, tmp_path / "empty", overwrite=True, progress=False)
    assert ts.TokenShards(tmp_path / "empty").tokens("train") > first
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine", "src"]  # nothing set aside is left


def test_a_damaged_or_foreign_manifest_is_refused_naming_the_fix(tmp_path):
    src = _text_folder(tmp_path / "src")
    out = tmp_path / "out"
    prep.prepare(src, out, shard_tokens=2000, progress=False)
    with open(out / "train-00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"train-00001.bin holds 100 bytes, but the manifest says 2000 tokens of "
                                        r"uint16 \(4000 bytes\).*prepare it again"):
        ts.read_manifest(out)
    m = json.loads((out / ts.MANIFEST).read_text())
    m["splits"]["train"]["shards"][0]["file"] = "../../etc/passwd"
    (out / ts.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="which is not a file inside the folder"):
        ts.read_manifest(out)
    (out / ts.MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="is not a manifest of pipeoptim prepare-data"):
        ts.read_manifest(out)


def test_windows_cross_shard_boundaries_and_the_sampler_depends_on_its_position_only(tmp_path):
    src = tmp_path / "t.txt"
    src.write_bytes(bytes(range(1, 256)) * 40)
    prep.prepare(src, tmp_path / "out", shard_tokens=100, progress=False)
    data = ts.TokenShards(tmp_path / "out")
    whole = data.window("train", 0, data.tokens("train"))
    for start in (0, 95, 99, 100, 250, data.tokens("train") - 17):
        assert np.array_equal(data.window("train", start, 17), whole[start:start + 17])
    with pytest.raises(IndexError):
        data.window("train", data.tokens("train") - 3, 5)
    a, b = ts.WindowSampler(seed=7), ts.WindowSampler(seed=7, position=3)
    draws = [a.starts("train", 10_000, 8, 32, position=k) for k in range(4)]
    assert np.array_equal(draws[3], b.starts("train", 10_000, 8, 32))  # no earlier draw needed
    assert not np.array_equal(draws[0], draws[1])
    assert not np.array_equal(draws[0], ts.WindowSampler(seed=8).starts("train", 10_000, 8, 32))
    assert not np.array_equal(draws[0], a.starts("val", 10_000, 8, 32, position=0))
    assert ts.read_windows(data, "train", draws[0] % 1000, 16).shape == (8, 17)


def test_a_tokenizer_folders_hash_covers_its_tokenizer_files_only(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": 1}')
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    first = ts.tokenizer_sha256(str(folder))
    (folder / "model.safetensors").write_bytes(b"weights")  # not a tokenizer file
    assert ts.tokenizer_sha256(str(folder)) == first
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert ts.tokenizer_sha256(str(folder)) != first
    assert ts.tokenizer_sha256(str(folder / "tokenizer.json")) != first  # the file alone is another identity
    with pytest.raises(DataError, match="holds none of the tokenizer files"):
        ts.tokenizer_sha256(str(tmp_path))
