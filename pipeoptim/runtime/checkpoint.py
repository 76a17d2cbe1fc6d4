"""Checkpoints keyed by global parameter names, so a run resumes exactly and a checkpoint loads into another
stage balance.

Each process writes ``part-<rank>.pt`` with, for every parameter of its replica-0 chunks (replica 1 of
bidirectional schedules holds identical values), the fp32 value (the master in mixed precision) and the
optimizer's per-parameter state, plus its param-group hyperparameters, LR-scheduler state and the pipeline's
step count; ``extra`` (e.g. the data generator's state) goes to ``meta.pt``. Loading reads every part and
hands each chunk the entries of its own parameters, whatever stage layout wrote them. With data-parallel
replicas (``Pipeline(dp=...)``), whose weights and optimizer state are the same after every step, only replica
0's parts hold them: the others hold their own buffers and the step, so a checkpoint is one model's size
whatever ``dp`` is, and it resumes into any ``dp``.

The weight policy's state goes along, also keyed by global names (``policy_state``): stashes and predictions
end with every window, but the last gradient (prediction rules that read it: SGD without momentum or with
Nesterov, RMSprop without momentum, Adagrad, NAdam), SpecTrain's own gradient average and the binding's step
count (torch keeps none for SGD) carry over; without them a resumed run's first predictions differ from the
uninterrupted run's. Checkpoints written before policy state was saved still load (the policy starts fresh).

How the files reach the disk (atomic parts, a manifest with hashes as the commit, the newest intact one,
keep K) is ``checkpoint_files``: ``save(pipe, root)`` writes ``root/step-<step count>/`` and ``load(pipe,
root)`` reads the newest intact checkpoint under ``root`` (or exactly the step directory it is given).
Resuming into another stage balance, stage count or schedule works (parameters and their optimizer state
are keyed by global names); into another optimizer it fails with the reason, unless ``weights_only=True``.

Persistent buffers (BatchNorm's running statistics) travel too, by global name, each data-parallel replica's
own (a replica the checkpoint lacks starts from replica 0's). Loading maps each part into memory
(``torch.load(mmap=True)``) and copies only this process's own entries, so a rank of a large, meta-built
pipeline reads its share of the checkpoint, never the whole model.

A checkpoint holds tensors and plain containers only (``plain_problem`` refuses anything else at save), and
every file is read with ``torch.load(weights_only=True)``: a file someone handed you cannot run code, it is
refused naming the file. Before anything is written into the model, ``load`` checks that the parts are one
per rank of the world that wrote them, all of the manifest's step, and that every parameter, buffer and
optimizer state has this model's name, shape and dtype; else nothing is loaded and the error names what.
"""
from __future__ import annotations

import glob
import os
import shutil
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .checkpoint_load import inspect, load, read
from .checkpoint_state import is_distributed, optimizer_names, pipeline_state, this_rank
from .watchdog import COLLECTIVE

__all__ = ["pipeline_state", "save", "load", "read", "inspect", "plain_problem", "CheckpointError"]


