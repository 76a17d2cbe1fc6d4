"""Deprecated alias of ``pipeoptim.cli.train`` (pipeoptim train), kept so that old imports keep working.

The command line became the package ``pipeoptim.cli``, one module per subcommand; import from there.
"""
import warnings

from .cli import train as _moved
from .cli.train import *  # noqa: F401,F403
from .cli.train import __all__  # noqa: F401

warnings.warn("pipeoptim.cli_train is deprecated: import pipeoptim.cli.train instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the module's other names, as the old module had them


if __name__ == "__main__":
    raise SystemExit(_moved.main())
