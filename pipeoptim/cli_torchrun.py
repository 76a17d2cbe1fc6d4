"""Deprecated alias of ``pipeoptim.cli.torchrun`` (pipeoptim train under torchrun), kept so that old imports keep working.

The command line became the package ``pipeoptim.cli``, one module per subcommand; import from there.
"""
import warnings

from .cli import torchrun as _moved
from .cli.torchrun import *  # noqa: F401,F403
from .cli.torchrun import __all__  # noqa: F401

warnings.warn("pipeoptim.cli_torchrun is deprecated: import pipeoptim.cli.torchrun instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the module's other names, as the old module had them
