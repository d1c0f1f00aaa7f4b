"""The public API is pstrain/__init__.py, sorted and importable; importing is cheap."""

from __future__ import annotations

import subprocess
import sys

import pstrain


def test_all_is_sorted_and_every_name_resolves():
    assert pstrain.__all__ == sorted(pstrain.__all__)
    for name in pstrain.__all__:
        assert getattr(pstrain, name) is not None, name


def test_every_public_name_has_a_docstring():
    for name in pstrain.__all__:
        obj = getattr(pstrain, name)
        if callable(obj) or isinstance(obj, type):
            assert (obj.__doc__ or "").strip(), f"pstrain.{name} has no docstring"


def test_import_is_cheap_and_has_no_side_effects():
    code = ("import sys, pstrain; heavy = [m for m in ('aiohttp', 'numpy', 'cloudpickle', 'uvloop') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pstrain.Nope  # noqa: B018
