"""Backend discovery, selection precedence and errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import meshembed as me
from meshembed.backend import registry
from meshembed_numpy import NumpyBackend


def test_numpy_is_always_available_and_default(monkeypatch):
    monkeypatch.delenv("MESHEMBED_BACKEND", raising=False)
    assert me.available_backends()[0] == "numpy"
    assert me.get_backend().name == "numpy"


def test_precedence_explicit_scope_env_default(monkeypatch):
    registry.register_backend("loopback", lambda: _Loopback())
    try:
        monkeypatch.setenv("MESHEMBED_BACKEND", "loopback")
        assert me.get_backend().name == "loopback"          # env beats the default
        with me.use_backend("numpy"):
            assert me.get_backend().name == "numpy"         # scope beats env
            assert me.get_backend("loopback").name == "loopback"  # explicit beats scope
        me.set_backend("numpy")
        assert me.get_backend().name == "numpy"             # process default beats env
    finally:
        me.set_backend(None)
        registry._extra.pop("loopback", None)
        registry._factories.pop("loopback", None)
        for key in [k for k in registry._instances if k[0] == "loopback"]:
            del registry._instances[key]


def test_unknown_backend_error_names_choices():
    with pytest.raises(me.BackendUnavailableError, match=r"Invalid `backend`. Expected one of .*'numpy'.*Received: backend='nope'"):
        me.get_backend("nope")


def test_unavailable_backend_says_what_to_install():
    class Missing(NumpyBackend):
        @classmethod
        def unavailable_reason(cls):
            return "framework 'x' is not installed"

    registry.register_backend("missing", Missing)
    try:
        with pytest.raises(me.BackendUnavailableError, match="unavailable here: framework 'x' is not installed.$"):
            me.get_backend("missing")
        assert "missing" not in me.available_backends()
        with pytest.raises(me.BackendUnavailableError):
            me.set_backend("missing")
    finally:
        registry._extra.pop("missing", None)


def test_core_never_imports_frameworks():
    code = (
        "import sys, meshembed as me, meshembed.sharding, meshembed.backend;"
        "me.get_backend('numpy');"
        "print(sorted(m for m in ('torch','jax','cupy','tensorflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Loopback(NumpyBackend):
    """A third-party-style backend registered by hand: the suite runs through it too."""

    name = "loopback"


def test_entry_point_group_lists_builtin_backends():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="meshembed.backends")}
    assert {"numpy", "torch", "jax"} <= names
    assert isinstance(me.get_backend("numpy").asarray([1.0]), np.ndarray)


def test_cupy_is_registered_and_says_why_it_cannot_run_here():
    """Registered once it passed the GPU conformance run (conformance/README.md): by entry point
    and in the source tree's table; without cupy or a CUDA device, unavailable with the reason."""
    import pathlib
    import tomllib

    from meshembed_array_api import CupyBackend

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["meshembed.backends"]["cupy"] == registry._BUILTIN["cupy"]
    assert registry._BUILTIN["cupy"] == "meshembed_array_api:CupyBackend"
    if CupyBackend.unavailable_reason() is None:
        pytest.skip("CuPy sees a CUDA device here: scripts/gpu_check.sh runs the suite on it")
    with pytest.raises(me.BackendUnavailableError, match="Backend 'cupy' is unavailable here: (cupy|CuPy)"):
        me.get_backend("cupy")
    assert "cupy" not in me.available_backends()
