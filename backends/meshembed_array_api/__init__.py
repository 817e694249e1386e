"""Any Array API library as a meshembed backend (standard-only code, certified on array-api-strict)."""

from meshembed_array_api.backend import ArrayAPIBackend, ArrayAPIStrictBackend, CupyBackend
from meshembed_array_api.table import ArrayAPIShardedTable

__all__ = ["ArrayAPIBackend", "ArrayAPIShardedTable", "ArrayAPIStrictBackend", "CupyBackend"]
