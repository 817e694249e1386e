"""``EmbeddingCollection``: the TPU embedding engine as an ``nn.Module``, optimizer in backward.

The forward is one ``torch.library`` custom op (``meshembed::ec_forward``): inside it the
engine's host work (validation, flattening, combiner factors, in NumPy) and its lookup run
eagerly, and its fake kernel gives the activations' static shapes, so ``torch.compile`` never
traces meshembed's code. Its backward is a second custom op (``meshembed::ec_backward``) that
hands the activation gradients to the engine's ``apply_gradients`` (SendTPUEmbeddingGradients)
— the fbgemm TBE "optimizer in backward" shape — or, with ``fused_optimizer=False``, keeps them
for ``apply_gradients()``. Both ops go through the same ``TPUEmbedding`` object as
``TPUEmbedding(backend="torch")``, so the numbers are the engine's, bit for bit.

Autograd reaches the ops through ``anchor``, a zero-element leaf tensor requiring grad (not a
parameter: the dense optimizer never sees it). Each training forward returns a ``token``
tensor saved for backward; the batch it names lives as long as that token (the autograd
graph), so a forward without backward leaks nothing.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from meshembed.embedding import batch as batches
from meshembed.embedding import precision
from meshembed.embedding import step as steps
from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.inputs import RaggedIds, SparseIds
from meshembed.errors import ConfigError, InputError, StateError
from meshembed.tpu import nest as _nest
from meshembed.tpu import flat_features, is_feature

__all__ = ["EmbeddingCollection"]

_MODULES: "weakref.WeakValueDictionary[int, EmbeddingCollection]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_TOKENS = itertools.count(1)


def _module(handle: int) -> "EmbeddingCollection":
    try:
        return _MODULES[handle]
    except KeyError:
        raise StateError(f"meshembed EmbeddingCollection #{handle} no longer exists.") from None


# -- the custom ops -------------------------------------------------------------------------
# spec: one entry per feature joined by ";": kind (d dense, o offsets, l lengths, s COO with
# its dense shape after ":"), then "w" when a weights tensor follows; then "|T" (training) or
# "|I" (inference). The tensors come flat in the same order.

@torch.library.custom_op("meshembed::ec_forward", mutates_args=())
def _ec_forward(handle: int, spec: str, anchor: torch.Tensor, tensors: list[torch.Tensor],
                lrs: torch.Tensor | None) -> list[torch.Tensor]:
    return _module(handle)._run_forward(spec, tensors, lrs)


@_ec_forward.register_fake
def _ec_forward_fake(handle: int, spec: str, anchor: torch.Tensor, tensors: list[torch.Tensor],
                     lrs: torch.Tensor | None) -> list[torch.Tensor]:
    m = _module(handle)
    outs = [anchor.new_empty(shape, dtype=dtype) for shape, dtype in m._out_specs]
    return outs + [torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("meshembed::ec_backward", mutates_args=())
def _ec_backward(handle: int, token: torch.Tensor, anchor: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    _module(handle)._run_backward(int(token), grads)
    return torch.zeros_like(anchor)


@_ec_backward.register_fake
def _ec_backward_fake(handle: int, token: torch.Tensor, anchor: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(anchor)


def _setup_context(ctx: Any, inputs: tuple, output: list) -> None:
    ctx.handle = inputs[0]
    ctx.num_tensors = len(inputs[3])
    ctx.save_for_backward(output[-1], inputs[2])


def _backward(ctx: Any, grads: list) -> tuple:
    token, anchor = ctx.saved_tensors
    grad = torch.ops.meshembed.ec_backward(ctx.handle, token, anchor, list(grads[:-1]))
    return None, None, grad, [None] * ctx.num_tensors, None


_ec_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerLookup(torch.autograd.Function):
    """The same two op bodies for eager calls: an autograd.Function skips the custom-op
    machinery (schema checks, pytree flattening; docs/benchmarks.md); dynamo sees the ops."""

    @staticmethod
    def forward(ctx: Any, handle: int, spec: str, anchor: torch.Tensor, lrs: Any, *tensors: torch.Tensor) -> tuple:
        outs = _module(handle)._run_forward(spec, tensors, lrs)
        ctx.handle, ctx.num_tensors = handle, len(tensors)
        ctx.save_for_backward(outs[-1], anchor)
        ctx.mark_non_differentiable(outs[-1])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        token, anchor = ctx.saved_tensors
        _module(ctx.handle)._run_backward(int(token), grads[:-1])
        return (None, None, torch.zeros_like(anchor), None) + (None,) * ctx.num_tensors


# -- input forms -----------------------------------------------------------------------------

def _weights_values(w: Any) -> torch.Tensor:
    """The per-id weights of any input form (a 1-D values tensor)."""
    if isinstance(w, (tuple, list)):
        return torch.as_tensor(w[0])
    if isinstance(w, (RaggedIds, SparseIds)):
        return _tensor(w.values)
    if isinstance(w, torch.Tensor):
        if w.is_nested:
            return w.values()
        if w.layout == torch.sparse_coo:
            return w._values()
        return w
    return w


def _flatten(name: str, batch: int, x: Any, w: Any) -> tuple[str, list[torch.Tensor]]:
    """One feature's input as (spec entry, tensors); see the ops' spec comment."""
    if isinstance(x, RaggedIds):
        x = (_tensor(x.values), _tensor(x.row_splits))
    elif isinstance(x, SparseIds):  # tensors stay tensors: under torch.compile they are graph inputs
        dims = x.dense_shape if isinstance(x.dense_shape, (tuple, list, torch.Size)) else np.asarray(x.dense_shape).reshape(-1)
        kind, ts = "s:" + "x".join(str(int(s)) for s in dims), [_tensor(x.indices), _tensor(x.values)]
        x = None
    if x is None:
        pass
    elif isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise InputError(
                f"Invalid input for feature {name!r}: expected a (values, offsets) or (values, lengths) "
                f"pair. Received: a {type(x).__name__} of {len(x)} items."
            )
        values, other = torch.as_tensor(x[0]), torch.as_tensor(x[1])
        n = other.shape[0] if other.dim() == 1 else -1
        if n == batch + 1:
            kind = "o"
        elif n == batch:
            kind = "l"
        else:
            raise InputError(
                f"Invalid input for feature {name!r}: the second tensor of a (values, offsets|lengths) "
                f"pair must have {batch + 1} offsets or {batch} lengths (batch {batch}). Received: "
                f"shape={tuple(other.shape)}"
            )
        ts = [values, other]
    elif isinstance(x, torch.Tensor) and x.is_nested:
        kind, ts = "o", [x.values(), x.offsets()]
    elif isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo:
        kind = "s:" + "x".join(str(int(s)) for s in x.shape)
        ts = [x._indices().t(), x._values()]
    elif isinstance(x, torch.Tensor):
        kind, ts = "d", [x]
    else:
        kind, ts = "d", [_as_tensor(name, "ids", x)]
    if w is not None:
        kind += "w"
        ts.append(_as_tensor(name, "weights", _weights_values(w)))
    return kind, ts


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def _as_tensor(name: str, what: str, x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise InputError(
            f"Invalid {what} for feature {name!r}: expected a tensor or an array of numbers. "
            f"Received: {type(x).__name__} of dtype {arr.dtype}"
        )
    return torch.as_tensor(arr)


def _engine_input(kind: str, ts: Sequence[torch.Tensor]) -> tuple[Any, Any]:
    """Rebuild the engine's input form from a spec entry and its tensors. (The engine keeps
    private copies of what it validated, so a buffer the compiled graph reuses is safe.)"""
    # NumPy: the engine duck-types COO weights by an `indices` attribute, which every tensor has
    weights = ts[-1].detach().cpu().numpy() if kind.endswith("w") else None
    kind = kind.rstrip("w")
    if kind == "d":
        return ts[0], weights
    if kind == "o":
        return RaggedIds(ts[1], ts[0]), weights
    if kind == "l":
        lengths = ts[1].detach().cpu().numpy()
        if lengths.dtype.kind not in "iu":
            return RaggedIds(lengths, ts[0]), weights  # the engine names the bad dtype
        splits = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        return RaggedIds(splits, ts[0]), weights
    shape = np.asarray([int(s) for s in kind[2:].split("x")], dtype=np.int64)
    return SparseIds(ts[0], ts[1], shape), weights


class EmbeddingCollection(torch.nn.Module):
    """Embedding tables of an ``me.EmbeddingConfig`` as an ``nn.Module`` (torchrec's shape).

    ``forward(features, weights=None)`` → ``{feature_name: activation}``; each activation has
    the feature's ``input_shape + [dimension]``. ``features``: a dict by feature name (or a
    list in config order) of dense int tensors, ``torch.nested`` jagged tensors, sparse COO
    tensors, ``(values, offsets)`` pairs (B+1 offsets) or ``(values, lengths)`` pairs
    (B lengths); ``me.RaggedIds``/``me.SparseIds`` too. ``weights`` mirrors it (per-id).

    With ``fused_optimizer=True`` (default) ``loss.backward()`` applies the config's optimizer
    to the looked-up rows; with ``False`` it keeps the gradients and ``apply_gradients()``
    sends them. In ``eval()`` mode or under ``torch.no_grad()`` lookups are inference only.
    Tables are row-sharded over ``num_shards`` (default: the ``torch.distributed`` world size)
    exactly as ``me.TPUEmbedding(config, backend="torch")`` does; ``seed`` and
    ``initializers`` (``{table: initializer or [V, D] array}``) are the engine's.

    ``config``: an ``me.EmbeddingConfig`` (outputs keyed by feature name; by the config's keys,
    in the order given, when its ``features`` were a dict), or TF's ``feature_config``: any
    nest (dicts, lists, tuples, namedtuples) of ``me.tpu.FeatureConfig``, built as
    ``me.tpu.TPUEmbedding`` builds it (``optimizer=`` for tables without one; ``batch_size=``
    for features without ``output_shape``): ``forward`` then takes and returns that nest, as
    TF's mid-level API does. ``process_group``: any ``dist.new_group`` this rank is in (tables
    sharded over its ranks only); None = the default group.

    Under ``torch.compile`` pass tensors, ``(values, offsets|lengths)`` pairs, jagged tensors
    or ``me.SparseIds(indices, values, shape)`` of tensors. A sparse COO tensor works eagerly
    only: dynamo refuses to take one as a graph input ("Attempted to wrap sparse Tensor") and
    cannot trace ``torch.sparse_coo_tensor``; pass ``me.SparseIds(coo._indices().t(),
    coo._values(), coo.shape)`` built from tensors taken outside the compiled function.
    """

    def __init__(self, config: Any, *, num_shards: int | None = None, process_group: Any = None,
                 device: Any = None, seed: int = 0, fused_optimizer: bool = True,
                 initializers: Mapping[str, Any] | None = None, optimizer: Any = None,
                 batch_size: int | None = None) -> None:
        super().__init__()
        from meshembed.config import EmbeddingConfig
        from meshembed_torch.backend import TorchBackend

        backend = TorchBackend(device=device, process_group=_check_group(process_group))
        if isinstance(config, EmbeddingConfig):
            for name, value in (("optimizer", optimizer), ("batch_size", batch_size)):
                if value is not None:
                    raise ConfigError(
                        f"Invalid `{name}`: it is for a feature_config nest (me.tpu.FeatureConfig leaves); an "
                        f"EmbeddingConfig carries its own optimizers and input shapes. Received: {name}={value!r}")
            engine = TPUEmbedding(config, backend=backend, num_shards=num_shards, seed=seed, initializers=initializers)
            self._attach(engine, fused_optimizer)
            return
        engine = _engine_of_nest(config, optimizer, batch_size, initializers,
                                 dict(backend=backend, num_shards=num_shards, seed=seed))
        self._attach(engine, fused_optimizer, nest=config)

    @classmethod
    def _from_engine(cls, engine: TPUEmbedding, fused_optimizer: bool = True, nest: Any = None) -> "EmbeddingCollection":
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        self._attach(engine, fused_optimizer, nest)
        return self

    def _attach(self, engine: TPUEmbedding, fused_optimizer: bool, nest: Any = None) -> None:
        if engine.backend.name != "torch":
            raise ConfigError(f"EmbeddingCollection needs the torch backend. Received: backend={engine.backend.name!r}")
        self.engine = engine
        self.fused_optimizer = bool(fused_optimizer)
        # Output structure: `_nest` (a feature_config nest, packed as me.tpu does), else a dict
        # keyed by `_keys` (a dict-of-features EmbeddingConfig: its keys, in the order given;
        # otherwise the feature names)
        self._nest = nest
        layout = engine.layout
        self._out_specs = [
            (f.output_shape + (layout.tables[f.table].dimension,),
             torch.float32 if precision.is_low(layout.tables[f.table])  # 16-bit storage: float32 activations
             else engine.state.tables[f.table][0].data.dtype)
            for f in layout.features
        ]
        self._batch_sizes = [int(f.output_shape[0]) for f in layout.features]
        self._names = [f.name for f in layout.features]
        keys = engine.layout.keys
        if keys:  # inputs and outputs keyed by the config's keys (engine order: sorted)
            self._names = sorted(keys)
        self._keys = list(keys) if keys else list(self._names)
        self._order = [self._names.index(k) for k in self._keys]
        self._learning_rates: list[float] | None = None
        self._batches: dict[int, Any] = {}  # token -> the engine's pending batch (+ its lrs)
        self._accumulated: list[tuple[Any, list, Any]] = []  # fused_optimizer=False
        # one update of the tables at a time: two threads' backward passes each apply theirs
        # (the state is read, updated and written back under it: no update is lost)
        self._update_lock = threading.Lock()
        dev = engine.backend.device
        self.anchor = torch.zeros(0, device=dev, requires_grad=True)
        self._handle = next(_HANDLES)
        _MODULES[self._handle] = self

    # -- public API --------------------------------------------------------------------------
    @property
    def feature_names(self) -> list[str]:
        return list(self._names)

    @property
    def table_names(self) -> list[str]:
        return self.engine.table_names

    def set_learning_rates(self, learning_rates: Sequence[Any]) -> None:
        """Values of the config's dynamic learning-rate tags, used by every following update
        (host values: a new one every step never recompiles anything)."""
        self._learning_rates = steps.check_learning_rates(self.engine.layout, learning_rates, self.engine.backend)

    def forward(self, features: Any, weights: Any = None, learning_rates: Any = None) -> Any:
        """Activations by feature name (or in the config's nest: see the class). ``learning_rates`` (optional, a 1-D tensor or a list)
        overrides ``set_learning_rates`` for this batch's update; pass a tensor under
        ``torch.compile`` so a new value is a new input, not a recompilation."""
        if self._nest is not None:
            ids = _nest.match(self._nest, features, "features", is_feature)
            ws = [None] * len(ids) if weights is None else _nest.match(self._nest, weights, "weights", is_feature)
        else:
            ids = self._by_name(features, "features")
            ws = [None] * len(ids) if weights is None else self._by_name(weights, "weights", allow_missing=True)
        kinds, flat = [], []
        for name, b, x, w in zip(self._names, self._batch_sizes, ids, ws):
            kind, ts = _flatten(name, b, x, w)
            kinds.append(kind)
            flat.extend(ts)
        training = self.training and torch.is_grad_enabled()
        spec = ";".join(kinds) + ("|T" if training else "|I")
        lrs = None
        if learning_rates is not None:
            lrs = learning_rates if isinstance(learning_rates, torch.Tensor) else torch.tensor(
                [float(v) for v in learning_rates], dtype=torch.float64)
        anchor = self.anchor if training else self.anchor.detach()  # inference: no backward
        if torch.compiler.is_compiling():
            outs = torch.ops.meshembed.ec_forward(self._handle, spec, anchor, flat, lrs)
        else:
            outs = _EagerLookup.apply(self._handle, spec, anchor, lrs, *flat)
        if self._nest is not None:
            return _nest.pack(self._nest, list(outs[:-1]), is_feature)
        return {k: outs[i] for k, i in zip(self._keys, self._order)}

    def apply_gradients(self, learning_rates: Sequence[Any] | None = None) -> None:
        """``fused_optimizer=False``: send the gradients every backward since the last call
        kept, batch by batch in forward order (each an engine ``apply_gradients``)."""
        if self.fused_optimizer:
            raise StateError(
                "apply_gradients() is for fused_optimizer=False: with the fused optimizer, "
                "loss.backward() already applied the update. Fix: drop the call, or build the "
                "module with fused_optimizer=False."
            )
        if learning_rates is not None:
            self.set_learning_rates(learning_rates)
        while self._accumulated:
            pending, grads, lrs = self._accumulated[0]
            self._send(pending, grads, lrs)
            self._accumulated.pop(0)

    def save(self, path: Any) -> Any:
        """A portable meshembed checkpoint (any backend / shard count restores it)."""
        return self.engine.save(path)

    @classmethod
    def restore(cls, path: Any, *, num_shards: int | None = None, device: Any = None,
                fused_optimizer: bool = True, process_group: Any = None) -> "EmbeddingCollection":
        """A module from a portable checkpoint (``save``, or ``TPUEmbedding.save`` anywhere);
        outputs keyed by feature name (the checkpoint keeps no feature_config nest)."""
        from meshembed_torch.backend import TorchBackend

        backend = TorchBackend(device=device, process_group=_check_group(process_group))
        engine = TPUEmbedding.restore(path, backend=backend, num_shards=num_shards)
        return cls._from_engine(engine, fused_optimizer)

    def __deepcopy__(self, memo: dict) -> "EmbeddingCollection":
        """A copy with its own engine (and op handle): the same tables, slots, step, mode and
        learning rates (copying the handle would route the copy's ops to this module)."""
        e = self.engine
        engine = TPUEmbedding(e.config, backend=e.backend, num_shards=e.num_shards, seed=e.seed,
                              initializers={t: "zeros" for t in e.table_names})
        for table in e.table_names:
            values = e.retrieve_parameters(table)
            engine.load_parameters(table, values.pop("parameters"), **values)
        engine.step = e.step
        new = type(self)._from_engine(engine, self.fused_optimizer, self._nest)
        new._learning_rates = None if self._learning_rates is None else list(self._learning_rates)
        memo[id(self)] = new
        return new.train(self.training)

    # -- .to(device) / .cpu() / .cuda(): the tables move with the module ------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> "EmbeddingCollection":
        """``nn.Module.to``/``cpu``/``cuda``/``double``... call this with a per-tensor ``fn``; it
        is probed on an empty tensor of each table dtype first, so what cannot be done (a dtype
        change: the TPU tables keep the config's dtype; ``meta``; another device for tables
        sharded over ranks) raises before anything moves. A device change moves every table
        and slot (a new backend on that device: the engine's may be shared)."""
        engine = self.engine
        here = engine.backend.device
        tables = [t for state in engine.state.tables.values() for t in state]
        target = None
        for dtype in dict.fromkeys(t.data.dtype for t in tables):
            try:
                out = fn(torch.empty(0, dtype=dtype, device=here))
            except (RuntimeError, AssertionError, TypeError) as exc:  # e.g. .cuda() without CUDA
                raise ConfigError(f"EmbeddingCollection cannot apply this conversion to its tables: {exc}") from exc
            if out.dtype != dtype:
                raise ConfigError(
                    f"EmbeddingCollection tables keep their dtype ({dtype}): the TPU optimizers and fused "
                    f"kernels update them in it, so converting them to {out.dtype} is refused. Fix: convert the "
                    "dense part only (e.g. model.mlp.to(dtype)), or build the tables in that dtype "
                    "(initializers={table: array of that dtype}). Nothing was changed.")
            target = out.device
        if target is not None and target != here:
            self._move_tables(torch.device(target))
        return super()._apply(fn, recurse)

    def _move_tables(self, device: Any) -> None:
        from meshembed_torch.backend import TorchBackend

        engine = self.engine
        tables = [t for state in engine.state.tables.values() for t in state]
        if device.type == "meta":
            raise ConfigError(
                "EmbeddingCollection cannot move to the meta device: its tables are data (lookups, "
                "state_dict and checkpoints read their rows). Nothing was changed.")
        if any(t.group is not None for t in tables):
            raise ConfigError(
                f"EmbeddingCollection tables sharded over torch.distributed ranks stay on their device "
                f"({engine.backend.device}): every rank's collectives use it. Fix: build the module with "
                f"device={str(device)!r} on every rank. Nothing was changed.")
        if self._batches or self._accumulated:
            raise StateError(
                "EmbeddingCollection cannot move while a training forward's backward (or, with "
                "fused_optimizer=False, an apply_gradients()) is pending. Fix: finish the step first.")
        old = engine.backend
        backend = TorchBackend(device=device, compile=old._compile_mode, process_group=old._group)
        moved = [t.data.to(device) for t in tables]  # may fail (memory): nothing assigned yet
        offsets = [t.rowmap._offsets.to(device) for t in tables]
        for t, data, off in zip(tables, moved, offsets):
            t.data, t.rowmap._offsets = data, off
        engine.backend = backend
        self.anchor = torch.zeros(0, device=device, requires_grad=True)

    def extra_repr(self) -> str:
        return (f"tables={self.table_names}, features={self._names}, num_shards={self.engine.num_shards}, "
                f"fused_optimizer={self.fused_optimizer}")

    # -- state dict: whole logical tables, TF slot names ------------------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for table in self.engine.table_names:
            for name, arr in self.engine.retrieve_parameters(table).items():
                destination[f"{prefix}{table}.{name}"] = torch.from_numpy(np.ascontiguousarray(arr))

    def _load_from_state_dict(self, state_dict: Mapping, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        loads = {}
        for table in self.engine.table_names:
            t = self.engine.layout.table(table)
            given = {}
            for name in ("parameters",) + self.engine.table_slot_names(table):
                key = f"{prefix}{table}.{name}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                v = state_dict[key]
                shape = tuple(v.shape)
                if shape != (t.vocabulary_size, t.dimension):
                    raise InputError(
                        f"Invalid state_dict entry {key!r}: expected shape {(t.vocabulary_size, t.dimension)} "
                        f"(the whole logical table {table!r}). Received: shape={shape}. Nothing was loaded."
                    )
                given[name] = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
            loads[table] = given
        ours = {f"{prefix}{t}." for t in self.engine.table_names}
        for key in state_dict:
            if key.startswith(prefix) and "." in key[len(prefix):] and not any(key.startswith(o) for o in ours):
                rest = key[len(prefix):]
                if rest.split(".")[0] not in self._modules:
                    unexpected_keys.append(key)
            elif key.startswith(prefix) and any(key.startswith(o) for o in ours):
                table, _, name = key[len(prefix):].partition(".")
                if name not in ("parameters",) + self.engine.table_slot_names(table):
                    unexpected_keys.append(key)
        ours_wrong = [k for k in missing_keys + unexpected_keys if k.startswith(prefix)]
        if strict and ours_wrong:
            return  # torch raises for these after every module: nothing of ours is loaded
        # every array of every table checked before any is written (all or nothing)
        self.engine.load_tables({table: given for table, given in loads.items() if given})

    # -- op bodies ---------------------------------------------------------------------------
    def _by_name(self, values: Any, what: str, allow_missing: bool = False) -> list[Any]:
        names = self._names
        if isinstance(values, Mapping):
            unknown = sorted(set(values) - set(names))
            missing = [n for n in names if n not in values]
            if unknown or (missing and not allow_missing):
                raise InputError(
                    f"Invalid `{what}`: expected one entry per feature {names}. Missing: {missing}; "
                    f"unknown: {unknown}"
                )
            return [values.get(n) for n in names]
        if isinstance(values, (list, tuple)) and len(values) == len(names) and not (
                len(names) == 1 and len(values) == 2 and isinstance(values[0], torch.Tensor)):
            return list(values)
        if len(names) == 1:
            return [values]
        raise InputError(
            f"Invalid `{what}`: expected a dict keyed by feature name {names} or a list in config order. "
            f"Received: {type(values).__name__}"
        )

    def _run_forward(self, spec: str, tensors: Sequence[torch.Tensor], lrs: torch.Tensor | None) -> list[torch.Tensor]:
        kinds, mode = spec.split("|")
        training = mode == "T"
        feats, weights, k = [], [], 0
        for kind in kinds.split(";"):
            n = (1 if kind.startswith("d") else 2) + kind.endswith("w")
            x, w = _engine_input(kind, tensors[k:k + n])
            feats.append(x)
            weights.append(w)
            k += n
        engine = self.engine
        layout = engine.layout
        lr_list = None if lrs is None else steps.check_learning_rates(layout, lrs.detach().cpu().reshape(-1),
                                                                         engine.backend)
        # config-order lists, in the engine's structure (a dict when the config's features were);
        # this forward's own batch: nothing of the engine's (its pending batch) is touched
        pending = steps.prepare_on(engine.backend, layout, batches.structured(layout, feats),
                                   None if all(w is None for w in weights) else batches.structured(layout, weights),
                                   training=training)
        acts = steps.lookup(engine.backend, engine.state, pending)
        token = torch.tensor(next(_TOKENS) if training else 0, dtype=torch.int64)
        if training:
            key = int(token)
            self._batches[key] = (pending, lr_list)
            weakref.finalize(token, self._batches.pop, key, None)
        return [a if a.is_contiguous() else a.contiguous() for a in acts] + [token]

    def _run_backward(self, key: int, grads: Sequence[torch.Tensor]) -> None:
        entry = self._batches.pop(key, None)
        if entry is None:
            raise StateError(
                "EmbeddingCollection backward: this batch's lookup is gone (its backward already "
                "ran, or the forward ran in eval()/no_grad mode). Fix: one backward per training forward; "
                "use retain_graph=False."
            )
        pending, lrs = entry
        if self.fused_optimizer:
            self._send(pending, list(grads), lrs)
        else:
            self._accumulated.append((pending, [g.detach().clone() for g in grads], lrs))

    def _send(self, pending: Any, grads: list, lrs: Any) -> None:
        engine = self.engine
        if lrs is None:
            lrs = self._learning_rates if self._learning_rates is not None else ()
        with self._update_lock:
            engine.state = steps.apply_gradients(engine.backend, engine.state, pending,
                                                 batches.structured(engine.layout, list(grads)), lrs,
                                                 allow_nonfinite=engine.allow_nonfinite, rules=engine.rules)


def _check_group(process_group: Any) -> Any:
    """The group tables are sharded over: None for the default (world) group, else a
    ``ProcessGroup`` this rank belongs to (any ``dist.new_group``)."""
    if process_group is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "Invalid `process_group`: torch.distributed is not initialised. Fix: call "
            "torch.distributed.init_process_group(...) first, or pass process_group=None."
        )
    if process_group is dist.group.WORLD or process_group is dist.distributed_c10d._get_default_group():
        return None
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns to non-members
        raise ConfigError(
            f"Invalid `process_group`: rank {dist.get_rank()} is not one of its ranks (dist.new_group returned "
            "NON_GROUP_MEMBER here). Fix: build the module only on the group's ranks.")
    if not isinstance(process_group, dist.ProcessGroup):
        raise ConfigError(
            "Invalid `process_group`: expected a torch.distributed ProcessGroup (from dist.new_group) "
            f"or None. Received: {type(process_group).__name__}")
    if dist.get_rank(process_group) < 0:
        raise ConfigError(
            f"Invalid `process_group`: rank {dist.get_rank()} is not one of its ranks "
            f"{dist.get_process_group_ranks(process_group)}. Fix: build the module only on the group's "
            "ranks (every rank must call dist.new_group, but only members use the group).")
    return process_group


def _engine_of_nest(nest: Any, optimizer: Any, batch_size: int | None, initializers: Any,
                    engine_args: dict) -> TPUEmbedding:
    """The engine of a TF-style feature_config nest, built as ``me.tpu.TPUEmbedding`` builds it
    (tables by first appearance, features named by their nest paths)."""
    from meshembed.tpu import FeatureConfig
    from meshembed.tpu import TPUEmbedding as TFEmbedding
    from meshembed.tpu import flat_features

    if not (isinstance(nest, FeatureConfig) or _nest.is_container(nest)):
        raise ConfigError(
            "Invalid `config`: expected a meshembed.EmbeddingConfig or a nest (dict, list, tuple) of "
            f"meshembed.tpu.FeatureConfig. Received: {type(nest).__name__}")
    if initializers is not None:
        raise ConfigError(
            "Invalid `initializers`: a feature_config nest takes each table's initializer from its "
            "me.tpu.TableConfig(initializer=...). Fix: drop initializers=.")
    unknown = [p or "<top>" for p, f in flat_features(nest) if f.output_shape is None]
    if unknown and batch_size is None:
        raise ConfigError(
            f"Invalid `batch_size`: features {unknown} have no output shape, and the module needs every "
            "shape when it is built (its ops have static shapes). Fix: pass batch_size=, or give "
            "me.tpu.FeatureConfig(output_shape=...).")
    emb = TFEmbedding(nest, optimizer, **engine_args)
    if batch_size is not None:
        emb.build(per_replica_batch_size=batch_size)
    return emb.engine
