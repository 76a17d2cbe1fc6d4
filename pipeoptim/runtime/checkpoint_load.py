"""Loading a checkpoint that ``checkpoint.save`` wrote (the module docstring of ``checkpoint`` says what it holds and
what is checked before anything is written into the model): ``load`` into a pipeline, ``read`` one directory's
files, ``inspect`` a step directory without loading it."""
from __future__ import annotations

import glob
import os
import pickle
import re
import warnings

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .checkpoint_state import buffers_of, is_distributed, optimizer_names, param_order, this_rank

__all__ = ["load", "read", "inspect"]


def _load_scheduler(st, saved: dict, directory: str) -> None:
    """The checkpoint's lr scheduler state into this stage's scheduler. The state was written by one stage and
    holds a value per parameter group; a stage of another cut may have other groups (Muon alone on a stage of
    matrices, Muon + AdamW where vectors join them). A LambdaLR then takes the saved step and computes each of its
    own groups' lr from it; another scheduler cannot be carried over, and says so."""
    scheduler = st.scheduler
    groups = len(scheduler.optimizer.param_groups)
    if len(saved.get("base_lrs", ())) in (0, groups):
        scheduler.load_state_dict(saved)
        return
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise CheckpointError(f"checkpoint {directory}: its {type(scheduler).__name__} state is of "
                              f"{len(saved['base_lrs'])} parameter groups, stage {st.chunk.stage}'s optimizer has "
                              f"{groups} (another cut of the model between stages); resume with the balance it was "
                              "written with, or use a LambdaLR, which carries over to any cut")
    scheduler.last_epoch, scheduler._step_count = saved["last_epoch"], saved.get("_step_count", 1)
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _optimizer_kinds(names) -> set[str]:
    """The optimizer classes behind ``optimizer_names``: 'ChainedOptimizer(Muon, AdamW)' is Muon and AdamW. A
    stage holding only matrices gets Muon alone where another cut gives it Muon + AdamW, so the classes, not the
    names, say whether a checkpoint's optimizer state fits this pipeline's."""
    kinds = set()
    for name in names:
        inner = re.fullmatch(r"\w+\((.*)\)", name)
        kinds.update(inner.group(1).split(", ") if inner else [name])
    return kinds


def _share(pipe):
    """How a distributed load shares out hashing: rank r hashes every world-size-th file, verdicts gathered
    (so every rank reaches the same decision, each having read only its slice)."""
    if not is_distributed(pipe):
        return None

    def share(names, check):
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, check(names[dist.get_rank()::dist.get_world_size()]))
        return [p for mine in found for p in mine]
    return share


def _parts(pipe, directory: str) -> tuple[str, list[str], str | None, dict | None]:
    """(checkpoint directory, its part files, meta file, manifest) for ``directory``: one checkpoint, or the
    newest intact one under a root, or an old-style directory of parts without a manifest (no manifest)."""
    if files.is_checkpoint(directory):
        manifest = files.verify(directory, _share(pipe))
    elif files.list_steps(directory):
        root = directory
        directory, manifest, skipped = files.newest_and_skipped(root, warn=False, share=_share(pipe))
        if (0 if pipe.emulate else this_rank()) == 0:
            for d, problem in skipped:
                warnings.warn(f"skipping a checkpoint: {problem}; set it aside as {files.set_aside(d)}; loading "
                              f"{directory}", files.CheckpointWarning, stacklevel=3)
    else:
        if not glob.glob(os.path.join(directory, "part-*.pt")):
            raise FileNotFoundError(f"no checkpoint in {directory} (neither step-* directories nor part-*.pt); "
                                    "save one with Pipeline.save")
        warnings.warn(f"{directory} has no manifest (written by an older pipeoptim): its parts cannot be checked "
                      "for completeness", files.CheckpointWarning, stacklevel=3)
        manifest = None
    parts, meta = _part_files(directory, manifest)
    return directory, parts, meta, manifest


