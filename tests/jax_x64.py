"""x64 for the JAX tests that need it, scoped to the test (``jax.enable_x64``), never
process-wide: meshembed does not turn it on, so float64/int64 cases ask for it themselves.

Import the fixture into a test module: ``from tests.jax_x64 import x64_where_named  # noqa: F401``.
"""

from __future__ import annotations

import pytest

#: A test whose id names one of these runs with x64 on.
WIDE = ("float64", "int64")


@pytest.fixture(autouse=True)
def x64_where_named(request):
    """Runs float64/int64 cases inside ``jax.enable_x64(True)``; every other case as is."""
    import jax

    if any(w in request.node.name for w in WIDE):
        with jax.enable_x64(True):
            yield
    else:
        yield
