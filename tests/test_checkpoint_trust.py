"""Checkpoints someone handed you, or that a crash, a full disk or a mix-up left behind (issue 21, items 1, 3,
5, 9, 10), each injected for real: a pickle whose unpickling runs a command is refused and never runs; a
committed step is never rewritten in place (a SIGKILL while it is written again leaves it loadable); a shape
or dtype that does not fit names the parameter before anything is copied; a full disk says so, with the
checkpoint to go back to; parts of different steps or a missing part are named; a resumed run's summary
counts its own steps only."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch
from torch import nn

import fault_harness as fh
import fault_jobs as fj
from pipeoptim.cli import train as cli_train
from pipeoptim.job import TrainConfig
from pipeoptim.runtime import checkpoint_files as files
from pipeoptim.runtime.checkpoint_files import CheckpointError, CheckpointWarning
from pipeoptim.train import Pipeline


def _small():
    return fj.small_pipeline(2, microbatches=2, emulate=True, devices=2)


def _trained(root, steps=2, keep=None):
    """A pipeline trained ``steps`` steps and saved after each (under ``root``)."""
    pipe = _small()
    for step in range(steps):
        pipe.train_step(fj.batch(step))
        pipe.save(str(root), keep=keep)
    return pipe


def _recommit(directory):
    """Rewrite the manifest to match the files as they now are: what anyone who can write the files can do,
    so the hashes are no defence against a file planted in a checkpoint."""
    manifest = json.load(open(os.path.join(directory, files.MANIFEST)))
    names = [n for n in os.listdir(directory) if n.endswith(".pt")]
    records = {n: files.write_file(os.path.join(directory, f"{n}.copy"), lambda f, n=n: f.write(
        open(os.path.join(directory, n), "rb").read())) for n in names}
    for n in names:
        os.replace(os.path.join(directory, f"{n}.copy"), os.path.join(directory, n))
    files.uncommit(directory)
    files.commit(directory, records, {k: v for k, v in manifest.items() if k not in ("files", "format", "written")})


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a malicious checkpoint file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---- 1: no checkpoint file runs code ------------------------------------------------------------------------
@pytest.mark.parametrize("planted", ["meta.pt", "part-0.pt"])
def test_a_planted_pickle_is_refused_naming_the_file_and_never_runs(tmp_path, planted, one_thread):
    _trained(tmp_path / "ck")
    step2 = tmp_path / "ck" / "step-00000002"
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    data = torch.load(step2 / planted, weights_only=True)
    data["extra" if planted == "meta.pt" else "groups"] = _Payload(str(marker))
    torch.save(data, step2 / planted)
    _recommit(str(step2))
    files.verify(str(step2))  # the hashes agree: only the loader stands between the file and the command
    with pytest.raises(CheckpointError, match=rf"{step2}/{planted} is refused: it holds more than tensors"):
        _small().load(str(step2))
    with pytest.raises(CheckpointError, match=rf"{step2}/{planted} is refused"):
        cli_train._resume_point(str(tmp_path / "ck"), TrainConfig())
    assert not marker.exists(), "the checkpoint ran its payload"


def test_a_planted_pickle_in_the_old_layout_without_a_manifest_is_refused(tmp_path, one_thread):
    root = tmp_path / "old"
    _trained(root, steps=1)
    for f in (root / "step-00000001").iterdir():  # the layout of pipeoptim before manifests
        if f.name != files.MANIFEST:
            f.rename(root / f.name)
    (root / "step-00000001" / files.MANIFEST).unlink()
    (root / "step-00000001").rmdir()
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    meta = torch.load(root / "meta.pt", weights_only=True)
    meta["step_count"] = _Payload(str(marker))
    torch.save(meta, root / "meta.pt")
    with pytest.raises(CheckpointError, match=rf"{root}/meta.pt is refused"), pytest.warns(CheckpointWarning):
        _small().load(str(root))
    with pytest.raises(CheckpointError, match=rf"{root}/meta.pt is refused"):
        cli_train._resume_point(str(root), TrainConfig())
    assert not marker.exists(), "the checkpoint ran its payload"


def test_saving_what_cannot_be_read_back_without_code_is_refused_before_writing(tmp_path):
    pipe = _small()
    pipe.train_step(fj.batch(0))
    with pytest.raises(TypeError, match=r"extra\['note'\] is a .*_Payload; a checkpoint holds only tensors"):
        pipe.save(str(tmp_path), extra={"note": _Payload("x")})
    assert not os.listdir(tmp_path)
    gen = torch.Generator().manual_seed(3)  # what pipeoptim train keeps: the generator's state, a history
    pipe.save(str(tmp_path), extra={"gen": gen.get_state(), "history": [{"step": 1, "loss": 0.5}]})
    extra = _small().load(str(tmp_path))
    assert torch.equal(extra["gen"], gen.get_state()) and extra["history"] == [{"step": 1, "loss": 0.5}]


# ---- 3: a committed step is never rewritten in place --------------------------------------------------------
_RESAVE_AND_DIE = """
import os, signal, sys
import fault_jobs as fj
from pipeoptim.runtime import checkpoint_files as files
root, where = sys.argv[1], sys.argv[2]
pipe = fj.small_pipeline(2, microbatches=2, emulate=True, devices=2)
pipe.load(root)                       # the finished run: nothing left to train, and it saves again
if where == "part":                   # SIGKILL halfway through writing the part again
    real = files.write_file
    def half_then_die(path, write):
        if not os.path.basename(path).startswith("part-"):
            return real(path, write)
        with open(path + ".tmp-%d" % os.getpid(), "wb") as f:
            f.write(b"half a part")
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    files.write_file = half_then_die
else:                                 # SIGKILL between the two renames that put the new copy in place
    real_replace = os.replace
    def replace(src, dst):
        if str(src).endswith(".next"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)
    os.replace = replace
