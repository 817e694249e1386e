"""conformance/xdist_groups.py: how ``make test`` splits the run over xdist workers."""

from __future__ import annotations

import pathlib
import re
import types

import pytest

from conformance import xdist_groups

TESTS = pathlib.Path(__file__).resolve().parent
#: What starts a group of communicating processes (gloo ranks, jax.distributed).
LAUNCHES = re.compile(r"spawn\(|ranks\.launch\(|distributed\.initialize\(|init_process_group\(|\b_launch\(")


class _Item:
    def __init__(self, nodeid: str, backend: str | None = None, marks: tuple[str, ...] = ()):
        self.nodeid = nodeid
        self.marks = [getattr(pytest.mark, m).mark for m in marks]
        if backend is not None:
            self.callspec = types.SimpleNamespace(params={"backend_name": backend})

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)

    def group(self):
        mark = self.get_closest_marker("xdist_group")
        return mark.args[0] if mark else None


def _config(dist: str):
    return types.SimpleNamespace(option=types.SimpleNamespace(dist=dist))


def _items():
    return [
        _Item("tests/test_config.py::test_a"),
        _Item("conformance/test_engine.py::test_x[numpy]", "numpy"),
        _Item("tests/test_config.py::test_b"),
        _Item("conformance/test_engine.py::test_x[jax]", "jax"),
        _Item("tests/test_torch_distributed.py::test_ranks"),
        _Item("tests/test_checkpoint_integrity.py::test_crash[a]", marks=("slow",)),
        _Item("tests/test_checkpoint_integrity.py::test_fast"),
        _Item("tests/test_jax_api.py::test_jax_backend_agree_over_two_processes"),
        _Item("tests/test_jax_conformance_devices.py::test_one"),
        _Item("tests/test_jax_conformance_devices.py::test_two"),
    ]


def test_without_loadgroup_nothing_changes():
    items = _items()
    before = [i.nodeid for i in items]
    xdist_groups.assign(_config("no"), items)
    assert [i.nodeid for i in items] == before and all(i.group() is None for i in items)


def test_files_stay_together_process_tests_share_one_group_queued_first():
    items = _items()
    xdist_groups.assign(_config("loadgroup"), items)
    groups = {i.nodeid: i.group() for i in items}
    assert groups["tests/test_config.py::test_a"] == groups["tests/test_config.py::test_b"] == "tests/test_config.py"
    assert groups["conformance/test_engine.py::test_x[numpy]"] == "conformance/test_engine.py::numpy"
    assert groups["conformance/test_engine.py::test_x[jax]"] == "conformance/test_engine.py::jax"
    assert groups["tests/test_checkpoint_integrity.py::test_fast"] == "tests/test_checkpoint_integrity.py"
    own = [groups[f"tests/test_jax_conformance_devices.py::test_{n}"] for n in ("one", "two")]
    own.append(groups["tests/test_checkpoint_integrity.py::test_crash[a]"])
    assert len(set(own)) == 3 and not any(c in g for g in own for c in "[]@")  # a unit each; xdist splits on "@"
    process = [n for n, g in groups.items() if g == xdist_groups.PROCESSES]
    assert process == ["tests/test_torch_distributed.py::test_ranks",
                       "tests/test_jax_api.py::test_jax_backend_agree_over_two_processes"]
    order = [i.nodeid for i in items]
    assert order[:2] == process  # the serial group first, then the long ones
    assert set(order[2:7]) == {"tests/test_checkpoint_integrity.py::test_crash[a]",
                               "tests/test_checkpoint_integrity.py::test_fast", "conformance/test_engine.py::test_x[jax]",
                               "tests/test_jax_conformance_devices.py::test_one",
                               "tests/test_jax_conformance_devices.py::test_two"}
    assert order.index("tests/test_config.py::test_a") < order.index("tests/test_config.py::test_b")  # file order kept
    assert order[-1] == "conformance/test_engine.py::test_x[numpy]"  # the quick backends' conformance last


def test_a_group_set_by_the_test_is_kept():
    item = _Item("tests/test_config.py::test_a")
    item.add_marker(pytest.mark.xdist_group("mine"))
    xdist_groups.assign(_config("loadgroup"), [item])
    assert item.group() == "mine"


def test_every_file_that_launches_process_groups_runs_in_the_serial_group():
    """A new test file that starts gloo ranks or jax.distributed processes must be listed, or under
    xdist it could run beside another such test, with its short rank timeouts."""
    launching = {p.name for p in TESTS.glob("test_*.py") if p.name != pathlib.Path(__file__).name
                 and LAUNCHES.search(p.read_text())}
    assert {"test_torch_distributed.py", "test_jax_multidevice.py"} <= launching  # the pattern finds them
    listed = {t.split("::")[0].rsplit("/", 1)[-1] for t in xdist_groups.PROCESS_TESTS}
    listed |= set(xdist_groups.PROCESS_FILES) | set(xdist_groups.PARALLEL_PROCESS_FILES)
    assert launching <= listed, ("add to conformance/xdist_groups.PROCESS_FILES (or PROCESS_TESTS, or PARALLEL_PROCESS_FILES "
                                 f"when its ranks wait minutes): {sorted(launching - listed)}")
    for test in xdist_groups.PROCESS_TESTS:  # a renamed test would silently leave the group
        path, name = test.split("::")
        assert f"def {name}(" in (TESTS.parent / path).read_text(), f"{test} is gone: update PROCESS_TESTS"
