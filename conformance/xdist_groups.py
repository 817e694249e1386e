"""How ``make test`` splits the run over pytest-xdist workers (``-n 2 --dist loadgroup``).

Why groups: ``loadgroup`` alone hands out single tests, which would set up every module fixture
on every worker and split files whose tests build on each other's caches. So each test gets an
``xdist_group``: its file (in conformance/, its file and backend, so the big suites spread over
both workers), except the tests that start process groups (gloo ranks, ``jax.distributed``,
8-device subprocess suites). Those share one group: they run one after another on one worker,
never two of them at once, so their rank timeouts and free ports see at most one other test
beside them. That group and the other long ones are queued first (``--no-loadscope-reorder``
keeps this order), so no long test starts last. Without xdist nothing here changes the run.
"""

from __future__ import annotations

import pytest

#: Files whose tests launch several communicating processes (or 8-device subprocess suites).
PROCESS_FILES = (
    "test_torch_distributed.py", "test_torch_ranks_agree.py", "test_torch_conformance_ranks.py",
    "test_torch_api_dist.py", "test_torch_module_groups.py", "test_jax_multidevice.py",
    "test_mesh_multidevice.py", "test_jax_conformance_devices.py",
)
#: Such tests in files that are otherwise in-process (node id prefixes).
PROCESS_TESTS = ("tests/test_jax_api.py::test_jax_backend_agree_over_two_processes",)
PROCESSES = "processes"
#: Queued right after PROCESSES: single long tests or long files (measured, 2-core box).
LONG_FILES = ("test_jax_api.py", "test_keras3_adadelta.py", "test_jax_x64.py", "test_checkpoint_integrity.py",
              "test_cli.py", "test_bench.py")


def _group(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if (name in PROCESS_FILES or item.nodeid.startswith(PROCESS_TESTS) or item.get_closest_marker("slow")
            or item.get_closest_marker("ranks")):
        return PROCESSES
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend_name") if callspec is not None else None
    return f"{path}::{backend}" if backend and path.startswith("conformance/") else path


def _rank(item: pytest.Item) -> int:
    group = _group(item)
    if group == PROCESSES:
        return 0
    if group.rsplit("/", 1)[-1] in LONG_FILES:
        return 1
    return 3 if group.startswith("conformance/") and not group.endswith(("::jax", "::jax-functional")) else 2


def assign(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test without one an ``xdist_group`` and queue the long groups first."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
    items.sort(key=_rank)  # stable: each file keeps its own order
