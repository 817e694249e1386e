"""Test-run settings shared by tests/ and the subprocesses it starts."""

from conformance import jax_compile_cache

jax_compile_cache.share()  # identical XLA programs compile once per run (see that module)
