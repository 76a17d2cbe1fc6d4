"""How ``models.hf`` finds a Hugging Face model's parts without a table of architectures: the model's own forward is
run on stand-ins (``make_view``) and watched (``hf_watch.watch_calls``), which shows the embedding, the decoder blocks, the
final norm and the head, and what each passes the next (``Anatomy``). ``hf`` cuts the model into stages from it.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["require_transformers", "UnsupportedModel", "HFInit", "Anatomy", "find_anatomy",
           "make_view", "rebuild_model", "shared_weightless", "has_weights", "call_entry", "Arrived", "LayerStandIn",
           "Elsewhere", "BackboneOutputModule", "OwnBuffers"]


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("Hugging Face models need the transformers package: pip install 'pipeoptim[hf]'") from None
    return transformers


class UnsupportedModel(TypeError):
    """The model uses something the cut does not reproduce; the message names the feature and where it is."""


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


class HFInit:
    """``init_fn`` for meta-built Hugging Face layers: the model's own ``_init_weights`` on every submodule of a
    layer, children first (as ``post_init`` does). Use it for layers written by hand from a model's modules:
    ``Pipeline(my_layers, init_fn=HFInit(model), ...)``."""

    def __init__(self, model):
        self.model = model

    def __call__(self, layer: nn.Module) -> None:
        for m in _post_order(layer):
            self.model._init_weights(m.__dict__.get("owner_view", m))  # OwnBuffers: as the module they belong to


# ---- the views: the model's own forward, run on stand-ins --------------------------------------------------
class Arrived(Exception):
    """Raised by the stand-in of the layer a view stops at, carrying what the model passed it."""

    def __init__(self, args, kwargs):
        super().__init__("arrived")
        self.args, self.kwargs = args, kwargs


class LayerStandIn(nn.Module):
    """Takes a decoder layer's place in a view: passes the hidden states on, or stops the forward at its index.
    Carries the layer's plain attributes (``attention_type``, ``layer_idx``...) that a model's loop may read."""

    def __init__(self, index: int, layer: nn.Module):
        super().__init__()
        for k, v in vars(layer).items():
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool, type(None))):
                setattr(self, k, v)
        self.index, self.stop_at, self.as_tuple = index, -1, False

    def forward(self, *args, **kwargs):
        if self.index == self.stop_at:
            raise Arrived(args, kwargs)
        return self.passed_on(args, kwargs)

    def passed_on(self, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        return (hidden,) if self.as_tuple else hidden


class Elsewhere(nn.Module):
    """Takes the place of a module that another stage holds: passes a float activation on (a wrapper of the
    input embedding called with ``inputs_embeds``), else gives a zero that adds to anything (learned positions)."""

    def forward(self, *args, **kwargs):
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3:
                return t
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        return torch.zeros((), device=device)


class BackboneOutputModule(nn.Module):
    """The backbone's place in the head's view of the top model: returns the (normed) hidden states set just
    before, as the backbone's output; any attribute on the path to the layers is itself."""

    def __init__(self, path: list[str]):
        super().__init__()
        self.path, self.hidden = set(path), None

    def __getattr__(self, name):
        if name in self.__dict__.get("path", ()):
            return self
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        return _backbone_output_class()(last_hidden_state=self.hidden)


@functools.cache
def _backbone_output_class():
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    class BackboneOutput(BaseModelOutputWithPastAndCrossAttentions):
        """The hidden states as the backbone's output; any other field a model reads (router logits, caches)
        is None, as when the unsplit model is not asked for it."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None
    return BackboneOutput


class OwnBuffers(nn.Module):
    """A stage's copy of the buffers a backbone module holds itself, not in a submodule (GPTBigCode's causal
    mask, RecurrentGemma's normalizer): the stage's view of that module reads them from here, so they move and
    materialise with the stage. ``HFInit`` fills them with the model's ``_init_weights`` of that module."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        for n, b in owner.named_buffers(recurse=False):
            self.register_buffer(n, torch.empty_like(b, device="meta") if b.is_meta else b.detach().clone(),
                                 persistent=False)
        view = make_view(owner, {})
        view._modules, view._buffers = {}, self._buffers  # the same dict: to_empty's new tensors show in the view
        self.__dict__["owner_view"] = view


