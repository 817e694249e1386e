"""The Backend protocol: what a backend must supply (storage, movement, compilation).

A backend never holds optimizer math. It stores sharded row tables and dense arrays,
gathers/scatters rows, sums duplicate ids, routes data between shards or ranks and
compiles the core's pure functions. The engine and the dense optimizer call only this.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from meshembed.errors import InputError, NonFiniteError
from meshembed.math.rule import UpdateRule, apply_rule
from meshembed.sharding.placement import Placement

Array = Any  # a backend's own array type (np.ndarray, torch.Tensor, jax.Array, cupy.ndarray)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; tests and the engine branch on these, never on names."""

    devices: int = 1
    float64: bool = True
    in_place: bool = True
    deterministic_scatter: bool = True
    autodiff: bool = False
    compiles: bool = False
    distributed: bool = False
    #: ``hlo_program`` supplies UserDefinedProgram's HLO runner (the core has none).
    runs_hlo: bool = False
    #: ``update_rows`` takes ``guard`` (from ``finite_guard``) and writes nothing where it
    #: is false, without waiting for it: the engine's NaN/Inf check then costs no sync.
    guarded_updates: bool = False
    #: ``update_rows`` takes ``grad_index`` / ``grad_weights`` (the combiner's backward pass
    #: fused into the update; the protocol's default does).
    grad_index_updates: bool = True
    #: ``gather`` takes ids of any shape and returns ``ids.shape + (D,)``, and ``update_rows``
    #: without ``grad_index`` takes one gradient row per id as ``[..., D]``: the engine then
    #: passes per-id (sequence) features in their own shape. Where an eager reshape copies
    #: (JAX), that saves two copies of every row per step.
    shaped_rows: bool = False
    #: ``update_rows`` takes ``check_finite=True``: it then raises
    #: :class:`~meshembed.errors.NonFiniteError`, having written nothing, when any element of
    #: ``grads`` is NaN or Inf (every row, whether an id reads it or not). The engine then
    #: leaves the check of the gradients it passes unchanged to that call (torch: done while
    #: the fused kernel sums them, saving a pass over the gradients). Single process only;
    #: not used where ``guarded_updates`` (the guard covers every gradient).
    checked_updates: bool = False
    #: ``update_rows`` (and the dense step of ``compile_update``) run row kernels generated
    #: from the rule (``meshembed_native.codegen``) where they apply, bit-identical to the NumPy
    #: reference and counted in :meth:`Backend.stats` (``fused_updates``,
    #: ``fused_dense_updates``); the constructor's ``fused=False`` turns them off. The fused-kernel
    #: conformance module (``conformance/test_fused_kernels.py``) runs where this is true.
    generated_kernels: bool = False


class ShardedTable(abc.ABC):
    """A ``[vocabulary_size, dim]`` table whose rows are split over shards by a Placement.

    Slots of a table are separate ShardedTables with the same placement (co-sharded).
    """

    placement: Placement

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int]: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> Any: ...


@dataclass(frozen=True)
class RowUpdate:
    """One :meth:`Backend.update_rows` call as data: what :meth:`Backend.apply_update` gets.

    ``tables``: the table and its slots (``rule.slot_names`` order); ``ids`` (may repeat) and
    ``grads`` (one row per id, or per sample with ``grad_index``); ``rule`` and its ``values``
    (``rule.dynamic`` order, not yet checked); ``grad_index`` / ``grad_weights``: id ``i``'s
    gradient is ``grad_weights[i] * grads[grad_index[i]]``; ``guard``: a device boolean,
    false = write nothing; ``check_finite``: NaN/Inf in ``grads`` raise NonFiniteError."""

    tables: tuple[ShardedTable, ...]
    ids: Any
    grads: Any
    rule: UpdateRule
    values: Sequence[Any] = ()
    grad_index: Any = None
    grad_weights: Any = None
    guard: Any = None
    check_finite: bool = False


