"""checkpoint_files: a checkpoint counts only once its manifest is written after every file; a missing,
truncated or corrupted file is named; the newest intact checkpoint is found past damaged ones; keep K."""
from __future__ import annotations

import os

import pytest

from pipeoptim.runtime import checkpoint_files as files
from pipeoptim.runtime.checkpoint_files import CheckpointError, CheckpointWarning


def _write(root, step, payloads: dict[str, bytes], commit=True):
    d = files.step_dir(str(root), step)
    os.makedirs(d, exist_ok=True)
    recs = {name: files.write_file(os.path.join(d, name), lambda f, b=data: f.write(b))
            for name, data in payloads.items()}
    if commit:
        files.commit(d, recs, {"step": step})
    return d


def _payloads(seed: int):
    rnd = os.urandom(1)[0] + seed
    return {"part-0.pt": bytes([rnd % 256]) * 5000 + os.urandom(3001), "part-1.pt": os.urandom(777),
            "meta.pt": b"m" * 10}


def test_write_commit_verify_round_trip(tmp_path):
    data = _payloads(1)
    d = _write(tmp_path, 7, data)
    manifest = files.verify(d)
    assert manifest["step"] == 7 and set(manifest["files"]) == set(data)
    for name, blob in data.items():
        assert open(os.path.join(d, name), "rb").read() == blob
        assert manifest["files"][name]["bytes"] == len(blob)
    assert not [n for n in os.listdir(d) if ".tmp-" in n]  # no temporary file left


