"""``python -m pipeoptim.cli ...`` (and ``torchrun ... -m pipeoptim.cli train ...``): the ``pipeoptim`` command."""
import sys

from .main import main

sys.exit(main())
