"""Builds the compiled kernels (pstrain/_kernels/compiled.pyx, and the parts it includes); the
rest of the package is in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("pstrain._kernels.compiled", ["pstrain/_kernels/compiled.pyx"],
               include_dirs=[numpy.get_include()],  # its allocator hooks (NEP 49)
               define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
               # the numpy reference's arithmetic, bit for bit: no fused multiply-add; sqrt
               # without errno lets the loops vectorise (it stays IEEE's correctly rounded sqrt).
               # No debug information (Python's own flags ask for it): a quarter of the
               # compile time (20 s against 26 s here), paid at every install and wheel build.
               extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-g0"])],
    compiler_directives={"language_level": "3"}))