pipe.save(root, keep=1)
"""


@pytest.mark.parametrize("where", ["part", "swap"])
def test_a_rank_killed_while_a_committed_step_is_written_again_leaves_it_loadable(tmp_path, where, one_thread):
    root = tmp_path / "ck"
    finished = _trained(root, steps=2, keep=1)  # --keep-checkpoints 1: step 2 is the only checkpoint
    proc = subprocess.run([sys.executable, "-c", _RESAVE_AND_DIE, str(root), where], env=fh.env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    resumed = _small()
    resumed.load(str(root))
    assert resumed.step_count == 2
    for name, value in finished.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[name], value), name
    resumed.save(str(root), keep=1)  # written again, completely this time; the debris goes
    assert sorted(os.listdir(root)) == ["step-00000002"], os.listdir(root)
    assert sorted(os.listdir(root / "step-00000002")) == ["manifest.json", "meta.pt", "part-0.pt"]
    files.verify(str(root / "step-00000002"))


def test_resume_with_nothing_left_to_do_leaves_the_checkpoint_untouched(tmp_path):
    run = tmp_path / "run"
    common = [*_cli_small(), "--run-dir", str(run), "--emulate", "--no-progress", "--keep-checkpoints", "1"]
    proc = _cli(tmp_path, *common, "--steps", "2", "--save-every", "0")
    assert proc.returncode == 0, proc.stderr
    step2 = run / "checkpoint" / "step-00000002"
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size) for f in step2.iterdir()}
    proc = _cli(tmp_path, *common, "--steps", "2", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"nothing to do: step 2 of 2 already reached ({step2})" in proc.stderr, proc.stderr
    assert "final loss:" in proc.stdout.strip().splitlines()[-1]
    after = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size) for f in step2.iterdir()}
    assert after == before  # not one file of the committed checkpoint was written again
    # ---- 10: the next resume finds it, and its summary counts its own steps only
    proc = _cli(tmp_path, *common, "--steps", "3", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {step2} (step 2 of 3)" in proc.stderr, proc.stderr
    assert "steps 3..3: loss" in proc.stdout, proc.stdout
    history = json.load(open(run / "history.json"))["history"]
    assert [h["step"] for h in history] == [1, 2, 3]


def _cli_small():
    return ["--model", "tiny", "--stages", "2", "--microbatches", "2", "--microbatch-size", "2", "--schedule", "1f1b"]


def _cli(tmp_path, *args):
    return subprocess.run(fh.train_cmd(*args), env=fh.env(), cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=600)


# ---- 5: shapes and dtypes are compared per parameter before anything is copied ------------------------------
def _pipe(widths, **kw):
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    return Pipeline(layers, loss_fn=fj.mse, devices=2, schedule="1f1b", microbatches=2, emulate=True,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **kw)


def test_a_shape_that_would_broadcast_is_refused_naming_the_parameter_and_nothing_is_loaded(tmp_path):
    saved = _pipe([4, 4, 1])  # layer 1: weight (1, 4), bias (1,): both would broadcast into (4, 4), (4,)
    saved.save(str(tmp_path))
    target = _pipe([4, 4, 4])
    with torch.no_grad():
        for p in target.named_parameters().values():
            p.fill_(7.0)
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}/step-00000000: parameter '1.weight' is "
                       r"torch.float32 of shape \(1, 4\) there but this model's is torch.float32 of shape \(4, 4\)"):
        target.load(str(tmp_path))
    assert all((p == 7.0).all() for p in target.named_parameters().values()), "half a model was loaded"
    assert target.loaded_from is None


def test_a_dtype_that_does_not_fit_is_refused_naming_the_parameter(tmp_path):
    _pipe([4, 4, 4]).save(str(tmp_path))
    step0 = tmp_path / "step-00000000"
    part = torch.load(step0 / "part-0.pt", weights_only=True)
    part["params"]["0.bias"] = part["params"]["0.bias"].to(torch.int64)
    torch.save(part, step0 / "part-0.pt")
    _recommit(str(step0))
    with pytest.raises(CheckpointError, match=r"parameter '0.bias' is torch.int64 of shape \(4,\) there but this "
                       r"model's is torch.float32 of shape \(4,\)"):
        _pipe([4, 4, 4]).load(str(tmp_path))


# ---- 9: a full disk ----------------------------------------------------------------------------------------
def _full_disk_checks(root, error, make):
    """Step 1 did not fit; step 0 is the checkpoint to go back to, and it loads."""
    text = str(error)
    assert text.startswith(f"{root}/step-00000001: no space left on device ("), text
    assert f"bytes free); the newest intact checkpoint is {root}/step-00000000." in text, text
    assert "enforce fail" not in text
    assert not files.is_checkpoint(os.path.join(root, "step-00000001"))  # nothing half-written is committed
    assert not os.path.exists(os.path.join(root, "step-00000001"))  # and its space is given back
    resumed = make()
    resumed.load(root)
    assert resumed.loaded_from == os.path.join(root, "step-00000000")


def _saved_then_one_step_more(root, make):
    pipe = make()
    pipe.save(root)
    pipe.step_count += 1  # as a train_step would count: the next save is step 1
    return pipe


def test_a_full_disk_names_the_directory_and_the_checkpoint_to_go_back_to(tmp_path, monkeypatch):
    """ENOSPC raised by the file write itself, as the kernel does, through torch.save's own handling (which
    turns it into `RuntimeError: [enforce fail at inline_container.cc...]`)."""
    root = str(tmp_path / "ck")
    pipe = _saved_then_one_step_more(root, _small)
    real = files._Hashing.write

    def full_after_64_bytes(self, data):
        if self.bytes + len(data) > 64:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(files._Hashing, "write", full_after_64_bytes)
    with pytest.raises(CheckpointError) as caught:
        pipe.save(root)
    monkeypatch.undo()
    _full_disk_checks(root, caught.value, _small)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); the test above injects ENOSPC instead")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("width", [4, 256])  # a part smaller than the write buffer (ENOSPC at its flush), and
def test_a_really_full_disk(small_tmpfs, width):  # a larger one (ENOSPC inside torch.save: its enforce-fail)
    root = str(small_tmpfs / "ck")
    make = lambda: _pipe([width] * 3)  # noqa: E731
    pipe = _saved_then_one_step_more(root, make)
    st = os.statvfs(small_tmpfs)
    with open(small_tmpfs / "filler", "wb") as f:  # fill the disk up to 300 bytes
        f.write(b"\0" * (st.f_bavail * st.f_frsize - 300))
    with pytest.raises(CheckpointError) as caught:
        pipe.save(root)
    _full_disk_checks(root, caught.value, make)


# ---- 10: integrity of what the manifest says against the parts ---------------------------------------------
def _two_parts(tmp_path, steps=(2, 2)):
    """A checkpoint of two ranks' parts (as two processes write it), the second from step ``steps[1]``."""
    root = tmp_path / "ck"
    _trained(root, steps=2)
    step2 = root / "step-00000002"
    part = torch.load(step2 / "part-0.pt", weights_only=True)
    torch.save(dict(part, world_size=2), step2 / "part-0.pt")
    older = torch.load(root / f"step-{steps[1]:08d}" / "part-0.pt", weights_only=True)
    torch.save(dict(older, rank=1, world_size=2), step2 / "part-1.pt")
    manifest = json.load(open(step2 / files.MANIFEST))
    manifest["world_size"] = 2
    json.dump(manifest, open(step2 / files.MANIFEST, "w"))
    _recommit(str(step2))
    return root, step2


