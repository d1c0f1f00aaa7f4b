"""Builds the compiled table kernels (pstrain/_kernels/compiled.pyx); the rest of the
package is in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("pstrain._kernels.compiled", ["pstrain/_kernels/compiled.pyx"],
               # the numpy reference's arithmetic, bit for bit: no fused multiply-add; sqrt
               # without errno lets the loops vectorise (it stays IEEE's correctly rounded sqrt)
               extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"])],
    compiler_directives={"language_level": "3"}))
