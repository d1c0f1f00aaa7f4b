"""Initializers of variables, made on the ps (Keras' ``Zeros``, ``Constant``,
``RandomUniform``, ``RandomNormal``, ``TruncatedNormal``, ``GlorotUniform``)."""

from ._formats.numerics.initializers import *  # noqa: F403
from ._formats.numerics.initializers import __all__ as __all__
