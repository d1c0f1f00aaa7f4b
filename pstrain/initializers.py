"""Initializers of variables, made on the ps (Keras' ``Zeros``, ``Ones``, ``Constant``,
``RandomUniform``, ``RandomNormal``, ``TruncatedNormal``, ``VarianceScaling`` and its
named kinds ``GlorotUniform``, ``GlorotNormal``, ``HeNormal``, ``HeUniform``,
``LecunNormal``, ``LecunUniform``, and ``Orthogonal``, ``Identity``)."""

from ._formats.numerics.initializers import *  # noqa: F403
from ._formats.numerics.initializers import __all__ as __all__
