"""What every ``pipeoptim`` subcommand's ``--help`` shares: the formatter that names each option's default.

Its own module so that the entry point and each subcommand (``train``, ``prepare-data``, which also build a parser
of their own in ``main(argv)``) can use it without importing one another.
"""
from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` names every optional option's default: appended as "(default: X)" unless the help already
    says "(default" itself (where X alone would not explain it); a switch's default is "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.default is argparse.SUPPRESS
                or "(default" in text):
            return text
        if action.nargs == 0:  # store_true and the like
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"