def test_parts_of_different_steps_are_refused_naming_the_file(tmp_path):
    root, step2 = _two_parts(tmp_path, steps=(2, 1))
    with pytest.raises(CheckpointError, match=rf"{step2}/part-1.pt holds step 1 but the manifest says step 2: "
                       "parts of different checkpoints were mixed"):
        _small().load(str(step2))
    with pytest.raises(CheckpointError, match=rf"{step2}/part-1.pt holds step 1"):
        cli_train._resume_point(str(root), TrainConfig())


def test_parts_of_different_steps_in_the_old_layout_are_refused(tmp_path):
    """Before manifests, parts went straight into one directory; a crash mid-save mixed two steps there,
    and the load took the larger step count of the two silently."""
    _trained(tmp_path / "ck", steps=2)
    old = tmp_path / "old"
    old.mkdir()
    for name, step in (("part-0.pt", 2), ("part-1.pt", 1), ("meta.pt", 2)):
        data = torch.load(tmp_path / "ck" / f"step-{step:08d}" / name.replace("part-1", "part-0"),
                          weights_only=True)
        data.pop("rank", None), data.pop("world_size", None)  # as an old pipeoptim wrote them
        torch.save(data, old / name)
    with pytest.raises(CheckpointError, match=rf"{old}/part-1.pt holds step 1 but {old}/part-0.pt says step 2"), \
            pytest.warns(CheckpointWarning, match="no manifest"):
        _small().load(str(old))


