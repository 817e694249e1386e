"""UserDefinedProgram on the JAX backend: a TPU HLO program run by XLA's CPU client.

The core's math (``meshembed.math.user_defined``) only calls an ``hlo_runner`` it is given;
this backend supplies it (``JaxBackend.hlo_program``, found by the core through
``Capabilities.runs_hlo``), so the core imports nothing of JAX. The runner compiles the
program once (HloModuleProto -> StableHLO -> CPU executable, jaxlib internals) and runs it
element by element inside ``jax.pure_callback``, so it also works inside the backend's jitted
update step: exact but slow, a correctness path for programs ported from TPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from meshembed.errors import ConfigError


@functools.lru_cache(maxsize=32)
def _compile_hlo(program: bytes) -> tuple[Any, Any]:
    """Compile a serialized HloModuleProto for JAX's CPU client (cached per program)."""
    try:
        import jax.extend.backend as jax_backend
        from jax._src.lib import _jax, xla_client
    except ImportError as exc:  # pragma: no cover - depends on the installed jax
        raise NotImplementedError(
            "UserDefinedProgram needs jax with jaxlib's HLO -> StableHLO converter "
            f"(jax._src.lib._jax.mlir.hlo_to_stablehlo): {exc}"
        ) from exc
    mlir = _jax.mlir.hlo_to_stablehlo(program)
    backend = jax_backend.get_backend("cpu")
    device = backend.devices()[0]
    executable = backend.compile_and_load(mlir, xla_client.DeviceList((device,)), xla_client.CompileOptions())
    return executable, device


def jax_hlo_runner(program: bytes, *arguments: Any) -> tuple[np.ndarray, ...]:
    """Run a TPU user-defined HLO program on JAX's CPU XLA client, element by element (eager).

    The program's parameters are float32 ``[1,1]`` arrays (gradients, weights, slots) and an
    optional float32 scalar (the lr); it returns a tuple of ``[1,1]`` arrays."""
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
    return tuple(np.stack(column).reshape(shape) if size else np.zeros(shape, np.float32) for column in columns)


@functools.lru_cache(maxsize=32)
def program_hyperparameters(table_name: str, program: bytes, num_slots: int) -> tuple[tuple[str, Any], ...]:
    """``hlo_runner`` / ``takes_learning_rate`` for UserDefinedProgram's math: the runner wraps
    :func:`jax_hlo_runner` in ``jax.pure_callback`` (usable under jit). Whether the program
    takes the scalar lr is read from its parameter count (inputs = outputs + 1 or + 2, with
    outputs = 1 + slots); another count is a ConfigError naming the table. Cached, so equal
    tables get the same runner and so equal rules (one compiled step)."""
    import jax
    from jax._src.lib import xla_client

    try:
        n_params = len(xla_client.XlaComputation(program).program_shape().parameter_shapes())
    except Exception as exc:
        raise ConfigError(
            f"Table {table_name!r}: UserDefinedProgram.program is not a serialized "
            f"xla.HloModuleProto ({type(exc).__name__}: {exc})."
        ) from None
    if n_params not in (2 + num_slots, 3 + num_slots):
        raise ConfigError(
            f"Table {table_name!r}: the HLO program takes {n_params} parameters, but with "
            f"num_slots={num_slots} it must take gradients, weights and the slots "
            f"({2 + num_slots}), optionally plus the learning rate ({3 + num_slots})."
        )

    def runner(prog: bytes, *args: Any) -> tuple:
        def host(*arrays: Any) -> tuple:
            return tuple(np.asarray(a, np.float32) for a in jax_hlo_runner(prog, *arrays))

        shape = jax.ShapeDtypeStruct(tuple(args[0].shape), np.float32)
        return jax.pure_callback(host, (shape,) * (1 + num_slots), *args)

    return (("hlo_runner", runner), ("takes_learning_rate", n_params == 3 + num_slots))
