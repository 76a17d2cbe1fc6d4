"""Make a rank's own layers real: a model built on the ``meta`` device becomes, layer by layer, storage on
this rank's device, initialised deterministically.

A model large enough to need a pipeline must not be materialised whole on any rank. The user builds it on
``meta`` (``with torch.device("meta"): model = ...``: shapes and structure, no memory), cuts it into layers,
and each rank turns only its own layers into real tensors (``to_empty``) and initialises them.

Determinism: each layer is initialised under its own random seed, derived from the pipeline's seed and the
layer's global name (its index in the layer list, or the stage index for a stage factory), never from the
order in which layers happen to be built. So the same seed gives the same weights whatever the number of
stages, the balance or the rank that builds a layer (on one device type: CPU and CUDA generators differ).
A model built normally gets the same weights from ``initialize(layer, name, seed, init_fn)`` on each layer.

Initialisation: a user ``init_fn(layer)``, or else every submodule's own ``reset_parameters()`` (what torch
modules run in their constructors), in module order. A submodule holding parameters or buffers but no
``reset_parameters`` is an error naming it: after ``to_empty`` its memory is garbage, so it needs an init_fn.
"""
from __future__ import annotations

import copy
import hashlib
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

__all__ = ["layer_seed", "is_meta", "materialize", "initialize", "default_init", "clone_structure", "replicate",
           "check_materialized"]


def _config_error(message: str) -> Exception:
    from ..errors import ConfigError
    return ConfigError(message)


def layer_seed(seed: int, name: str) -> int:
    """The random seed of the layer called ``name`` in a pipeline seeded with ``seed`` (stable across runs,
    processes and machines: a hash, not Python's randomised ``hash``)."""
    digest = hashlib.sha256(f"pipeoptim/{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def is_meta(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` lives on the meta device; one partly on meta and partly real is an error (``to_empty``
    would throw the real values away)."""
    kinds = {t.is_meta for _, t in _tensors(module)}
    if kinds == {True, False}:
        meta = next(n for n, t in _tensors(module) if t.is_meta)
        real = next(n for n, t in _tensors(module) if not t.is_meta)
        raise _config_error(f"layer {name or type(module).__name__} is partly on the meta device ({meta!r}) and "
                            f"partly real ({real!r}); build the whole model on meta, or all of it for real")
    return kinds == {True}


@contextmanager
def _seeded(seed: int, name: str, device: torch.device):
    """Run the block with every generator on ``device`` seeded from (seed, name); the caller's RNG state is
    restored afterwards, so building a pipeline does not consume the user's random stream."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(layer_seed(seed, name))
        yield


def default_init(layer: nn.Module) -> None:
    """Every submodule's own ``reset_parameters()``, in module order (what their constructors ran)."""
    for sub_name, sub in layer.named_modules():
        owns = any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))
        if not owns:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            raise _config_error(
                f"submodule {sub_name or '(the layer itself)'!r} ({type(sub).__name__}) holds parameters or buffers "
                "but has no reset_parameters(), so a meta-built copy cannot be initialised: pass "
                "init_fn=lambda layer: ... to Pipeline (it gets each layer after to_empty and must fill every "
                "tensor in place)")
        reset()


def _shared(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters that one layer uses under several names (tied inside the layer): [(owner, attr), ...] each."""
    where: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((mod, attr))
    return [places for places in where.values() if len(places) > 1]


def initialize(layer: nn.Module, name: str, seed: int, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Initialise a real ``layer`` in place under the seed of (seed, name): ``init_fn(layer)`` or
    ``default_init``. Use it on a normally built model to get the weights a meta-built pipeline gets."""
    device = next((t.device for _, t in _tensors(layer)), torch.device("cpu"))
    with torch.no_grad(), _seeded(seed, name, device):
        (init_fn or default_init)(layer)


def check_materialized(module: nn.Module, where: str) -> None:
    for n, t in _tensors(module):
        if t.is_meta:
            raise _config_error(f"{where}: tensor {n!r} is still on the meta device after initialisation; the "
                                "init_fn must fill the existing tensors in place (nn.init.*_, tensor.copy_), not "
                                "replace them with new (meta) ones")


def _to_empty(module: nn.Module, device: torch.device) -> None:
    ties = _shared(module)
    module.to_empty(device=device)
    for places in ties:  # to_empty gives every occurrence of a shared parameter its own storage: tie them again
        first = getattr(places[0][0], places[0][1])
        for mod, attr in places[1:]:
            setattr(mod, attr, first)


def materialize(layer: nn.Module, name: str, device: torch.device, seed: int,
                init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """A meta ``layer`` made real on ``device`` (``to_empty``) and initialised from (seed, name), in place.
    Parameters the layer shares between its submodules stay shared."""
    _to_empty(layer, device)
    initialize(layer, name, seed, init_fn)
    check_materialized(layer, f"layer {name}")
    return layer


def clone_structure(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose tensors are on the meta device: the structure without the data (nothing is
    allocated). ``materialize`` it, or ``to_empty`` it and copy values in, to get a second real copy."""
    memo: dict[int, object] = {}
    for _, t in _tensors(module):
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def replicate(module: nn.Module, device: torch.device) -> nn.Module:
    """A second real copy of a real ``module`` on ``device`` (one allocation per tensor, no intermediate copy):
    for a stage that two model replicas hold in one process (bidirectional schedules, emulated)."""
    clone = clone_structure(module)
    _to_empty(clone, device)
    with torch.no_grad():
        for (_, dst), (_, src) in zip(_tensors(clone), _tensors(module)):
            dst.copy_(src)
    return clone