def read(path: str) -> dict:
    """A part or meta file, mapped rather than read (only the entries this process copies are paged in), with
    ``torch.load(weights_only=True)``: tensors and plain containers only, never code. A file holding anything
    else (a pickled object, say one whose unpickling would run a command) is refused, naming the file."""
    try:
        try:
            return torch.load(path, weights_only=True, mmap=True)
        except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is refused: it holds more than tensors and plain containers ({first}); "
                              "pipeoptim never writes such a file, and loading it could run code, so nothing in it "
                              "was run or loaded. Use a checkpoint from a source you trust") from None
    except Exception as e:  # a file damaged in a way its size and hash could not show (no manifest)
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); it is truncated or "
                              "corrupted") from None


def _check_parts(directory: str, parts: list[str], loaded: list[dict], manifest: dict | None,
                 meta: dict | None) -> int:
    """The step every part (and meta.pt) holds, after checking that they agree with each other and with the
    manifest, and that no rank's part is missing; else CheckpointError naming the file and what is wrong."""
    expected = manifest.get("step") if manifest else None
    where = "the manifest" if expected is not None else None
    for path, part in zip(parts, loaded):
        step = part.get("step_count")
        if expected is None:
            expected, where = step, path
        elif step != expected:
            raise CheckpointError(f"{path} holds step {step} but {where} says step {expected}: parts of "
                                  f"different checkpoints were mixed in {directory}; use a checkpoint whose "
                                  "parts were written together")
        world, rank = part.get("world_size"), part.get("rank")
        if rank is not None and os.path.basename(path) != f"part-{rank}.pt":
            raise CheckpointError(f"{path} was written by rank {rank} (it should be part-{rank}.pt): parts "
                                  f"of {directory} were renamed or copied")
        if world is not None:
            present = {os.path.basename(p) for p in parts}
            missing = [f"part-{r}.pt" for r in range(world) if f"part-{r}.pt" not in present]
            if missing:
                raise CheckpointError(f"{', '.join(os.path.join(directory, m) for m in missing)} "
                                      f"{'is' if len(missing) == 1 else 'are'} missing: {path} says {world} "
                                      f"rank(s) wrote the checkpoint, and {directory} has "
                                      f"{', '.join(sorted(present))}")
    if meta is not None and expected is not None and meta.get("step_count", expected) != expected:
        raise CheckpointError(f"{directory}/meta.pt holds step {meta['step_count']} but {where} says step "
                              f"{expected}: files of different checkpoints were mixed in {directory}")
    return expected or 0


def inspect(directory: str, manifest: dict | None = None) -> tuple[str, int, dict]:
    """(checkpoint directory, its step, its meta) for one checkpoint directory or a legacy directory of
    parts, after the checks ``load`` makes of its files (for the CLI to check a resume point before any rank
    starts). ``manifest``: the directory's, already verified."""
    if manifest is None and files.is_checkpoint(directory):
        manifest = files.verify(directory)
    parts, meta_path = _part_files(directory, manifest)
    if not parts:
        raise CheckpointError(f"{directory} holds no part-*.pt: it is no checkpoint of pipeoptim.save")
    meta = read(meta_path) if meta_path else None
    step = _check_parts(directory, parts, [read(p) for p in parts], manifest, meta)
    return directory, step, meta or {}


def _part_files(directory: str, manifest: dict | None) -> tuple[list[str], str | None]:
    if manifest is None:
        parts = sorted(glob.glob(os.path.join(directory, "part-*.pt")))
        meta = os.path.join(directory, "meta.pt")
        return parts, meta if os.path.exists(meta) else None
    names = sorted(n for n in manifest["files"] if n.startswith("part-"))
    return ([os.path.join(directory, n) for n in names],
            os.path.join(directory, "meta.pt") if "meta.pt" in manifest["files"] else None)


