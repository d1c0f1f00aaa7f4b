"""Numbers read from text as TF's readers read them (``strings::safe_strto64`` and C's
``strtod``, behind ``tf.io.decode_csv`` and the vocabulary files of Keras' lookups):
Python's ``int`` and ``float``, but without their ``_`` separators, and with C's
hexadecimal floats (``0x1p3``) and ``nan(...)``. Each raises ``ValueError`` for text that is
not such a number."""

from __future__ import annotations

import re

__all__ = ["c_float", "c_int"]

#: C's ``strtod`` takes ``nan(`` characters ``)`` for a NaN.
_C_NAN = re.compile(r"\s*[+-]?nan\([0-9A-Za-z_]*\)\s*", re.IGNORECASE)


def c_int(text: str | bytes) -> int:
    """An integer (spaces around it and a sign taken), as TF's ``safe_strto64`` reads one."""
    if "_" in (text if isinstance(text, str) else text.decode("latin-1")):
        raise ValueError(f"not an integer: {text!r}")  # (Python's int takes 1_000)
    return int(text)


def c_float(text: str) -> float:
    """A number as C's ``strtod`` reads one: Python's (no ``_``), hexadecimal ones, and
    ``nan(...)``."""
    if _C_NAN.fullmatch(text):
        return float("nan")
    if "_" in text:
        raise ValueError(f"not a number: {text!r}")
    try:
        return float(text)
    except ValueError:
        return float.fromhex(text.strip())
