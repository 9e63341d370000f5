"""The command line's argument types: sizes, bandwidths and rates with SI or binary prefixes,
counts, shapes; a bad value is a UsageError naming it."""
from __future__ import annotations

import argparse
import re


_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
    """Bad input: reported argparse-style (usage, `error: ...`), exit status 2."""


# -- argument types -------------------------------------------------------------------------------------
def _quantity(text: str, what: str, unit_letter: bool, per_second: bool) -> float:
    s = text.strip()
    if per_second:
        s = re.sub(r"(/s|ps)$", "", s, flags=re.IGNORECASE)
    m = _QUANTITY.match(s)
    if not m or (m.group(4) and not unit_letter) or (m.group(3) and not m.group(2)):
        examples = {"size": "'40GB', '40GiB', '512MiB' or '80e9' (bytes)",
                    "bandwidth": "'20GB/s', '16GiB/s' or '25e9' (bytes/s)",
                    "rate": "'2e9', '50G' (elements/s)"}[what]
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}: use e.g. {examples}")
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    scale = 1024 ** "kmgtp".index(prefix) * 1024 if binary else _PREFIX[prefix]
    value = number * scale
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the {what} must be positive")
    return value


def size(text: str) -> int:
    """Bytes: '40GB' (1e9), '40GiB' (2**30), '80e9', '1MB'."""
    return int(_quantity(text, "size", unit_letter=True, per_second=False))


def bandwidth(text: str) -> float:
    """Bytes/s: '20GB/s', '16GiB/s', '25e9'."""
    return _quantity(text, "bandwidth", unit_letter=True, per_second=True)


def rate(text: str) -> float:
    """Elements/s: '2e9', '50G'."""
    return _quantity(text, "rate", unit_letter=False, per_second=True)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return v


def non_negative_size(text: str) -> int:
    if text.strip() in ("0", "0B", "0b"):
        return 0
    return size(text)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive finite number")
    return v


def shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape: use positive integers separated by commas, "
                                         "e.g. 4,128")
    return dims


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers, e.g. 1,4,16") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,4,16")
    return out


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


def parameter_count(text: str) -> float | None:
    """7.5B -> 7.5e9, 1T -> 1e12, 350M, 1.3e9; None if `text` is not a count."""
    m = _COUNT.match(text)
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
