"""``me.torch.Adadelta``: a ``torch.optim.Optimizer`` whose step is ``me.optimizers.Adadelta``.

Each param group is driven by one ``me.optimizers.Adadelta`` over ``me.Variable``s that
*adopt* the parameters' storage, so the step is the core ``meshembed.math.adadelta`` through
the torch backend's in-place compiled (or generated fused) update, writing straight into the
parameters: the same numbers as ``me.optimizers.Adadelta``, bit for bit.

Defaults are Keras' (lr 1e-3, ρ 0.95, ε 1e-7). ``torch.optim.Adadelta``'s are lr 1.0, ρ 0.9,
ε 1e-6, and its ``lr`` is the same factor: ``torch.optim.Adadelta(p, lr=1.0, rho=0.9, eps=1e-6)``
≡ ``me.torch.Adadelta(p, lr=1.0, rho=0.9, eps=1e-6)``. State names follow torch
(``square_avg`` = Keras ``accumulated_grad`` = TPU ``accumulators``; ``acc_delta`` =
``accumulated_delta_var`` = ``updates``). ``weight_decay`` is Keras' decoupled decay
(``w ← w − lr·wd·w`` before the update), not torch's L2 term added to the gradient.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

import meshembed as me
from meshembed.errors import InputError
from meshembed.variable import _Fresh

__all__ = ["Adadelta"]

_FIXED = ("rho", "eps", "weight_decay", "gradients_clip_option", "ema_option")


class Adadelta(torch.optim.Optimizer):
    """Adadelta (Keras/TPU rule, see ``meshembed.math.adadelta``) as a torch optimizer.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
        lr, rho, eps: learning rate, decay and the ε inside both roots (Keras defaults).
        weight_decay: Keras' decoupled weight decay (0 = none).
        gradients_clip_option, ema_option: ``me.optimizers.GradientsClipOption`` /
            ``EMAOption`` (tf_keras semantics; ``finalize_variable_values()`` swaps the EMA in).
        maximize: ascend the objective (the gradients are negated).
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, rho: float = 0.95, eps: float = 1e-7, *,
                 weight_decay: float = 0.0, gradients_clip_option: Any = None, ema_option: Any = None,
                 maximize: bool = False) -> None:
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
                        gradients_clip_option=gradients_clip_option, ema_option=ema_option, maximize=maximize)
        self._inner: dict[int, tuple[tuple, Any, list]] = {}  # id(group) -> (fixed, optimizer, variables)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._driver(self.param_groups[-1])  # bad hyper-parameters raise now, not at step

    def _driver(self, group: dict) -> tuple[Any, list]:
        """The group's ``me.optimizers.Adadelta`` and variables; rebuilt (slots kept) when a
        fixed hyper-parameter of the group changed (e.g. after ``load_state_dict``)."""
        fixed = tuple(group[k] for k in _FIXED)
        params = group["params"]
        entry = self._inner.get(id(group))
        if entry is not None and entry[0] == fixed and len(entry[2]) == len(params) and all(
                v.value.data_ptr() == p.data_ptr() for v, p in zip(entry[2], params)):
            return entry[1], entry[2]
        for p in params:
            if not p.is_floating_point():
                raise InputError(
                    f"Invalid parameter of dtype {p.dtype}: Adadelta needs floating parameters. Fix: "
                    "optimize torch.view_as_real(...) or a float copy instead."
                )
        backend = me.get_backend("torch")
        variables = [me.Variable(_Fresh(p.detach()), name=f"param_{k}", backend=backend) for k, p in enumerate(params)]
        opt = me.optimizers.Adadelta(
            learning_rate=float(group["lr"]), rho=group["rho"], epsilon=group["eps"],
            weight_decay=group["weight_decay"] or None, gradients_clip_option=group["gradients_clip_option"],
            ema_option=group["ema_option"])
        opt.build(variables)
        if entry is not None:  # carry the slots (and the step count) over
            old = self._slots(entry[1])
            for k, (a, d) in enumerate(self._slots(opt)):
                if k < len(old):
                    a.value.copy_(old[k][0].value)
                    d.value.copy_(old[k][1].value)
            opt._counter.assign(entry[1]._counter.numpy())
        self._inner[id(group)] = (fixed, opt, variables)
        return opt, variables

    @staticmethod
    def _slots(opt: Any) -> list[tuple[Any, Any]]:
        return list(zip(opt._accumulated_grads, opt._accumulated_delta_vars))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            opt, variables = self._driver(group)
            pairs = []
            for p, v in zip(group["params"], variables):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise InputError("Invalid gradient: me.torch.Adadelta does not take sparse gradients.")
                pairs.append((-p.grad if group["maximize"] else p.grad, v))
            if not pairs:
                continue
            opt.learning_rate = float(group["lr"])  # a scheduler's new value: no recompilation
            opt.apply_gradients(pairs)
            for p, v in zip(group["params"], variables):
                if v.value.data_ptr() != p.data_ptr():  # a path that returned new arrays
                    p.copy_(v.value)
                    v._value = p.detach()
        return loss

    @torch.no_grad()
    def finalize_variable_values(self) -> None:
        """With EMA: write the moving averages into the parameters (Keras' end-of-training call)."""
        for group in self.param_groups:
            opt, variables = self._driver(group)
            opt.finalize_variable_values(variables)
            for p, v in zip(group["params"], variables):
                if v.value.data_ptr() != p.data_ptr():
                    p.copy_(v.value)
                    v._value = p.detach()

    def state_dict(self) -> dict[str, Any]:
        """torch's format: per parameter ``step``, ``square_avg``, ``acc_delta`` (+ ``ema``)."""
        for group in self.param_groups:
            opt, variables = self._driver(group)
            step = torch.tensor(float(opt._counter.numpy()))
            averages = list(opt._averages)
            for k, (p, (a, d)) in enumerate(zip(group["params"], self._slots(opt))):
                state = {"step": step.clone(), "square_avg": a.value, "acc_delta": d.value}
                if averages:
                    state["ema"] = averages[k].value
                self.state[p] = state
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for group in self.param_groups:
                opt, variables = self._driver(group)
                averages = list(opt._averages)
                for k, (p, (a, d)) in enumerate(zip(group["params"], self._slots(opt))):
                    state = self.state.get(p)
                    if not state:
                        continue
                    a.value.copy_(state["square_avg"])
                    d.value.copy_(state["acc_delta"])
                    if averages and "ema" in state:
                        averages[k].value.copy_(state["ema"])
                    opt._counter.assign(torch.as_tensor(state["step"]).to(torch.int64).numpy())