def test_a_missing_part_is_named_missing_and_resume_falls_back(tmp_path):
    root, step2 = _two_parts(tmp_path)
    _small().load(str(step2))  # intact as written: two parts of step 2
    os.remove(step2 / "part-1.pt")  # ... then part-1 is lost, and its line taken out of the manifest
    manifest = json.load(open(step2 / files.MANIFEST))
    del manifest["files"]["part-1.pt"]
    json.dump(manifest, open(step2 / files.MANIFEST, "w"))
    with pytest.raises(CheckpointError, match=rf"{step2}/manifest.json is inconsistent: it says 2 rank\(s\) wrote "
                       rf"the checkpoint, so it should list part-0.pt, part-1.pt, but it lists part-0.pt "
                       rf"\({step2}/part-1.pt missing from it\)"):
        _small().load(str(step2))
    pipe = _small()
    with pytest.warns(CheckpointWarning, match=r"step-00000002/manifest.json is inconsistent"):
        pipe.load(str(root))
    assert pipe.loaded_from == str(root / "step-00000001")
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002.damaged"]


def test_a_part_missing_from_a_checkpoint_whose_parts_say_how_many_is_named(tmp_path):
    """A directory of parts that each say how many ranks wrote them (no manifest): a missing one is named."""
    root, step2 = _two_parts(tmp_path)
    (step2 / files.MANIFEST).unlink()
    os.remove(step2 / "part-1.pt")
    with pytest.raises(CheckpointError, match=rf"{step2}/part-1.pt is missing: {step2}/part-0.pt says 2 rank\(s\) "
                       "wrote the checkpoint"), pytest.warns(CheckpointWarning, match="no manifest"):
        _small().load(str(step2))


def test_a_manifest_copied_under_another_step_is_named(tmp_path):
    root = tmp_path / "ck"
    _trained(root, steps=1)
    os.rename(root / "step-00000001", root / "step-00000005")
    with pytest.raises(CheckpointError, match=r"step-00000005/manifest.json says step 1 but lies in .*"
                       r"step-00000005 \(step 5\)"):
        files.verify(str(root / "step-00000005"))


def test_the_advice_after_a_failed_load_does_not_point_at_the_checkpoint_that_failed(tmp_path):
    root = tmp_path / "ck"
    _trained(root, steps=1)
    step1 = root / "step-00000001"
    failure = f"rank 1 of 2 (pid 1): CheckpointError: checkpoint {step1}: parameter '0.lin.weight' is ..."
    line = cli_train._newest_checkpoint(str(root), failure)
    assert "continue with --resume" not in line and f"{step1} (step 1)" in line and "the failure above names it" in line
    assert "continue with --resume" in cli_train._newest_checkpoint(str(root), "rank 0 ... killed by SIGKILL")
