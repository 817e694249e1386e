"""The dense optimizer's step on NumPy (mixed into ``NumpyBackend``), as the other backends'
``dense.py``: an element-wise rule runs in place, piece by piece."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import array_api_compat.numpy as xp_numpy
import numpy as np

from meshembed.math.rule import UpdateRule, apply_rule

#: Elements per piece of an elementwise dense step (256 KiB of float32; see compile_update).
PIECE_ELEMENTS = 1 << 16


class NumpyDenseMixin:
    """``compile_update`` for :class:`~meshembed_numpy.backend.NumpyBackend`."""

    def compile_update(self, rule: UpdateRule, count: int) -> Callable[..., Any]:
        """An element-wise rule (Adadelta's) runs on pieces of ``PIECE_ELEMENTS`` of each
        variable and writes them in place: NumPy evaluates a formula one full-size temporary
        per operation, which at W2 held several extra full-size arrays at once (the peak
        memory: docs/benchmarks.md, "Measurements behind design choices in the code", Core).
        Same numbers: every element depends only on the same element of each input."""
        if not rule.elementwise:
            return super().compile_update(rule, count)

        def step(grad: Any, values: tuple, *own: Any) -> tuple:
            return apply_rule(xp_numpy, rule, values, grad, *own)

        def step_in_pieces(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> None:
            for n in range(count):
                own = [t[n] for t in targets]
                grad = np.asarray(grads[n])
                hp = tuple(values[n])  # Python floats: the reference's arithmetic
                if grad.shape != own[0].shape or not all(t.shape == grad.shape and t.flags.c_contiguous for t in own):
                    for target, new in zip(own, step(grad, hp, *own)):
                        target[...] = new
                    continue
                flat_grad, flat = grad.reshape(-1), [t.reshape(-1) for t in own]  # views of the targets
                for start in range(0, flat_grad.size, PIECE_ELEMENTS):
                    piece = slice(start, start + PIECE_ELEMENTS)
                    for target, new in zip(flat, step(flat_grad[piece], hp, *(t[piece] for t in flat))):
                        target[piece] = new

        return step_in_pieces