def make_view(module: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` whose children named in ``children`` are replaced (the module is untouched)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters, out._buffers = dict(module._parameters), dict(module._buffers)
    out._forward_hooks, out._forward_pre_hooks = OrderedDict(), OrderedDict()
    out._modules.update(children)
    return out


@dataclass
class Anatomy:
    """Where the parts of a Hugging Face model are, found by its structure and by watching its forward once."""
    model: nn.Module
    config: object
    path: list[str]                     # from the model to the backbone (the layers' parent)
    layers_name: str
    layers: list[nn.Module]
    entry: list[str]                    # the module whose forward the views run (the base model)
    head_place: str                     # the top model's child holding the output projection
    tuple_layers: bool = False          # the model's loop takes layer(...)[0]: stand-ins return a 1-tuple
    first: dict[str, nn.Module] = field(default_factory=dict)   # run before layer 0: the embedding stage's
    last: dict[str, nn.Module] = field(default_factory=dict)    # run after the last layer, in order: the head's
    buffers: dict[str, nn.Module] = field(default_factory=dict)  # weightless with buffers (rotary): one copy a stage
    own_buffers: list[str] = field(default_factory=list)  # backbone modules holding buffers themselves

    @property
    def list_place(self) -> str:
        return ".".join([*self.path, self.layers_name])


def has_weights(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def find_anatomy(model: nn.Module) -> tuple[Anatomy, dict[str, nn.Module]]:
    """The layers, the backbone path and the output head, by structure; and every other module beside the path
    (``place -> module``), to be placed by watching the forward."""
    require_transformers()
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "get_input_embeddings"):
        raise UnsupportedModel(f"{name} is not a Hugging Face model (no config/get_input_embeddings); write its "
                               "layers as a list of modules (docs/models/hugging-face.md, 'Layers by hand')")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_encoder_decoder", False) or getattr(text, "add_cross_attention", False):
        raise UnsupportedModel(f"{name}: cross-attention (is_encoder_decoder / add_cross_attention): its layers "
                               "need encoder states, which the cut does not carry")
    if getattr(text, "output_router_logits", False):
        raise UnsupportedModel(f"{name}: output_router_logits=True adds the routers' auxiliary loss to the loss, "
                               "which the cut's loss does not compute; set output_router_logits=False")
    if (getattr(text, "layerdrop", 0.0) or 0.0) > 0.0:
        raise UnsupportedModel(f"{name}: layerdrop={text.layerdrop} skips layers at random in training, which a "
                               "pipeline's stages cannot agree on; set layerdrop=0")
    n = getattr(text, "num_hidden_layers", None)
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and n and len(m) == n
             and len({type(x) for x in m}) == 1]
    if len(lists) != 1:
        found = ", ".join(p for p, _ in lists) or "none"
        raise UnsupportedModel(f"{name}: the cut looks for one list of num_hidden_layers={n} layers of one class "
                               f"and found {found}; write its layers by hand (docs/models/hugging-face.md)")
    list_path, blocks = lists[0]
    *path, layers_name = list_path.split(".")
    prefix = getattr(model, "base_model_prefix", "")
    entry = path[:1] if path else []
    if prefix and path[:1] != [prefix] and hasattr(model, prefix):
        raise UnsupportedModel(f"{name}: the layers ({list_path}) are not inside the base model ({prefix}); write "
                               "its layers by hand")
    out = model.get_output_embeddings()
    head_place, beside, own_buffers = None, {}, []
    for depth in range(len(path) + 1):
        owner_path = path[:depth]
        below = path[depth] if depth < len(path) else layers_name
        for child_name, child in model.get_submodule(".".join(owner_path)).named_children():
            if child_name == below:
                continue
            if depth == 0:  # beside the base model: the output head, or refused
                if out is not None and any(m is out for m in child.modules()) and head_place is None:
                    head_place = child_name
                elif has_weights(child):
                    raise UnsupportedModel(f"{name}.{child_name} ({type(child).__name__}) has weights beside the "
                                           "base model and the output head; the cut does not know when it runs")
                continue
            beside[".".join([*owner_path, child_name])] = child
        owner = model.get_submodule(".".join(owner_path))
        direct = [n for n, _ in owner.named_parameters(recurse=False)]
        if depth == 0:
            direct += [n for n, _ in owner.named_buffers(recurse=False)]
        elif any(True for _ in owner.buffers(recurse=False)):
            own_buffers.append(".".join(owner_path))
        if direct:
            where = ".".join([*owner_path, direct[0]]) or direct[0]
            raise UnsupportedModel(f"{name}: {where} is a tensor of {type(owner).__name__} itself, outside its "
                                   "submodules; the cut places whole modules in stages, so it cannot place it")
    if head_place is None:
        raise UnsupportedModel(f"{name} has no output head beside its base model (get_output_embeddings() is "
                               f"{type(out).__name__}); pass the *ForCausalLM / *LMHeadModel / *ForMaskedLM class")
    return Anatomy(model, text, path, layers_name, list(blocks), entry, head_place, own_buffers=own_buffers), beside


def call_entry(view: nn.Module, **inputs):
    try:
        return view(**inputs, use_cache=False)
    except TypeError as e:
        if "use_cache" not in str(e):
            raise
        return view(**inputs)


def rebuild_model(a: Anatomy, replace: dict[str, nn.Module], holders: dict[str, OwnBuffers] | None = None) -> nn.Module:
    """A view of the base model: the modules named in ``replace`` replaced, the path down to the layers copied,
    the buffers of a path module itself read from ``holders`` (by the module's place)."""
    def rebuild(prefix: list[str]) -> nn.Module:
        module = a.model.get_submodule(".".join(prefix))
        children = {}
        for child_name, _ in module.named_children():
            place = ".".join([*prefix, child_name])
            if place in replace:
                children[child_name] = replace[place]
            elif [*prefix, child_name] == a.path[:len(prefix) + 1]:
                children[child_name] = rebuild([*prefix, child_name])
        out = make_view(module, children)
        if holders and ".".join(prefix) in holders:
            out._buffers = holders[".".join(prefix)]._buffers
        return out
    return rebuild(a.entry)


def shared_weightless(blocks: list[nn.Module]) -> None:
    """A weightless module (a rotary embedding) that several layers hold as one object gets one copy per layer,
    so each layer owns its buffers (stages materialise their layers one by one)."""
    seen: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for owner in block.modules():
            for child_name, child in list(owner.named_children()):
                if id(child) in seen and seen[id(child)] != i:
                    if has_weights(child):
                        raise UnsupportedModel(f"layers {seen[id(child)]} and {i} share the module {child_name} "
                                               f"({type(child).__name__}) with weights; a pipeline cannot split "
                                               "one weight between layers")
                    setattr(owner, child_name, copy.deepcopy(child))
                else:
                    seen.setdefault(id(child), i)
