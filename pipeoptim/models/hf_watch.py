"""The watched forward of ``models.hf``: the base model's own forward run once on CPU with every weighted module
and decoder block as a recording stand-in (four token ids; nothing of the model's size is allocated), which places
each module before the blocks, after them, or between them (refused), and records what the blocks receive
(``Anatomy``'s entry, head and buffers are filled from it). Its own module because it is the one part of the
anatomy that runs the model.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from .hf_anatomy import (Anatomy, HFInit, LayerStandIn, OwnBuffers, UnsupportedModel, call_entry, has_weights,
                         rebuild_model)

__all__ = ["watch_calls"]


class _Watch(nn.Module):
    """A module's place in the watched forward: records the call and returns an activation of the right shape
    (an input's, or zeros (B, T, hidden) for ids), which requires grad so that what is computed from it shows."""

    def __init__(self, place: str, hidden_size: int, log: list):
        super().__init__()
        self.place, self.hidden_size, self.log = place, hidden_size, log

    def forward(self, *args, **kwargs):
        self.log.append(self.place)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.is_floating_point() and t.dim() >= 3:
                return t
        ids = tensors[0]
        return torch.zeros(*ids.shape, self.hidden_size, requires_grad=True)


class _WatchLayer(LayerStandIn):
    def __init__(self, index, layer, log, received):
        super().__init__(index, layer)
        self.log, self.received = log, received

    def forward(self, *args, **kwargs):
        self.log.append(self.index)
        self.received.append((args, kwargs))
        return self.passed_on(args, kwargs)


def watch_calls(a: Anatomy, beside: dict[str, nn.Module]) -> None:
    """Run the base model's forward once on CPU with every weighted module and layer as a recording stand-in
    (four token ids, nothing of the model's size is allocated) and place each module by when it ran: before the
    layers (the embedding stage), after them (the head), or between them (refused). A layer argument computed
    from the hidden states or from weights is refused too: a stage could not rebuild it."""
    with torch.device("cpu"):  # also when cut inside `with torch.device("meta")`: the watch runs for real
        try:
            _watch_once(a, beside, as_tuple=False)
        except UnsupportedModel as plain:
            if plain.__cause__ is None:
                raise
            try:
                _watch_once(a, beside, as_tuple=True)  # a loop that takes layer(...)[0]
            except UnsupportedModel:
                raise plain from plain.__cause__
            a.tuple_layers = True


def _watch_once(a: Anatomy, beside: dict[str, nn.Module], as_tuple: bool) -> None:
    name = type(a.model).__name__
    a.first.clear(), a.last.clear(), a.buffers.clear()
    log, received = [], []
    hidden_size = getattr(a.config, "hidden_size", None)
    watched = nn.ModuleList(_WatchLayer(i, b, log, received) for i, b in enumerate(a.layers))
    for s in watched:
        s.as_tuple = as_tuple
    replace: dict[str, nn.Module] = {a.list_place: watched}
    init = HFInit(a.model)
    for place, m in beside.items():
        if has_weights(m):
            replace[place] = _Watch(place, hidden_size, log)
        elif any(True for _ in m.buffers()):
            c = copy.deepcopy(m)
            if any(t.is_meta for t in c.buffers()) or any(t.device.type != "cpu" for t in c.buffers()):
                c.to_empty(device="cpu")
                with torch.no_grad():
                    init(c)
            replace[place] = c
            a.buffers[place] = m
        else:
            hooked = copy.copy(m)
            hooked._forward_hooks, hooked._forward_pre_hooks = OrderedDict(), OrderedDict()
            hooked.register_forward_pre_hook(lambda mod, args, place=place: log.append(place))
            replace[place] = hooked
    holders = {}
    for place in a.own_buffers:
        holder = OwnBuffers(a.model.get_submodule(place))
        if any(t.is_meta or t.device.type != "cpu" for t in holder.buffers()):
            holder.to_empty(device="cpu")
            with torch.no_grad():
                init(holder)
        holders[place] = holder
    view = rebuild_model(a, replace, holders)
    view.train(False)
    ids = torch.zeros(1, 4, dtype=torch.long)
    try:
        call_entry(view, input_ids=ids)
    except UnsupportedModel:
        raise
    except Exception as e:  # noqa: BLE001  (the model's own code failed on the stand-ins: say so, do not guess)
        last = (f" right after {log[-1]} ({type(beside[log[-1]]).__name__}) ran, whose output the model uses in a "
                "way a stand-in cannot imitate" if log and isinstance(log[-1], str) else "")
        raise UnsupportedModel(f"{name}: the cut runs the model's forward with stand-ins for its layers and for the "
                               f"modules of other stages to see where each runs, and it failed{last}; the cut does "
                               "not reproduce this model: write the layers by hand (docs/models/hugging-face.md). "
                               f"The model's error: {type(e).__name__}: {e}") from e
    layer_at = [k for k, e in enumerate(log) if isinstance(e, int)]
    if [log[k] for k in layer_at] != list(range(len(a.layers))):
        raise UnsupportedModel(f"{name}: its forward called the layers in the order {[log[k] for k in layer_at]}, "
                               "not once each in order; the cut cannot place them")
    for k, e in enumerate(log):
        if isinstance(e, int) or e in a.first or e in a.last:
            continue
        if layer_at[0] < k < layer_at[-1]:
            raise UnsupportedModel(f"{name}: {e} ({type(beside[e]).__name__}) runs between layers "
                                   f"{log[max(j for j in layer_at if j < k)]} and "
                                   f"{log[min(j for j in layer_at if j > k)]}; the cut cannot place it")
        (a.first if k < layer_at[0] else a.last)[e] = beside[e]
    for place, m in beside.items():  # weighted modules the forward never ran (unused): the embedding stage keeps
        if place not in a.first and place not in a.last and place not in a.buffers and has_weights(m):
            a.first[place] = m
    for i, (args, kwargs) in enumerate(received):
        named = {**{f"argument {j}": v for j, v in enumerate(args[1:], 1)}, **kwargs}
        for key, value in named.items():
            if key == "hidden_states":
                continue
            flat = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in flat):
                raise UnsupportedModel(f"layer {i} ({type(a.layers[i]).__name__}) receives {key!r}, which the "
                                       "model's forward computes from the hidden states or from weights outside the "
                                       "layer; the cut cannot rebuild it in the layer's stage, so it refuses")
