"""Low-precision tables on torch (docs/low_precision.md): the engine's update of a 16-bit table
(``meshembed.embedding.precision.update_table``) with the optimizer's float32 math in the
generated C++ row kernel (:mod:`.fused_cpu`) instead of torch operations.

Run op by op with torch, the generic path's float math is not NumPy's in every rule (measured:
``torch.pow`` is not libm's ``powf``; 8 optimizers left float32 slot values a last bit off).
The generated row kernels are checked bit for bit against the NumPy reference in float32
(conformance/test_fused_kernels.py), so here the generic path's steps run unchanged — the
per-id gradient rows summed per unique id (``Backend.segment_sum``), the rows of every array
gathered and widened to float32, each 16-bit array rounded with the same Philox words (keyed
by seed, table and array, counted by column, row id and step) and scattered back — and only
the rule in between is the kernel, over ``[n_unique, D]`` float32 temporaries with rows
``0..n_unique-1`` (each row once: the driver's sum is the summed gradient itself). A kernel
that calls pow/exp/log is not NumPy's there (its float32 versions are its own, within 1 ulp;
measured: AdagradMomentum's ``pow(x, -1/2)`` left 7-15 ``momenta`` values a bit off), so for
such a rule NumPy's own ``apply_rule`` runs on zero-copy NumPy views of the temporaries (the
NumPy backend's computation of the same rows).

With the fused kernels off (``MESHEMBED_TORCH_FUSED=0``) or for a rule without a generated
kernel (a user-defined program), NumPy's ``apply_rule`` runs the same way. ``None`` (the generic
path, torch operations) elsewhere: a device other than the CPU, tables sharded over processes,
a rule not computed in float32, a value that is not a Python number (the kernel takes doubles;
NumPy treats a Python float as a weak scalar), gradients that are not float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from meshembed.config.precision import array_dtypes
from meshembed.math import rounding
from meshembed.math.rounding import counters, words_for
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed_torch import fused_cpu

__all__ = ["engine_update"]

#: Operations whose float32 results in the generated kernels are the kernels' own (codegen.py:
#: within 1 ulp of the correctly rounded result), not NumPy's (libm ``powf``, NumPy's exp/log).
_LIBM = ("pow", "exp", "log")


def _numpy_xp() -> Any:
    import array_api_compat.numpy as xp

    return xp


def engine_update(be: Any, tables: Sequence[Any], t: Any, rule: UpdateRule, values: Sequence[Any],
                  host_ids: np.ndarray, row_grads: Any, step: int, guard: Any) -> list | None:
    """The torch engine's low-precision update (``Backend.update_low_precision``), or None."""
    torch = be._torch
    if guard is not None and not bool(guard):  # update_table asks only when true; write nothing
        return list(tables)
    if (be.processes > 1 or be.device.type != "cpu" or not tables
            or any(tb.group is not None or tb.data.device.type != "cpu" for tb in tables)):
        return None
    if not isinstance(rule, UpdateRule) or rule.dtype != "float32":
        return None
    if any(type(v) not in (int, float) for v in values):
        return None
    dtypes = array_dtypes(t)
    if len(dtypes) != len(tables):
        return None
    host_ids = np.asarray(host_ids, dtype=np.int64).reshape(-1)
    if host_ids.size == 0:
        return list(tables)
    # the generic path's sums and ids (update_table: segment_sum, then np.unique as counters)
    uids, grads = be.segment_sum(be.asarray(host_ids, dtype="int64"), row_grads)
    if grads.dtype != torch.float32 or grads.device.type != "cpu" or grads.dim() != 2:
        return None
    grads = grads.contiguous()
    unique = np.unique(host_ids)
    n = int(unique.shape[0])
    rows = [rounding.widen(be, be.gather(a, uids), d).contiguous() for a, d in zip(tables, dtypes)]
    if any(r.dtype != torch.float32 for r in rows):
        return None
    kernel = fused_cpu.kernel_for(rule, values, rows, grads, n, None, None) if be.fused else None
    if kernel is None or any(node.op in _LIBM for node in kernel[0].graph.nodes):
        # no kernel (fused kernels off, a user-defined program), or one whose float32
        # pow/exp/log are its own (within 1 ulp), not NumPy's: NumPy's own apply_rule on the
        # same rows (zero-copy views), the NumPy backend's computation
        new = apply_rule(_numpy_xp(), rule, values, grads.numpy(), *(r.numpy() for r in rows))
        rows = [torch.from_numpy(np.ascontiguousarray(r, dtype=np.float32)) for r in new]
        be._stats["numpy_low_precision_updates"] += 1
    else:
        # rows 0..n-1 of the temporaries, each once: the kernel's sum (from zero) is grads itself
        fused_cpu.update(kernel, torch.arange(n, dtype=torch.int64), grads, None, None, rows,
                         torch.get_num_threads())
        be._stats["fused_low_precision_updates"] += 1
    xp = be.xp
    p = t.precision
    out = []
    for k, (array, row, dtype) in enumerate(zip(tables, rows, dtypes)):
        if dtype != "float32":
            random = None
            if p.rounding == "stochastic":
                random = words_for(xp, p.seed, rounding.stream_of(t.index, k),
                                   counters(xp, unique, step, t.dimension, row.device), t.dimension)
            row = rounding.narrow(be, row, dtype, p.rounding, random)
        out.append(be.scatter(array, uids, row))
    return out
