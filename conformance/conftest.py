"""The conformance suite runs every test against every available backend.

``MESHEMBED_TEST_BACKENDS=numpy,torch`` narrows the list; a named backend that is not
usable here is still collected and skipped with the reason. Expected failures per backend
live in ``conformance/xfail.toml`` with a reason each.

Started as one rank of a group (``python -m conformance.distributed -n N`` or ``torchrun``:
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set), the process first joins the gloo
process group, the default backend list becomes ``torch-ranks`` (the distributed torch backend
fed data-parallel, see ``conformance/distributed.py``) and the ranks run in lockstep.
"""

from __future__ import annotations

import os
import pathlib
import tomllib

import pytest

from conformance import device_repeats, jax_compile_cache

jax_compile_cache.share()  # before jax is imported: identical XLA programs compile once per run

import meshembed as me  # noqa: E402
from conformance import distributed as _ranks  # noqa: E402
from conformance import functional_jax as _functional  # noqa: E402
from conformance import functional_torch as _module  # noqa: E402
from meshembed.errors import BackendUnavailableError  # noqa: E402

#: This process's rank context when it runs as one rank of a group, else None.
RANKS = _ranks.from_env()

_HERE = pathlib.Path(__file__).parent
GOLDEN = _HERE / "golden"


#: The suite's front-end entries (not registry backends) and the registry backend under each.
FRONT_ENDS = {_functional.NAME: _functional.INNER, **{name: _module.INNER for name in _module.NAMES}}


def inner(name: str) -> str:
    """The registry backend under a backend name of the suite (a front end's, or itself)."""
    return FRONT_ENDS.get(name, name)


def _requested() -> list[str]:
    env = os.environ.get("MESHEMBED_TEST_BACKENDS", "").strip()
    if env:
        names = [n.strip() for n in env.split(",") if n.strip()]
        if _ranks.BACKEND_NAME in names:
            _ranks.register()  # outside a rank group it is then skipped, with the reason
        return names
    if RANKS is not None:
        return [_ranks.BACKEND_NAME]
    names = list(me.available_backends())
    # me.jax (jitted); me.torch.EmbeddingCollection (eager, compiled)
    return names + [name for name, under in FRONT_ENDS.items() if under in names]


def _params() -> list:
    params = []
    for name in _requested():
        try:
            me.get_backend(inner(name))
        except BackendUnavailableError as exc:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=str(exc)), id=name))
            continue
        params.append(pytest.param(name, id=name))
    return params


BACKEND_PARAMS = _params()


def pytest_configure(config):
    if RANKS is not None:
        config.pluginmanager.register(_ranks.Lockstep(RANKS), "meshembed-ranks")


@pytest.fixture(params=BACKEND_PARAMS)
def backend_name(request) -> str:
    return request.param


@pytest.fixture
def backend(backend_name):
    """The Backend instance under test."""
    return me.get_backend(inner(backend_name))


@pytest.fixture(autouse=True)
def _functional_front_end(request, monkeypatch):
    """On ``jax-functional``, ``me.TPUEmbedding`` steps through jitted me.jax (functional_jax.py); on
    ``torch-module`` / ``torch-module-compiled`` through me.torch.EmbeddingCollection (functional_torch.py)."""
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("backend_name") if callspec is not None else None
    if name == _functional.NAME:
        monkeypatch.setattr(me, "TPUEmbedding", _functional.FunctionalEngine)
    elif name in _module.NAMES:
        monkeypatch.setattr(me, "TPUEmbedding", _module.engine_class(name))


@pytest.fixture
def golden() -> pathlib.Path:
    return GOLDEN


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Attach the largest errors of each comparison to the test report (for the CLI table)."""
    from conformance import tolerances

    tolerances.RECORDS.clear()
    yield
    for against in ("golden", "reference"):
        rows = [r for r in tolerances.RECORDS if r[0] == against]
        if rows:
            item.user_properties.append((f"err_{against}", (max(r[1] for r in rows), max(r[2] for r in rows))))


def _xfails() -> dict[str, dict[str, str]]:
    path = _HERE / "xfail.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


#: ``MESHEMBED_TEST_DEVICE_REPEATS=0`` (the 8-device runs, tests/test_jax_conformance_devices.py): leave out the
#: optimizer variants whose path does not depend on the device count (README, "Repeats on 8 devices").
_DEVICE_REPEATS = os.environ.get("MESHEMBED_TEST_DEVICE_REPEATS", "1")
if _DEVICE_REPEATS not in ("0", "1"):
    raise pytest.UsageError(f"MESHEMBED_TEST_DEVICE_REPEATS={_DEVICE_REPEATS!r}: expected 0 or 1")


def _backend_of(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend_name") if callspec else None


def pytest_collection_modifyitems(config, items):
    if _DEVICE_REPEATS == "0":
        one_process = RANKS is None
        repeats = [item for item in items if device_repeats.is_repeat(item, one_process)]
        items[:] = [item for item in items if not device_repeats.is_repeat(item, one_process)]
        config.hook.pytest_deselected(items=repeats)
    manifest = _xfails()
    subset = _module.compiled_subset(item.nodeid for item in items if _backend_of(item) == _module.COMPILED_NAME)
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("backend_name") if callspec else None
        if name == _functional.NAME and not _functional.covers(item.nodeid):
            item.add_marker(pytest.mark.skip(reason=_functional.SKIP_REASON))
        if name in _module.NAMES and not _module.covers(item.nodeid, name, subset):
            item.add_marker(pytest.mark.skip(reason=_module.skip_reason(item.nodeid)))
        for pattern, reason in manifest.get(name or "", {}).items():
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=f"[{name}] {reason}", strict=True))
