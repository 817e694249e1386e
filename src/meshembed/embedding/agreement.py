"""Validate, then agree: one process's bad input fails the call on every process.

With several processes (torch.distributed ranks) every engine call runs the same collectives
on every rank. If one rank rejected its input (an id out of range, a NaN gradient, a wrong
shape) and returned while the others went on into the row exchange, they would wait there
for the process group's timeout (gloo's default: 30 minutes) or pair up with the wrong
collective. So an engine method decorated with :func:`agreed` runs its local validation,
then calls :func:`validated` before its first collective: one tiny all-gather of a status
code (``Backend.agree``) tells every rank whether any rank failed. The failing rank raises
its own error; the others raise the same type naming the failing rank; none has changed
anything. A single-process backend answers at once, without communication.
"""

from __future__ import annotations

import contextvars
import functools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from meshembed.backend.status import KINDS, peer_error, status_of  # noqa: F401 (re-exported)
from meshembed.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class _Call:
    backend: Any
    what: str
    agreed: bool = False


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("meshembed_agreement", default=None)


def _own_backend(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self.backend


def _first_argument(backend: Any, *args: Any, **kwargs: Any) -> Any:
    return backend


def agreed(what: str, backend_of: Callable[..., Any] = _own_backend) -> Callable[[F], F]:
    """Decorate a call (an engine method, whose backend is ``self.backend``; or a step function,
    ``agreed(what, backend_of=first_argument)``) whose validation ends at a :func:`validated`
    call: an error raised before that point is agreed with the other processes (they raise
    :func:`peer_error`), and a call that returns without reaching it still takes part in the
    agreement. Nested decorated calls share the outer one's."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _CURRENT.get() is not None:
                return method(*args, **kwargs)
            call = _Call(backend_of(*args, **kwargs), what)
            token = _CURRENT.set(call)
            try:
                out = method(*args, **kwargs)
            except Exception as exc:
                if not call.agreed:
                    call.agreed = True
                    try:
                        call.backend.agree(status_of(exc))
                    except Exception:  # noqa: BLE001 - a dead peer: the local error is the one to report
                        pass
                raise
            finally:
                _CURRENT.reset(token)
            if not call.agreed:
                _agree(call)
            return out

        return run  # type: ignore[return-value]

    return decorate


first_argument = _first_argument  #: ``backend_of`` for functions whose first argument is the backend


def validated(backend: Any, digest: int | None = None, subject: str = "", error: type = ConfigError) -> None:
    """The end of a decorated call's validation: agree that every process's input is valid,
    or raise :func:`peer_error`. Outside an :func:`agreed` call it agrees on its own.

    ``digest`` (:func:`fingerprint` of what every process must pass alike: the config, this
    step's learning rates, the mode) travels in the same exchange: processes that differ all
    raise ``error`` naming ``subject`` and the ranks, before anything changes — no rank trains
    on with other values, and none waits for a collective the others never reach."""
    call = _CURRENT.get()
    if call is None:
        _agree(_Call(backend, "this call"), digest, subject, error)
    elif not call.agreed:
        _agree(call, digest, subject, error)


def fingerprint(*parts: Any) -> int:
    """A 30-bit fingerprint of plain values (numbers, strings, tuples of them)."""
    return zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF


def _agree(call: _Call, digest: int | None = None, subject: str = "", error: type = ConfigError) -> None:
    call.agreed = True
    # a valid input's status is 0, or -(1 + digest): errors are the positive codes
    statuses = tuple(call.backend.agree(0 if digest is None else -(1 + digest)))
    if any(s > 0 for s in statuses):
        raise peer_error(call.what, statuses)
    if len(set(statuses)) > 1:
        groups: dict[int, list[int]] = {}
        for rank, s in enumerate(statuses):
            groups.setdefault(s, []).append(rank)
        sides = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        raise error(
            f"`{call.what}`: the ranks disagree on {subject or 'their arguments'} ({sides} passed different "
            "values). Nothing was changed on any rank. Fix: pass the same values on every rank (a "
            "config, num_shards, seed, learning rates and training mode are global, not per rank).")
