"""Example models written as a list of layers, so a pipeline can cut them into stages anywhere."""
from .gpt import GPTConfig, gpt_layers
from .convnet import convnet_layers

__all__ = ["GPTConfig", "gpt_layers", "convnet_layers"]
