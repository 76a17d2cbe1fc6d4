"""A weight policy's state across optimizer steps, per parameter by its name: what ``WeightPolicy.state_dict`` saves
in a checkpoint and ``load_state_dict`` puts back, possibly into another stage layout (the entries are keyed by the
module's parameter names, not by flat-buffer offsets)."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["gather", "scatter"]

Entries = Callable[[int], dict]  # flat group index -> {key: flat buffer laid out like that group's weights}


def gather(groups, entries_of: Entries) -> dict[str, dict]:
    """{parameter name: {"steps_taken": n, "last_grad": tensor (where kept), key: tensor for each of
    ``entries_of(group)``}}, every tensor a copy of the parameter's own slice."""
    params: dict[str, dict] = {}
    for g in groups:
        for j, name in enumerate(g.names):
            entry: dict = {"steps_taken": g.steps_taken}
            if g.last_grad is not None:
                entry["last_grad"] = g.view(g.last_grad, j).detach().clone()
            params[name] = entry
    for i, g in enumerate(groups):
        for key, flat in entries_of(i).items():
            for j, name in enumerate(g.names):
                params[name][key] = g.view(flat, j).detach().clone()
    return params


def scatter(policy: str, groups, entries_of: Entries, params: dict) -> None:
    """Copy ``params`` (``gather``'s form) into the flat groups; ``policy``: its name, for the errors.

    A group none of whose parameters appear keeps its state; one only partly covered is an error (its parameters
    would resume from different points); entries a group does not keep are ignored."""
    for i, g in enumerate(groups):
        have = [n for n in g.names if n in params]
        if not have:
            continue
        if len(have) != len(g.names):
            missing = [n for n in g.names if n not in params]
            raise ValueError(f"{policy}: the policy state has entries for {have[:3]} but not for "
                             f"{missing[:3]}, which share one flat group (one step count); save and load the "
                             "whole model's policy state")
        steps = {int(params[n]["steps_taken"]) for n in g.names if "steps_taken" in params[n]}
        if len(steps) > 1:
            raise ValueError(f"{policy}: parameters of one flat group were saved at different step counts "
                             f"{sorted(steps)}; they must step together")
        if steps:
            g.steps_taken = steps.pop()
        kept = dict(entries_of(i))
        if g.last_grad is not None:
            kept["last_grad"] = g.last_grad
        with torch.no_grad():
            for key, flat in kept.items():
                for j, name in enumerate(g.names):
                    value = params[name].get(key)
                    if value is None:
                        continue
                    view = g.view(flat, j)
                    if tuple(value.shape) != tuple(view.shape):
                        raise ValueError(f"{policy}: saved {key} of {name} has shape {tuple(value.shape)} but "
                                         f"the parameter has {tuple(view.shape)}; the checkpoint belongs to "
                                         "another model")
                    view.copy_(value)
