"""How ``make test`` splits the run over pytest-xdist workers (``-n 2 --dist loadgroup``).

Why groups: ``loadgroup`` alone hands out single tests, which would set up every module fixture
on every worker and split files whose tests build on each other's caches. So each test gets an
``xdist_group``: its file (in conformance/, its file and backend, so the big suites spread over
both workers; a long subprocess suite, its own), except the tests that start process groups
with short rank timeouts (gloo ranks, ``jax.distributed``). Those share one group: they run one after another on one
worker, never two of them at once, so their rank timeouts and free ports see at most one other
test beside them. That group and the other long ones are queued first (``--no-loadscope-reorder``
keeps this order), so no long test starts last. Without xdist nothing here changes the run.
"""

from __future__ import annotations

import re

import pytest

#: Files whose tests launch communicating processes with short rank timeouts (gloo ranks).
PROCESS_FILES = ("test_torch_distributed.py", "test_torch_ranks_agree.py", "test_torch_conformance_ranks.py",
                 "test_ranks_disagree.py")
#: Such tests in files that are otherwise one process (node id prefixes).
PROCESS_TESTS = (
    "tests/test_jax_api.py::test_jax_backend_agree_over_two_processes",
    "tests/test_jax_multidevice.py::test_two_processes_match_numpy",
    "tests/test_mesh_multidevice.py::test_torch_two_rank_gloo_mesh_matches_single_process",
    "tests/test_adadelta_complex.py::test_sharded_complex_variable_over_gloo_ranks",
)
#: Files that start ranks with torch's default (minutes) timeouts: they may run beside anything.
PARALLEL_PROCESS_FILES = ("test_torch_api_dist.py", "test_torch_module_groups.py")
PROCESSES = "processes"
#: Files of a few long, independent subprocess tests (8 devices, example scripts): a unit per test.
SPLIT_FILES = ("test_jax_conformance_devices.py", "test_torch_api_dist.py")
#: Long files, queued right after PROCESSES (measured on the 2-core box).
LONG_FILES = ("test_jax_api.py", "test_keras3_adadelta.py", "test_jax_x64.py", "test_checkpoint_integrity.py",
              "test_jax_multidevice.py", "test_mesh_multidevice.py", "test_torch_module_groups.py", "test_protos.py",
              "test_jax_cpu_kernels.py", "test_jax_fused.py", "test_torch_api.py", "test_cli.py", "test_bench.py")


def _group(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if name in PROCESS_FILES or item.nodeid.startswith(PROCESS_TESTS) or item.get_closest_marker("ranks"):
        return PROCESSES
    if name in SPLIT_FILES or item.get_closest_marker("slow"):
        return re.sub(r"[\[\]@]", "_", item.nodeid)  # a long test of its own (no "]" or "@": xdist splits on them)
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend_name") if callspec is not None else None
    return f"{path}::{backend}" if backend and path.startswith("conformance/") else path


def _rank(item: pytest.Item) -> int:
    group = _group(item)
    if group == PROCESSES:
        return 0
    name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in LONG_FILES or name in SPLIT_FILES or item.get_closest_marker("slow") or group.endswith(
            ("::jax", "::jax-functional", "::torch-module-compiled")):
        return 1
    return 3 if group.startswith("conformance/") else 2


def assign(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test without one an ``xdist_group`` and queue the long groups first."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    items.sort(key=_rank)  # stable: each file keeps its own order
