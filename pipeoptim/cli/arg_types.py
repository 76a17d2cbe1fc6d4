"""The value types the subcommands' flags share (``type=`` of ``add_argument``): each turns the text given into a
number or refuses it with a message argparse prints beside the flag's name. One place, so that every subcommand
words the same refusal the same way.
"""
from __future__ import annotations

import argparse
import math

__all__ = ["positive_int", "non_negative_int", "positive_float", "positive_float_or_inf", "non_negative_float",
           "port"]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_float_or_inf(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number or inf, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text}")
    return value
