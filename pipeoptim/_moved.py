"""Old import paths of the modules that moved into folders keep working, with a ``DeprecationWarning``.

``import pipeoptim.flat`` (or ``from pipeoptim import flat``) gives the module now at ``pipeoptim.prediction.flat``:
the very same module object, so its names, and anything a caller patches on it, are shared by both paths.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "pipeoptim.flat": "pipeoptim.prediction.flat",
    "pipeoptim.predictor": "pipeoptim.prediction.predictor",
    "pipeoptim.last_update": "pipeoptim.prediction.last_update",
    "pipeoptim.materialize": "pipeoptim.stages.materialize",
    "pipeoptim.model_cut": "pipeoptim.stages.model_cut",
    "pipeoptim.partition": "pipeoptim.stages.partition",
    "pipeoptim.copies": "pipeoptim.stages.copies",
    "pipeoptim.recompute": "pipeoptim.stages.recompute",
    "pipeoptim.cpu_memory": "pipeoptim.runtime.cpu_memory",
    "pipeoptim.token_shards": "pipeoptim.data.token_shards",
    "pipeoptim.train_batches": "pipeoptim.data.batches",
    # pipeoptim train's job, out of the command line into pipeoptim.job (TrainConfig, for Python and torchrun too)
    "pipeoptim.cli.train_config": "pipeoptim.job.checks",
    "pipeoptim.cli.train_rank": "pipeoptim.job.rank",
    "pipeoptim.cli.run_dir": "pipeoptim.job.run_dir",
    "pipeoptim.cli.train_outputs": "pipeoptim.job.outputs",
    "pipeoptim.cli.torchrun": "pipeoptim.job.torchrun",
    "pipeoptim.cli.torchrun_env": "pipeoptim.job.torchrun_env",
}


class _OldPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of ``MOVED`` and loads it as the module at the new one."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}: import it from there", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass  # the module at the new path is already executed


def install() -> None:
    if not any(isinstance(f, _OldPath) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPath())  # before an editable install's finder, which may know the old files
