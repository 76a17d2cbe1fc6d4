"""pipeoptim: pipeline-parallel training with optimizer-dependent weight prediction.

Layers, each importable on its own (data flows one way):
    pipeoptim_kernels      fused prediction kernels (knows nothing of pipelines)
    pipeoptim.flat         flat parameter buffers bound to torch.optim optimizers
    pipeoptim.policies     weight policies: none, stash, 2bw, spectrain, pipeoptim
    pipeoptim.schedules    schedules as data, validator; pipeoptim.sim / pipeoptim.viz read them
    pipeoptim.runtime      executor on torch.distributed and a single-process emulator

The whole layering, bottom to top, and which module may import which: docs/architecture.md (held by
tests/test_layering.py). This module imports nothing, so that importing any one layer loads no other.
"""
__version__ = "0.1.0"
