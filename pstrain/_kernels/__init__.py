"""Table kernels: the id index and the fused optimizer steps, compiled or in numpy.

:mod:`~pstrain._kernels.compiled` (C, from Cython, built by ``pip install``) runs each batch
in one loop without the GIL and without Python per id; :mod:`~pstrain._kernels.reference` is
the same in numpy, which the tests hold the compiled kernels to, bit for bit.

The compiled kernels are the default. ``PSTRAIN_KERNELS=numpy`` chooses the reference (to
compare, or where no compiler was at hand: its index operations make temporary arrays the
size of the index, outside a ps's memory budget); a missing build is an error that says how
to build it, never a quiet switch to code several times slower.
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from . import reference

__all__ = ["FLOAT_DTYPES", "KERNELS", "kernels", "reference"]


def kernels(name: str | None = None) -> ModuleType:
    """The kernels ``name`` chooses: ``"compiled"`` or ``"numpy"`` (default: the
    ``PSTRAIN_KERNELS`` variable, else ``"compiled"``)."""
    name = name or os.environ.get("PSTRAIN_KERNELS") or "compiled"
    if name == "numpy":
        return reference
    if name != "compiled":
        raise ValueError(f"PSTRAIN_KERNELS={name!r}: expected 'compiled' or 'numpy'")
    try:
        from . import compiled
    except ImportError as exc:
        raise ImportError(
            "pstrain's compiled table kernels (pstrain/_kernels/compiled.pyx) are not built: "
            "install pstrain with pip (`pip install -e .` in a clone; it needs a C compiler), "
            "or set PSTRAIN_KERNELS=numpy to run the numpy ones"
        ) from exc
    return compiled


#: The kernels this process uses.
KERNELS = kernels()
#: The element types the float kernels (gathers, optimizer steps, sums, initial rows) take.
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
