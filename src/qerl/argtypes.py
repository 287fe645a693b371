"""argparse types that check a value's range where it is parsed, so a bad number is one usage line before
any work, not a traceback (or a silently odd run) after the model has loaded."""

import argparse
import math


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _ranged(kind, within, requirement: str):
    """An argparse type: `kind` (int or float) parsed, then `within(value)` or "must be <requirement>"."""
    def parse(text: str):
        value = _number(kind, text)
        if not within(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value
    return parse


positive_int = _ranged(int, lambda v: v >= 1, ">= 1")
non_negative_int = _ranged(int, lambda v: v >= 0, ">= 0")
non_negative_float = _ranged(float, lambda v: v >= 0, ">= 0")
unit_interval = _ranged(float, lambda v: 0 <= v <= 1, "in [0, 1]")  # a fraction
probability_mass = _ranged(float, lambda v: 0 < v <= 1, "in (0, 1]")  # a nucleus-sampling mass


def checked_by(check):
    """An argparse type from a function that returns the value or raises ValueError with the reason."""
    def parse(text: str):
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    parse.__name__ = getattr(check, "__name__", "value")
    return parse
