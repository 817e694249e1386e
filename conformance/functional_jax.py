"""The embedding conformance suite through ``me.jax`` (jitted): the ``jax-functional`` entry.

``me.jax`` is a front end, not a backend, so it is certified by an engine-like wrapper:
for ``backend_name == "jax-functional"`` the conftest swaps ``me.TPUEmbedding`` for
:class:`FunctionalEngine` (the backend under it is the registry's ``jax``), and the tests
run unchanged. On a JAX backend the wrapper's

* ``enqueue`` also runs ``me.jax.prepare`` on the same inputs: both accept, or both raise the
  same error class with the same message (``prepare`` validates "exactly as enqueue does");
* ``dequeue`` returns ``jax.jit(me.jax.lookup)``'s activations;
* ``apply_gradients`` keeps the state ``jax.jit(me.jax.apply_gradients)`` returns;

and each step also runs the engine's own path on the same state and asserts that both give
the same bits (activations, every table and slot, the step counter). The engine's checks
(order of calls, NaN gradients, learning rates) stay the engine's: ``me.jax`` cannot check
values inside jit. Only ``conformance/test_engine*.py`` run here; the backend-protocol and
dense-optimizer tests would repeat the ``jax`` entry exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshembed.config.rowwise import slot_width
from meshembed.embedding import step as steps
from meshembed.embedding.batch import resolve_mode
from meshembed.embedding.engine import TPUEmbedding
from meshembed.errors import CapacityError, ConfigError, MeshembedError

NAME = "jax-functional"
#: The registry backend underneath.
INNER = "jax"
SKIP_REASON = ("me.jax is an embedding front end: only conformance/test_engine*.py run through it "
               "(the backend-protocol and dense tests would repeat the 'jax' entry)")


def covers(nodeid: str) -> bool:
    """Whether a conformance test runs on ``jax-functional`` (else it is skipped)."""
    return "/test_engine" in nodeid.replace("\\", "/") or nodeid.startswith("test_engine")


_JIT: dict[str, Any] = {}


def _jitted() -> tuple[Any, Any]:
    """``jax.jit(me.jax.lookup)`` and ``jax.jit(me.jax.apply_gradients)`` (made once: their
    trace caches persist across tests; a state's static part is cached per engine)."""
    if not _JIT:
        import jax

        from meshembed_jax import frontend as api

        _JIT["lookup"] = jax.jit(api.lookup)
        _JIT["apply"] = jax.jit(api.apply_gradients)
    return _JIT["lookup"], _JIT["apply"]


def _same_bits(got: Any, want: Any, what: str) -> None:
    """Bit for bit (NaN where NaN, the sign of zero), on any device count and either path
    (``MESHEMBED_JAX_FUSED=0`` too): me.jax runs the engine's programs with the engine's
    values (runtime scalars of the canonical dtype; the fused kernel's double block) and
    the engine's row-piece shapes."""
    got, want = np.asarray(got), np.asarray(want)
    ok = (got.shape == want.shape and got.dtype == want.dtype
          and np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want)))
    if not ok:
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64)) if got.shape == want.shape else None
        raise AssertionError(f"me.jax and TPUEmbedding(jax) differ in {what}: shapes {got.shape}/{want.shape}, "
                             f"dtypes {got.dtype}/{want.dtype}, max |diff| "
                             f"{None if diff is None else np.nanmax(diff) if diff.size else 0}")


