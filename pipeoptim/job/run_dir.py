"""The run directory of ``pipeoptim train``: the lock that keeps two runs out of one directory, claiming it
(``--overwrite``, ``--resume``), the checkpoint a run resumes from and what a resumed run must keep unchanged.

Both ways of starting a run use it: the local launcher (``job.launch``) and rank 0 of a torchrun job
(``job.torchrun``), before any rank reads the directory.
"""
from __future__ import annotations

import contextlib
import os
import sys

from .derived import _delay_hparams, _updates_per_window
from .config import TrainConfig

__all__ = ["RESUME_MUST_MATCH", "resume_config", "RUN_DIR_ENTRIES", "check_run_dir"]


# what a resumed run must share with the checkpoint it resumes, and why (the rest may change: stages, schedule
# with the same optimizer steps per window, micro-batch size, --steps, --data; --lr and --clip apply, said so)
_DO_NOT_FIT = "its weights and optimizer state do not fit"
RESUME_MUST_MATCH = {
    "model": _DO_NOT_FIT, "optimizer": _DO_NOT_FIT, "precision": _DO_NOT_FIT,
    "tokenizer": "its embedding rows are that tokenizer's token ids",
    "hf_config": _DO_NOT_FIT, "hf_set": _DO_NOT_FIT,
    "muon_scale": "Muon's steps would change size mid-run (its --lr was chosen for the scale it was written with)",
    "hf_model": "the model that --hf-config builds has changed (its config.json was edited?), so " + _DO_NOT_FIT,
    "seed": "a resumed run continues the checkpoint's random state (the data order), so another seed would "
            "change nothing",
}


