"""Low-precision tables on torch (docs/low_precision.md): the rule's float32 math of a 16-bit
table's update (``Backend.apply_rule_rows``, between the core's widening and rounding in
``meshembed.embedding.precision.update_table``) with NumPy's bits.

Run op by op with torch, the rule's float math is not NumPy's in every rule (measured:
``torch.pow`` is not libm's ``powf``; 8 optimizers left float32 slot values a last bit off).
So the rows run through the generated C++ row kernel (:mod:`.fused_cpu`, NumPy's bits for
``+ − × ÷ sqrt``) over ``[n, D]`` float32 rows ``0..n-1`` (each row once: the driver's sum is the
summed gradient itself). A kernel that calls pow/exp/log is not NumPy's there (its float32
versions are its own, within 1 ulp; measured: AdagradMomentum's ``pow(x, -1/2)`` left 7-15
``momenta`` values a bit off), so for such a rule — and with the fused kernels off, or for a
rule without a generated kernel — NumPy's own ``apply_rule`` runs on zero-copy NumPy views of
the rows (the NumPy backend's computation). ``None`` (torch operations) elsewhere: rows or
gradients not float32 on the CPU, a value that is not a Python number (the kernel takes
doubles; NumPy treats a Python float as a weak scalar), a rule not computed in float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from meshembed.math.rule import UpdateRule, apply_rule
from meshembed_torch import fused_cpu

__all__ = ["rule_rows"]

#: Operations whose float32 results in the generated kernels are the kernels' own (codegen.py:
#: within 1 ulp of the correctly rounded result), not NumPy's (libm ``powf``, NumPy's exp/log).
_LIBM = ("pow", "exp", "log")


def _numpy_xp() -> Any:
    import array_api_compat.numpy as xp

    return xp


def rule_rows(be: Any, rule: Any, values: Sequence[Any], grads: Any, rows: Sequence[Any]) -> list | None:
    """The rule's new rows with NumPy's bits (see the module docstring), or None."""
    torch = be._torch
    if not isinstance(rule, UpdateRule) or rule.dtype != "float32" or any(type(v) not in (int, float) for v in values):
        return None
    if any(a.dtype != torch.float32 or a.device.type != "cpu" for a in (grads, *rows)) or grads.dim() != 2:
        return None
    grads = grads.contiguous()
    rows = [r.contiguous() for r in rows]
    n = int(grads.shape[0])
    kernel = fused_cpu.kernel_for(rule, values, rows, grads, n, None, None) if be.fused else None
    if kernel is None or any(node.op in _LIBM for node in kernel[0].graph.nodes):
        new = apply_rule(_numpy_xp(), rule, values, grads.numpy(), *(r.numpy() for r in rows))
        be._stats["numpy_low_precision_updates"] += 1
        return [torch.from_numpy(np.ascontiguousarray(r, dtype=np.float32)) for r in new]
    # rows 0..n-1, each once: the kernel's sum (from zero) is grads itself; written in place
    fused_cpu.update(kernel, torch.arange(n, dtype=torch.int64), grads, None, None, rows, torch.get_num_threads())
    be._stats["fused_low_precision_updates"] += 1
    return rows
