"""Deprecated alias of ``pipeoptim.cli.prepare`` (pipeoptim prepare-data), kept so that old imports keep working.

The command line became the package ``pipeoptim.cli``, one module per subcommand; import from there.
"""
import warnings

from .cli import prepare as _moved
from .cli.prepare import *  # noqa: F401,F403
from .cli.prepare import __all__  # noqa: F401

warnings.warn("pipeoptim.cli_prepare is deprecated: import pipeoptim.cli.prepare instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the module's other names, as the old module had them
