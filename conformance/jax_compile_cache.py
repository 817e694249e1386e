"""One JAX persistent compilation cache per test run, shared by its subprocesses.

Why: the suites compile the same XLA programs many times over — the engine's kernels again for
``jax-functional`` (each step runs the engine too), in each 8-device subprocess suite, and in
tests that build equal engines. Measured on conformance/test_engine_optimizers.py through
``jax-functional``: 45 of 122 compiles were programs this process had compiled already.

It is the test run that turns the cache on (the conftests call :func:`share`), never the library:
a temporary folder, removed when the process that made it exits, handed to child processes
through the ``JAX_*`` variables. A cache the user set up (``JAX_COMPILATION_CACHE_DIR``) is left
as it is. Counting compiles still works: jax reports ``/jax/core/compile/backend_compile_duration``
for a program served from the cache too (it wraps the lookup), so a test that asserts "no
recompile" still fails when the library asks XLA for a program again.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

#: Cache every program (jax's defaults skip those compiled in under a second), and set a size
#: bound so that jax takes a file lock around reads and writes: xdist workers and the ranks of
#: a multi-process test share the folder.
_SETTINGS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
}
_DIR = "JAX_COMPILATION_CACHE_DIR"
#: Set in the process that made the folder (and inherited): the test run's own cache, not a user's.
_OURS = "MESHEMBED_TEST_JAX_CACHE"


def share() -> None:
    """Turn on the run's cache in this process (idempotent)."""
    if _DIR in os.environ and os.environ.get(_OURS) != os.environ[_DIR]:
        return  # the user's own cache, or theirs to leave off
    if _DIR not in os.environ:
        path = tempfile.mkdtemp(prefix="meshembed-test-jax-cache-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ.update(_SETTINGS, **{_DIR: path, _OURS: path})
    jax = sys.modules.get("jax")
    if jax is not None:  # already imported (before the conftest): its config read the variables then
        jax.config.update("jax_compilation_cache_dir", os.environ[_DIR])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_compilation_cache_max_size", int(_SETTINGS["JAX_COMPILATION_CACHE_MAX_SIZE"]))
