"""Example models written as a list of layers, so a pipeline can cut them into stages anywhere; adapters
that cut models nobody here wrote (``models.hf``: Hugging Face causal LMs, ``models.vision``: torchvision
ResNets; optional extras, imported on use)."""
from .gpt import GPTConfig, gpt_init_fn, gpt_layers
from .convnet import convnet_layers

__all__ = ["GPTConfig", "gpt_layers", "gpt_init_fn", "convnet_layers"]
