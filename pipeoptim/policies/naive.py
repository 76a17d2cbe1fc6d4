"""`none`: naive asynchronous pipelining — no stash, no prediction.

The forward reads the weights real at forward time; every backward op reads the weights real at backward
time (after the steps taken in between), so forward and backward see different weights. It is the
baseline the other policies improve on, and costs nothing.
"""
from __future__ import annotations

from .base import WeightPolicy


class NoPolicy(WeightPolicy):
    name = "none"
    saves_real_weights_at_s0 = True
