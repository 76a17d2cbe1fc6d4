"""Deprecated alias of ``pipeoptim.job.torchrun`` (pipeoptim train under torchrun), kept so that old imports keep working.

The command line became the package ``pipeoptim.cli``, one module per subcommand, and the training job it starts
the package ``pipeoptim.job``; import from there.
"""
import warnings

from .job import torchrun as _moved
from .job.torchrun import *  # noqa: F401,F403
from .job.torchrun import __all__  # noqa: F401

warnings.warn("pipeoptim.cli_torchrun is deprecated: import pipeoptim.job.torchrun instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the module's other names, as the old module had them