def _refuse_changed_tokenizer(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError when the --tokenizer's files changed under the same name since the checkpoint was written (its
    embedding and head rows are the old tokenizer's ids); checkpoints that did not record them are not checked."""
    from ..errors import ConfigError
    before, now = saved.get("tokenizer_sha256"), mine.get("tokenizer_sha256")
    if before is None or before == now:
        return
    sizes = f"vocabulary {saved.get('vocab_size')} then, {mine.get('vocab_size')} now"
    raise ConfigError(f"the tokenizer {mine['tokenizer']} changed since {directory} was written (its files' sha256 "
                      f"{before[:12]} then, {str(now)[:12]} now; {sizes}): the checkpoint's token embedding and "
                      "output head have one row per token id of the old tokenizer. Resume with the tokenizer's files "
                      "as they were, or start a new run in another --run-dir")


def _changed_clip(saved: dict, cfg: TrainConfig) -> list[str]:
    if "clip" not in saved or saved["clip"] == cfg.clip:
        return []
    new = f"--clip {cfg.clip:g}" + (" (off)" if not cfg.clip else "")
    return [f"{new} applies from here on: the checkpoint was written with --clip {saved['clip']:g}"]


def resume_config(cfg: TrainConfig) -> dict:
    """What a checkpoint records of the run that wrote it, for ``--resume`` to check."""
    out = {k: getattr(cfg, k) for k in (*RESUME_MUST_MATCH, "schedule", "stages", "microbatches", "clip")}
    out["update_every"] = cfg.update_every
    out["updates_per_window"] = _updates_per_window(cfg)
    out["dp"], out["microbatch_size"] = cfg.dp, cfg.microbatch_size
    out["tokenizer_sha256"], out["vocab_size"] = cfg.tokenizer_sha256, cfg.vocab_size
    out["delay"] = _delay_hparams(cfg)
    out["data"] = cfg.prepared  # a prepare-data folder: what its tokens are (None: plain text)
    return out


def _resume_point(root: str, cfg: TrainConfig) -> tuple[str, int, dict]:
    """The checkpoint ``--resume`` continues from (the newest intact one; each one passed over is printed
    as a warning), its step and its ``extra``, after checking its files (read with weights_only: no code
    runs) and that this run can continue it; ConfigError or CheckpointError says why not."""
    from ..runtime import checkpoint_files as files
    from ..runtime.checkpoint import inspect
    from ..errors import ConfigError
    if not files.list_steps(root) and os.path.exists(os.path.join(root, "meta.pt")):
        print(f"pipeoptim train: warning: {root} was written by an older pipeoptim (no manifest): its files "
              "cannot be checked", file=sys.stderr)
        directory, step, meta = inspect(root)
        return directory, step, meta.get("extra", {})
    directory, manifest, skipped = files.newest_and_skipped(root, warn=False)
    directory, step, meta = inspect(directory, manifest)
    extra = meta.get("extra", {})
    saved = extra.get("config")
    if saved:
        mine = resume_config(cfg)
        _refuse_changed(directory, saved, mine)
        _refuse_changed_data(directory, saved, mine)
        before = saved.get("delay", _delay_hparams(TrainConfig()))
        if before != mine["delay"]:
            flags = lambda d: f"--delay-lr {d['lr']} --delay-momentum {d['momentum']} --delay-warmup {d['warmup']}"  # noqa: E731
            raise ConfigError(f"{directory} was written with {flags(before)} and this run asks for "
                              f"{flags(mine['delay'])}: the learning-rate schedule's state would not carry over. "
                              f"Resume with {flags(before)}, or start a new run in another --run-dir")
        _refuse_changed_tokenizer(directory, saved, mine)
        _check_dp_change(directory, saved, mine, cfg.allow_dp_change)
        if saved["updates_per_window"] != mine["updates_per_window"]:
            def what(c):
                m = c.get("update_every")
                return f"{c['schedule']} with {c['microbatches']} micro-batches" + \
                    ("" if m is None else f" and --update-every {m}")
            raise ConfigError(f"{directory} was written by schedule {what(saved)} "
                              f"({saved['updates_per_window']} optimizer steps per window); {what(mine)} takes "
                              f"{mine['updates_per_window']}, so the learning-rate schedule would not carry over. "
                              "Resume with a schedule, micro-batch count and --update-every that step as often "
                              "(stage counts may differ)")
    for d, problem in skipped:  # set aside: never counted again (pruning would keep them, not intact ones)
        print(f"pipeoptim train: warning: skipping a checkpoint: {problem}; set it aside as {files.set_aside(d)}",
              file=sys.stderr)
    return directory, step, extra


def _check_dp_change(directory: str, saved: dict, mine: dict, allowed: bool) -> None:
    """A resume with another --dp changes the global batch (each replica trains on its own share of dp x the
    rows) at the same learning rate: refused with what changes, unless ``allowed`` (--allow-dp-change), which
    says it. Checkpoints from before --dp was recorded are not checked."""
    from ..errors import ConfigError
    if "dp" not in saved or saved["dp"] == mine["dp"]:
        return

    def rows(c):
        return (f"--dp {c['dp']}: {c['dp']} x {c['microbatches']} micro-batches x {c.get('microbatch_size', '?')} "
                f"sequences = {c['dp'] * c['microbatches'] * c.get('microbatch_size', 0)} sequences per window")
    what = (f"{directory} was written with {rows(saved)}; this run asks for {rows(mine)}. The global batch "
            "changes while the learning rate and its schedule go on as they were (nothing is rescaled with the "
            "batch)")
    if not allowed:
        raise ConfigError(f"{what}. Resume with --dp {saved['dp']}, or accept the change with --allow-dp-change")
    print(f"pipeoptim train: --allow-dp-change: {what}", file=sys.stderr)


def _refuse_changed_data(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError naming what changed when the checkpoint was trained on a prepare-data folder and this run's
    --data holds other tokens (another tokenizer, or other text): the batches would not continue its order."""
    from ..errors import ConfigError
    before, now = saved.get("data"), mine.get("data")
    same = lambda a, b: a["data_sha256"] == b["data_sha256"]  # noqa: E731  (tokenizer, dtype, every shard's hash)
    if not before or (now and same(before, now)):
        return
    fix = (f"Resume with --data {before['path']} (or a copy of it), or start a new run in another --run-dir")
    if not now:
        raise ConfigError(f"{directory} was trained on the prepared data {before['path']} and this run's --data is "
                          f"plain text: the batches would not continue its order. {fix}")
    if (before["tokenizer"], before["tokenizer_sha256"]) != (now["tokenizer"], now["tokenizer_sha256"]):
        what = (f"the tokenizer changed: {before['tokenizer']} (files sha256 {str(before['tokenizer_sha256'])[:12]}) "
                f"then, {now['tokenizer']} ({str(now['tokenizer_sha256'])[:12]}) now")
    else:
        what = (f"its tokens changed (same tokenizer, other text: data sha256 {before['data_sha256'][:12]} then, "
                f"{now['data_sha256'][:12]} now)")
    raise ConfigError(f"{directory} was trained on the prepared data {before['path']}, and in --data {now['path']} "
                      f"{what}. {fix}")


def _refuse_changed(directory: str, saved: dict, mine: dict) -> None:
    """ConfigError naming both values if this run asks for another value of a flag that must match the
    checkpoint (checkpoints from before a flag was recorded are not checked for it)."""
    from ..errors import ConfigError

    def flag(key, value):
        key = key.replace("_", "-")
        return f"no --{key}" if value is None else f"--{key} {value}"
    for key, why in RESUME_MUST_MATCH.items():
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(f"{directory} was written with {flag(key, saved[key])} and this run asks for "
                              f"{flag(key, mine[key])}: {why}. Resume with {flag(key, saved[key])}, or start a new "
                              "run in another --run-dir")


# what a run writes in its --run-dir, and whether each is a folder
RUN_DIR_ENTRIES = {"checkpoint": True, "history.json": False, "loss.png": False, ".lock": False}


def check_run_dir(run_dir: str) -> None:
    """ConfigError naming the path and the fix if the run could not write its outputs in ``run_dir``: a file
    where a folder goes (or the other way round), or a directory it cannot create or write in. Checked before
    any rank starts, so that a run never trains and then fails at its first checkpoint."""
    import tempfile

    from ..errors import ConfigError
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"--run-dir {run_dir} is a file, not a folder: give a folder (it is created if missing)")
    for name, folder in RUN_DIR_ENTRIES.items():
        path = os.path.join(run_dir, name)
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            want, found = ("a folder", "a file") if folder else ("a file", "a folder")
            if folder and os.path.islink(path) and not os.path.exists(path):
                found = "a broken link"
            raise ConfigError(f"{path} is {found}, but pipeoptim train writes {want} there ({name}); move it "
                              f"away, or give this run another --run-dir")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
        if os.path.isdir(ckpt := os.path.join(run_dir, "checkpoint")):
            with tempfile.TemporaryFile(dir=ckpt):
                pass
    except OSError as e:
        where = e.filename or run_dir
        raise ConfigError(f"cannot write in {where}: {e.strerror or e}; give a --run-dir you can write to (or "
                          "fix its permissions)") from None


@contextlib.contextmanager
def _run_dir_lock(run_dir: str):
    """Hold ``run_dir`` for this run: a second run given the same directory fails at once, naming this one
    (the lock goes with this process, however it ends; its file is removed when the run ends)."""
    import fcntl

    from ..errors import ConfigError
    check_run_dir(run_dir)
    path = os.path.join(run_dir, ".lock")
    try:
        f = open(path, "a+")
    except OSError as e:
        raise ConfigError(f"cannot create {path}: {e.strerror or e}; give a --run-dir you can write to") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process"
        f.close()
        raise ConfigError(f"{run_dir} is in use by another pipeoptim train ({holder}); give this run its own "
                          "--run-dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        yield
    finally:
        with contextlib.suppress(OSError):  # still locked: no other run can have taken it meanwhile
            os.remove(path)
        f.close()


def _newest_checkpoint(root: str, failure: str = "") -> str:
    """A line pointing at what a later --resume would continue from, or '' when there is nothing. Not the
    checkpoint that ``failure`` names (the job failed loading it: resuming from it would fail again)."""
    from ..runtime import checkpoint_files as files
    try:
        directory, manifest = files.newest(root, warn=False)
    except (FileNotFoundError, files.CheckpointError):
        return ""
    if directory in failure:
        return (f"{directory} (step {manifest['step']}) is the newest checkpoint whose files are intact, but the "
                "failure above names it, so --resume would meet it again: move it aside (--resume then takes the "
                "one before it), or start afresh in another --run-dir")
    return f"the newest intact checkpoint is {directory} (step {manifest['step']}); continue with --resume"


def _claim_run_dir(cfg: TrainConfig, ckpt_root: str) -> bool:
    """A run directory holding an earlier run's checkpoints is continued (--resume) or deleted first
    (--overwrite), never silently overwritten; ConfigError says which flag to use. Returns whether this run
    resumes: --resume auto does where a checkpoint was committed, and starts afresh where none was (a first
    start, or a restart of a run that failed before its first commit: nothing of it can be lost)."""
    from ..runtime import checkpoint_files as files
    from ..errors import ConfigError
    earlier = sorted(os.listdir(ckpt_root)) if os.path.isdir(ckpt_root) else []
    if cfg.resume == "auto":
        if files.has_committed(ckpt_root):
            return True
        if earlier:
            print(f"pipeoptim train: --resume auto: {ckpt_root} holds no committed checkpoint (only what a run "
                  f"stopped while writing left: {', '.join(earlier)}); starting afresh", file=sys.stderr)
        return False
    if cfg.resume:
        if not files.list_steps(ckpt_root) and not os.path.exists(os.path.join(ckpt_root, "meta.pt")):
            raise ConfigError(f"--resume: no checkpoint in {ckpt_root}: a run writes one every --save-every "
                              "windows and at its end. Start this run without --resume")
    elif earlier and not cfg.overwrite:
        steps = files.list_steps(ckpt_root)
        what = f"checkpoints up to step {steps[0][0]}" if steps else f"{len(earlier)} checkpoint file(s)"
        raise ConfigError(f"{cfg.run_dir} holds an earlier run ({what} in {ckpt_root}): continue it with "
                          "--resume, or start afresh with --overwrite (deletes its checkpoints, history.json and "
                          "loss.png), or give this run its own --run-dir")
    elif cfg.overwrite:
        import shutil
        shutil.rmtree(ckpt_root, ignore_errors=True)
        for name in ("history.json", "loss.png"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(cfg.run_dir, name))
        if earlier:
            print(f"pipeoptim train: --overwrite: deleted the earlier run's checkpoints, history.json and loss.png "
                  f"in {cfg.run_dir}", file=sys.stderr)
    return bool(cfg.resume)
