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
import pickle
import re
import shutil
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import checkpoint_files as files
from .checkpoint_files import CheckpointError
from .watchdog import COLLECTIVE

__all__ = ["pipeline_state", "save", "load", "read", "inspect", "plain_problem", "CheckpointError"]


def _param_order(st) -> list[str]:
    """Global names of the optimizer's parameters in its own state_dict order (which a chained optimizer, e.g.
    Muon on the matrices + AdamW on the rest, does not keep in module order)."""
    module_params = list(st.module.named_parameters())
    name_of = {id(p): st.names[n] for n, p in module_params}
    binding = getattr(st.policy, "binding", None)
    if binding is not None:
        name_of.update({id(p): st.names[n] for n, p in binding.named_master_params()})
    names = [name_of.get(id(p)) for g in st.optimizer.param_groups for p in g["params"]]
    if None in names or len(set(names)) != len(module_params) or len(names) != len(module_params):
        raise RuntimeError(f"stage {st.chunk.stage}: the optimizer holds {len(names)} parameters but the module has "
                           f"{len(module_params)}; checkpoints need every parameter of the stage in its optimizer, "
                           "once")
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


def pipeline_state(pipe, weights: bool = True) -> dict:
    """This process's share of the pipeline's state, by global name. ``weights=False`` leaves out the
    parameters, the optimizer's and the policy's per-parameter state (what another data-parallel replica holds
    too), and copies none of them."""
    params, opt_state, groups, sched, pol_state, buffers = {}, {}, None, None, {}, {}
    for w in pipe.workers:
        for c, st in w.stages.items():
            if c.replica != 0:
                continue
            for name, t in _buffers(st).items():
                buffers[name] = t.detach().cpu().clone()
            sd = st.optimizer.state_dict()
            if groups is None:
                groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            if sched is None and st.scheduler is not None:
                sched = st.scheduler.state_dict()
            if not weights:
                continue
            for name, t in _masters(st).items():
                params[name] = t.detach().float().cpu().clone()
            order = _param_order(st)
            for i, name in enumerate(order):
                if i in sd["state"]:
                    opt_state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                       for k, v in sd["state"][i].items()}
            for local, entry in st.policy.state_dict()["params"].items():
                pol_state[st.names[local]] = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in entry.items()}
    return {"params": params, "opt_state": opt_state, "groups": groups, "scheduler": sched,
            "step_count": pipe.step_count, "policy_state": pol_state, "buffers": buffers,
            "optimizers": _optimizer_names(pipe)}


def _optimizer_names(pipe) -> list[str]:
    """The optimizers' names; a ChainedOptimizer by its children's (Muon + AdamW is not SGD + AdamW)."""
    return sorted({repr(st.optimizer) if hasattr(st.optimizer, "children") else type(st.optimizer).__name__
                   for w in pipe.workers for st in w.stages.values()})


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
    """The optimizer classes behind ``_optimizer_names``: 'ChainedOptimizer(Muon, AdamW)' is Muon and AdamW. A
    stage holding only matrices gets Muon alone where another cut gives it Muon + AdamW, so the classes, not the
    names, say whether a checkpoint's optimizer state fits this pipeline's."""
    kinds = set()
    for name in names:
        inner = re.fullmatch(r"\w+\((.*)\)", name)
        kinds.update(inner.group(1).split(", ") if inner else [name])
    return kinds


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _distributed(pipe) -> bool:
    return not pipe.emulate and dist.is_initialized()


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
    rank, distributed = (0 if pipe.emulate else _rank()), _distributed(pipe)
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
            "world_size": dist.get_world_size() if _distributed(pipe) else 1, "dp": getattr(pipe, "dp", 1),
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


def _parts(pipe, directory: str) -> tuple[str, list[str], str | None, dict | None]:
    """(checkpoint directory, its part files, meta file, manifest) for ``directory``: one checkpoint, or the
    newest intact one under a root, or an old-style directory of parts without a manifest (no manifest)."""
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
    order = _param_order(st)
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
    for name, t in _buffers(st).items():
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
    mine = set(_optimizer_names(pipe))
    saved_kinds, my_kinds = _optimizer_kinds(optimizers), _optimizer_kinds(mine)
    # a rank of a distributed pipeline holds some stages only, so some of the checkpoint's optimizers
    fits = my_kinds <= saved_kinds if _distributed(pipe) else my_kinds == saved_kinds
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
            order = _param_order(st)
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
                _load_scheduler(st, sched, directory)
    if not weights_only:
        pipe.step_count = steps
    pipe.loaded_from = directory
    return meta["extra"] if meta else {}
