"""Backend discovery and selection.

Backends are found through the entry-point group ``meshembed.backends`` (meshembed's own
register the same way) and loaded lazily. Precedence of the default:
explicit ``backend=`` argument > ``use_backend`` > ``MESHEMBED_BACKEND`` > ``"numpy"``.

A backend reads its ``MESHEMBED_*`` switches once, in its constructor (``Backend.environment``
names them); :func:`get_backend` hands out, per name, the instance made under the switches'
current values (one per distinct set of values, made on first use), so an instance's
behaviour never changes under it and a switch set before an engine is built applies to it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator

from meshembed.backend.protocol import Backend
from meshembed.errors import BackendUnavailableError

ENTRY_POINT_GROUP = "meshembed.backends"

# Used only when meshembed runs from a source tree that was not pip-installed.
_BUILTIN = {
    "numpy": "meshembed_numpy:NumpyBackend",
    "torch": "meshembed_torch:TorchBackend",
    "jax": "meshembed_jax:JaxBackend",
    "array_api_strict": "meshembed_array_api:ArrayAPIStrictBackend",
    # usable only where cupy imports and sees a CUDA device (CupyBackend.unavailable_reason);
    # certified by the GPU conformance run (conformance/README.md, scripts/gpu_check.sh)
    "cupy": "meshembed_array_api:CupyBackend",
}
# Backends designed but not shipped yet, with the reason (shown instead of "unknown").
_NOT_SHIPPED: dict[str, str] = {}
_INSTALL_HINT = {
    "torch": "pip install 'meshembed[torch]'  (torch==2.13.0)",
    "jax": "pip install 'meshembed[jax]'",
    "array_api_strict": "pip install array-api-strict",
}

_extra: dict[str, Callable[[], Backend] | str] = {}
#: (name, the values of the backend's environment switches) -> its instance
_instances: dict[tuple[str, tuple[str | None, ...]], Backend] = {}
_factories: dict[str, Any] = {}  # name -> its resolved factory (once imported)
_process_default: str | None = None
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshembed_backend", default=None)


def _targets() -> dict[str, Callable[[], Backend] | str]:
    found: dict[str, Callable[[], Backend] | str] = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    found.update(_extra)
    return found


def register_backend(name: str, factory: Callable[[], Backend] | str) -> None:
    """Register a backend by hand (a ``"module:Class"`` string or a zero-argument factory)."""
    _extra[name] = factory
    _factories.pop(name, None)
    for key in [k for k in _instances if k[0] == name]:
        del _instances[key]


def _switches(factory: Any) -> tuple[str | None, ...]:
    """The current values of the environment switches ``factory``'s constructor reads."""
    return tuple(os.environ.get(v) for v in getattr(factory, "environment", ()))


def _load(name: str) -> Backend:
    factory = _factories.get(name)
    if factory is not None:
        found = _instances.get((name, _switches(factory)))
        if found is not None:
            return found
    targets = _targets()
    if name not in targets and name in _NOT_SHIPPED:
        raise BackendUnavailableError(f"Backend {name!r} is unavailable: {_NOT_SHIPPED[name]}.")
    if name not in targets:
        raise BackendUnavailableError(
            f"Invalid `backend`. Expected one of {sorted(targets)}. Received: backend={name!r}"
        )
    target = targets[name]
    hint = _INSTALL_HINT.get(name, f"install the package that provides backend {name!r}")
    try:
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        else:
            factory = target
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"Backend {name!r} cannot be imported ({exc}). Fix: {hint}.") from exc
    reason = factory.unavailable_reason() if hasattr(factory, "unavailable_reason") else None
    if reason:
        # The backend's own reason says what is missing; add an install hint only where we know one.
        fix = f" Fix: {_INSTALL_HINT[name]}." if name in _INSTALL_HINT else ""
        raise BackendUnavailableError(f"Backend {name!r} is unavailable here: {reason}.{fix}")
    key = (name, _switches(factory))
    if key not in _instances:
        _instances[key] = factory()
    _factories[name] = factory
    return _instances[key]


def available_backends() -> tuple[str, ...]:
    """Names of the backends usable in this process, NumPy first."""
    names = []
    for name in _targets():
        try:
            _load(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return tuple(sorted(names, key=lambda n: (n != "numpy", n)))


def default_backend_name() -> str:
    return _scoped.get() or _process_default or os.environ.get("MESHEMBED_BACKEND") or "numpy"


def get_backend(name: str | Backend | None = None) -> Backend:
    """The backend called ``name``; ``None`` means the current default."""
    if isinstance(name, Backend):
        return name
    return _load(name or default_backend_name())


def set_backend(name: str | None) -> None:
    """Set the process default (``None`` clears it). Fails early if unusable."""
    global _process_default
    if name is not None:
        _load(name)
    _process_default = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Scoped default backend: ``with me.use_backend("jax"): ...``."""
    backend = _load(name)
    token = _scoped.set(name)
    try:
        yield backend
    finally:
        _scoped.reset(token)
