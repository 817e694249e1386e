"""Tolerances of the conformance suite, stated once per dtype.

Comparisons follow the golden-vector convention: per array, ``rtol`` and
``atol = rtol * max|expected|`` so tiny slots are still checked.
"""

from __future__ import annotations

import numpy as np

# Same backend, same formula (NumPy reference vs another backend).
RTOL_BACKEND = {"float32": 2e-6, "float64": 1e-13}
# Against another framework's kernels (TensorFlow, Keras, PyTorch, Optax).
RTOL_FRAMEWORK = {"float32": 1e-5, "float64": 1e-12}


def assert_close(actual, expected, *, dtype: str | None = None, rtol: float | None = None, what: str = "") -> None:
    """Assert ``|actual - expected| <= atol + rtol*|expected|`` with ``atol = rtol*max|expected|``."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if rtol is None:
        rtol = RTOL_BACKEND[dtype or "float32"]
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)
