"""argparse types shared by `capstan serve` and `capstan gateway`: a value out of range is a CLI error naming the
flag, before anything starts."""

from __future__ import annotations

import argparse


def port(text: str) -> int:
    """A TCP port (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {value}")
    return value
