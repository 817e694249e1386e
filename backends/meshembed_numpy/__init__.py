"""NumPy reference backend: logical shards in one process. Readable first — the executable spec."""

from meshembed_numpy.backend import NumpyBackend
from meshembed_numpy.table import NumpyShardedTable

__all__ = ["NumpyBackend", "NumpyShardedTable"]
