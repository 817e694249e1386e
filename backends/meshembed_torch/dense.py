"""Dense mesh support of the Torch backend: ``DeviceMesh`` + DTensor placements, autograd.

Mixed into ``TorchBackend`` so the dense optimizer (``me.Variable``, ``me.optimizers``)
can place variables and slots on a mesh and take gradients without knowing torch.

Single process (no ``torch.distributed`` process group initialised): there is no
``DeviceMesh`` to build, so ``make_mesh`` returns ``None`` and the mesh is *logical*, exactly
as on NumPy: every value is a plain ``torch.Tensor`` holding the whole array and
``sharding_of`` returns ``None``. With a process group, the mesh is a real ``DeviceMesh``
over all ranks and values become ``DTensor``s with ``Shard(axis)``/``Replicate()``.

torch is imported inside the methods (this module imports without it, like the rest of the
package, so discovery can report a missing install instead of failing to import).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from meshembed.backend.protocol import call_values
from meshembed.errors import ConfigError, InputError
from meshembed.math.rule import UpdateRule


def _dist_ready() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_dtensor(value: Any) -> bool:
    if not hasattr(value, "device_mesh"):  # plain tensors and arrays: no import, no check
        return False
    import torch

    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


class TorchDenseMixin:
    """``make_mesh`` / ``place`` / ``sharding_of`` / ``value_and_grad`` for torch."""

    def make_mesh(self, dim_names: Sequence[str], shape: Sequence[int], devices: Any = None) -> Any:
        """A ``DeviceMesh`` over all ranks, or ``None`` (logical mesh) in a single process.

        ``devices`` is the device type (``"cpu"``, ``"cuda"``); by default ``"cuda"`` when
        the process group runs NCCL, else ``"cpu"``.
        """
        import torch

        if not _dist_ready():
            if math.prod(shape) > 1:  # it would silently leave every variable unsharded
                raise ConfigError(
                    f"Invalid `shape`. A torch mesh of shape {tuple(shape)} needs {math.prod(shape)} "
                    "torch.distributed ranks, but no process group is initialised (one process). Fix: "
                    "call torch.distributed.init_process_group(...) first (e.g. under torchrun), or use "
                    "a mesh of size 1 (or no mesh) in a single process."
                )
            return None
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        if math.prod(shape) != world:
            raise ConfigError(
                f"Invalid `shape`. Expected the mesh size (product of shape) to equal the "
                f"torch.distributed world size {world}. Received: shape={tuple(shape)}"
            )
        if devices is None:
            devices = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        elif isinstance(devices, torch.device):
            devices = devices.type
        if not isinstance(devices, str):
            raise ConfigError(
                "Invalid `devices`. Expected a torch device type such as 'cpu' or 'cuda' "
                f"(the process group decides which devices). Received: devices={devices!r}"
            )
        return init_device_mesh(devices, tuple(int(s) for s in shape), mesh_dim_names=tuple(dim_names))

    def _placements(self, layout: Any) -> tuple[Any, ...]:
        from torch.distributed.tensor import Replicate, Shard

        specs = tuple(layout.sharding_specs)
        out = []
        for name in layout.mesh.dim_names:
            out.append(Shard(specs.index(name)) if name in specs else Replicate())
        return tuple(out)

    def place(self, value: Any, layout: Any) -> Any:
        """A DTensor with the layout's placements on its mesh (a plain tensor when the mesh
        is logical). The value must be the same global array on every rank."""
        import torch

        native = None if layout is None else layout.mesh.native
        if native is None:
            if _is_dtensor(value):
                return value.full_tensor()
            return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        placements = self._placements(layout)
        if _is_dtensor(value):
            if value.device_mesh == native and tuple(value.placements) == placements:
                return value
            return value.redistribute(native, placements)
        from torch.distributed.tensor import distribute_tensor

        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        return distribute_tensor(tensor.detach(), native, placements)

    def sharding_of(self, value: Any) -> Any:
        """``(DeviceMesh, placements)`` of a DTensor; ``None`` for a plain tensor."""
        if _is_dtensor(value):
            return (value.device_mesh, tuple(value.placements))
        return None

    # -- the dense optimizer's step ------------------------------------------------------------
    def step_values(self, values: Sequence[float], like: Any) -> tuple:
        """0-d tensors of ``like``'s dtype: ``torch.compile`` specialises on Python floats
        (a guard per value), tensors are inputs, so a new learning rate recompiles nothing."""
        return call_values(self.xp, values, like)

    def finite_guard(self, arrays: Sequence[Any]) -> Any:
        """One C pass over every CPU float tensor (:func:`meshembed_torch.native.all_finite`:
        W2's 64 gradients in one call instead of two torch reductions each); else the default."""
        import torch

        from meshembed_torch import native

        ok = native.all_finite(list(arrays), torch.get_num_threads()) if self.fused else None  # type: ignore[attr-defined]
        return super().finite_guard(arrays) if ok is None else torch.tensor(ok)  # type: ignore[misc]

    def in_place_group(self, rule: UpdateRule) -> int:
        """Every staged tensor in one call where the generated kernel runs (one C call with
        OpenMP, no compile time); else the default groups of the compiled core function."""
        from meshembed_torch import native

        if self.fused and native.dense_kernel_for(rule) is not None:  # type: ignore[attr-defined]
            return 64
        return super().in_place_group(rule)  # type: ignore[misc]

    def compile_update(self, rule: UpdateRule, count: int) -> Callable[..., Any]:
        """The generated row kernel of ``rule`` over the ``count`` tensors in one call
        (:mod:`meshembed_torch.native`: CPU tensors of the rule's dtype), written in place;
        otherwise the core function compiled in place (``Backend.compile_update``), whose
        values are 0-d tensors so a new learning rate recompiles nothing."""
        import torch

        from meshembed_torch import native

        fallback = super().compile_update(rule, count)  # type: ignore[misc]
        kernel = native.dense_kernel_for(rule) if self.fused else None  # type: ignore[attr-defined]
        if kernel is None:
            return fallback

        def run(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> None:
            prepared = native.dense_pointers(kernel, grads, targets)  # checked and collected in one loop
            if prepared is None:
                return fallback(grads, values, *targets)
            native.dense_update(kernel, grads, values, targets, torch.get_num_threads(), prepared)
            self._stats["fused_dense_updates"] += 1
            return None

        return run

    def value_and_grad(self, fn: Callable[..., Any], values: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Loss and d loss / d values by torch autograd, on detached copies so the caller's
        tensors never join a graph. Values the loss does not use get zero gradients. A
        non-scalar loss is summed first (what tf.GradientTape and tf_keras do)."""
        import torch

        leaves = [v.detach().requires_grad_(True) for v in values]
        with torch.enable_grad():
            loss = fn(*leaves)
            if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
                raise InputError(
                    "Invalid `loss`. Expected a callable returning a floating tensor (a non-scalar one is "
                    f"summed). Received: loss value of type {type(loss).__name__}"
                    + (f" with dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else "")
                )
            loss = loss.sum() if loss.dim() else loss
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        out = [torch.zeros_like(v) if g is None else g.detach() for v, g in zip(leaves, grads)]
        return loss.detach(), out
