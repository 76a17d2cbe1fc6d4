"""The model as the user gave it, cut into stages: global parameter names for every stage, and the real
module of a stage built only when this process holds that stage.

A model comes in one of three forms, all cut the same way:

- a list (or ``nn.Sequential``) of layers plus a balance: stage i holds a contiguous run of layers; a
  parameter's global name is ``<layer index>.<name in the layer>``, whatever the balance;
- a list of stage modules, one per stage: global names ``<stage>.<name>``;
- a stage factory ``stages=lambda i: module``, called only for the stages this process holds (and, on the
  meta device, for the shapes of the others when ``tied=``/``copies=`` need them).

Layers may be real or built on the ``meta`` device. A real layer is used as it is (moved to the device; the
pipeline trains it in place, no copy); a meta layer is materialised on the device and initialised
deterministically (``materialize``), so a rank never holds more than its own stages. Layers of stages this
process does not hold are never touched, and the cut forgets them once the pipeline is built.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .materialize import is_meta, materialize, replicate
from ..errors import ConfigError

__all__ = ["StageModule", "ModelCut", "as_layers", "check_unshared"]

_CUT_HELP = ("give the model as a list of layers (each maps the previous layer's output, a tensor or a tuple of "
             "tensors, to its own), as stages=[one module per stage], or as stages=lambda stage_index: module; for "
             "Hugging Face causal LMs use pipeoptim.models.hf.causal_lm_layers(model), for torchvision ResNets "
             "pipeoptim.models.vision.resnet_layers(model)")


class StageModule(nn.Module):
    """Consecutive layers as one stage; a layer returning a tuple feeds the next layer's arguments. Every
    layer's output must be a tensor or a tuple of tensors (what can cross to the next stage); anything else is
    an error naming the layer."""

    def __init__(self, layers: Sequence[nn.Module], names: Sequence[str] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layer_names = [str(j) for j in range(len(self.layers))] if names is None else list(names)

    def forward(self, *xs):
        out = xs
        for name, layer in zip(self.layer_names, self.layers):
            out = _boundary(layer(*out) if isinstance(out, tuple) else layer(out), name, layer)
        return out

    def global_name(self, local: str) -> str:
        """``layers.<j>.<rest>`` (a name in this module) -> ``<layer's global name>.<rest>``."""
        _, j, rest = local.split(".", 2)
        return f"{self.layer_names[int(j)]}.{rest}"


def _boundary(out, name: str, layer: nn.Module):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    if isinstance(out, (tuple, list)):
        bad = next((i for i, t in enumerate(out) if not isinstance(t, torch.Tensor)), None)
        what = (f"a {type(out).__name__} whose item {bad} is {type(out[bad]).__name__}" if bad is not None
                else f"an empty {type(out).__name__}")
    else:
        what = type(out).__name__
    raise TypeError(f"layer {name} ({type(layer).__name__}) returned {what}; a pipeline layer must return a tensor or "
                    "a tuple of tensors (everything that crosses to the next layer or stage). Wrap the layer so it "
                    "returns only tensors (e.g. out['hidden_states'], or drop None entries)")


def check_unshared(layers: Sequence[nn.Module]) -> None:
    """A ConfigError naming them if two meta-built layers hold one submodule with tensors (e.g. a rotary
    embedding every decoder layer points at): each layer is made real on its own, so the first makes the shared
    module real and the second is then half real, half meta."""
    if not any(any(t.is_meta for t in layer.parameters()) or any(t.is_meta for t in layer.buffers())
               for layer in layers):
        return
    owner: dict[int, tuple[int, str]] = {}
    for i, layer in enumerate(layers):
        for sub_name, sub in layer.named_modules():
            if not (any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))):
                continue
            if id(sub) in owner and owner[id(sub)][0] != i:
                j, first = owner[id(sub)]
                here, there = f"{j}.{first or '(itself)'}", f"{i}.{sub_name or '(itself)'}"
                raise ConfigError(f"layers {j} and {i} share one {type(sub).__name__} module ({here} is {there}); a "
                                  "meta-built layer is made real on its own, so a module two layers hold cannot be. "
                                  "Give each layer its own copy (copy.deepcopy(module)) if it holds only buffers (a "
                                  "rotary embedding), or two copies declared tied=/copies= if it holds weights")
            owner.setdefault(id(sub), (i, sub_name))


