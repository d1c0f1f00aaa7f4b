"""Strings to ids as TensorFlow hashes them: ``to_hash_bucket_fast`` and ``fingerprint64``
(FarmHash's Fingerprint64, TF's ``tf.strings.to_hash_bucket_fast``), and
``to_hash_bucket_strong`` (SipHash-2-4 under a key, Keras' ``Hashing`` with a salt)."""

from ._training.strings import *  # noqa: F403
from ._training.strings import __all__ as __all__
