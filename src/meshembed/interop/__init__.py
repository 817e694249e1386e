"""``me.interop``: translate configs and trained state between meshembed and torchrec/fbgemm
(and its managed-collision modules, for dynamic vocabularies),
keras-rs and jax-tpu-embedding, each with a gap report, and diff meshembed against them.

Nothing here imports a foreign library at import time; each function imports what it needs
(``pip install meshembed[interop]``). docs/interop.md lists every mapping and gap.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshembed.interop._gaps import Gap, GapReport, Translation

_LAZY = {
    "from_torchrec": "_torchrec", "to_torchrec": "_torchrec", "TorchrecConfig": "_torchrec",
    "Uniform": "_torchrec", "import_torchrec_state": "_torchrec", "export_torchrec_state": "_torchrec",
    "from_keras_rs": "_keras_rs", "to_keras_rs": "_keras_rs", "keras_rs_arrays": "_keras_rs",
    "load_keras_rs_arrays": "_keras_rs",
    "to_torchrec_mc": "_torchrec_mc", "from_torchrec_mc": "_torchrec_mc", "OccurrenceThreshold": "_torchrec_mc",
    "export_torchrec_mc_state": "_torchrec_mc", "import_torchrec_mc_state": "_torchrec_mc",
    "from_jax_tpu_embedding": "_jte", "to_jax_tpu_embedding": "_jte", "import_table_arrays": "_jte",
    "export_table_arrays": "_jte",
    "compare_torchrec": "_conformance", "compare_keras_rs": "_conformance", "ulp_distance": "_conformance",
    "ConformanceReport": "_conformance", "run_conformance": "_conformance", "cli_main": "_conformance",
}

__all__ = ["Gap", "GapReport", "Translation", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshembed.interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"meshembed.interop.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