def test_a_write_that_fails_leaves_no_file_and_no_temporary(tmp_path):
    def boom(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_file(str(tmp_path / "part-0.pt"), boom)
    assert os.listdir(tmp_path) == []


def test_without_a_manifest_it_is_not_a_checkpoint(tmp_path):
    d = _write(tmp_path, 3, _payloads(2), commit=False)
    assert not files.is_checkpoint(d)
    with pytest.raises(CheckpointError, match=r"step-00000003 is incomplete: it has no manifest\.json"):
        files.verify(d)


@pytest.mark.parametrize("damage,words", [
    ("truncate", r"part-0\.pt is truncated or overwritten: \d+ bytes, the manifest says 8001"),
    ("flip", r"part-0\.pt is corrupted: its SHA-256 differs"),
    ("delete", r"part-0\.pt is missing"),
    ("manifest", r"manifest\.json is damaged"),
])
def test_each_kind_of_damage_is_named(tmp_path, damage, words):
    d = _write(tmp_path, 5, _payloads(3))
    path = os.path.join(d, "part-0.pt")
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[:100])
    elif damage == "flip":
        i = len(data) // 2
        open(path, "wb").write(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif damage == "delete":
        os.remove(path)
    else:
        m = os.path.join(d, files.MANIFEST)
        open(m, "w").write(open(m).read()[:40])
    with pytest.raises(CheckpointError, match=words):
        files.verify(d)


def test_newest_passes_over_damaged_and_incomplete_ones_with_a_warning_each(tmp_path):
    good = _write(tmp_path, 10, _payloads(4))
    bad = _write(tmp_path, 20, _payloads(5))
    open(os.path.join(bad, "part-1.pt"), "ab").write(b"x")  # one byte too many
    _write(tmp_path, 30, _payloads(6), commit=False)  # the job died writing it
    with pytest.warns(CheckpointWarning) as caught:
        d, manifest, skipped = files.newest_and_skipped(str(tmp_path))
    assert d == good and manifest["step"] == 10
    assert [d for d, _ in skipped] == [files.step_dir(str(tmp_path), 30), bad]
    text = " | ".join(str(w.message) for w in caught)
    assert "step-00000030 is incomplete" in text and "step-00000020/part-1.pt is truncated or overwritten" in text
    # set aside, they never count again: the newest is the intact one, silently
    for d, _ in skipped:
        files.set_aside(d)
    assert sorted(os.listdir(tmp_path)) == ["step-00000010", "step-00000020.damaged", "step-00000030.incomplete"]
    assert files.newest(str(tmp_path))[0] == good


def test_no_intact_checkpoint_lists_every_problem(tmp_path):
    d = _write(tmp_path, 1, _payloads(7))
    os.remove(os.path.join(d, "meta.pt"))
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .*meta\.pt is missing"):
        files.newest(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        files.newest(str(tmp_path / "empty"))


def test_distributed_share_of_the_hashing_sees_every_file(tmp_path):
    """verify(share=...) lets each rank hash a slice; here two 'ranks' in turn, one of whose slice is bad."""
    d = _write(tmp_path, 2, _payloads(8))
    path = os.path.join(d, "part-1.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(bytes([data[0] ^ 1]) + data[1:])
    seen = []

    def two_ranks(names, check):
        slices = [names[0::2], names[1::2]]
        seen.extend(n for sl in slices for n in sl)
        return [p for sl in slices for p in check(sl)]

    with pytest.raises(CheckpointError, match=r"part-1\.pt is corrupted"):
        files.verify(d, two_ranks)
    assert sorted(seen) == ["meta.pt", "part-0.pt", "part-1.pt"]


def test_prune_keeps_the_newest_k_and_removes_older_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _write(tmp_path, step, _payloads(step))
    _write(tmp_path, 0, _payloads(9), commit=False)  # an old crash leftover
    _write(tmp_path, 5, _payloads(10), commit=False)  # being written now: newer than any commit, kept
    truncated = files.step_dir(str(tmp_path), 4)
    open(os.path.join(truncated, "part-0.pt"), "wb").write(b"")  # does not count, and is not deleted
    removed = files.prune(str(tmp_path), 2)
    assert sorted(os.path.basename(d) for d in removed) == ["step-00000000", "step-00000001"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003", "step-00000004", "step-00000005"]
    assert files.prune(str(tmp_path), None) == []
    with pytest.raises(ValueError, match="keep must be at least 1"):
        files.prune(str(tmp_path), 0)


def test_uncommit_before_rewriting_the_same_step(tmp_path):
    d = _write(tmp_path, 4, _payloads(11))
    files.uncommit(d)
    assert not files.is_checkpoint(d)  # the manifest is gone, the parts stay until overwritten
    assert sorted(os.listdir(d)) == ["meta.pt", "part-0.pt", "part-1.pt"]


def test_has_committed_tells_a_checkpoint_from_what_a_stopped_run_left(tmp_path):
    root = tmp_path / "ckpt"
    assert not files.has_committed(str(root))  # nothing at all
    _write(root, 4, _payloads(0), commit=False)  # a run stopped while writing its first checkpoint
    assert not files.has_committed(str(root)) and files.list_steps(str(root))
    _write(root, 2, _payloads(1))
    assert files.has_committed(str(root)) and files.has_committed(files.step_dir(str(root), 2))
    (root / "step-00000002" / "part-0.pt").write_bytes(b"damaged")  # committed, then damaged: still committed
    assert files.has_committed(str(root))
    legacy = tmp_path / "legacy"  # an older pipeoptim's parts, without a manifest
    legacy.mkdir()
    (legacy / "part-0.pt").write_bytes(b"x")
    assert files.has_committed(str(legacy))


def test_prune_removes_steps_set_aside_as_incomplete_once_a_newer_one_is_committed(tmp_path):
    # issue 44: a half-written step set aside as .incomplete survived pruning forever
    half = _write(tmp_path, 1, _payloads(1), commit=False)
    aside = files.set_aside(half)
    assert os.path.basename(aside) == "step-00000001.incomplete"
    again = files.set_aside(_write(tmp_path, 1, _payloads(2), commit=False))  # the same step, set aside twice
    assert os.path.basename(again) == "step-00000001.incomplete-2"
    late = files.set_aside(_write(tmp_path, 9, _payloads(3), commit=False))  # newer than any commit: kept
    damaged = files.set_aside(_write(tmp_path, 0, _payloads(4)))  # committed but damaged: kept for a look
    assert os.path.basename(damaged) == "step-00000000.damaged"
    for step in (2, 3):
        _write(tmp_path, step, _payloads(step))
    removed = files.prune(str(tmp_path), 2)
    assert sorted(removed) == sorted([aside, again])
    assert sorted(os.listdir(tmp_path)) == ["step-00000000.damaged", "step-00000002", "step-00000003",
                                            os.path.basename(late)]
