"""pipeoptim: pipeline-parallel training with optimizer-dependent weight prediction.

The folders are the layers, bottom to top (data flows one way; each importable on its own):
    pipeoptim_kernels      fused prediction kernels (knows nothing of pipelines)
    pipeoptim.prediction   flat parameter buffers bound to torch.optim optimizers, the predictor
    pipeoptim.schedules    schedules as data, validator; pipeoptim.sim / pipeoptim.viz read them
    pipeoptim.policies     weight policies: none, stash, 2bw, spectrain, pipeoptim
    pipeoptim.stages       a model cut into stages: balance, meta builds, recomputation
    pipeoptim.runtime      executor on torch.distributed and a single-process emulator
    pipeoptim.data         text, tokenizers, prepared token shards, a rank's batches
    pipeoptim.train        Pipeline, the user's front door; pipeoptim.models and pipeoptim.recipes above it
    pipeoptim.cli          the ``pipeoptim`` command

The whole layering, and which module may import which: docs/architecture.md (held by tests/test_layering.py).
This module imports no layer, so that importing any one layer loads no other; it only keeps the old import paths
of moved modules working (``_moved``).
"""
from ._moved import install as _install_old_paths

_install_old_paths()
__version__ = "0.1.0"
