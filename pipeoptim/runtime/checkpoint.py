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

Persistent buffers (BatchNorm's running statistics) travel too, by global name. Loading maps each part into
memory (``torch.load(mmap=True)``) and copies only this process's own entries, so a rank of a large, meta-built
pipeline reads its share of the checkpoint, never the whole model.
"""
from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist

__all__ = ["pipeline_state", "save", "load"]


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
            "step_count": pipe.step_count, "policy_state": pol_state, "buffers": buffers}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(pipe, directory: str, extra: dict | None = None) -> None:
    os.makedirs(directory, exist_ok=True)
    rank = 0 if pipe.emulate else _rank()
    if rank == 0:
        for old in glob.glob(os.path.join(directory, "part-*.pt")):
            os.remove(old)
    if not pipe.emulate and dist.is_initialized():
        dist.barrier()
    tmp = os.path.join(directory, f".part-{rank}.tmp")
    torch.save(pipeline_state(pipe), tmp)
    os.replace(tmp, os.path.join(directory, f"part-{rank}.pt"))
    if rank == 0:
        torch.save({"extra": extra or {}, "schedule": pipe.schedule.name, "devices": pipe.devices,
                    "step_count": pipe.step_count}, os.path.join(directory, "meta.pt"))
    if not pipe.emulate and dist.is_initialized():
        dist.barrier()


def load(pipe, directory: str) -> dict:
    """Load a checkpoint written by ``save`` (any balance, any number of parts); returns its ``extra``."""
    parts = sorted(glob.glob(os.path.join(directory, "part-*.pt")))
    if not parts:
        raise FileNotFoundError(f"no checkpoint parts (part-*.pt) in {directory}; save one with Pipeline.save")
    params, opt_state, groups, sched, steps, pol_state, buffers = {}, {}, None, None, 0, {}, {}
    for path in parts:
        try:  # mapped, not read: only the entries this process copies below are paged in
            part = torch.load(path, weights_only=False, mmap=True)
        except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
            part = torch.load(path, weights_only=False)
        params.update(part["params"])
        buffers.update(part.get("buffers", {}))
        opt_state.update(part["opt_state"])
        pol_state.update(part.get("policy_state", {}))
        groups = groups or part["groups"]
        sched = sched or part["scheduler"]
        steps = max(steps, part["step_count"])
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
    pipe.step_count = steps
    meta_path = os.path.join(directory, "meta.pt")
    return torch.load(meta_path, weights_only=False)["extra"] if os.path.exists(meta_path) else {}
