"""A small conv net for 8×8 digits as a flat list of layers, for pipeline stages."""
from __future__ import annotations

import torch
from torch import nn


def convnet_layers(num_classes: int = 10, width: int = 32, seed: int = 0) -> list[nn.Module]:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return [
            nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 4, 128), nn.ReLU()),
            nn.Linear(128, num_classes),
        ]
    finally:
        torch.random.set_rng_state(gen_state)
