"""UserDefinedProgram: an HLO program as the per-row update (spec §4.2)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import array_api_compat

from meshembed.math.common import Array, Scalar, scalar

#: ``hlo_runner(program, *arguments) -> sequence of arrays``. ``program`` is the serialized
#: ``xla.HloModuleProto`` (bytes); ``arguments`` are, in the HLO's order, gradients,
#: weights, the slots, then (when the program takes it) the scalar learning rate.
HloRunner = Callable[..., Sequence[Array]]


def user_defined_slot_names(num_slots: int) -> tuple[str, ...]:
    """TPU's names for the slots of a user-defined program: ``Slot_0 … Slot_{k-1}``."""
    return tuple(f"Slot_{i}" for i in range(num_slots))


def user_defined_program(
    xp: Any, params: Array, grads: Array, slots: Sequence[Array], *, lr: Scalar,
    program: bytes, hlo_runner: HloRunner | None = None, takes_learning_rate: bool = True,
) -> tuple[Array, tuple[Array, ...]]:
    """Run an element-wise float32 HLO update ``(g, p, slots…[, lr]) -> (p', slots'…)``.

    The HLO has ``num_inputs == num_outputs + 1`` (no lr) or ``+ 2`` (with the scalar lr)
    and is applied to every element of the touched rows. Executing HLO needs an XLA
    compiler, so the work is delegated to ``hlo_runner``; without one this raises
    ``NotImplementedError`` naming the array library, because NumPy, torch (eager or
    ``torch.compile``), CuPy and array-api-strict cannot compile an ``HloModuleProto``.
    A backend with ``capabilities.runs_hlo`` supplies one (``Backend.hlo_program``; the JAX
    backend runs the program on XLA's CPU client).
    """
    if hlo_runner is None:
        raise NotImplementedError(
            "UserDefinedProgram runs an XLA HLO program, and the array library "
            f"{getattr(xp, '__name__', xp)!r} has no HLO compiler. Pass hlo_runner=... "
            "(e.g. the jax backend's, Backend.hlo_program) or use "
            "meshembed.math.custom.CustomOptimizer with a Python update function."
        )
    args: list[Any] = [grads, params, *slots]
    if takes_learning_rate:
        args.append(xp.asarray(scalar(xp, lr, params), dtype=params.dtype))
    outputs = tuple(xp.asarray(o, device=array_api_compat.device(params))
                    for o in hlo_runner(program, *args))
    if len(outputs) != 1 + len(slots):
        raise ValueError(
            "Invalid HLO program outputs. Expected new weights plus one array per slot "
            f"({1 + len(slots)} arrays). Received: {len(outputs)} arrays"
        )
    return outputs[0], tuple(outputs[1:])
