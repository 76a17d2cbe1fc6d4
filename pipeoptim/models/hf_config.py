"""The user's own Hugging Face model for ``pipeoptim train --hf-config``: its config read from a local
``config.json``, a folder holding one, or a name in the local Hugging Face cache (nothing is downloaded, no code
from the user's folder runs), changed by ``--hf-set key=value``, and built with random weights on the meta device.

Everything here answers a wrong input with ``HFConfigError`` naming it and the fix, before anything is built for
real: a file that is not there, a ``model_type`` transformers does not ship (a model that needs its own code,
``trust_remote_code``, is refused, never run), a key the config does not have, a value of the wrong type, a model
``causal_lm_layers`` cannot cut (its refusal, by name). ``spec`` is what a run records and sends to its ranks (a
plain dict); ``build(spec)`` makes the model from it on each rank.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os

__all__ = ["HFConfigError", "resolve", "build"]

BYTE_VOCAB = 256


class HFConfigError(ValueError):
    """A --hf-config or --hf-set that cannot make a model; the message says which and how to fix it."""


def _config_file(path_or_name: str) -> str:
    if os.path.isfile(path_or_name):
        return path_or_name
    if os.path.isdir(path_or_name):
        found = os.path.join(path_or_name, "config.json")
        if not os.path.isfile(found):
            raise HFConfigError(f"--hf-config {path_or_name}: the folder has no config.json; give the config file or "
                                "a folder saved with save_pretrained")
        return found
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(path_or_name, "config.json")
    except Exception:  # noqa: BLE001  (not a valid repository name either)
        cached = None
    if isinstance(cached, str) and os.path.isfile(cached):
        return cached
    raise HFConfigError(f"--hf-config {path_or_name}: no such file or folder, and no model of that name in the local "
                        "Hugging Face cache (nothing is downloaded); give a config.json, a folder holding one, or "
                        "download the model first (huggingface-cli download NAME config.json)")


def _read(path_or_name: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    path = _config_file(path_or_name)
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise HFConfigError(f"--hf-config {path}: not a readable JSON config ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFConfigError(f"--hf-config {path}: no model_type in it; a Hugging Face config.json names its "
                            "architecture with model_type (e.g. \"qwen3\")")
    model_type = raw["model_type"]
    if model_type not in CONFIG_MAPPING or raw.get("auto_map"):
        why = "its auto_map points at the model's own code" if raw.get("auto_map") else \
            "transformers does not ship it"
        raise HFConfigError(f"--hf-config {path}: model_type {model_type!r} needs custom code ({why}); pipeoptim "
                            "never runs code from a model's folder (trust_remote_code=False). Use a model_type "
                            "transformers ships, or write the layers in Python (docs/models/hugging-face.md)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFConfigError(f"--hf-config {path}: model_type {model_type!r} has no causal language model in "
                            "transformers (an encoder or a vision model?); pipeoptim train trains causal LMs")
    config = CONFIG_MAPPING[model_type].from_dict({k: v for k, v in raw.items() if k != "model_type"})
    return path, config


def _parse(item: str, config) -> tuple[str, object]:
    if "=" not in item:
        raise HFConfigError(f"--hf-set {item!r}: write key=value, e.g. --hf-set num_hidden_layers=4")
    key, text = (s.strip() for s in item.split("=", 1))
    known = config.to_dict()
    if key not in known and not hasattr(config, key):
        close = difflib.get_close_matches(key, list(known), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise HFConfigError(f"--hf-set {item!r}: the {config.model_type} config has no key {key!r}{hint}")
    try:
        value = json.loads(text)
    except ValueError:
        value = text  # a bare string, e.g. hidden_act=silu
    old = getattr(config, key, known.get(key))
    if isinstance(old, bool) and not isinstance(value, bool):
        raise HFConfigError(f"--hf-set {item!r}: {key} is true or false, not {text!r}")
    if isinstance(old, int) and not isinstance(old, bool) and not (isinstance(value, int)
                                                                   and not isinstance(value, bool)):
        raise HFConfigError(f"--hf-set {item!r}: {key} is a whole number (now {old}), not {text!r}")
    if isinstance(old, float) and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise HFConfigError(f"--hf-set {item!r}: {key} is a number (now {old}), not {text!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and (
            key.startswith("num_") or key.endswith("_size") or key in ("vocab_size", "head_dim")):
        raise HFConfigError(f"--hf-set {item!r}: {key} must be positive")
    return key, value


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def resolve(path_or_name: str, overrides: list[str] | None = None, vocab_size: int | None = None) -> dict:
    """The model a run trains, as a plain dict (``spec``): the config with ``overrides`` applied and the
    vocabulary set (``vocab_size``: the tokenizer's; None: bytes, 256, unless ``--hf-set vocab_size``), checked
    by building it on the meta device and cutting it. ``spec["notes"]``: what was changed without being asked."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    path, config = _read(path_or_name)
    asked, notes = {}, []
    for item in overrides or []:
        key, value = _parse(item, config)
        setattr(config, key, value)
        asked[key] = value
    entries = config.to_dict()
    types = entries.get("layer_types")
    if "num_hidden_layers" in asked and "layer_types" not in asked and isinstance(types, list) and \
            len(types) != asked["num_hidden_layers"]:
        del entries["layer_types"]  # the config class draws its pattern again for the new depth
        notes.append(f"layer_types recomputed for {asked['num_hidden_layers']} layers")
    try:
        config = CONFIG_MAPPING[config.model_type].from_dict({k: v for k, v in entries.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001  (transformers' own validation: say which flag made it fail)
        changed = " with " + " ".join(f"--hf-set {i}" for i in overrides) if overrides else ""
        raise HFConfigError(f"--hf-config {path}{changed}: the config is invalid: {e}") from None
    text = _text_config(config)
    want = vocab_size if vocab_size is not None else BYTE_VOCAB
    if "vocab_size" in asked:
        if asked["vocab_size"] < want:
            source = "the tokenizer's" if vocab_size is not None else "bytes need"
            raise HFConfigError(f"--hf-set vocab_size={asked['vocab_size']}: {source} {want} token ids; give at "
                                f"least {want}")
    elif text.vocab_size != want:
        notes.append(f"vocab_size {text.vocab_size} -> {want} ("
                     f"{'the tokenizer' if vocab_size is not None else 'bytes, no --tokenizer'})")
        text.vocab_size = want
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value >= text.vocab_size:
            setattr(text, key, None)
            notes.append(f"{key} {value} is outside the vocabulary of {text.vocab_size}: None")
    if getattr(text, "layerdrop", 0.0) and "layerdrop" not in asked:  # a pipeline's stages cannot agree on it
        notes.append(f"layerdrop {text.layerdrop} -> 0")
        text.layerdrop = 0.0
    spec = {"model_type": config.model_type, "source": path, "config": config.to_dict(), "notes": notes,
            "layers": text.num_hidden_layers, "hidden": getattr(text, "hidden_size", None),
            "heads": getattr(text, "num_attention_heads", None),
            "max_positions": getattr(text, "max_position_embeddings", None)}
    blob = json.dumps(spec["config"], sort_keys=True, default=str).encode()
    spec["sha256"] = hashlib.sha256(blob).hexdigest()
    from .hf import UnsupportedModel, causal_lm_layers
    try:
        causal_lm_layers(build(spec))
    except UnsupportedModel as e:
        raise HFConfigError(f"--hf-config {path}: {e}") from None
    except Exception as e:  # noqa: BLE001  (the model's constructor refused the config: say so, with the flags)
        changed = " with " + " ".join(f"--hf-set {i}" for i in overrides) if overrides else ""
        raise HFConfigError(f"--hf-config {path}{changed} does not build a model: {type(e).__name__}: {e}") from None
    return spec


def build(spec: dict):
    """The causal LM of ``spec`` on the meta device (no memory; each rank materialises its own stages)."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = CONFIG_MAPPING[spec["model_type"]].from_dict(
        {k: v for k, v in spec["config"].items() if k != "model_type"})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[spec["model_type"]])
    with torch.device("meta"):
        return cls(config)