def _expected(st, saved_params, buffers, opt_state, directory: str) -> None:  # opt_state {}: not loaded
    """Every name, shape and dtype of this stage's parameters, buffers and optimizer state against the
    checkpoint's, before anything is copied; else CheckpointError naming the parameter."""
    order = param_order(st)
    missing = [n for n in order if n not in saved_params]
    if missing:
        raise CheckpointError(f"checkpoint {directory} has no values for {missing[:4]} (stage {st.chunk.stage}): "
                              "it was saved from a different model (every part it lists is present)")
    for n, p in st.module.named_parameters():
        name, value = st.names[n], saved_params[st.names[n]]
        _same(directory, "parameter", name, value, p.shape, torch.float32 if p.is_floating_point() else p.dtype)
        for key, v in opt_state.get(name, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                raise CheckpointError(f"checkpoint {directory}: the optimizer state {key!r} of parameter {name!r} "
                                      f"has shape {tuple(v.shape)}, the parameter {tuple(p.shape)}: it is damaged "
                                      "or not of this model")
    for name, t in buffers_of(st).items():
        if name in buffers:
            _same(directory, "buffer", name, buffers[name], t.shape, t.dtype)


def _same(directory, kind, name, saved, shape, dtype) -> None:
    if not torch.is_tensor(saved) or saved.shape != shape or saved.dtype != dtype:
        got = (f"{saved.dtype} of shape {tuple(saved.shape)}" if torch.is_tensor(saved)
               else f"a {type(saved).__name__}")
        raise CheckpointError(f"checkpoint {directory}: {kind} {name!r} is {got} there but this model's is "
                              f"{dtype} of shape {tuple(shape)}; it was saved from a different model. Nothing "
                              "was loaded")


def load(pipe, directory: str, weights_only: bool = False, missing_ok: bool = False) -> dict | None:
    """Load a checkpoint written by ``save`` (any balance, any number of parts); returns its ``extra``.
    ``directory``: a root (the newest intact checkpoint under it) or one ``step-*`` directory.
    ``weights_only``: only the parameters (a new optimizer, scheduler and policy start fresh).
    ``missing_ok``: where no checkpoint was ever committed (none yet, or only a step some run stopped while
    writing), load nothing and return None: one script for a run's first start and its restarts.
    Everything is checked (files, steps, names, shapes, dtypes) before anything is written into the model."""
    if missing_ok and not files.has_committed(directory):
        return None
    directory, parts, meta_path, manifest = _parts(pipe, directory)
    loaded = [read(path) for path in parts]
    meta = read(meta_path) if meta_path else None
    steps = _check_parts(directory, parts, loaded, manifest, meta)
    params, opt_state, groups, sched, pol_state, optimizers = {}, {}, None, None, {}, set()
    replica_buffers = {}  # data-parallel replica -> its buffers (parts written before replicas were told: 0)
    for part in loaded:
        params.update(part["params"])
        replica_buffers.setdefault(part.get("dp_rank", 0), {}).update(part.get("buffers", {}))
        opt_state.update(part["opt_state"])
        pol_state.update(part.get("policy_state", {}))
        optimizers.update(part.get("optimizers", ()))
        groups = groups or part["groups"]
        sched = sched or part["scheduler"]
    # each replica resumes its own statistics where the checkpoint has that replica, else replica 0's
    buffers = {**replica_buffers.get(0, {}), **replica_buffers.get(getattr(pipe, "dp_rank", 0), {})}
    mine = set(optimizer_names(pipe))
    saved_kinds, my_kinds = _optimizer_kinds(optimizers), _optimizer_kinds(mine)
    # a rank of a distributed pipeline holds some stages only, so some of the checkpoint's optimizers
    fits = my_kinds <= saved_kinds if is_distributed(pipe) else my_kinds == saved_kinds
    if optimizers and not fits and not weights_only:
        raise CheckpointError(f"checkpoint {directory} was written with optimizer {', '.join(sorted(optimizers))} "
                              f"but this pipeline uses {', '.join(sorted(mine))}: one optimizer's state means "
                              "nothing to another. Resume with the same optimizer, or load the weights alone "
                              "(load(..., weights_only=True)) to start the new optimizer from them")
    for w in pipe.workers:
        for st in w.stages.values():
            _expected(st, params, buffers, {} if weights_only else opt_state, directory)
    for w in pipe.workers:
        for c, st in w.stages.items():
            order = param_order(st)
            with torch.no_grad():
                local = dict(st.policy.binding.named_master_params())
                for n, p in st.module.named_parameters():
                    value = params[st.names[n]]
                    p.copy_(value.to(p.dtype))
                    if n in local and local[n] is not p:
                        local[n].copy_(value.to(local[n].dtype))
                for name, t in buffers_of(st).items():
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
                _load_scheduler(st, sched, directory)
    if not weights_only:
        pipe.step_count = steps
    pipe.loaded_from = directory
    return meta["extra"] if meta else {}
