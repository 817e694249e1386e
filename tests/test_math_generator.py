"""The project's own generator (conformance/golden/generate_math.py) reproduces the copied
golden data: TF raw kernels (dense and dedup-sparse), torch and optax are rerun here
(tf_keras is covered by running the script by hand; its import alone costs seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "conformance" / "golden"
RTOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-13}  # same kernels, same inputs


def _load_generator():
    spec = importlib.util.spec_from_file_location("generate_math", GOLDEN / "generate_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_reproduces_golden_data(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow", reason="the generator reruns TensorFlow kernels")
    frameworks = {"tf_raw_ResourceApplyAdadelta", "tf_raw_ResourceSparseApplyAdadelta_dedup"}
    for name, module in (("torch", "torch"), ("optax", "optax"), ("optax_lr_none", "optax")):
        if importlib.util.find_spec(module) is not None:
            frameworks.add(name)
    written = _load_generator().generate(tmp_path, frameworks)
    assert len(written) >= 9
    for path in written:
        fresh, kept = np.load(path), np.load(GOLDEN / path.relative_to(tmp_path))
        for key in kept:
            assert fresh[key].dtype == kept[key].dtype, (path, key)
            atol = RTOL[kept[key].dtype] * float(np.max(np.abs(kept[key])))
            np.testing.assert_allclose(fresh[key], kept[key], rtol=RTOL[kept[key].dtype],
                                       atol=atol, err_msg=f"{path.relative_to(tmp_path)} {key}")
