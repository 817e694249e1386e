"""meshembed.backend.env: one spelling of every MESHEMBED_* switch, the same for each reader."""

from __future__ import annotations

import pytest

from meshembed.backend.env import env_flag, env_int
from meshembed.errors import ConfigError

NAME = "MESHEMBED_TEST_FLAG"


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " ON "])
def test_on_spellings(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, False) is True


@pytest.mark.parametrize("value", ["0", "false", "False", "NO", "off", "Off "])
def test_off_spellings(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, True) is False


@pytest.mark.parametrize("value", [None, "", "  "])
@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, value, default):
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert env_flag(NAME, default) is default


@pytest.mark.parametrize("value", ["2", "enable", "y", "offf", "-1"])
def test_other_values_raise_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ConfigError, match=rf"{NAME}={value!r}.*Fix: set {NAME}=1 or {NAME}=0"):
        env_flag(NAME, True)


def test_env_int(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_int(NAME) is None and env_int(NAME, 7) == 7
    monkeypatch.setenv(NAME, " 42 ")
    assert env_int(NAME) == 42
    monkeypatch.setenv(NAME, "4k")
    with pytest.raises(ConfigError, match=rf"{NAME}='4k'.*integer"):
        env_int(NAME)


def test_the_backends_switches_read_off_as_off(monkeypatch):
    """Every boolean switch of the torch and JAX backends goes through env_flag, read by the
    backend's constructor: "off" is off (it was on for some readers) and a typo is an error,
    not a silent default."""
    readers = {"MESHEMBED_TORCH_FUSED": (_torch, lambda b: b.fused),
               "MESHEMBED_JAX_FUSED": (_jax, lambda b: b.fused),
               "MESHEMBED_JAX_CPU_KERNELS": (_jax, lambda b: b.use_cpu_kernels)}
    for name, (make, read) in readers.items():
        monkeypatch.setenv(name, "Off")
        assert read(make()) is False, name
        monkeypatch.setenv(name, "on")
        assert read(make()) is True, name
        monkeypatch.setenv(name, "maybe")
        with pytest.raises(ConfigError, match=name):
            make()
        monkeypatch.delenv(name)
        assert read(make()) is True, name


@pytest.mark.parametrize("name, make, read", [
    ("MESHEMBED_TORCH_FUSED", lambda: _torch(), lambda b: b.fused),
    ("MESHEMBED_JAX_FUSED", lambda: _jax(), lambda b: b.fused),
    ("MESHEMBED_JAX_CPU_KERNELS", lambda: _jax(), lambda b: b.use_cpu_kernels),
])
def test_a_backend_reads_its_switches_once(monkeypatch, name, make, read):
    """Read in the constructor, never again: changing the variable afterwards changes nothing
    of an existing backend (its attribute switches it), and ``me.get_backend(name)`` hands out
    the instance made under the current values, the same one again once they are back."""
    import meshembed as me

    monkeypatch.delenv(name, raising=False)
    be = make()
    backend_name = be.name
    assert name in type(be).environment
    default = me.get_backend(backend_name)
    monkeypatch.setenv(name, "0")
    assert read(be) is True and read(default) is True  # nothing re-reads the environment
    off = me.get_backend(backend_name)
    assert off is not default and read(off) is False
    assert me.get_backend(backend_name) is off
    monkeypatch.delenv(name)
    assert me.get_backend(backend_name) is default


def test_env_choice(monkeypatch):
    from meshembed.backend.env import env_choice

    monkeypatch.delenv(NAME, raising=False)
    assert env_choice(NAME, ("dense", "sort")) is None and env_choice(NAME, ("a", "b"), "a") == "a"
    monkeypatch.setenv(NAME, " Sort ")
    assert env_choice(NAME, ("dense", "sort")) == "sort"
    monkeypatch.setenv(NAME, "hash")
    with pytest.raises(ConfigError, match=rf"{NAME}='hash'. Expected one of dense, sort"):
        env_choice(NAME, ("dense", "sort"))


def _jax():
    pytest.importorskip("jax")
    from meshembed_jax import JaxBackend

    return JaxBackend()


def _torch():
    pytest.importorskip("torch")
    from meshembed_torch import TorchBackend

    return TorchBackend()


@pytest.mark.parametrize("name, bad, good, make, read, expected", [
    ("MESHEMBED_JAX_CAPACITY", "lots", "128", _jax, lambda b: b.capacity, 128),
    ("MESHEMBED_JAX_DEDUP", "hash", "Dense", _jax, lambda b: b.dedup, "dense"),
    ("MESHEMBED_TORCH_COMPILE", "sometimes", "NEVER", _torch, lambda b: b._compile_mode, "never"),
])
def test_backend_switches_name_the_variable(monkeypatch, name, bad, good, make, read, expected):
    """A bad value of a backend's int/choice switch is a ConfigError naming the variable."""
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError, match=f"{name}={bad!r}"):
        make()
    monkeypatch.setenv(name, good)
    assert read(make()) == expected
