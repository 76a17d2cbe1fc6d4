"""What of a ``Pipeline`` a checkpoint holds, shared by saving (``checkpoint``) and loading (``checkpoint_load``): its
parameters in a fixed order by global name, their fp32 masters, its persistent buffers, its optimizers, and which
rank of which world this process is."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["pipeline_state", "param_order", "masters_of", "buffers_of", "optimizer_names", "this_rank",
           "is_distributed"]


def param_order(st) -> list[str]:
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


def masters_of(st) -> dict[str, torch.Tensor]:
    local = dict(st.policy.binding.named_master_params())
    out = {}
    for n, p in st.module.named_parameters():
        out[st.names[n]] = local.get(n, p)
    return out


def buffers_of(st) -> dict[str, torch.Tensor]:
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
            for name, t in buffers_of(st).items():
                buffers[name] = t.detach().cpu().clone()
            sd = st.optimizer.state_dict()
            if groups is None:
                groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
            if sched is None and st.scheduler is not None:
                sched = st.scheduler.state_dict()
            if not weights:
                continue
            for name, t in masters_of(st).items():
                params[name] = t.detach().float().cpu().clone()
            order = param_order(st)
            for i, name in enumerate(order):
                if i in sd["state"]:
                    opt_state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                       for k, v in sd["state"][i].items()}
            for local, entry in st.policy.state_dict()["params"].items():
                pol_state[st.names[local]] = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in entry.items()}
    return {"params": params, "opt_state": opt_state, "groups": groups, "scheduler": sched,
            "step_count": pipe.step_count, "policy_state": pol_state, "buffers": buffers,
            "optimizers": optimizer_names(pipe)}


def optimizer_names(pipe) -> list[str]:
    """The optimizers' names; a ChainedOptimizer by its children's (Muon + AdamW is not SGD + AdamW)."""
    return sorted({repr(st.optimizer) if hasattr(st.optimizer, "children") else type(st.optimizer).__name__
                   for w in pipe.workers for st in w.stages.values()})


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_distributed(pipe) -> bool:
    return not pipe.emulate and dist.is_initialized()