class Backend(abc.ABC):
    """Base class of every backend. Subclasses are registered under the entry-point group
    ``meshembed.backends`` and instantiated lazily, once per process."""

    name: str = "abstract"
    #: The environment variables (``MESHEMBED_*`` switches) the constructor reads, once: an
    #: instance never reads them again, and ``me.get_backend(name)`` hands out the instance
    #: made under their current values (:mod:`meshembed.backend.registry`).
    environment: tuple[str, ...] = ()

    # -- discovery ---------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when usable here; otherwise why not and what to install."""
        return None

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    def stats(self) -> dict[str, int]:
        """How often this backend instance took each of its fast paths, by name (a copy):
        ``"fused_updates"`` — :meth:`update_rows` calls run by a fused kernel generated from
        the rule (``meshembed_native.codegen``); ``"fused_dense_updates"`` — calls of a
        :meth:`compile_update` function run by one; ``"compiled_calls"`` — calls of a
        :meth:`compile` function that ran compiled, not eagerly. For tests and diagnostics (which path
        ran); a name never counted is absent. The default keeps none."""
        return {}

    @property
    @abc.abstractmethod
    def xp(self) -> Any:
        """The Array-API namespace the core's math runs in (array_api_compat wrapped)."""

    # -- dense arrays ------------------------------------------------------------------
    @abc.abstractmethod
    def asarray(self, x: Any, dtype: Any = None) -> Array:
        """Convert NumPy / Python / own arrays into this backend's arrays.

        ``dtype`` may be a NumPy dtype or a string such as ``"float32"``."""

    @abc.abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray: ...

    def is_native(self, x: Any) -> bool:
        """Whether ``x`` is already this backend's array type."""
        return isinstance(x, np.ndarray)

    def bitcast(self, x: Array, dtype: Any) -> Array:
        """``x``'s bits read as ``dtype``, an integer or float dtype of the same item size
        (``"int32"`` <-> ``"float32"``, ``"int16"`` <-> ``"float16"``): data movement, not math,
        which the Array API standard lacks. Low-precision tables use it to round float32
        values at the bit level (``meshembed.math.rounding``). Backends override it with their
        own reinterpretation (NumPy ``view``, torch ``Tensor.view(dtype)``, JAX
        ``lax.bitcast_convert_type``); this default goes through a NumPy copy."""
        host = np.ascontiguousarray(self.to_numpy(x))
        return self.asarray(host.view(np.dtype(dtype)))

    def real_view(self, x: Array) -> Array:
        """A complex array as its real view ``[..., 2]`` (real part, imaginary part; the
        layout of ``torch.view_as_real``): how the dense optimizer runs a complex variable
        through its real rule (torch.optim's semantics). Default: the standard's
        ``stack(real(x), imag(x))``, a copy; NumPy and torch return a view of the storage
        (:meth:`real_view_aliases`)."""
        xp = self.xp
        return xp.stack([xp.real(x), xp.imag(x)], axis=-1)

    def from_real_view(self, x: Array) -> Array:
        """Inverse of :meth:`real_view`, bit for bit: float32 ``[..., 2]`` -> complex64,
        float64 -> complex128. The Array API standard cannot build a complex array from two
        real ones exactly (``re + 1j·im`` makes the real part NaN where ``im`` is Inf, and
        drops signs of zeros), so this default goes through a NumPy copy."""
        host = np.ascontiguousarray(self.to_numpy(x))
        return self.asarray(host.view(np.complex64 if host.dtype == np.float32 else np.complex128)[..., 0])

    def real_view_aliases(self, x: Array) -> bool:
        """Whether :meth:`real_view` of the complex array ``x`` is a view of its storage
        (writes into it change ``x``), so an in-place dense step may run on it. Default: no."""
        return False

    def is_traced(self, x: Any) -> bool:
        """Whether ``x`` is an abstract value of a trace (a JAX tracer inside ``jax.jit``):
        the stateful engine refuses it rather than storing it. Eager backends: never."""
        return False

    def tracing(self) -> bool:
        """Whether this backend's operations are being staged now (inside ``jax.jit`` even an
        operation on concrete arrays yields a tracer): the stateful engine then refuses the
        call. Asked with one new scalar where the backend traces; eager backends: never."""
        return type(self).is_traced is not Backend.is_traced and self.is_traced(self.xp.zeros(()))

    # -- sharded row tables ------------------------------------------------------------
    @abc.abstractmethod
    def create_table(self, values: np.ndarray, placement: Placement) -> ShardedTable:
        """Place a logical ``[V, D]`` NumPy table over ``placement.num_shards`` shards."""

    def create_table_from_blocks(self, shape: tuple[int, int], blocks: Iterable[np.ndarray],
                                 placement: Placement, dtype: Any = "float32") -> ShardedTable:
        """A ``dtype`` table from consecutive blocks of its logical rows (in order, ``[V, D]``
        in all), so that the whole table need not sit on the host next to the backend's copy:
        the engine makes tables and slots this way (peak memory at creation ≈ the table, not
        2×; a 16-bit table's blocks are its int16 patterns). Backends place each block with
        :meth:`Placement.block_parts`; this default joins the blocks and calls :meth:`create_table`."""
        return self.create_table(join_blocks(shape, blocks, np.dtype(dtype)), placement)

    @abc.abstractmethod
    def unshard(self, table: ShardedTable) -> np.ndarray:
        """The logical ``[V, D]`` table as NumPy (inverse of create_table)."""

    @abc.abstractmethod
    def gather(self, table: ShardedTable, ids: Array) -> Array:
        """Rows ``table[ids]`` for global ids (duplicates allowed), shape ``[len(ids), D]``."""

    @abc.abstractmethod
    def scatter(self, table: ShardedTable, ids: Array, rows: Array) -> ShardedTable:
        """Write ``rows`` at *unique* global ``ids``; returns the (possibly new) table."""

    @abc.abstractmethod
    def segment_sum(self, ids: Array, values: Array) -> tuple[Array, Array]:
        """Sum rows of ``values`` that share an id: returns (unique ids sorted, sums)."""

    @abc.abstractmethod
    def segment_sum_to(self, values: Array, segment_ids: Array, num_segments: int) -> Array:
        """Dense segment sum: ``out[k] = Σ values[i] for segment_ids[i] == k``, shape
        ``[num_segments, ...]`` (the combiner's forward reduction; the Array API has no
        scatter-add)."""

    def all_finite(self, x: Array) -> bool:
        """Whether every element of ``x`` is finite (the engine's NaN/Inf gradient policy).

        One reduction: a sum is finite only if every term is (NaN and ±Inf propagate through
        addition), so only a non-finite sum — a NaN/Inf, or an overflow of finite values —
        pays for the element-wise test. Compiling backends fuse it into one kernel."""
        xp = self.xp
        if bool(xp.isfinite(xp.sum(x))):
            return True
        return bool(xp.all(xp.isfinite(x)))

    def finite_guard(self, arrays: Sequence[Array]) -> Array:
        """A boolean scalar: whether every element of every array is finite, for
        ``update_rows(guard=...)``. Backends with ``guarded_updates`` compute it on their
        devices without waiting for it; the default answers at once."""
        return self.xp.asarray(all(self.all_finite(a) for a in arrays))

    def gather_combine(
        self, table: ShardedTable, ids: Array, segment_ids: Array, num_segments: int, weights: Array | None = None,
        *, offsets: Array | None = None,
    ) -> Array:
        """The combiner's forward pass in one call: ``out[s] = Σ weights_i · table[ids_i]``
        over ``i`` with ``segment_ids_i == s``, shape ``[num_segments, D]``.

        ``offsets`` (a host NumPy int64 ``[num_segments + 1]``, optional): the ids come grouped
        by segment in segment order, segment ``s`` at positions ``offsets[s]:offsets[s + 1]`` —
        the same segments as ``segment_ids``, given so a backend need not find them (on the
        host: a backend that ignores it pays no transfer).

        Backends override this to avoid materialising the ``[len(ids), D]`` rows (torch's
        ``embedding_bag``); the default composes ``gather`` and ``segment_sum_to``."""
        rows = self.gather(table, ids)
        if weights is not None:
            rows = rows * self.xp.reshape(weights, (-1, 1))
        return self.segment_sum_to(rows, segment_ids, num_segments)

    def gather_widened(self, table: ShardedTable, ids: Array, dtype: str) -> Array | None:
        """Rows ``table[ids]`` of a low-precision table (the ``int16`` patterns of ``dtype``,
        ``"bfloat16"`` or ``"float16"``) widened to float32, ``[len(ids), D]``: exactly the values
        of the generic path — :meth:`gather`, then the exact widening
        (``meshembed.math.rounding.widen_bits``) — which runs where this returns None (this
        default), and which also reports bad ids. A backend overrides it to skip the 16-bit rows
        and the widening's integer temporaries (and, compiling, the widening's program)."""
        return None

    def gather_combine_low_precision(self, table: ShardedTable, ids: Array, segment_ids: Array, num_segments: int,
                                     dtype: str, *, offsets: Array | None = None) -> Array | None:
        """A low-precision table's pooled lookup with unit weights (``meshembed.embedding.precision``):
        ``out[s] = Σ widen(table[ids_i])`` over ``i`` with ``segment_ids_i == s``, float32
        ``[num_segments, D]``, where ``table`` holds the ``int16`` patterns of ``dtype``
        (``"bfloat16"`` or ``"float16"``) and ``widen`` is the exact widening to float32
        (``meshembed.math.rounding.widen_bits``). It must give exactly the bits of the generic path
        — :meth:`gather`, widening, then :meth:`segment_sum_to` — which runs where this returns
        None (this default), and which also reports bad ids. ``offsets``: as for :meth:`gather_combine`.
        A backend overrides it to skip the ``[len(ids), D]`` 16-bit rows and their float32 copy."""
        return None

    def hlo_program(self, table_name: str, program: bytes, num_slots: int) -> dict[str, Any]:
        """The static hyper-parameters (``hlo_runner``, ``takes_learning_rate``) with which
        UserDefinedProgram's math runs the serialized HLO ``program`` on this backend; only
        where ``capabilities.runs_hlo``. Raises ConfigError for a program that is not one."""
        raise NotImplementedError(f"the {self.name!r} backend cannot run HLO programs (capabilities.runs_hlo)")

    def check_update(self, tables: Sequence[ShardedTable], ids: np.ndarray) -> None:
        """Raise, before any table of a step is written, the error ``update_rows`` would raise
        for these (host) ids — e.g. a fixed capacity they exceed — so that a step with several
        tables changes all of them or none. Default: nothing to check."""

    def apply_rule_rows(self, rule: Any, values: Sequence[Any], grads: Array, rows: Sequence[Array]) -> list[Array]:
        """A rule's float32 math on gathered rows (one summed gradient row per row, each row
        once), as a 16-bit table's generic update runs it between widening and rounding; it
        must give NumPy's bits (``meshembed.math.apply_rule`` over NumPy). Default: that
        function over this backend's ``xp``."""
        from meshembed.math.rule import apply_rule

        return list(apply_rule(self.xp, rule, values, grads, *rows))

    def update_low_precision(self, tables: Sequence[ShardedTable], table: Any, rule: Any, values: Sequence[Any],
                             host_ids: Any, row_grads: Array, step: int, guard: Any) -> list[Any] | None:
        """A 16-bit table's update as this backend's own program, with exactly the bits (NumPy's)
        of the generic path (``meshembed.embedding.precision.update_table``, which asks this
        first); ``None`` (this default): the generic path runs.

        ``tables``: the table's ``[params, *slots]`` (16-bit arrays as ``int16`` patterns);
        ``table``: the layout's ``TableSpec`` (its ``precision``, ``index``, ``dimension``,
        ``vocabulary_size``); ``rule`` / ``values``: the checked ``UpdateRule`` and its per-call
        values (Python floats); ``host_ids``: int64 host ids (every row appended for a non-lazy
        optimizer); ``row_grads``: their ``[n, D]`` gradient rows; ``step``: the steps applied
        before this one (the random bits' counter); ``guard``: true or None (not asked when false)."""
        return None

    def update_rows(
        self,
        tables: Sequence[ShardedTable],
        ids: Array,
        grads: Array,
        fn: UpdateRule,
        *,
        values: Sequence[Any] = (),
        grad_index: Array | None = None,
        grad_weights: Array | None = None,
        guard: Array | None = None,
        check_finite: bool = False,
    ) -> list[ShardedTable]:
        """Apply the table's update rule once per unique id: ``apply_rule(xp, fn, values,
        grad_rows, *table_rows) -> new table_rows``; the call as a :class:`RowUpdate` is what
        :meth:`apply_update` (the method backends override) receives.

        ``ids`` may repeat; their gradients are summed first (duplicate ids are combined
        before any scatter). ``fn`` is the core's :class:`UpdateRule` (static: cache compiled
        code on it) and ``values`` this call's dynamic hyper-parameters (``fn.dynamic``
        order; never compile them in).

        With ``grad_index`` the gradient of ``ids[i]`` is ``grad_weights[i] * grads[grad_index[i]]``
        (the combiner's backward pass), so a backend can sum it without building one row per id.

        With ``guard`` (a boolean scalar from ``finite_guard``) false, nothing is written.

        With ``check_finite`` (passed only where ``capabilities.checked_updates``), any NaN or
        Inf element of ``grads`` raises :class:`~meshembed.errors.NonFiniteError` before
        anything is written.
        """
        return self.apply_update(RowUpdate(tuple(tables), ids, grads, fn, values, grad_index, grad_weights, guard,
                                           bool(check_finite)))

    def apply_update(self, u: RowUpdate) -> list[ShardedTable]:
        """:meth:`update_rows` of one call; backends override this to fuse, compile or route to
        the owning ranks (each validates ``u.rule`` / ``u.values`` with :func:`check_rule`).
        Default: segment sum, gather, the rule, scatter."""
        values = check_rule(u.rule, u.values, self.name)
        grads = u.grads
        if u.check_finite and not self.all_finite(grads):
            raise NonFiniteError()
        if u.guard is not None and not bool(u.guard):
            return list(u.tables)
        if u.grad_index is not None:
            grads = self.xp.take(grads, u.grad_index, axis=0)
            if u.grad_weights is not None:
                grads = grads * self.xp.reshape(u.grad_weights, (-1, 1))
        uids, g = self.segment_sum(u.ids, grads)
        rows = [self.gather(t, uids) for t in u.tables]
        new_rows = apply_rule(self.xp, u.rule, values, g, *rows)
        return [self.scatter(t, uids, r) for t, r in zip(u.tables, new_rows)]

    def update_rows_in_order(
        self,
        tables: Sequence[ShardedTable],
        ids: np.ndarray,
        grads: Array,
        fn: UpdateRule,
        *,
        values: Sequence[Any] = (),
        groups: np.ndarray | None = None,
        guard: Array | None = None,
    ) -> list[ShardedTable]:
        """Apply ``fn`` once per *occurrence* of every id, unsummed (gradient accumulation off):
        an id's contributions go in one after another in input order and, with several
        processes, ordered by ``groups`` (non-decreasing host ints, e.g. the feature of each
        id; default all 0), then by process, then by position — the order of every process's
        batch concatenated group by group (feature by feature), as in one process.

        ``ids`` are host int64 ids (``[n]``), ``grads`` their ``[n, D]`` rows. The default runs
        rounds in which each id occurs at most once (round r: the r-th occurrence of every id)
        through :meth:`update_rows`, which is right for one process (or for processes that all
        pass the same ids). A multi-process backend routes the contributions to the owners and
        runs the rounds there, so the number of rounds never has to match across processes."""
        guarded: dict[str, Any] = {"values": values} if guard is None else {"values": values, "guard": guard}
        values = check_rule(fn, values, self.name)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rounds = occurrence_rounds(ids)
        state = list(tables)
        for r in range(int(rounds.max()) + 1 if rounds.size else 0):
            pick = np.flatnonzero(rounds == r)
            sel = self.xp.take(grads, self.asarray(pick, dtype="int64"), axis=0)
            state = list(self.update_rows(state, self.asarray(ids[pick], dtype="int64"), sel, fn, **guarded))
        return state

    # -- processes -----------------------------------------------------------------------
    @property
    def processes(self) -> int:
        """How many processes share the tables (1 here). Above 1, every call that may run a
        collective — ``gather``, ``gather_combine``, ``scatter``, ``update_rows``,
        ``update_rows_in_order``, ``unshard``, :meth:`agree`, :meth:`barrier` — must be made by
        every process, in the same order, whatever its local ids (an empty batch included)."""
        return 1

    def agree(self, status: int = 0) -> tuple[int, ...]:
        """Every process's ``status`` (0: its input is valid; else an error code), in process
        order: one tiny all-gather, so that an input rejected on one process is known to all
        of them before any collective that moves rows (validate, then agree: see
        ``meshembed.embedding.agreement``). Single process: ``(status,)``, no communication."""
        return (int(status),)

    @property
    def is_writer(self) -> bool:
        """Whether this process writes files that every process shares (checkpoints).

        True in a single process. A multi-process backend answers True on exactly one process
        (torch: rank 0); the others still take part in the collectives that gather the data
        and then wait in :meth:`barrier`."""
        return True

    def barrier(self, ok: bool = True) -> bool:
        """Wait until every process arrives; returns whether every process passed ``ok=True``
        (so a writer's failure reaches all processes). Single process: returns ``ok``."""
        return bool(ok)

    def compile(self, fn: Callable, **options: Any) -> Callable:
        """Compile a pure function of arrays (jax.jit, torch.compile, ...). Default: as is."""
        return fn

    def can_update_in_place(self, value: Array) -> bool:
        """Whether :meth:`compile_update` may overwrite (or donate) ``value``'s storage."""
        return self.sharding_of(value) is None

    def in_place_group(self, rule: UpdateRule) -> int:
        """How many variables' staged updates of ``rule`` one :meth:`compile_update` call may
        take: more amortise a call's dispatch, fewer keep a compiler's time down (XLA's cold
        compile grows with the group: docs/benchmarks.md, "Measurements behind design choices
        in the code", Core)."""
        return 8

    def compile_update(self, rule: UpdateRule, count: int) -> Callable[..., Any]:
        """The dense optimizer's step (``apply_rule`` of ``rule``) for ``count`` variables at
        once, over their storage.

        The result is called as ``f(grads, values, *targets)``: ``values[n]`` the call-time
        values of variable ``n`` (Python floats in ``rule.dynamic`` order: a new learning rate
        must not recompile anything), ``targets[k]`` the ``count`` arrays of position k (the
        variables, then each slot in ``rule.slot_names`` order). It either writes each new
        value over its target and returns None (mutable arrays) or returns the new arrays by
        position (immutable arrays whose buffers it donated: JAX). The caller runs it only
        after every step of the update was built and validated. Default: the core function,
        through :meth:`compile`, with the values as :meth:`step_values` gives them."""
        xp = self.xp

        def step_in_place(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> None:
            for n in range(count):
                own = [t[n] for t in targets]
                for target, new in zip(own, apply_rule(xp, rule, values[n], grads[n], *own)):
                    target[...] = new

        compiled = self.compile(step_in_place)

        def run(grads: Sequence[Any], values: Sequence[Any], *targets: Sequence[Any]) -> None:
            arrays = [self.step_values(v, t) for v, t in zip(values, targets[0])]
            return compiled(grads, arrays, *targets)

        return run

    def step_values(self, values: Sequence[float], like: Array) -> tuple:
        """A rule's call-time ``values`` as a compiled step of ``like`` takes them. Default:
        the Python floats (the NumPy reference's arithmetic, which the generated kernels
        match); a backend whose compiler specialises on Python floats returns 0-d arrays
        (:func:`call_values`), so a new learning rate recompiles nothing."""
        return tuple(values)

    # -- dense mesh (me.Mesh / me.Layout / me.Variable) ----------------------------------
    def make_mesh(self, dim_names: Sequence[str], shape: Sequence[int], devices: Any = None) -> Any:
        """The backend's own mesh object (jax Mesh, torch DeviceMesh) or None for logical."""
        return None

    def place(self, value: Array, layout: Any) -> Array:
        """Put ``value`` on the devices of ``layout`` (NamedSharding, DTensor placements)."""
        return value

    def sharding_of(self, value: Array) -> Any:
        """The backend's own sharding object of an array (None when not tracked)."""
        return None

    def value_and_grad(self, fn: Callable[..., Array], values: Sequence[Array]) -> tuple[Array, list[Array]]:
        """Loss and gradients of ``fn(*values)`` through the backend's own autodiff."""
        raise NotImplementedError(
            f"Backend {self.name!r} has no autodiff: compute gradients yourself and call "
            "`apply_gradients([(grad, var), ...])`, or use the 'torch' or 'jax' backend."
        )

    def __repr__(self) -> str:
        return f"<meshembed backend {self.name!r}>"


def check_rule(rule: Any, values: Sequence[Any], backend: str = "") -> tuple:
    """``values`` as a tuple, after checking that ``rule`` is an :class:`UpdateRule` and
    ``values`` has one entry per ``rule.dynamic`` (an InputError otherwise, before anything is
    written): what every backend's ``update_rows`` checks first."""
    if not isinstance(rule, UpdateRule):
        raise InputError(
            f"Invalid `fn` for the {backend or 'backend'!r} backend's update_rows. Expected a "
            "meshembed.math.UpdateRule (meshembed.embedding.updates.make_rule(table)) with its `values=`; "
            f"plain update functions are no longer accepted. Received: {type(rule).__name__}"
        )
    if len(values) != len(rule.dynamic):
        raise InputError(
            f"Invalid `values` for the {rule.algorithm!r} rule. Expected {len(rule.dynamic)} values, one per "
            f"{rule.dynamic}. Received: {len(values)}"
        )
    return tuple(values)


def walk_blocks(shape: tuple[int, int], blocks: Iterable[np.ndarray], place: Callable[[int, np.ndarray], None]) -> None:
    """Hand each block of logical rows to ``place(start_row, block)``; raises ``ValueError``
    unless the blocks are ``[rows, D]`` arrays that cover ``shape`` exactly."""
    rows, dim = shape
    start = 0
    for block in blocks:
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[1] != dim or start + block.shape[0] > rows:
            raise ValueError(
                f"Invalid table block of shape {block.shape} at row {start}: expected [rows, {dim}] "
                f"blocks covering {rows} rows in all."
            )
        place(start, block)
        start += block.shape[0]
    if start != rows:
        raise ValueError(f"Invalid table blocks: they cover {start} rows, expected {rows}.")


def join_blocks(shape: tuple[int, int], blocks: Iterable[np.ndarray], dtype: Any) -> np.ndarray:
    """Blocks of logical rows -> one ``shape`` array."""
    out = np.empty(shape, dtype=dtype)
    walk_blocks(shape, blocks, lambda start, block: out.__setitem__(slice(start, start + len(block)), block))
    return out


def occurrence_rounds(ids: np.ndarray) -> np.ndarray:
    """Round of each contribution: 0 for an id's first occurrence, 1 for its second, ..."""
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_ids)) + 1]
    run_start = np.repeat(starts, np.diff(np.r_[starts, ids.size]))
    rounds = np.empty(ids.size, dtype=np.int64)
    rounds[order] = np.arange(ids.size) - run_start
    return rounds


def call_values(xp: Any, values: Sequence[float], like: Array) -> tuple:
    """A rule's call-time ``values`` as 0-d arrays of ``like``'s dtype and device: the same
    numbers as Python floats (which the math casts to that dtype too), but compiler inputs,
    so a new learning rate recompiles nothing."""
    import array_api_compat

    device = array_api_compat.device(like)
    return tuple(xp.asarray(v, dtype=like.dtype, device=device) for v in values)
