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

The slots live in ``opt.state[p]`` (``step``, ``square_avg``, ``acc_delta``, ``ema``) as the very
tensors the step updates, as with any torch optimizer, so checkpoint tools see them. Hyper-
parameters are checked as ``me.optimizers.Adadelta`` checks them, and in each parameter's dtype,
when a group is added and before ``load_state_dict`` changes anything; ``rho`` and ``eps`` may be
callables (tf_keras' legacy optimizers take them: called once per step, checked then).

Complex parameters are optimised as ``torch.optim.Adadelta`` does: as ``torch.view_as_real``,
real and imaginary parts two independent reals (``square_avg`` holds ``E[re(g)²] + i·E[im(g)²]``,
complex like the parameter, as torch's state does).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

import meshembed as me
from meshembed.errors import ConfigError, InputError
from meshembed.optimizers.step import check_in_dtype
from meshembed.variable import Fresh

__all__ = ["Adadelta"]

_FIXED = ("rho", "eps", "weight_decay", "gradients_clip_option", "ema_option")
_SLOTS = ("step", "square_avg", "acc_delta")


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's ``view_as_real`` (its storage, real and imaginary parts as reals)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A slot as ``p``'s dtype shows it: the complex view of a complex parameter's real slot."""
    return torch.view_as_complex(t) if p.is_complex() else t


def _shows(shown: Any, live: torch.Tensor) -> bool:
    """``opt.state`` holds the live slot ``live`` itself, or (complex parameter) its view."""
    return shown is live or (shown is not None and shown._base is live)


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
        self._steps: dict[int, torch.Tensor] = {}  # id(group) -> its live "step" tensor
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group's optimizer is built: bad hyper-parameters raise now (not at
        the first step), and the refused group is not kept."""
        super().add_param_group(param_group)
        try:
            self._driver(self.param_groups[-1])
        except Exception:
            self.param_groups.pop()
            raise

    @staticmethod
    def _optimizer(group: dict) -> Any:
        """A ``me.optimizers.Adadelta`` for ``group``'s hyper-parameters: its constructor's checks,
        and the learning rate, ε and weight decay finite in each parameter's dtype (lr=1e39 is
        Inf in float32). Raises ``ConfigError`` / ``InputError``; changes nothing."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point():
            lr = lr.item()
        if callable(lr) or not isinstance(group["maximize"], bool):
            raise ConfigError(f"Invalid `lr`/`maximize`. Expected a float and a bool. Received: "
                              f"lr={group['lr']!r}, maximize={group['maximize']!r}")
        opt = me.optimizers.Adadelta(
            learning_rate=lr, rho=group["rho"], epsilon=group["eps"], weight_decay=group["weight_decay"] or None,
            gradients_clip_option=group["gradients_clip_option"], ema_option=group["ema_option"])
        for k, p in enumerate(group["params"]):
            if not (p.is_floating_point() or p.is_complex()):
                raise InputError(
                    f"Invalid parameter of dtype {p.dtype}: Adadelta needs floating or complex parameters. Fix: "
                    "optimize a float copy instead."
                )
            scalars = {"lr": opt.learning_rate, "eps": None if callable(opt.epsilon) else opt.epsilon,
                       "weight_decay": opt.weight_decay}
            check_in_dtype(scalars, f"param {k}", str(_real(p).dtype).removeprefix("torch."))
        return opt

    def _driver(self, group: dict) -> tuple[Any, list]:
        """The group's ``me.optimizers.Adadelta`` and variables; rebuilt (slots kept) when a
        fixed hyper-parameter of the group changed (e.g. after ``load_state_dict``)."""
        fixed = tuple(group[k] for k in _FIXED)
        params = group["params"]
        entry = self._inner.get(id(group))
        if entry is not None and entry[0] == fixed and len(entry[2]) == len(params) and all(
                v.value.data_ptr() == p.data_ptr() and v.shape == _real(p).shape for v, p in zip(entry[2], params)):
            return entry[1], entry[2]
        opt = self._optimizer(group)
        backend = me.get_backend("torch")
        variables = [me.Variable(Fresh(_real(p.detach())), name=f"param_{k}", backend=backend)
                     for k, p in enumerate(params)]
        opt.build(variables)
        if entry is not None:  # carry the slots (and the step count) over
            old = self._slots(entry[1])
            for k, (a, d) in enumerate(self._slots(opt)):
                if k < len(old):
                    a.value.copy_(old[k][0].value)
                    d.value.copy_(old[k][1].value)
            opt.step_counter.assign(entry[1].step_counter.numpy())
        self._inner[id(group)] = (fixed, opt, variables)
        self._publish(group, opt)
        return opt, variables

    @staticmethod
    def _slots(opt: Any) -> list[tuple[Any, Any]]:
        return list(zip(opt.accumulated_grads, opt.accumulated_delta_vars))

    def _publish(self, group: dict, opt: Any) -> None:
        """``self.state[p]`` holds the live slot tensors (rebound only when a step made new
        ones) and the group's ``step`` tensor, updated in place (no host sync)."""
        step = self._steps.get(id(group))
        if step is None:
            step = self._steps[id(group)] = torch.zeros((), dtype=torch.float64)  # exact past 2**24 steps
        step.copy_(opt.step_counter.value)
        averages = opt.averages
        for k, (p, (a, d)) in enumerate(zip(group["params"], self._slots(opt))):
            state = self.state[p]
            if state.get("step") is step and _shows(state.get("square_avg"), a.value) \
                    and _shows(state.get("acc_delta"), d.value) \
                    and (not averages or _shows(state.get("ema"), averages[k].value)):
                continue
            state.clear()
            state.update(step=step, square_avg=_like(p, a.value), acc_delta=_like(p, d.value))
            if averages:
                state["ema"] = _like(p, averages[k].value)

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
                grad = _real(p.grad)
                pairs.append((-grad if group["maximize"] else grad, v))
            if not pairs:
                continue
            lr = group["lr"]  # a scheduler's new value: no recompilation
            opt.learning_rate = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 else lr
            opt.apply_gradients(pairs)
            for p, v in zip(group["params"], variables):
                if v.value.data_ptr() != p.data_ptr():  # a path that returned new arrays
                    _real(p).copy_(v.value)
                    v.adopt(_real(p.detach()))
            self._publish(group, opt)
        return loss

    @torch.no_grad()
    def finalize_variable_values(self) -> None:
        """With EMA: write the moving averages into the parameters (Keras' end-of-training call)."""
        for group in self.param_groups:
            opt, variables = self._driver(group)
            opt.finalize_variable_values(variables)
            for p, v in zip(group["params"], variables):
                if v.value.data_ptr() != p.data_ptr():
                    _real(p).copy_(v.value)
                    v.adopt(_real(p.detach()))

    def state_dict(self) -> dict[str, Any]:
        """torch's format: per parameter ``step``, ``square_avg``, ``acc_delta`` (+ ``ema``)."""
        for group in self.param_groups:
            self._driver(group)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, after checking that ``state_dict`` is a ``me.torch.Adadelta``'s that fits
        these parameters (another optimizer's, torch.optim.Adadelta's included — its weight
        decay is another rule — is a ``ConfigError``); a refused call changes nothing."""
        self._check_state_dict(state_dict)
        super().load_state_dict(state_dict)
        loaded = [[dict(self.state.get(p, {})) for p in g["params"]] for g in self.param_groups]
        with torch.no_grad():
            for group, states in zip(self.param_groups, loaded):
                opt, variables = self._driver(group)  # publishes its own (fresh) slots
                averages = opt.averages
                for k, (state, (a, d)) in enumerate(zip(states, self._slots(opt))):
                    if not state:
                        continue
                    a.value.copy_(_real(state["square_avg"]))
                    d.value.copy_(_real(state["acc_delta"]))
                    if averages and "ema" in state:
                        averages[k].value.copy_(_real(state["ema"]))
                    opt.step_counter.assign(torch.as_tensor(state["step"]).to(torch.int64).numpy())
                self._publish(group, opt)

    def _check_state_dict(self, state_dict: Any) -> None:
        what = "Invalid `state_dict` for me.torch.Adadelta"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ConfigError(f"{what}. Expected torch's optimizer format {{'state', 'param_groups'}}. "
                              f"Received: {type(state_dict).__name__} with keys {list(getattr(state_dict, 'keys', list)())}")
        saved, state = state_dict["param_groups"], state_dict["state"]
        if len(saved) != len(self.param_groups):
            raise ConfigError(f"{what}. Expected {len(self.param_groups)} param groups. Received: {len(saved)}")
        for i, (s, g) in enumerate(zip(saved, self.param_groups)):
            missing = sorted(set(self.defaults) - set(s))
            if missing:
                raise ConfigError(
                    f"{what}: param group {i} is another optimizer's (no {missing}; it has {sorted(set(s) - {'params'})}). "
                    "Fix: load a state_dict saved by me.torch.Adadelta, or start this optimizer's state afresh."
                )
            if len(s["params"]) != len(g["params"]):
                raise ConfigError(f"{what}. Expected {len(g['params'])} parameters in group {i}. "
                                  f"Received: {len(s['params'])}")
            self._optimizer({**s, "params": g["params"]})  # the same checks as at construction
            for key, p in zip(s["params"], g["params"]):
                entry = state.get(key)
                if entry is None:
                    continue
                if not isinstance(entry, dict) or not set(_SLOTS) <= set(entry):
                    names = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                    raise ConfigError(f"{what}: the state of parameter {key} is another optimizer's (no "
                                      f"{sorted(set(_SLOTS) - set(entry or ()))}; it has {names}).")
                for name in ("square_avg", "acc_delta", "ema"):
                    t = entry.get(name)
                    if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape)):
                        raise ConfigError(f"{what}: state[{key}][{name!r}] has shape "
                                          f"{tuple(getattr(t, 'shape', ()))}; the parameter has {tuple(p.shape)}.")
                step = torch.as_tensor(entry["step"]).double()
                if step.numel() != 1 or not bool(torch.isfinite(step).all()) or step.item() < 0 \
                        or step.item() != int(step.item()):
                    raise ConfigError(f"{what}: state[{key}]['step'] = {entry['step']!r}. Expected a "
                                      "non-negative whole number.")