class FunctionalEngine(TPUEmbedding):
    """``TPUEmbedding`` whose steps on a JAX backend run through jitted ``me.jax`` (see the
    module docstring); on any other backend it is the plain engine (the tests' references)."""

    def _functional(self) -> bool:
        from meshembed_jax.backend import JaxBackend

        return isinstance(self.backend, JaxBackend)

    def _fstate(self) -> Any:
        """The engine's arrays as an ``EmbeddingState`` with a static part kept per engine
        (the jitted calls retrace only when the shard layouts change, e.g. never)."""
        from meshembed_jax import frontend as api

        try:
            state = api.from_engine(self)  # ConfigError for what me.jax does not support
        except ConfigError as exc:
            if "needs every table on the same devices" in str(exc):  # a tiny table on 8 devices
                import pytest

                pytest.xfail(f"[{NAME}] me.jax refuses tables on different device sets (one jitted step "
                             f"takes them all; the engine caps a default shard count per table): {exc}")
            raise
        cached = getattr(self, "_fstatic", None)
        if cached is None or cached.shard_layouts != state._static.shard_layouts:
            self._fstatic = cached = state._static
        return api.EmbeddingState(state.tables, state.step, cached)

    def enqueue(self, features: Any, weights: Any = None, *, training: bool | None = None,
                mode_override: str | None = None) -> None:
        if not self._functional():
            return super().enqueue(features, weights, training=training, mode_override=mode_override)
        from meshembed_jax import frontend as api

        resolve_mode(self.layout, training, mode_override)  # the engine's own mode and order errors first
        self._check_can_enqueue()
        try:
            batch, prepared = api.prepare(self.config, features, weights), None
        except MeshembedError as exc:
            batch, prepared = None, exc
        try:
            super().enqueue(features, weights, training=training, mode_override=mode_override)
        except MeshembedError as exc:
            if prepared is None or type(prepared) is not type(exc) or str(prepared) != str(exc):
                raise AssertionError(f"enqueue raised {type(exc).__name__}: {exc}\nbut me.jax.prepare "
                                     f"{'accepted the batch' if prepared is None else repr(prepared)}") from exc
            raise
        if prepared is not None:
            raise AssertionError(f"enqueue accepted the batch but me.jax.prepare raised {prepared!r}")
        self._jax_batch = (self.pending, self._engine_capacity(features, weights) or batch)

    def _engine_capacity(self, features: Any, weights: Any) -> Any:
        """The batch again with each table's ``unique_capacity`` set to the one the engine's
        update compiles with (None when that bound is too small for this batch).

        Why: the XLA step applies the optimizer to pieces of the unique rows sized by that
        bound, and XLA:CPU compiles the elementwise math per piece shape: the same HLO ops on
        [11, 3] and [8, 3] pieces gave non-lazy Adam 1 ulp apart (measured; not reproduced
        outside the update loop, mechanism unknown). On the fused CPU kernels the bound
        changes nothing. A user of me.jax alone
        picks the bound; here it is the engine's, so the two are compared on one program."""
        from meshembed_jax import frontend as api

        sizes = {}
        for f, d in zip(self.layout.features, self.pending.features):
            sizes[f.table] = sizes.get(f.table, 0) + int(d.ids.shape[0])
        caps = {t.name: max(1, self.backend.capacity_for(self.state.tables[t.index][0].layout, sizes[t.index]))
                for t in self.layout.tables if sizes.get(t.index)}
        try:
            return api.prepare(self.config, features, weights, unique_capacity=caps)
        except CapacityError:
            pass
        # prepare's check counts the distinct ids of all devices (a bound on each device's);
        # the engine's capacity is per device and, for <= 1024 ids, min(ids, rows per device):
        # it holds every device's distinct rows by construction, so the bound is safe to use
        if max(sizes.values()) > 1024:
            return None
        b = api.prepare(self.config, features, weights)
        return api.Batch(b.ids, b.slots, b.scale, b.features,
                         tuple(caps.get(t.name) for t in self.layout.tables))

    def _batch_of_pending(self) -> Any:
        """The me.jax batch prepared beside the engine's pending one (None: enqueued another way)."""
        held = getattr(self, "_jax_batch", None)
        return held[1] if held is not None and held[0] is self.pending else None

    def dequeue(self) -> Any:
        want = super().dequeue()  # the engine's state checks; the pending batch is marked read
        if not self._functional():
            return want
        lookup, _ = _jitted()
        got = lookup(self._fstate(), self._batch_of_pending())
        keys = self.layout.keys
        pairs = zip(keys, keys) if keys else enumerate(f.name for f in self.layout.features)
        out = [None] * len(self.layout.features) if not keys else {}
        for k, name in pairs:
            _same_bits(got[name], want[k], f"the activations of {name!r}")
            out[k] = got[name]
        return out

    def apply_gradients(self, gradients: Any, learning_rates: Any = (), *, allow_nonfinite: bool | None = None) -> None:
        if not self._functional():
            return super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        from meshembed_jax.table import JaxShardedTable

        # the engine's checks (me.jax cannot check values inside jit): they raise before anything runs
        self._check_can_apply()
        allow = self.allow_nonfinite if allow_nonfinite is None else bool(allow_nonfinite)
        grads = steps.check_gradients(self.backend, self.layout, gradients, check_now=not allow)
        lrs = steps.check_learning_rates(self.layout, learning_rates, self.backend)
        batch = self._batch_of_pending()
        state = self._fstate()
        if batch is None:  # enqueued another way (e.g. enqueue_batch): the engine's path only
            return super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        shaped = [g.reshape(f.output_shape + (self.layout.tables[f.table].dimension,))
                  for f, g in zip(self.layout.features, grads)]
        _, apply = _jitted()
        new = apply(state, batch, shaped, list(lrs))  # not donated: the engine's step reads the same arrays
        import jax

        jax.block_until_ready(new)  # done reading them before the engine's kernels donate them
        super().apply_gradients(gradients, learning_rates, allow_nonfinite=allow_nonfinite)
        st = new._static
        tables = {}
        for t in self.layout.tables:
            names = st.names[t.index]
            for n, old in zip(names, self.state.tables[t.index]):
                _same_bits(new.tables[t.name][n], old.data, f"table {t.name!r} {n!r} after step {self.step}")
            tables[t.index] = [JaxShardedTable(new.tables[t.name][n], st.shard_layouts[t.index],
                                             slot_width(t.optimizer, n, t.dimension))
                               for n in names]
        self.state = self.state.replace(tables)
        if int(new.step) != self.step:
            raise AssertionError(f"me.jax step counter {int(new.step)} != the engine's {self.step}")
