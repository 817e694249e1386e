"""Tolerances of the conformance suite, stated once per dtype, and the error recorder.

Comparisons follow the golden-vector convention: per array, ``rtol`` and
``atol = rtol * max|expected|`` so tiny slots are still checked. Every comparison records
its largest absolute and relative error, so ``meshembed conformance`` can print them.
"""

from __future__ import annotations

import numpy as np

# Same formula on two backends (NumPy reference vs another backend).
RTOL_BACKEND = {"float32": 2e-6, "float64": 1e-13}
# Against another framework's kernels (TensorFlow, Keras, PyTorch, Optax).
RTOL_FRAMEWORK = {"float32": 1e-5, "float64": 1e-12}

#: (against, max_abs, max_rel) of every comparison in the running test; reset per test.
RECORDS: list[tuple[str, float, float]] = []


def assert_close(
    actual,
    expected,
    *,
    dtype: str | None = None,
    rtol: float | None = None,
    what: str = "",
    against: str = "reference",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol*|expected|`` with ``atol = rtol*max|expected|``.

    ``against`` says what ``expected`` is: ``"golden"`` (another framework's numbers) or
    ``"reference"`` (the NumPy backend / a plain transcription of the spec).
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if rtol is None:
        rtol = (RTOL_FRAMEWORK if against == "golden" else RTOL_BACKEND)[dtype or "float32"]
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    diff = np.abs(actual - expected)
    max_abs = float(np.max(diff)) if diff.size else 0.0
    RECORDS.append((against, max_abs, max_abs / scale if scale else max_abs))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=what)
