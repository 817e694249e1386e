"""Error status codes that processes exchange, so one process's bad input fails everywhere.

A backend's collectives carry these small ints (``Backend.agree``, torch's row routes); the
engine's validate-then-agree logic (``meshembed.embedding.agreement``) builds on them. They
live here, beside the protocol, so that backends need nothing from ``meshembed.embedding``.
"""

from __future__ import annotations

from meshembed.errors import (BackendUnavailableError, CapacityError, CheckpointError, ConfigError, InputError,
                              MeshembedError, StateError)

#: Status codes: 0 is success, k > 0 an error of type ``KINDS[k - 1]`` (the most specific
#: one in this tuple that the error is an instance of; anything else counts as the base class).
KINDS: tuple[type[MeshembedError], ...] = (
    MeshembedError, InputError, CapacityError, StateError, ConfigError, CheckpointError, BackendUnavailableError,
)


def status_of(exc: BaseException) -> int:
    """The status code of an error (see :data:`KINDS`)."""
    best = 0
    for k, kind in enumerate(KINDS):
        if isinstance(exc, kind) and issubclass(kind, KINDS[best]):
            best = k
    return best + 1


def peer_error(what: str, statuses: tuple[int, ...]) -> MeshembedError:
    """The error a process whose own input was valid raises when another's was not."""
    bad = [r for r, s in enumerate(statuses) if s > 0]  # <= 0: valid (a negative one carries a digest)
    kind = KINDS[statuses[bad[0]] - 1] if 0 < statuses[bad[0]] <= len(KINDS) else MeshembedError
    ranks = ", ".join(str(r) for r in bad)
    return kind(
        f"`{what}` failed on rank {ranks} of {len(statuses)} ({kind.__name__}): that rank rejected its "
        f"input. This rank's input was valid, but no rank changed anything, so that the ranks stay in "
        f"step. Fix: correct the input on rank {bad[0]} (its own error says what is wrong) and call "
        f"`{what}` again on every rank."
    )
