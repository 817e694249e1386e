"""Test-run settings shared by tests/ and conformance/ and the subprocesses they start."""

import pytest

from conformance import jax_compile_cache, xdist_groups

jax_compile_cache.share()  # identical XLA programs compile once per run (see that module)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    xdist_groups.assign(config, items)
