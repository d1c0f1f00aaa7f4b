"""Input pipelines: ``Dataset`` (TF's ``tf.data`` subset: batches, shuffles and shards arrays
and jagged features), per-worker datasets and their iterators."""

from ._embeddings import jagged as _jagged  # noqa: F401  (slices SparseTensor and RaggedTensor)
from ._embeddings.tf_examples import *  # noqa: F403
from ._embeddings.tf_examples import __all__ as _examples
from ._training.csv_fields import *  # noqa: F403
from ._training.csv_fields import __all__ as _csv
from ._training.data import *  # noqa: F403
from ._training.data import __all__ as _datasets
from ._training.file_datasets import *  # noqa: F403
from ._training.file_datasets import __all__ as _files
from ._training.lookups import *  # noqa: F403
from ._training.lookups import __all__ as _lookups

__all__ = [*_datasets, *_files, *_examples, *_csv, *_lookups]