def as_layers(layers) -> list[nn.Module]:
    """The user's layers as a list of modules, or a ConfigError saying how to give them."""
    if isinstance(layers, (nn.Sequential, nn.ModuleList)):
        layers = list(layers)
    elif isinstance(layers, nn.Module):
        raise ConfigError(f"a single {type(layers).__name__} cannot be cut into stages: {_CUT_HELP}")
    elif not isinstance(layers, Sequence) or isinstance(layers, (str, bytes)):
        raise ConfigError(f"layers must be a list of modules, got {type(layers).__name__}: {_CUT_HELP}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"layer {i} is a {type(layer).__name__}, not an nn.Module: {_CUT_HELP}")
    if not layers:
        raise ConfigError(f"the model has no layers: {_CUT_HELP}")
    return layers


class ModelCut:
    """Per stage: the user's layers (or a factory) and their global names."""

    def __init__(self, stage_layers: list[list[nn.Module] | None], names: list[list[str]],
                 factory: Callable[[int], nn.Module] | None = None):
        self._layers, self.names, self._factory = stage_layers, names, factory
        self._shapes: dict[int, nn.Module] = {}  # factory stages built on meta, for their parameter shapes

    @classmethod
    def from_layers(cls, layers: list[nn.Module], balance: Sequence[int]) -> "ModelCut":
        check_unshared(layers)
        starts = [sum(balance[:i]) for i in range(len(balance))]
        return cls([layers[a:a + b] for a, b in zip(starts, balance)],
                   [[str(a + j) for j in range(b)] for a, b in zip(starts, balance)])

    @classmethod
    def from_stages(cls, stages, num_stages: int, schedule_name: str, devices: int) -> "ModelCut":
        names = [[str(i)] for i in range(num_stages)]
        if callable(stages) and not isinstance(stages, nn.Module):
            return cls([None] * num_stages, names, factory=stages)
        if isinstance(stages, nn.Module) and not isinstance(stages, (nn.Sequential, nn.ModuleList)):
            raise ConfigError(f"stages= got one {type(stages).__name__}; give one module per stage (a list of "
                              f"{num_stages}) or a factory stages=lambda stage_index: module")
        stages = list(stages)
        if len(stages) != num_stages:
            raise ConfigError(f"schedule {schedule_name!r} on {devices} devices has {num_stages} stages but "
                              f"{len(stages)} stage modules were given")
        for i, m in enumerate(stages):
            if not isinstance(m, nn.Module):
                raise ConfigError(f"stage {i} is a {type(m).__name__}, not an nn.Module; give one module per stage")
        return cls([[m] for m in stages], names)

    @property
    def num_stages(self) -> int:
        return len(self.names)

    # ---- what the whole model looks like (no memory: meta or the user's own tensors) ----------------------
    def _stage_layers(self, stage: int, need_all: bool) -> list[nn.Module]:
        if self._factory is None:
            return self._layers[stage]
        if stage not in self._shapes:
            if not need_all:
                return []
            with torch.device("meta"):
                self._shapes[stage] = self._call_factory(stage, None)
        return [self._shapes[stage]]

    def global_params(self, need_all: bool = True) -> dict[str, tuple[int, torch.Tensor]]:
        """Global name -> (stage, the user's tensor, real or meta), for every stage (a factory's other stages are
        built on meta for this, and only when ``need_all``). A parameter object in two stages is an error."""
        out, seen = {}, {}
        for stage in range(self.num_stages):
            for layer, prefix in zip(self._stage_layers(stage, need_all), self.names[stage]):
                for pname, p in layer.named_parameters():
                    name = f"{prefix}.{pname}"
                    if id(p) in seen and seen[id(p)][0] != stage:
                        raise ConfigError(f"parameter {name} is the same tensor as {seen[id(p)][1]} (stage "
                                          f"{seen[id(p)][0]}): two stages cannot share a parameter object. Give "
                                          "each stage its own copy and declare them tied=[(first, second)] "
                                          "(synchronous schedules) or copies=[(first, second)]")
                    seen.setdefault(id(p), (stage, name))
                    out[name] = (stage, p)
        return out

    # ---- building a stage ---------------------------------------------------------------------------------
    def _call_factory(self, stage: int, device: torch.device | None) -> nn.Module:
        m = self._factory(stage)
        if isinstance(m, (list, tuple, nn.ModuleList)):
            raise ConfigError(f"the stages= factory returned {len(m)} modules for stage {stage}; the schedule has "
                              f"{self.num_stages} stages and calls the factory once per stage this rank holds: "
                              "return only stage_index's module")
        if not isinstance(m, nn.Module):
            raise ConfigError(f"the stages= factory returned a {type(m).__name__} for stage {stage}; it must "
                              "return that stage's nn.Module")
        if device is not None and not is_meta(m, f"stage {stage}"):
            where = {t.device for t in list(m.parameters()) + list(m.buffers())}
            if any(d != device for d in where):
                raise ConfigError(f"the stages= factory built stage {stage} on {sorted(map(str, where))} but this rank "
                                  f"runs on {device}; build it on {device}, or on 'meta' (with torch.device('meta')) "
                                  "and let the pipeline materialise it")
        return m

    def build(self, stage: int, device: torch.device, seed: int, init_fn) -> StageModule:
        """Stage ``stage``'s real module on ``device``, from the user's layers (taken, not copied)."""
        layers = [self._call_factory(stage, device)] if self._factory is not None else self._layers[stage]
        for name, layer in zip(self.names[stage], layers):
            taken = next((n for n, p in layer.named_parameters() if getattr(p, "_pipeoptim_taken", False)), None)
            if taken is not None:
                raise ConfigError(f"parameter {name}.{taken} already belongs to another Pipeline, which trains it in "
                                  "place; build the model again (or pass a copy) for a second pipeline")
        real = []
        for name, layer in zip(self.names[stage], layers):
            if is_meta(layer, name):
                real.append(materialize(layer, name, device, seed, init_fn))
            else:
                real.append(layer.to(device))
        return StageModule(real, self.names[stage])

    @staticmethod
    def second_copy(module: StageModule, device: torch.device) -> StageModule:
        """Another real copy of a built stage (a second model replica of the same stage in this process)."""
        return replicate(module, device)

    @staticmethod
    def mark_taken(modules) -> None:
        """Mark the parameters of built stages: a second pipeline built from the same layers would rebind them."""
        for module in modules:
            for p in module.parameters():
                p._pipeoptim_taken = True

    def forget(self) -> None:
        """Drop every reference to the user's layers (the other stages' memory is the user's to free)."""
        self._layers = [None] * self.num_stages
        self._shapes.clear()


def timing_copy(layer: nn.Module, name: str, device: torch.device, seed: int, init_fn) -> nn.Module:
    """``layer`` as ``balance='time'`` profiles it: itself when real and on ``device``, else a temporary real
    copy there (a meta layer materialised as the pipeline would; one layer at a time, dropped after timing)."""
    from .materialize import clone_structure
    if is_meta(layer, name):
        return materialize(clone_structure(layer), name, device, seed, init_fn)
    if any(t.device != device for t in list(layer.parameters()) + list(layer.buffers())):
        return replicate(layer, device)
    return layer
