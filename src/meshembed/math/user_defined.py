"""UserDefinedProgram: an HLO program as the per-row update (spec §4.2)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import array_api_compat
import numpy as np

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
    Under JAX pass ``meshembed.math.user_defined.jax_hlo_runner`` where it is available.
    """
    if hlo_runner is None:
        raise NotImplementedError(
            "UserDefinedProgram runs an XLA HLO program, and the array library "
            f"{getattr(xp, '__name__', xp)!r} has no HLO compiler. Pass hlo_runner=... "
            "(e.g. meshembed.math.user_defined.jax_hlo_runner under JAX) or use "
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


@functools.lru_cache(maxsize=32)
def _compile_hlo(program: bytes) -> tuple[Any, Any]:
    """Compile a serialized HloModuleProto for JAX's CPU client (cached per program)."""
    try:
        import jax
        import jax.extend.backend as jax_backend
        from jax._src.lib import _jax, xla_client
    except ImportError as exc:  # pragma: no cover - depends on the installed jax
        raise NotImplementedError(
            "jax_hlo_runner needs jax with jaxlib's HLO -> StableHLO converter "
            f"(jax._src.lib._jax.mlir.hlo_to_stablehlo): {exc}"
        ) from exc
    del jax
    mlir = _jax.mlir.hlo_to_stablehlo(program)
    backend = jax_backend.get_backend("cpu")
    device = backend.devices()[0]
    executable = backend.compile_and_load(mlir, xla_client.DeviceList((device,)),
                                          xla_client.CompileOptions())
    return executable, device


def jax_hlo_runner(program: bytes, *arguments: Array) -> tuple[np.ndarray, ...]:
    """Run a TPU user-defined HLO program on JAX's CPU XLA client, element by element.

    The program's parameters are float32 ``[1,1]`` arrays (gradients, weights, slots) and
    an optional float32 scalar (the lr); it returns a tuple of ``[1,1]`` arrays. XLA
    compiles it once (HloModuleProto -> StableHLO -> CPU executable) and it is executed
    for every element of the rows, which is exact but slow: a correctness path for
    programs ported from TPU, not a fast kernel. It uses jaxlib internals
    (``hlo_to_stablehlo``, ``Client.compile_and_load``) and runs eagerly, so it cannot
    be called inside ``jax.jit``.
    """
    import jax

    executable, device = _compile_hlo(bytes(program))
    host = [np.asarray(a, dtype=np.float32) for a in arguments]
    shape = host[0].shape
    size = int(np.prod(shape))
    flat = [a.reshape(-1) if a.ndim else a for a in host]
    columns: list[list[np.ndarray]] = []
    for i in range(size):
        inputs = [jax.device_put(a[i].reshape(1, 1) if a.ndim else a, device) for a in flat]
        outputs = executable.execute(inputs)
        if not columns:
            columns = [[] for _ in outputs]
        for column, value in zip(columns, outputs):
            column.append(np.asarray(value).reshape(()))
    return tuple(np.stack(column).reshape(shape) if size else np.zeros(shape, np.float32)
                 for column in columns)