def save(pipe, root: str, extra: dict | None = None, keep: int | None = None) -> str:
    """Write ``root/step-<step count>/`` from every rank (call on all of them), commit it, then keep the newest
    ``keep`` checkpoints under ``root`` (None: all). Returns the checkpoint's directory. A step already
    committed is written beside it and swapped in, never rewritten in place."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint being written), got {keep}")
    extra = extra or {}
    if problem := plain_problem(extra, "extra"):
        raise TypeError(f"cannot save a checkpoint: {problem}; a checkpoint holds only tensors, numbers, strings "
                        "and lists, tuples and dicts of them (it is read back with torch.load(weights_only=True), "
                        "which runs no code)")
    rank, distributed = (0 if pipe.emulate else this_rank()), is_distributed(pipe)
    directory = files.step_dir(root, pipe.step_count)
    watch = getattr(pipe, "_watch", None)
    if watch is not None:
        watch.doing(f"saving checkpoint {directory}", COLLECTIVE)
    try:
        _save(pipe, root, directory, extra, keep, rank, distributed)
    finally:
        if watch is not None:
            watch.idle()
    return directory


def _save(pipe, root, directory, extra, keep, rank, distributed) -> None:
    world = dist.get_world_size() if distributed else 1
    state = _part_state(pipe, rank, world)
    problem = plain_problem(state, "the pipeline state")
    # rank 0 decides where the files go: the step directory, or beside it when that step is already committed
    target, error = None, None
    if rank == 0:
        try:
            target = files.staging_dir(directory) if files.is_checkpoint(directory) else directory
            if os.path.exists(target) and target != directory:
                shutil.rmtree(target)  # a crash while writing this step again left it: never committed
            os.makedirs(target, exist_ok=True)
            files.uncommit(target)  # no manifest over debris (a crash leftover of this step, uncommitted)
            for stale in glob.glob(os.path.join(target, "*.tmp-*")):  # a rank died writing it
                os.remove(stale)
        except OSError as e:
            error = _write_problem(root, directory, "its directory", e)
    if distributed:
        target, error = _from_rank0((target, error))
    if error:
        raise CheckpointError(error)
    if problem is None:
        try:
            record = files.write_file(os.path.join(target, f"part-{rank}.pt"), lambda f: torch.save(state, f))
        except Exception as e:  # torch wraps a full disk in a RuntimeError; every rank must hear of it
            record = _write_problem(root, directory, f"part-{rank}.pt (rank {rank})", e)
    else:
        record = f"rank {rank} cannot save {problem}: a checkpoint holds only tensors and plain containers"
    records = [None] * world if distributed else [record]
    if distributed:
        dist.all_gather_object(records, record)
    error = next((r for r in records if isinstance(r, str)), None)
    if rank == 0:
        if error is None:
            try:
                meta = files.write_file(os.path.join(target, "meta.pt"), lambda f: torch.save(
                    {"extra": extra, "schedule": pipe.schedule.name, "devices": pipe.devices,
                     "step_count": pipe.step_count}, f))
                listed = {f"part-{r}.pt": rec for r, rec in enumerate(records)}
                files.commit(target, {**listed, "meta.pt": meta}, _describe(pipe))
                if target != directory:
                    files.swap_in(target, directory)
            except Exception as e:
                error = _write_problem(root, directory, "meta.pt and manifest.json", e)
            else:
                try:
                    files.prune(root, keep)
                except OSError as e:
                    error = f"checkpoint {directory} is committed, but removing older ones failed: {e}"
        if error is not None and not files.is_checkpoint(target):  # no checkpoint: give its space back
            shutil.rmtree(target, ignore_errors=True)
    if distributed:
        error = _from_rank0(error)
    if error:
        raise CheckpointError(error)


def _part_state(pipe, rank: int, world: int) -> dict:
    """What ``part-<rank>.pt`` holds: this rank's pipeline state, saying whose it is. The data-parallel replicas
    hold the same weights, optimizer and policy state after every step, so only replica 0's parts carry them;
    every replica keeps its own buffers (BatchNorm's statistics are of the rows that replica saw)."""
    dp_rank = getattr(pipe, "dp_rank", 0)
    return dict(pipeline_state(pipe, weights=dp_rank == 0), rank=rank, world_size=world, dp_rank=dp_rank)


def _write_problem(root: str, directory: str, what: str, e: BaseException) -> str:
    """What went wrong writing ``what`` of checkpoint ``directory``; a full disk said as such, with the
    checkpoint to go back to."""
    if not files.no_space(e):
        return f"cannot write checkpoint {directory} ({what}): {type(e).__name__}: {e}"
    found = next((d for _, d in files.list_steps(root) if files.sizes_ok(d)), None)  # no hashing: cheap
    newest = (f"the newest intact checkpoint is {found}" if found else f"there is no intact checkpoint in {root}")
    return (f"{directory}: no space left on device ({files.free_bytes(directory):,} bytes free); {newest}. "
            f"Writing {what} failed and nothing of this checkpoint was committed; free some space (or keep "
            "fewer checkpoints) and save again")


_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def plain_problem(obj, where: str) -> str | None:
    """None if ``obj`` is tensors, numbers, strings and lists/tuples/dicts of them (what a checkpoint may
    hold: torch.load(weights_only=True) reads it back without running code), else what is not."""
    kind = type(obj)
    if kind in (torch.Tensor, torch.nn.Parameter) or kind in _PLAIN:
        return None
    if kind in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in _PLAIN:
                return f"{where} has a key of type {type(k).__qualname__}"
            if problem := plain_problem(v, f"{where}[{k!r}]"):
                return problem
        return None
    if kind in (list, tuple, set):
        for i, v in enumerate(obj):
            if problem := plain_problem(v, f"{where}[{i}]"):
                return problem
        return None
    return f"{where} is a {kind.__module__}.{kind.__qualname__}"


def _from_rank0(error: str | None) -> str | None:
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _describe(pipe) -> dict:
    return {"step": pipe.step_count, "schedule": pipe.schedule.name, "devices": pipe.devices,
            "world_size": dist.get_world_size() if is_distributed(pipe) else 1, "dp": getattr(pipe, "dp", 1),
            "optimizers": optimizer_names(pipe), "policy": pipe.policy_name}
