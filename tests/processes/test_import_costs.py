"""Importing pstrain in a fresh interpreter: cheap, no side effects, classes pickled by reference."""

from __future__ import annotations

import subprocess
import sys


def test_import_is_cheap_and_has_no_side_effects():
    code = (
        "import sys, pstrain; heavy = [m for m in ('aiohttp', 'numpy', 'cloudpickle', 'uvloop') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_class_pickles_by_reference_before_its_facade_is_imported():
    # cloudpickle sends by value a class whose module is not imported yet: a worker would
    # get a copy of the class (and `super()` in its methods fails there). pstrain imports
    # the public module first, as the standard pickle does.
    code = (
        "import sys, pickle\n"
        "from pstrain._training.optimizers import Adagrad\n"
        "from pstrain._formats.messages.pickling import dumps_object\n"
        "assert 'pstrain.optimizers' not in sys.modules\n"
        "data = dumps_object(Adagrad(0.1))\n"
        "assert pickle.loads(data).__class__ is Adagrad, 'not the same class'\n"
        "print(b'_make_skeleton_class' in data)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the class went by value"
