"""Low-precision tables on JAX (docs/low_precision.md): the engine's update of a 16-bit table
(``meshembed.embedding.precision.update_table``) as one compiled program, shared by the JAX
engine (:meth:`JaxBackend.update_low_precision`) and me.jax (``frontend/step.py``: traced into the
user's ``jax.jit``, or jitted once per table and shapes when called eagerly).

The program: the per-id gradient rows summed per unique id (the engine's ``segment_sum``
program: sorted unique ids, as ``np.unique``), the rows of every array gathered and widened,
``meshembed.math.apply_rule`` on *sealed* arrays (:mod:`.exact`: each float operation rounds
once, as NumPy runs it op by op), the Philox words keyed by seed, table and array and counted
by column, row id and the step (a program input), each 16-bit array rounded and scattered
back. Padding ids are -1 and are written nowhere; with ``guard`` false no id is.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshembed.config.precision import array_dtypes
from meshembed.errors import ConfigError
from meshembed.math import rounding
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed_jax import kernels
from meshembed_jax.distributed import ShardLayout
from meshembed_jax.kernels import exact

__all__ = ["counters", "engine_update", "materialized", "update", "update_compiled"]

_PROGRAMS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class Inexact(ConfigError):
    """The rule meets a traced scalar with another scalar (see :class:`exact.ScalarArithmetic`)."""


def counters(uniq: Any, step: Any, dim: int) -> tuple:
    """``rounding.counters`` from traced ids and step: ``(column group, row mod 2**32,
    row // 2**32, step mod 2**32)`` as ``[n, ceil(dim / 4)]`` int32 limb pairs (the layout of
    ``rounding.random_words``). They enter the words' loop (:func:`materialized`) from outside,
    as the engine's host-made arrays entered its compiled words program (XLA:CPU ran 10 rounds
    fed by broadcasts over 1000x slower)."""
    groups = -(-int(dim) // 4)
    shape = (int(uniq.shape[0]), groups)
    u = uniq.reshape(-1, 1)

    def limbs(x: Any) -> tuple:
        return (jnp.broadcast_to((x & 0xFFFF).astype(jnp.int32), shape),
                jnp.broadcast_to(((x >> 16) & 0xFFFF).astype(jnp.int32), shape))

    high = (u >> 32) if u.dtype.itemsize == 8 else jnp.zeros_like(u)  # int32 ids (no x64): below 2**31
    col = jnp.broadcast_to(jnp.arange(groups, dtype=jnp.int32), shape)
    return ((col, jnp.zeros(shape, jnp.int32)), limbs(u), limbs(high), limbs(jnp.asarray(step).reshape(1, 1)))


def materialized(fn: Callable, zero: Any, *args: Any) -> Any:
    """``fn(*args)`` as the body of a ``while`` loop that runs once (a runtime trip count: XLA
    cannot unroll it), so its results are buffers no consumer fuses into. The Philox words
    need it: fused into their consumer (the interleave and the rounding), XLA:CPU recomputed
    the 10 rounds per element (measured: a bf16 SR step of 4096 ids x 32 columns took 4.3 s;
    ``optimization_barrier`` does not stop it on CPU, XLA drops the barrier before fusion)."""
    shapes = jax.eval_shape(fn, *args)
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    trips = 1 - jnp.asarray(zero, jnp.int32)  # 1 (zero is 0), unknown to the compiler
    _, out = jax.lax.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, fn(*args)), (jnp.int32(0), init))
    return out


def update(be: Any, sl: ShardLayout, t: Any, rule: UpdateRule, datas: tuple, values: tuple, guard: Any, ids: Any,
           grads: Any, step: Any, cap: int, widths: Sequence[int], zero: Any = None) -> tuple:
    """``precision.update_table`` traced (any caller's trace): ``datas`` the table's
    ``[params, *slots]`` storage arrays (``sl``'s layout, ``widths`` columns each), ``ids``
    and ``grads`` the per-id rows (padding id -1), at most ``cap`` distinct ids, ``step`` a
    program input (the counter of the random bits, and, as ``min(step, 0)``, the runtime zero
    of the sealed math unless ``zero``, an int32 zero that is a program input, is given).
    Raises :class:`Inexact` where a traced value meets another scalar in the rule."""
    dim = t.dimension
    xp, p, dtypes = be.xp, t.precision, array_dtypes(t)
    n = int(ids.shape[0])
    seg = be._kernel(("segment_sum", n), lambda: kernels.make_segment_sum(n))
    uniq, sums, _ = seg(ids, grads)
    cap = max(1, min(int(cap), n, t.vocabulary_size))
    idt = kernels.index_dtype(sl)
    uniq = jnp.where(guard, uniq[:cap], -1).astype(idt)
    sums = sums[:cap]
    stored = [be._kernel(("lookup", sl, w), lambda w=w: kernels.make_lookup(sl, w))(d, uniq)
              for d, w in zip(datas, widths)]
    rows = [r if d == "float32" else rounding.widen(be, r, d) for r, d in zip(stored, dtypes)]
    # the optimizer op by op, as NumPy runs it (exact.py: no fused multiply-add, no rewrite
    # across operations, divisions and powers correctly rounded); a runtime zero: the step
    # counter is an input of the program (a constant step would let XLA fold the seals)
    # (XLA's range analysis folds min(step & 0x7FFFFFFF, 0) to 0: measured, the seals vanished;
    # the engine passes a zero of its own, as an input, so its counter may pass 2**31)
    zero = jnp.minimum(jnp.asarray(step), 0) if zero is None else zero
    try:
        with kernels.traced_rule_errors(rule, "me.jax", "train this table with me.TPUEmbedding"):
            new = exact.call(lambda xp_, vals, g, *r: apply_rule(xp_, rule, vals, g, *r), xp, zero, tuple(values),
                             sums, *rows)
    except exact.ScalarArithmetic as exc:
        raise Inexact(
            f"Table {t.name!r} ({type(t.optimizer).__name__}, low-precision storage): me.jax cannot give the "
            f"engine's bits with a dynamic value in this rule: the rule combines it with another scalar before "
            f"any row ({exc}; e.g. a dynamic learning rate times the weight decay), which the engine computes in "
            "double from the Python float it holds, and a traced value is float32 here. Nothing was changed. "
            "Fix: a constant learning rate in the config for this table, or train it with "
            "me.TPUEmbedding(config, backend='jax').") from None
    ctr = None
    out = []
    for k, (data, row, dtype, w) in enumerate(zip(datas, new, dtypes, widths)):
        if dtype != "float32":
            random = None
            if p.rounding == "stochastic":
                ctr = counters(uniq, step, dim) if ctr is None else ctr
                stream = rounding.stream_of(t.index, k)
                words = materialized(lambda c, stream=stream: tuple(rounding.philox_words(xp, p.seed, stream, c)),
                                     zero, ctr)
                random = rounding.interleave(xp, words, dim)
            row = rounding.narrow(be, row, dtype, p.rounding, random)
        write = be._kernel(("scatter", sl, w), lambda w=w: kernels.make_scatter(sl, w))
        out.append(write(data, uniq, row))
    return tuple(out)


def update_compiled(be: Any, cache: dict, sl: ShardLayout, t: Any, rule: UpdateRule, datas: tuple, values: tuple,
                    guard: Any, ids: Any, grads: Any, step: Any, cap: int, widths: Sequence[int],
                    donate: bool = False, zero: Any = None) -> tuple:
    """:func:`update` jitted once per table, capacity and constants (``cache``: the caller's
    dict of programs; jit itself keys the shapes). Python-number values stay constants of the
    program, as a config's constants inside a user's jit; array values (dynamic rates) are
    inputs. ``donate``: the storage arrays are donated (the engine's tables; not a user's)."""
    arrays = tuple(i for i, v in enumerate(values) if not isinstance(v, (int, float)))
    constants = tuple(None if i in arrays else float(v) for i, v in enumerate(values))
    key = (t.index, sl, int(cap), constants, arrays, tuple(widths), donate)
    fn = cache.get(key)
    if fn is None:
        def program(datas: tuple, dyn: tuple, guard: Any, ids: Any, grads: Any, step: Any, zero: Any) -> tuple:
            vals = list(constants)
            for i, v in zip(arrays, dyn):
                vals[i] = v
            return update(be, sl, t, rule, datas, tuple(vals), guard, ids, grads, step, cap, widths, zero)

        fn = cache[key] = jax.jit(program, donate_argnums=(0,) if donate else ())
    return fn(datas, tuple(values[i] for i in arrays), guard, ids, grads, step, zero)


def _weak(x: float) -> Any:
    """A Python float as a runtime weakly-typed float32 scalar (how JAX converts the engine's
    float where it meets a float32 row)."""
    try:
        from jax._src.lax.lax import _convert_element_type

        return _convert_element_type(np.float32(x), jnp.float32, weak_type=True)
    except Exception:  # pragma: no cover - private API moved
        return jnp.asarray(x, jnp.float32)


def _dynamic_rate(t: Any) -> bool:
    return type(getattr(t.optimizer, "learning_rate", None)).__name__ == "DynamicLearningRate"


def engine_update(be: Any, tables: Sequence[Any], t: Any, rule: UpdateRule, values: Sequence[Any],
                  host_ids: np.ndarray, row_grads: Any, step: int, guard: Any) -> list | None:
    """The JAX engine's low-precision update (``Backend.update_low_precision``): :func:`update`
    compiled once per table, capacity and id bucket, on one device or several. ``None`` where
    the generic path must run (several processes; a dynamic value meeting another scalar)."""
    if be.processes > 1:
        return None
    sl = tables[0].layout
    if any(tb.layout != sl for tb in tables):
        return None
    n = int(host_ids.size)
    count = int(np.unique(host_ids).size)
    gids, grows, _, _ = be._global_batch(sl, host_ids, row_grads)
    nb = int(gids.shape[0])
    cap = min(max(16, 1 << max(0, count - 1).bit_length()), nb, t.vocabulary_size)
    assert cap >= count and nb >= n
    # a dynamic rate changes every step: a runtime input (as a traced rate in me.jax), so one program
    values = tuple(_weak(v) if _dynamic_rate(t) and isinstance(v, (int, float)) else v for v in values)
    del guard  # update_table wrote nothing where it was false; here it is true
    g = jnp.asarray(True)
    # programs per table object (the engine's tables keep their wrapper objects across steps;
    # another engine on the same backend, with other dtypes or rules, has its own)
    cache = _PROGRAMS.setdefault(tables[0], {})
    widths = [int(tb.shape[1]) for tb in tables]
    datas = tuple(tb.data for tb in tables)
    ctr = np.asarray(np.uint32(int(step) % (1 << 32))).view(np.int32)
    if cache.get("inexact"):
        return None
    try:
        out = update_compiled(be, cache, sl, t, rule, datas, values, g, gids, grows, ctr, cap, widths, donate=True,
                              zero=np.int32(0))
    except Inexact:  # found while tracing (nothing ran, nothing donated): the generic path, from now on
        cache["inexact"] = True
        return None
    for tb, data in zip(tables, out):
        tb.data = data
    return list(tables)
