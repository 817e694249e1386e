"""Combiners: forward reduction and its exact backward (spec §3.1 step 1, gotcha 2).

For output slot ``s`` holding ids ``i_k`` with weights ``w_k``:
``a_s = Σ_k (w_k / N_s) · E[i_k]`` with ``N_s = 1`` (sum), ``Σ_k w_k`` (mean) or
``sqrt(Σ_k w_k²)`` (sqrtn); hence ``∂L/∂E[i_k] += (w_k / N_s) · g_s``.

The per-id factor ``scale_k = w_k / N_s`` is computed once on the host at enqueue, so forward
and backward are one gather + segment-sum and one take + multiply on any backend.

Zero normaliser: a slot whose ``Σw`` (mean) or ``Σw²`` (sqrtn) is zero gets scale 0 — TF's
``div_no_nan`` as used by its CPU lookup — so its activation is zero and its ids receive zero
gradient (they still count as looked up). The TPU documents that case as invalid input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshembed.errors import InputError

COMBINERS = ("sum", "mean", "sqrtn")


def check_combiner(combiner: str, where: str = "") -> str:
    name = str(combiner).lower()
    if name not in COMBINERS:
        raise InputError(f"Invalid `combiner`{where}. Expected one of {list(COMBINERS)}. Received: combiner={combiner!r}")
    return name


def combiner_scale(slots: np.ndarray, weights: np.ndarray, num_slots: int, combiner: str) -> np.ndarray:
    """Per-id factor ``w_k / N_s`` (float32), with div_no_nan for a zero normaliser."""
    combiner = check_combiner(combiner)
    w = weights.astype(np.float32, copy=False)
    if combiner == "sum" or w.size == 0:
        return w.copy()
    if combiner == "mean":
        norm = np.bincount(slots, weights=w, minlength=num_slots).astype(np.float32)
    else:
        norm = np.sqrt(np.bincount(slots, weights=w.astype(np.float64) ** 2, minlength=num_slots)).astype(np.float32)
    denom = norm[slots]
    out = np.zeros_like(w)
    np.divide(w, denom, out=out, where=denom != 0)
    return out


def is_unit(scale: np.ndarray) -> bool:
    """Whether every factor is exactly 1 (the sum combiner without weights): multiplying by
    it changes nothing, so forward and backward may skip the weighting pass."""
    return bool(scale.size == 0 or (scale.min() == 1 and scale.max() == 1))


def is_identity(slots: np.ndarray, num_slots: int) -> bool:
    """Whether id ``k`` is alone in slot ``k`` (``slots == arange(num_slots)``): a sequence
    feature with every position filled, e.g. dense ids of shape ``[B, M]``. Its forward pass
    is a plain gather and its backward the activation gradient itself, so the engine skips
    the segment-sum and the ``[n]`` slot index on every backend. ``slots`` are validated to
    lie in ``[0, num_slots)``, so ``n == num_slots`` and strictly increasing means identity."""
    n = slots.shape[0]
    if n != num_slots:
        return False
    return n < 2 or bool(np.all(slots[1:] > slots[:-1]))


def forward(backend: Any, rows: Any, scale: Any, slots: Any, num_slots: int) -> Any:
    """``act[s] = Σ_{k: slot_k = s} scale_k · rows_k`` as a ``[num_slots, D]`` backend array."""
    return backend.segment_sum_to(rows * scale, slots, num_slots)


def backward(backend: Any, grad: Any, scale: Any, slots: Any, unit: bool = False, identity: bool = False) -> Any:
    """Per-id row gradients ``scale_k · grad[slot_k]`` (``grad`` is ``[num_slots, D]``);
    ``unit``: every ``scale_k`` is 1, so the product is the taken rows themselves;
    ``identity``: ``slots`` is ``arange(num_slots)`` (:func:`is_identity`), so no take."""
    xp = backend.xp
    rows = grad if identity else xp.take(grad, slots, axis=0)
    return rows if unit else rows * scale
