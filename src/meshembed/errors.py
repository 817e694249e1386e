"""Exception types. Every error names what was wrong, where (table/feature) and the fix."""

from __future__ import annotations


class MeshembedError(Exception):
    """Base class of every error meshembed raises on purpose."""


class BackendUnavailableError(MeshembedError, ImportError):
    """A backend is unknown, or its framework is not installed / cannot run here."""


class ConfigError(MeshembedError, ValueError):
    """An embedding configuration (typed or proto) is invalid."""


class UntrainableError(ConfigError, NotImplementedError):
    """A table's optimizer cannot be trained here (no public formula, or a program this
    backend cannot run): raised when a training engine is built, before any table exists."""


class InputError(MeshembedError, ValueError):
    """Ids, weights, gradients or learning rates passed to the engine are invalid.

    Raised before any table or slot is touched, so state is unchanged.
    """


class StateError(MeshembedError, RuntimeError):
    """An engine call came in the wrong order (e.g. apply_gradients without dequeue)."""


class NonFiniteError(InputError):
    """Gradients hold NaN or Inf (``update_rows(check_finite=True)``); nothing was written."""

    def __init__(self, message: str = "Invalid `grads`: they contain NaN or Inf. Nothing was updated.") -> None:
        super().__init__(message)


class CapacityError(InputError):
    """A batch has more unique ids than a static-shape backend was compiled for."""


class CheckpointError(MeshembedError, ValueError):
    """A checkpoint path cannot be written, or a checkpoint fails verification on restore.

    Raised before anything at the path (on save) or in the engine (on restore) is touched.
    """



class ResourceError(MeshembedError, MemoryError):
    """An allocation whose size the user controls (a table, a batch, a slot, a copy) failed,
    or cannot fit in this process at all. Still a ``MemoryError``, so ``except MemoryError``
    keeps working; the message names what was allocated, its bytes, shape and dtype, and the fix.
    Nothing was changed (``meshembed.backend.memory.allocating``)."""
