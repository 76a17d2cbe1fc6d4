"""Checkpoints keyed by global parameter names, so a run resumes exactly and a checkpoint loads into another
stage balance.

Each process writes ``part-<rank>.pt`` with, for every parameter of its replica-0 chunks (replica 1 of
bidirectional schedules holds identical values), the fp32 value (the master in mixed precision) and the
optimizer's per-parameter state, plus its param-group hyperparameters, LR-scheduler state and the pipeline's
step count; ``extra`` (e.g. the data generator's state) goes to ``meta.pt``. Loading reads every part and
hands each chunk the entries of its own parameters, whatever stage layout wrote them.

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

Persistent buffers (BatchNorm's running statistics) travel too, by global name. Loading maps each part
into memory (``torch.load(mmap=True)``) and copies only this process's own entries, so a rank of a large,
meta-built pipeline reads its share of the checkpoint, never the whole model.
"""
from __future__ import annotations

import glob
import os
import warnings

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .watchdog import COLLECTIVE

__all__ = ["pipeline_state", "save", "load", "CheckpointError"]


def _param_order(st) -> list[str]:
    names = [st.names[n] for n, _ in st.module.named_parameters()]
    count = sum(len(g["params"]) for g in st.optimizer.param_groups)
    if count != len(names):
        raise RuntimeError(f"stage {st.chunk.stage}: the optimizer holds {count} parameters but the module has "
                           f"{len(names)}; checkpoints need every parameter in the optimizer, in module order")
    return names


def _masters(st) -> dict[str, torch.Tensor]:
    local = dict(st.policy.binding.named_master_params())
    out = {}
    for n, p in st.module.named_parameters():
        out[st.names[n]] = local.get(n, p)
    return out


def _buffers(st) -> dict[str, torch.Tensor]:
    """Persistent buffers by global name (modules that know their layers' global names only)."""
    global_name = getattr(st.module, "global_name", None)
    if global_name is None:
        return {}
    params = {n for n, _ in st.module.named_parameters()}
    return {global_name(n): t for n, t in st.module.state_dict(keep_vars=True).items() if n not in params}


def pipeline_state(pipe) -> dict:
    params, opt_state, groups, sched, pol_state, buffers = {}, {}, None, None, {}, {}
    for w in pipe.workers:
        for c, st in w.stages.items():
            if c.replica != 0:
                continue
            for name, t in _masters(st).items():
                params[name] = t.detach().float().cpu().clone()
            for name, t in _buffers(st).items():
                buffers[name] = t.detach().cpu().clone()
            sd = st.optimizer.state_dict()
            order = _param_order(st)
            for i, name in enumerate(order):
                if i in sd["state"]:
                    opt_state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                       for k, v in sd["state"][i].items()}
            if groups is None:
                groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            if sched is None and st.scheduler is not None:
                sched = st.scheduler.state_dict()
            for local, entry in st.policy.state_dict()["params"].items():
                pol_state[st.names[local]] = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in entry.items()}
    return {"params": params, "opt_state": opt_state, "groups": groups, "scheduler": sched,
            "step_count": pipe.step_count, "policy_state": pol_state, "buffers": buffers,
            "optimizers": _optimizer_names(pipe)}


def _optimizer_names(pipe) -> list[str]:
    """The optimizers' names; a ChainedOptimizer by its children's (Muon + AdamW is not SGD + AdamW)."""
    return sorted({repr(st.optimizer) if hasattr(st.optimizer, "children") else type(st.optimizer).__name__
                   for w in pipe.workers for st in w.stages.values()})


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _distributed(pipe) -> bool:
    return not pipe.emulate and dist.is_initialized()


