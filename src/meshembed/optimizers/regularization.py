"""What Keras does around the update that is not per element: loss-scale and gradient
accumulation, norm clipping and the NaN policy, decoupled weight decay of sparse steps (the
rule applies it to dense ones), and the EMA of the variables.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from meshembed.errors import ConfigError, InputError, StateError
from meshembed.math.common import decay_weights
from meshembed.optimizers.gradients import _all_finite, _divide
from meshembed.optimizers.options import clip, ema, sum_squares
from meshembed.optimizers.step import real_dtype
from meshembed.variable import IndexedSlices, Variable

__all__ = ["RegularizationMixin"]


class RegularizationMixin:
    """Accumulation, clipping, the NaN policy, weight decay and EMA around the rule.

    One part of :class:`~meshembed.optimizers.Optimizer`."""

    def scale_loss(self, loss: Any) -> Any:
        """Keras 3: ``loss · loss_scale_factor`` (the gradients are divided by it again)."""
        return loss if self.loss_scale_factor is None else loss * self.loss_scale_factor

    def _accumulate(self, grads: list[Any], variables: Sequence[Variable]) -> tuple[list[Any], bool]:
        """Keras 3's gradient accumulation: add into the accumulators; every n-th call return
        the mean of the n gradients (accumulators reset) and update. Sparse gradients are
        densified first, so the update is then dense, as in Keras."""
        n = self.gradient_accumulation_steps
        dense = [self._densify(g, v)[0] for g, v in zip(grads, variables)]
        accs = [self._accumulators[self._slot_index(v)] for v in variables]
        if (self._calls() + 1) % n != 0:
            if not self.allow_nonfinite and not self._traced:  # never bank a NaN for a later update
                bad = [v.name for v, g in zip(variables, dense) if not _all_finite(self._xp, g)]
                if bad:
                    raise InputError(
                        f"Invalid gradients for {bad}: NaN or Inf. Nothing was accumulated. Fix: check the "
                        "loss, lower the loss scale, or pass `allow_nonfinite=True` to apply them anyway."
                    )
            for acc, g in zip(accs, dense):
                self._write(acc, g + self._read(acc))
            return grads, False
        out = [_divide(v.backend, g + self._read(acc), n) for acc, g, v in zip(accs, dense, variables)]
        for acc in self._accumulators:
            self._write(acc, self._xp.zeros_like(self._read(acc)))
        return out, True

    def _clip_and_check(self, grads: list[Any], variables: Sequence[Variable]) -> list[Any]:
        """Clip (GradientsClipOption), then the NaN policy on the clipped values. ``clipvalue``
        of a gradient the rule clips (``_folded``) is left to the rule: checked here only when
        a raw value is not finite (clipping maps ±Inf into range)."""
        option = self.gradients_clip_option
        xp = self._xp
        values = [g.values if isinstance(g, IndexedSlices) else g for g in grads]
        # A complex gradient is clipped as its real view (torch's clip_grad_norm_: the norm over
        # real and imaginary parts; clipvalue clamps each part), then made complex again.
        given = values
        complex_ = [option.active and real_dtype(v.dtype) != v.dtype for v in variables]
        if any(complex_):
            values = [v.backend.real_view(x) if c else x for x, v, c in zip(values, variables, complex_)]
        sums = [sum_squares(xp, x) for x in values] if option.uses_norm else None
        in_rule = [option.active and not option.uses_norm and id(v) in self._folded for v in variables]
        if any(in_rule):
            clipped = [x if r else clip(xp, [x], option)[0] for x, r in zip(values, in_rule)]
        else:
            clipped = clip(xp, values, option, sums)
        if not self.allow_nonfinite and not self._traced:  # traced: values unknown, NaN propagates
            if sums is not None and all(math.isfinite(x) for x in sums):
                bad = []  # Σg² finite: every element finite, and so is the clipped gradient
            elif self._finite(variables, clipped):
                bad = []
            else:
                final = [clip(xp, [c], option)[0] if r else c for c, r in zip(clipped, in_rule)]
                bad = [v.name for v, c in zip(variables, final) if not _all_finite(xp, c)]
            if bad:
                raw = [v.name for v, x in zip(variables, values) if not _all_finite(xp, x)]
                why = (f" (the raw gradients of {raw} are not finite"
                       + (", and global_clipnorm spreads a NaN/Inf norm to every gradient)" if option.global_clipnorm else ")")
                       if raw else " (their norm overflowed the dtype)")
                raise InputError(
                    f"Invalid gradients for {bad}: NaN or Inf after clipping{why}. Nothing was updated. "
                    "Fix: check the loss, lower the loss scale, or pass `allow_nonfinite=True` to apply them anyway."
                )
        if any(complex_):  # unclipped (clipvalue left to the rule): the given array itself
            clipped = [x if c is r else v.backend.from_real_view(c) if k else c
                       for c, r, x, v, k in zip(clipped, values, given, variables, complex_)]
        return [IndexedSlices(c, g.indices, g.dense_shape) if isinstance(g, IndexedSlices) else c
                for g, c in zip(grads, clipped)]

    def _finite(self, variables: Sequence[Variable], values: Sequence[Any]) -> bool:
        """All of ``values`` finite, in one backend check where the backend has one (a device
        guard covers its own sharded arrays: ``guarded_updates``); others (a torch DTensor)
        go through their all-reduced sums."""
        backend = variables[0].backend
        if backend.capabilities.guarded_updates or all(backend.sharding_of(x) is None for x in values):
            return bool(backend.finite_guard(list(values)))
        return all(_all_finite(self._xp, x) for x in values)

    def exclude_from_weight_decay(self, var_list: Sequence[Variable] | None = None,
                                  var_names: Sequence[str] | None = None) -> None:
        """Keras: no weight decay for these variables, or for variables whose name contains
        one of ``var_names`` (a regular-expression search). Call before the first step."""
        if self.built:
            raise StateError("Invalid call: exclude_from_weight_decay() after the optimizer was built. Call it first.")
        self._wd_excluded = {id(v) for v in self._check_var_list(var_list or [], "var_list")}
        names = list(var_names or [])
        if any(not isinstance(n, str) for n in names):
            raise ConfigError(f"Invalid `var_names`. Expected strings. Received: var_names={var_names!r}")
        self._wd_pattern = re.compile("|".join(sorted(set(names)))) if names else None

    def _uses_weight_decay(self, v: Variable) -> bool:
        if id(v) in getattr(self, "_wd_excluded", ()):
            return False
        pattern = getattr(self, "_wd_pattern", None)
        return pattern is None or pattern.search(v.name) is None

    def _decay_weights(self, variables: Sequence[Variable], lr: float) -> None:
        """Keras' decoupled weight decay ``w ← w − w·(wd·lr)`` before the update (core math)."""
        if not self.weight_decay:
            return
        for v in variables:
            if self._uses_weight_decay(v) and id(v) not in self._folded:  # else the rule decays it
                self._write(v, decay_weights(self._xp, self._read(v), self.weight_decay * lr))

    def _update_averages(self, variables: Sequence[Variable]) -> None:
        """The EMA of ``variables`` after the update (:func:`~meshembed.optimizers.options.ema`:
        tf_keras' or Keras 3's first step, overwrite after updates k, 2k, ...)."""
        averages = [self._averages[self._slot_index(v)] for v in variables]
        current = [self._read(v) for v in variables]
        new_avgs, new_vals = ema(self._xp, [self._read(a) for a in averages], current, self.ema_momentum,
                                 self._step(), keras3=self.keras3, overwrite_frequency=self.ema_overwrite_frequency)
        for a, v, old, new_a, new_v in zip(averages, variables, current, new_avgs, new_vals):
            self._write(a, new_a)
            if new_v is not old:  # overwritten by its average this step
                self._write(v, new_v)

    def finalize_variable_values(self, var_list: Sequence[Variable]) -> None:
        """With EMA, set each variable to its moving average (call once training ends)."""
        var_list = self._check_var_list(var_list, "var_list")
        if not self.use_ema:
            return
        if not self.built:
            raise StateError("Invalid call: finalize_variable_values() before the optimizer was built.")
        indices = [self._slot_index(v) for v in var_list]
        for v, i in zip(var_list, indices):
            v.assign_fresh(self._averages[i].value)
