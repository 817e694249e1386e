"""One table's update of a step — the routing every front end runs, written once.

:func:`update_table` decides how a table's rows are updated (``updates.update_kind``: summed
per looked-up row, one contribution after another, every row; or a low-precision table's
16-bit branch) and assembles what the update reads from the features' activation gradients:
the ids in feature order, the combiner's backward pass (each id's ``scale · grad[slot]``), or
the slot index and weights that a backend fuses into its update instead. It reads the batch
through :class:`StepInputs` and writes through :class:`TableUpdater`, two small documented
interfaces, so the same code runs

* in the engine's step (``embedding.step``): a host-prepared :class:`~meshembed.embedding.batch.Batch`,
  and any backend's ``update_rows`` / ``update_rows_in_order`` on concrete arrays;
* in ``me.jax.apply_gradients`` under the user's ``jax.jit``: a padded batch of traced arrays,
  and the JAX backend's programs traced into the user's step.

Only ``xp`` operations are used here (no host copies), so traced arrays pass through.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from meshembed.embedding import precision
from meshembed.embedding.layout import TableSpec
from meshembed.embedding.updates import update_kind

__all__ = ["StepInputs", "TableUpdater", "table_kind", "update_table"]


class StepInputs(Protocol):
    """A prepared batch as the update reads it, feature ``k`` by its config index."""

    def array(self, k: int, name: str) -> Any:
        """Feature ``k``'s ``"ids"``, ``"slots"`` (its output slot per id) or ``"scale"``
        (its combiner factor per id) as a backend array."""

    def joined(self, features: Sequence[int], name: str) -> Any:
        """Several features' arrays end to end; for ``"slots"`` each feature's slots after the
        previous features' output slots (one index into the joined gradients)."""

    def count(self, k: int) -> int:
        """How many ids feature ``k`` holds (a static number, padding included)."""

    def identity(self, k: int) -> bool:
        """Whether id ``i`` of feature ``k`` is alone in slot ``i`` (``combiners.is_identity``)."""

    def unit_scale(self, k: int) -> bool:
        """Whether every combiner factor of feature ``k`` is exactly 1."""

    def backward(self, k: int, grad: Any) -> Any:
        """Each id's gradient row ``scale · grad[slot]`` (``combiners.backward``), ``grad``
        being feature ``k``'s ``[slots, D]`` activation gradient."""


class TableUpdater(Protocol):
    """Runs the updates :func:`update_table` routes, with the table's rule, this step's values
    and guard (which it holds); each method returns the table's new ``(params, *slots)``."""

    #: ``Capabilities.grad_index_updates``: the combiner's backward fused into the update.
    grad_index_updates: bool
    #: ``Capabilities.shaped_rows``: the update takes one feature's gradients in its shape.
    shaped_rows: bool

    def check(self, t: TableSpec, grads: Sequence[Any]) -> None:
        """Where this updater checks table ``t``'s gradients for NaN/Inf itself: now, on the
        activation gradients (raises ``NonFiniteError``, nothing written)."""

    def update_rows(self, t: TableSpec, ids: Any, source: Any, checkable: bool, grad_index: Any = None,
                    grad_weights: Any = None) -> Sequence[Any]:
        """Summed per row (``Backend.update_rows``): id ``i``'s gradient is ``source[i]``, or with
        ``grad_index`` ``grad_weights[i] · source[grad_index[i]]`` (weights None: 1).
        ``checkable``: ``source`` holds the activation gradients as they came, so a NaN/Inf check
        of the update's own may stand in for :meth:`check`."""

    def per_id(self, t: TableSpec, kind: str, features: Sequence[int], row_grads: Any) -> Sequence[Any]:
        """The update of :func:`table_kind` ``kind`` from one gradient row per id of
        ``features`` (in feature order): ``"accumulate"`` summed per row, ``"in_order"`` one
        contribution after another, ``"every_row"`` every row of the table (g = 0 where not
        looked up), ``"low_precision"`` the 16-bit branch (``embedding.precision``)."""


def table_kind(t: TableSpec) -> str:
    """``"low_precision"`` for a table with 16-bit arrays, else ``updates.update_kind``."""
    return "low_precision" if precision.is_low(t) else update_kind(t)


def update_table(updater: TableUpdater, inputs: StepInputs, xp: Any, t: TableSpec, features: Sequence[int],
                 grads: Sequence[Any]) -> list[Any]:
    """Table ``t``'s new ``[params, *slots]`` from its ``features``' activation gradients
    ``grads`` (one per feature, in order)."""
    kind = table_kind(t)
    n_ids = sum(inputs.count(k) for k in features)
    unit = all(inputs.unit_scale(k) for k in features)
    if kind == "accumulate" and n_ids and all(inputs.identity(k) for k in features):
        # One id per slot: the (weighted) activation gradients are the per-id gradients, in id
        # order, so no slot index travels (one feature's may keep its shape).
        if not (len(features) == 1 and updater.shaped_rows):
            grads = [xp.reshape(g, (-1, t.dimension)) for g in grads]
        if not unit:
            updater.check(t, grads)
        rows = [g if inputs.unit_scale(k) else g * xp.reshape(inputs.array(k, "scale"), tuple(g.shape[:-1]) + (1,))
                for k, g in zip(features, grads)]
        return list(updater.update_rows(t, inputs.joined(features, "ids"), _joined(xp, rows), checkable=unit))
    grads = [xp.reshape(g, (-1, t.dimension)) for g in grads]  # [slots, D]
    if kind == "accumulate" and n_ids and updater.grad_index_updates:
        # The combiner's backward fused into the update: the backend sums scale_k · grad[slot_k]
        # per row without one gradient row per id (the sum combiner without weights: no scale).
        weights = None if unit else inputs.joined(features, "scale")
        return list(updater.update_rows(t, inputs.joined(features, "ids"), _joined(xp, grads), checkable=True,
                                        grad_index=inputs.joined(features, "slots"), grad_weights=weights))
    updater.check(t, grads)
    rows = [inputs.backward(k, g) for k, g in zip(features, grads)]
    row_grads = _joined(xp, rows) if rows else xp.zeros((0, t.dimension), dtype=xp.float32)
    return list(updater.per_id(t, kind, features, row_grads))


def _joined(xp: Any, arrays: list[Any]) -> Any:
    return arrays[0] if len(arrays) == 1 else xp.concat(arrays, axis=0)