def save(pipe, root: str, extra: dict | None = None, keep: int | None = None) -> str:
    """Write ``root/step-<step count>/`` from every rank (call on all of them), commit it, then keep the newest
    ``keep`` checkpoints under ``root`` (None: all). Returns the checkpoint's directory."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint being written), got {keep}")
    rank, distributed = (0 if pipe.emulate else _rank()), _distributed(pipe)
    directory = files.step_dir(root, pipe.step_count)
    watch = getattr(pipe, "_watch", None)
    if watch is not None:
        watch.doing(f"saving checkpoint {directory}", COLLECTIVE)
    try:
        error = None
        if rank == 0:
            try:
                os.makedirs(directory, exist_ok=True)
                files.uncommit(directory)  # the same step written again: no old manifest over new parts
                for stale in glob.glob(os.path.join(directory, "*.tmp-*")):  # a rank died writing it
                    os.remove(stale)
            except OSError as e:
                error = f"cannot write checkpoint {directory}: {e}"
        if distributed:
            error = _from_rank0(error)
        if error:
            raise CheckpointError(error)
        try:
            record = files.write_file(os.path.join(directory, f"part-{rank}.pt"),
                                      lambda f: torch.save(pipeline_state(pipe), f))
        except OSError as e:
            record = f"rank {rank} could not write {directory}/part-{rank}.pt: {e}"
        records = [None] * dist.get_world_size() if distributed else [record]
        if distributed:
            dist.all_gather_object(records, record)
        error = next((r for r in records if isinstance(r, str)), None)
        if rank == 0 and error is None:
            try:
                meta = files.write_file(os.path.join(directory, "meta.pt"), lambda f: torch.save(
                    {"extra": extra or {}, "schedule": pipe.schedule.name, "devices": pipe.devices,
                     "step_count": pipe.step_count}, f))
                listed = {f"part-{r}.pt": rec for r, rec in enumerate(records)}
                files.commit(directory, {**listed, "meta.pt": meta}, _describe(pipe))
                files.prune(root, keep)
            except OSError as e:
                error = f"cannot commit checkpoint {directory}: {e}"
        if distributed:
            error = _from_rank0(error)
        if error:
            raise CheckpointError(error)
    finally:
        if watch is not None:
            watch.idle()
    return directory


def _from_rank0(error: str | None) -> str | None:
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _describe(pipe) -> dict:
    return {"step": pipe.step_count, "schedule": pipe.schedule.name, "devices": pipe.devices,
            "world_size": dist.get_world_size() if _distributed(pipe) else 1,
            "optimizers": _optimizer_names(pipe), "policy": pipe.policy_name}


def _share(pipe):
    """How a distributed load shares out hashing: rank r hashes every world-size-th file, verdicts gathered
    (so every rank reaches the same decision, each having read only its slice)."""
    if not _distributed(pipe):
        return None

    def share(names, check):
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, check(names[dist.get_rank()::dist.get_world_size()]))
        return [p for mine in found for p in mine]
    return share


def _parts(pipe, directory: str) -> tuple[str, list[str], str | None]:
    """(checkpoint directory, its part files, meta file) for ``directory``: one checkpoint, or the newest
    intact one under a root, or an old-style directory of parts without a manifest."""
    if files.is_checkpoint(directory):
        manifest = files.verify(directory, _share(pipe))
    elif files.list_steps(directory):
        root = directory
        directory, manifest, skipped = files.newest_and_skipped(root, warn=False, share=_share(pipe))
        if (0 if pipe.emulate else _rank()) == 0:
            for d, problem in skipped:
                warnings.warn(f"skipping a checkpoint: {problem}; set it aside as {files.set_aside(d)}; loading "
                              f"{directory}", files.CheckpointWarning, stacklevel=3)
    else:
        parts = sorted(glob.glob(os.path.join(directory, "part-*.pt")))
        if not parts:
            raise FileNotFoundError(f"no checkpoint in {directory} (neither step-* directories nor part-*.pt); "
                                    "save one with Pipeline.save")
        warnings.warn(f"{directory} has no manifest (written by an older pipeoptim): its parts cannot be checked "
                      "for completeness", files.CheckpointWarning, stacklevel=3)
        meta = os.path.join(directory, "meta.pt")
        return directory, parts, meta if os.path.exists(meta) else None
    names = sorted(n for n in manifest["files"] if n.startswith("part-"))
    meta = "meta.pt" if "meta.pt" in manifest["files"] else None
    return (directory, [os.path.join(directory, n) for n in names],
            os.path.join(directory, meta) if meta else None)


def _read(path: str) -> dict:
    """A part or meta file, mapped rather than read: only the entries this process copies are paged in."""
    try:
        try:
            return torch.load(path, weights_only=False, mmap=True)
        except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
            return torch.load(path, weights_only=False)
    except Exception as e:  # a file damaged in a way its size and hash could not show (no manifest)
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is truncated or "
                              "corrupted") from None


def load(pipe, directory: str, weights_only: bool = False) -> dict:
    """Load a checkpoint written by ``save`` (any balance, any number of parts); returns its ``extra``.
    ``directory``: a root (the newest intact checkpoint under it) or one ``step-*`` directory.
    ``weights_only``: only the parameters (a new optimizer, scheduler and policy start fresh)."""
    directory, parts, meta_path = _parts(pipe, directory)
    params, opt_state, groups, sched, steps, pol_state, buffers, optimizers = {}, {}, None, None, 0, {}, {}, set()
    for path in parts:
        part = _read(path)
        params.update(part["params"])
        buffers.update(part.get("buffers", {}))
        opt_state.update(part["opt_state"])
        pol_state.update(part.get("policy_state", {}))
        optimizers.update(part.get("optimizers", ()))
        groups = groups or part["groups"]
        sched = sched or part["scheduler"]
        steps = max(steps, part["step_count"])
    mine = set(_optimizer_names(pipe))
    if optimizers and optimizers != mine and not weights_only:
        raise CheckpointError(f"checkpoint {directory} was written with optimizer {', '.join(sorted(optimizers))} "
                              f"but this pipeline uses {', '.join(sorted(mine))}: one optimizer's state means "
                              "nothing to another. Resume with the same optimizer, or load the weights alone "
                              "(load(..., weights_only=True)) to start the new optimizer from them")
    for w in pipe.workers:
        for c, st in w.stages.items():
            order = _param_order(st)
            missing = [n for n in order if n not in params]
            if missing:
                raise KeyError(f"checkpoint {directory} has no values for {missing[:4]} (stage {c.stage}); it was "
                               "saved from a different model")
            with torch.no_grad():
                local = dict(st.policy.binding.named_master_params())
                for n, p in st.module.named_parameters():
                    value = params[st.names[n]]
                    p.copy_(value.to(p.dtype))
                    if n in local and local[n] is not p:
                        local[n].copy_(value.to(local[n].dtype))
                for name, t in _buffers(st).items():
                    if name in buffers:
                        t.copy_(buffers[name].to(t.dtype))
            if weights_only:
                continue
            sd = st.optimizer.state_dict()
            # no clone: the flat binding copies loaded state into its own buffers (its load hook)
            sd["state"] = {i: dict(opt_state[n]) for i, n in enumerate(order) if n in opt_state}
            if groups is not None and len(groups) == len(sd["param_groups"]):
                for g, saved in zip(sd["param_groups"], groups):
                    g.update({k: v for k, v in saved.items() if k != "params"})
            st.optimizer.load_state_dict(sd)
            # after the optimizer: its load hook recounts the binding's steps, the policy state restores them
            st.policy.load_state_dict({"params": {local: pol_state[name] for local, name in st.names.items()
                                                  if name in pol_state}})
            if st.scheduler is not None and sched is not None:
                st.scheduler.load_state_dict(sched)
    if not weights_only:
        pipe.step_count = steps
    pipe.loaded_from = directory
    return _read(meta_path)["extra"] if meta_path else {}
