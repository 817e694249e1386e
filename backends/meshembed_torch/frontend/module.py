"""``EmbeddingCollection``: the TPU embedding engine as an ``nn.Module``, optimizer in backward.

The forward is one ``torch.library`` custom op (``meshembed::ec_lookup``): inside it the
engine's host work (validation, flattening, combiner factors, in NumPy) and its lookup run
eagerly, and its fake kernel gives the activations' static shapes, so ``torch.compile`` never
traces meshembed's code. Its backward is a second custom op (``meshembed::ec_update``) that
hands the activation gradients to the engine's ``apply_gradients`` (SendTPUEmbeddingGradients)
— the fbgemm TBE "optimizer in backward" shape — or, with ``fused_optimizer=False``, keeps them
for ``apply_gradients()``. Both ops go through the same ``TPUEmbedding`` object as
``TPUEmbedding(backend="torch")``, so the numbers are the engine's, bit for bit.

Autograd reaches the ops through ``anchor``, a zero-element leaf tensor requiring grad (not a
parameter: the dense optimizer never sees it). Each training forward returns a ``token``
tensor saved for backward; the batch it names lives as long as that token (the autograd
graph), so a forward without backward leaks nothing.

The configured batch size is a capacity: a forward with fewer samples (a DataLoader's last
batch) runs the ops on the configured shapes with the missing samples empty and returns the
activations of the samples given. Per-id weights that require grad get their gradient in the
backward (``nn.EmbeddingBag``'s ``per_sample_weights``). A meshembed error found while dynamo
traces ``forward`` is raised by the op when the compiled graph runs, so it reaches the caller
as itself, not as dynamo's ``Unsupported``.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from meshembed.config.rowwise import slot_width
from meshembed.embedding import batch as batches
from meshembed.embedding import precision
from meshembed.embedding import step as steps
from meshembed.embedding.engine import TPUEmbedding
from meshembed.embedding.inputs import RaggedIds, SparseIds
from meshembed.embedding.agreement import agreed, first_argument, validated
from meshembed.errors import CapacityError, ConfigError, InputError, MeshembedError, NonFiniteError, StateError
from meshembed.tpu import nest as _nest
from meshembed.tpu import flat_features, is_feature

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]

_MODULES: "weakref.WeakValueDictionary[int, EmbeddingCollection]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count(1)
_TOKENS = itertools.count(1)


def _module(handle: int) -> "EmbeddingCollection":
    try:
        return _MODULES[handle]
    except KeyError:
        raise StateError(f"meshembed EmbeddingCollection #{handle} no longer exists.") from None


# -- the custom ops -------------------------------------------------------------------------
# spec: one entry per feature joined by ";": kind (d dense, o offsets / row splits, l lengths,
# s COO with its dense shape after ":"), then "w" when a weights tensor follows and "g" when
# those weights need their gradient; then "|T" (training) or "|I" (inference). The tensors
# come flat in the same order. A spec "!<ErrorType>:<message>" makes the forward op raise that
# meshembed error (found while dynamo traced `forward`: raised when the graph runs).
# The compiled op's spec starts with the module's output signature and "/" (`_signature`):
# inductor's on-disk graph cache keys a graph by its ops and their constant arguments, and the
# handle alone names different modules in different processes (a cached graph of a 3-wide
# table was reused for a 1-wide one).
# torch's AOT autograd cache keys a compiled graph by its forward ops, not by their Python
# autograd formulas: an op whose backward changes gets a new name (ec_forward/ec_backward were
# the names before the weights' gradients), so no cached backward of the old contract is reused.

_ERRORS = {cls.__name__: cls for cls in (InputError, ConfigError, StateError, CapacityError, NonFiniteError)}


def _raise_error_spec(spec: str) -> None:
    name, _, message = spec[1:].partition(":")
    raise _ERRORS.get(name, InputError)(message)


def _grad_weights(spec: str) -> list[int]:
    """Positions in the flat tensor list of the weights that need their gradient."""
    if spec.startswith("!"):
        return []
    out, k = [], 0
    for kind in spec.split("|")[0].split(";"):
        n = (1 if kind.startswith("d") else 2) + ("w" in kind[-2:])
        if kind.endswith("g"):
            out.append(k + n - 1)
        k += n
    return out


@torch.library.custom_op("meshembed::ec_lookup", mutates_args=())
def _ec_forward(handle: int, spec: str, anchor: torch.Tensor, tensors: list[torch.Tensor],
                lrs: torch.Tensor | None) -> list[torch.Tensor]:
    return _module(handle)._run_forward(spec.partition("/")[2], tensors, lrs)


@_ec_forward.register_fake
def _ec_forward_fake(handle: int, spec: str, anchor: torch.Tensor, tensors: list[torch.Tensor],
                     lrs: torch.Tensor | None) -> list[torch.Tensor]:
    m = _module(handle)
    outs = [anchor.new_empty(shape, dtype=dtype) for shape, dtype in m._out_specs]
    return outs + [torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("meshembed::ec_update", mutates_args=())
def _ec_backward(handle: int, token: torch.Tensor, anchor: torch.Tensor, grads: list[torch.Tensor],
                 weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(anchor)] + _module(handle)._run_backward(int(token), grads)


@_ec_backward.register_fake
def _ec_backward_fake(handle: int, token: torch.Tensor, anchor: torch.Tensor, grads: list[torch.Tensor],
                      weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(anchor)] + [torch.empty_like(w) for w in weights]


def _setup_context(ctx: Any, inputs: tuple, output: list) -> None:
    ctx.handle = inputs[0]
    ctx.num_tensors = len(inputs[3])
    ctx.weight_positions = _grad_weights(inputs[1].partition("/")[2])
    ctx.save_for_backward(output[-1], inputs[2], *(inputs[3][k] for k in ctx.weight_positions))


def _backward(ctx: Any, grads: list) -> tuple:
    token, anchor, *weights = ctx.saved_tensors
    out = torch.ops.meshembed.ec_update(ctx.handle, token, anchor, list(grads[:-1]), weights)
    tensor_grads: list[Any] = [None] * ctx.num_tensors
    for k, g in zip(ctx.weight_positions, out[1:]):
        tensor_grads[k] = g
    return None, None, out[0], tensor_grads, None


_ec_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerLookup(torch.autograd.Function):
    """The same two op bodies for eager calls: an autograd.Function skips the custom-op
    machinery (schema checks, pytree flattening; docs/benchmarks.md); dynamo sees the ops."""

    @staticmethod
    def forward(ctx: Any, handle: int, spec: str, anchor: torch.Tensor, lrs: Any, *tensors: torch.Tensor) -> tuple:
        outs = _module(handle)._run_forward(spec, tensors, lrs)
        ctx.handle, ctx.num_tensors = handle, len(tensors)
        ctx.weight_positions = _grad_weights(spec)
        ctx.save_for_backward(outs[-1], anchor)
        ctx.mark_non_differentiable(outs[-1])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        token, anchor = ctx.saved_tensors
        weight_grads = _module(ctx.handle)._run_backward(int(token), grads[:-1])
        tensor_grads: list[Any] = [None] * ctx.num_tensors
        for k, g in zip(ctx.weight_positions, weight_grads):
            tensor_grads[k] = g
        return (None, None, torch.zeros_like(anchor), None, *tensor_grads)


# -- input forms -----------------------------------------------------------------------------

def _weights_values(w: Any) -> Any:
    """The per-id weights of any input form (a 1-D values tensor)."""
    if isinstance(w, (tuple, list)) and len(w) == 2 and isinstance(w[0], (torch.Tensor, np.ndarray, list, tuple)):
        return w[0]  # a (values, offsets|lengths) pair's values
    if isinstance(w, (RaggedIds, SparseIds)):
        return _tensor(w.values)
    if isinstance(w, torch.Tensor):
        if w.is_nested:
            return w.values()
        if w.layout == torch.sparse_coo:
            return w._values()
        return w
    return w


def _partial_pair_error(name: str, batch: int, n: int) -> InputError:
    return InputError(
        f"Invalid input for feature {name!r}: a (values, offsets|lengths) pair is read by its length: "
        f"{batch + 1} offsets or {batch} lengths for the batch size {batch}. Received: {n} entries, which "
        f"could be the offsets of {n - 1} samples or the lengths of {n} (a smaller batch than {batch}). "
        "Fix: for a smaller batch pass me.RaggedIds(offsets, values) or "
        "torch.nested.nested_tensor_from_jagged(values, offsets) (offsets: samples + 1 entries), or "
        "dense ids of shape [samples, ...]."
    )


def _flatten(name: str, batch: int, x: Any, w: Any) -> tuple[str, list[torch.Tensor], int]:
    """One feature's input as (spec entry, tensors, number of samples); see the ops' spec
    comment. The number of samples may be below the configured ``batch`` (a capacity)."""
    samples = None
    if isinstance(x, RaggedIds):  # explicit row splits: any number of samples up to the batch
        kind, ts = "o", [_tensor(x.values), _tensor(x.row_splits)]
        if ts[1].dim() == 1 and ts[1].shape[0] >= 1:
            samples = ts[1].shape[0] - 1
    elif isinstance(x, SparseIds):  # tensors stay tensors: under torch.compile they are graph inputs
        dims = x.dense_shape if isinstance(x.dense_shape, (tuple, list, torch.Size)) else np.asarray(x.dense_shape).reshape(-1)
        dims = [int(s) for s in dims]
        kind, ts = "s:" + "x".join(str(s) for s in dims), [_tensor(x.indices), _tensor(x.values)]
        samples = dims[0] if dims else None
    elif isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise InputError(
                f"Invalid input for feature {name!r}: expected a (values, offsets) or (values, lengths) "
                f"pair. Received: a {type(x).__name__} of {len(x)} items."
            )
        values, other = _as_tensor(name, "ids", x[0]), _as_tensor(name, "offsets or lengths", x[1])
        n = other.shape[0] if other.dim() == 1 else -1
        if n == batch + 1:
            kind = "o"
        elif n == batch:
            kind = "l"  # the op body refuses offsets of batch - 1 samples read as lengths
        elif 0 < n < batch:
            raise _partial_pair_error(name, batch, n)
        else:
            raise InputError(
                f"Invalid input for feature {name!r}: the second tensor of a (values, offsets|lengths) "
                f"pair must have {batch + 1} offsets or {batch} lengths (batch {batch}). Received: "
                f"shape={tuple(other.shape)}"
            )
        ts = [values, other]
    elif isinstance(x, torch.Tensor) and x.is_nested:
        kind, ts = "o", [x.values(), x.offsets()]
        samples = x.size(0)
    elif isinstance(x, torch.Tensor) and x.layout == torch.sparse_coo:
        kind = "s:" + "x".join(str(int(s)) for s in x.shape)
        ts = [x._indices().t(), x._values()]
        samples = x.shape[0] if x.dim() else None
    else:
        x = x if isinstance(x, torch.Tensor) else _as_tensor(name, "ids", x)
        kind, ts = "d", [x]
        samples = x.shape[0] if x.dim() else None
    if samples is None:
        samples = batch  # a malformed input: the engine names what is wrong
    elif samples > batch:
        raise InputError(
            f"Invalid input for feature {name!r}: {samples} samples, more than the batch size {batch} the "
            "module was built for (the feature's input_shape[0], a capacity: smaller batches are fine). "
            "Fix: split the batch, or build the module with a larger batch size."
        )
    if w is not None:
        wt = _as_tensor(name, "weights", _weights_values(w))
        kind += "wg" if wt.requires_grad and torch.is_grad_enabled() else "w"
        ts.append(wt)
    return kind, ts, samples


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


def _padded_splits(splits: np.ndarray, batch: int) -> np.ndarray:
    """Row splits of ``b <= batch`` samples as ``batch`` samples, the missing ones empty."""
    if splits.ndim != 1 or not 1 <= splits.shape[0] < batch + 1:
        return splits
    return np.concatenate([splits, np.full(batch + 1 - splits.shape[0], splits[-1], dtype=splits.dtype)])


def _engine_input(name: str, kind: str, ts: Sequence[torch.Tensor], shape: tuple[int, ...]) -> tuple[Any, Any]:
    """Rebuild the engine's input form from a spec entry and its tensors, with ``shape[0]``
    samples (fewer given: the missing ones empty). (The engine keeps private copies of what it
    validated, so a buffer the compiled graph reuses is safe.)"""
    # NumPy: the engine duck-types COO weights by an `indices` attribute, which every tensor has
    kind = kind.rstrip("g")
    weights = ts[-1].detach().cpu().numpy() if kind.endswith("w") else None
    kind = kind.rstrip("w")
    batch = shape[0]
    if kind == "d":
        x = ts[0]
        if weights is None and x.dim() >= 1 and x.shape[0] < batch:  # fewer samples: COO of the given ones
            rest = tuple(x.shape[1:])
            if rest == shape[1:] + (1,):
                rest = shape[1:]
            if rest == shape[1:]:
                index = np.indices((x.shape[0],) + rest).reshape(len(shape), -1).T
                return SparseIds(index, x.reshape(-1), np.asarray(shape, dtype=np.int64)), None
        return x, weights
    if kind == "o":
        splits = ts[1]
        if splits.dim() == 1 and 1 <= splits.shape[0] < batch + 1:
            splits = _padded_splits(splits.detach().cpu().numpy().astype(np.int64), batch)
        return RaggedIds(splits, ts[0]), weights
    if kind == "l":
        lengths = ts[1].detach().cpu().numpy()
        if lengths.dtype.kind not in "iu":
            return RaggedIds(lengths, ts[0]), weights  # the engine names the bad dtype
        n = int(ts[0].reshape(-1).shape[0])
        if lengths.ndim == 1 and (lengths.sum() != n or (lengths < 0).any()):
            offsets = lengths.shape[0] >= 1 and lengths[0] == 0 and lengths[-1] == n and (np.diff(lengths) >= 0).all()
            raise InputError(
                f"Invalid input for feature {name!r}: a (values, offsets|lengths) pair with {batch} entries "
                f"(the batch size) is read as lengths, which must be non-negative and sum to the number of "
                f"values ({n}). Received: lengths summing to {int(lengths.sum())}"
                + (f"; they are the offsets of {batch - 1} samples (a smaller batch)" if offsets else "")
                + f". Fix: pass {batch + 1} offsets or {batch} lengths for a full batch; for a smaller one pass "
                "me.RaggedIds(offsets, values) or torch.nested.nested_tensor_from_jagged(values, offsets)."
            )
        splits = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=splits[1:])
        return RaggedIds(splits, ts[0]), weights
    dims = np.asarray([int(s) for s in kind[2:].split("x")], dtype=np.int64)
    if dims.shape[0] >= 1 and dims[0] < batch:
        dims[0] = batch
    return SparseIds(ts[0], ts[1], dims), weights


def _kept(engine_input: Any, shape: tuple[int, ...], n: int) -> np.ndarray | None:
    """Which of a feature's ``n`` ids the engine keeps, in order (None: all): a sequence
    feature drops positions past its length (``inputs.from_ragged`` / ``from_coo``)."""
    if isinstance(engine_input, RaggedIds):
        splits = np.asarray(engine_input.row_splits, dtype=np.int64)
        row = np.repeat(np.arange(splits.shape[0] - 1), np.diff(splits))
        return np.arange(n) - splits[row] < int(np.prod(shape[1:]))
    indices = engine_input.indices
    indices = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    return indices[:, -1] < shape[-1]


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

    The batch size of each feature (``input_shape[0]``) is a capacity: a smaller batch (the
    last one of a ``DataLoader``) is looked up and trained on, and its activations have the
    samples given. A ``(values, offsets|lengths)`` pair is read by its length (B+1 offsets or
    B lengths), so a smaller batch comes as ``me.RaggedIds(offsets, values)``, a jagged tensor,
    dense ids ``[b, ...]`` or COO. Per-id ``weights`` that require grad get their gradient.

    ``parameters()`` and ``named_buffers()`` are empty: the tables are not ``nn.Parameter``s
    (the TPU optimizer updates them in backward, so no dense optimizer, ``clip_grad_norm_`` or
    DDP all-reduce may touch them); ``state_dict()`` holds them, as ``"<table>.parameters"``
    and ``"<table>.<slot>"`` whole logical tables. ``discard_gradients()`` drops what
    ``fused_optimizer=False`` kept. Threads: forward/backward may run in several threads on
    one module (each table update and each lookup holds one lock; no update is lost).
    ``pipelined=True``: the TPU's pipelined schedule, as ``me.TPUEmbedding(pipelined=True)``
    (a backward's update is applied right after the next forward's lookup; ``state_dict`` and
    ``save`` apply it first).
    """

    _pooled_only = False  # EmbeddingBagCollection: every feature pooled

    def __init__(self, config: Any, *, num_shards: int | None = None, process_group: Any = None,
                 device: Any = None, seed: int = 0, fused_optimizer: bool = True,
                 initializers: Mapping[str, Any] | None = None, optimizer: Any = None,
                 batch_size: int | None = None, pipelined: bool = False) -> None:
        super().__init__()
        from meshembed.config import EmbeddingConfig
        from meshembed_torch.backend import TorchBackend

        backend = _checked_backend(TorchBackend(device=device, process_group=_check_group(process_group)))
        if isinstance(config, EmbeddingConfig):
            for name, value in (("optimizer", optimizer), ("batch_size", batch_size)):
                if value is not None:
                    raise ConfigError(
                        f"Invalid `{name}`: it is for a feature_config nest (me.tpu.FeatureConfig leaves); an "
                        f"EmbeddingConfig carries its own optimizers and input shapes. Received: {name}={value!r}")
            engine = TPUEmbedding(config, backend=backend, num_shards=num_shards, seed=seed, initializers=initializers,
                                  pipelined=pipelined)
            self._attach(engine, fused_optimizer)
            return
        engine = _engine_of_nest(config, optimizer, batch_size, initializers,
                                 dict(backend=backend, num_shards=num_shards, seed=seed,
                                      pipeline_execution_with_tensor_core=pipelined))
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
        if self._pooled_only:
            sequences = [f.name for f in engine.layout.features if len(f.output_shape) != 1]
            if sequences:
                raise ConfigError(
                    f"Invalid `config` for {type(self).__name__}: it pools every feature to one [batch, dim] "
                    f"activation (torchrec's EmbeddingBagCollection), but features {sequences} are sequence "
                    "features (input_shape of rank 2 or more). Fix: use me.torch.EmbeddingCollection, which "
                    "takes both.")
        self.engine = engine
        self.fused_optimizer = batches.check_bool(fused_optimizer, "fused_optimizer", ConfigError)  # "no" is truthy
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
        self._signature = ",".join("x".join(map(str, shape)) + ":" + str(dtype).removeprefix("torch.")
                                   for shape, dtype in self._out_specs)
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

    def set_learning_rates(self, learning_rates: Any) -> None:
        """Values of the config's dynamic learning-rate tags, used by every following update
        (host values: a new one every step never recompiles anything): a sequence in tag order
        or a mapping ``{tag: value}``, checked as the engine checks them."""
        self._learning_rates = steps.check_learning_rates(self.engine.layout, learning_rates, self.engine.backend)

    def forward(self, features: Any, weights: Any = None, learning_rates: Any = None) -> Any:
        """Activations by feature name (or in the config's nest: see the class), each with the
        samples given (up to the configured batch size). ``learning_rates`` (optional: a 1-D
        tensor, a list in tag order or a ``{tag: value}`` mapping) overrides
        ``set_learning_rates`` for this batch's update; under ``torch.compile`` none of them
        recompiles per value (dynamo traces a list's floats as symbols)."""
        training = self.training and torch.is_grad_enabled()
        try:
            spec, flat, samples, lrs = self._call_inputs(features, weights, learning_rates, training)
        except MeshembedError as exc:
            if not torch.compiler.is_compiling():
                raise
            # dynamo would turn the raise into `Unsupported`: the op raises it when the graph runs
            spec, flat, samples, lrs = "!" + type(exc).__name__ + ":" + str(exc), [], None, None
        anchor = self.anchor if training else self.anchor.detach()  # inference: no backward
        if torch.compiler.is_compiling():
            outs = torch.ops.meshembed.ec_lookup(self._handle, self._signature + "/" + spec, anchor, flat, lrs)
        else:
            outs = _EagerLookup.apply(self._handle, spec, anchor, lrs, *flat)
        outs = list(outs[:-1])
        if samples is not None:  # a smaller batch: the activations of the samples given
            for k, (b, full) in enumerate(zip(samples, self._batch_sizes)):
                if b != full:
                    outs[k] = outs[k][:b]
        if self._nest is not None:
            return _nest.pack(self._nest, outs, is_feature)
        return {k: outs[i] for k, i in zip(self._keys, self._order)}

    def _call_inputs(self, features: Any, weights: Any, learning_rates: Any, training: bool
                     ) -> tuple[str, list[torch.Tensor], list[int], torch.Tensor | None]:
        """The ops' spec, their flat tensors, each feature's number of samples and the
        learning-rate tensor of one forward (meshembed errors for what is wrong)."""
        if self._nest is not None:
            ids = _nest.match(self._nest, features, "features", is_feature)
            ws = [None] * len(ids) if weights is None else _nest.match(self._nest, weights, "weights", is_feature)
        else:
            ids = self._by_name(features, "features")
            ws = [None] * len(ids) if weights is None else self._by_name(weights, "weights", allow_missing=True)
        kinds, flat, samples = [], [], []
        for name, b, x, w in zip(self._names, self._batch_sizes, ids, ws):
            kind, ts, n = _flatten(name, b, x, w)
            kinds.append(kind)
            flat.extend(ts)
            samples.append(n)
        if any(k.endswith("g") for k in kinds) and self.engine.backend.processes > 1:
            raise InputError(
                f"Invalid `weights`: per-id weights that require grad need the rows they weight, and the "
                f"tables are sharded over {self.engine.backend.processes} ranks (a gather every rank would "
                "have to join). Fix: pass the weights detached (weights.detach()), or keep the tables in one "
                "process.")
        spec = ";".join(kinds) + ("|T" if training else "|I")
        return spec, flat, samples, self._lr_tensor(learning_rates)

    def _lr_tensor(self, learning_rates: Any) -> torch.Tensor | None:
        """``forward``'s learning rates as a float64 tensor, read by tag as the engine reads
        them (a mapping's keys are tags, never rates); checked eagerly, in the op under compile."""
        if learning_rates is None or isinstance(learning_rates, torch.Tensor):
            return learning_rates
        layout = self.engine.layout
        if not torch.compiler.is_compiling():
            return torch.tensor(steps.check_learning_rates(layout, learning_rates, self.engine.backend),
                                dtype=torch.float64)
        values = steps.learning_rate_list(layout, learning_rates)
        if all(isinstance(v, torch.Tensor) for v in values) and values:
            return torch.stack([v.reshape(()).to(torch.float64) for v in values])
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return torch.tensor([float(v) for v in values], dtype=torch.float64)
        raise InputError(
            "Invalid `learning_rates`: expected numbers or 0-d tensors, one per dynamic tag. Received: "
            f"{[type(v).__name__ for v in values]}. Fix: e.g. learning_rates=torch.tensor([0.1]).")

    def apply_gradients(self, learning_rates: Any = None) -> None:
        """``fused_optimizer=False``: send the gradients every backward since the last call
        kept, batch by batch in forward order (each an engine ``apply_gradients``). Every
        batch's gradients and learning rates are checked first: if one is refused (a NaN in a
        later batch, say), nothing is applied and the batches stay kept (``discard_gradients``
        drops them)."""
        if self.fused_optimizer:
            raise StateError(
                "apply_gradients() is for fused_optimizer=False: with the fused optimizer, "
                "loss.backward() already applied the update. Fix: drop the call, or build the "
                "module with fused_optimizer=False."
            )
        if learning_rates is not None:
            self.set_learning_rates(learning_rates)
        engine = self.engine
        with self._update_lock:
            kept = list(self._accumulated)
            if not kept:
                return
            lrs = _check_accumulated(engine.backend, engine.layout, kept, self._learning_rates, engine.allow_nonfinite)
            for (pending, grads, _), values in zip(kept, lrs):
                engine.state = steps.apply_gradients(engine.backend, engine.state, pending,
                                                     batches.structured(engine.layout, grads), values,
                                                     allow_nonfinite=engine.allow_nonfinite, rules=engine.rules)
                self._accumulated.pop(0)

    def discard_gradients(self) -> int:
        """``fused_optimizer=False``: drop the gradients kept since the last ``apply_gradients``
        (e.g. after it refused a batch); returns how many batches were dropped."""
        with self._update_lock:
            n = len(self._accumulated)
            self._accumulated.clear()
        return n

    def __getstate__(self) -> dict:
        raise StateError(
            f"{type(self).__name__} cannot be pickled (torch.save(module), pickle, a spawned process's "
            "arguments): its tables live in a meshembed engine (with its backend, kernels and process group). "
            "Fix: torch.save(module.state_dict(), path) and load_state_dict into a module built from the same "
            "config, or ec.save(path) / me.torch.EmbeddingCollection.restore(path).")

    def __copy__(self) -> "EmbeddingCollection":
        """A shallow copy: the same engine and op handle (``copy.deepcopy`` makes a new one)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def save(self, path: Any) -> Any:
        """A portable meshembed checkpoint (any backend / shard count restores it)."""
        return self.engine.save(path)

    @classmethod
    def restore(cls, path: Any, *, num_shards: int | None = None, device: Any = None,
                fused_optimizer: bool = True, process_group: Any = None) -> "EmbeddingCollection":
        """A module from a portable checkpoint (``save``, or ``TPUEmbedding.save`` anywhere);
        outputs keyed by feature name (the checkpoint keeps no feature_config nest)."""
        from meshembed_torch.backend import TorchBackend

        backend = _checked_backend(TorchBackend(device=device, process_group=_check_group(process_group)))
        engine = TPUEmbedding.restore(path, backend=backend, num_shards=num_shards)
        return cls._from_engine(engine, fused_optimizer)

    def __deepcopy__(self, memo: dict) -> "EmbeddingCollection":
        """A copy with its own engine (and op handle): the same tables, slots, step, mode and
        learning rates (copying the handle would route the copy's ops to this module)."""
        e = self.engine
        engine = TPUEmbedding(e.config, backend=e.backend, num_shards=e.num_shards, seed=e.seed,
                              initializers={t: "zeros" for t in e.table_names}, pipelined=e.pipelined)
        for table in e.table_names:
            values = e.retrieve_parameters(table)
            engine.load_parameters(table, values.pop("parameters"), **values)
        engine.step = e.step
        for table, vocabulary in e.vocabularies.items():  # dynamic tables: the same keys on the same rows
            engine.load_vocabulary(table, vocabulary)
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
                shape = (t.vocabulary_size, slot_width(t.optimizer, name, t.dimension))  # row-wise slots: 1 column
                given[name] = _state_array(key, state_dict[key], shape, table)
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
        """Config-order values by the engine's one rule (``batch.by_feature``); a module of one
        feature also takes that feature's input bare (a tensor or an ``(ids, offsets)`` pair)."""
        if len(self._names) == 1 and not isinstance(values, Mapping) and not (
                isinstance(values, (list, tuple)) and len(values) == 1):
            return [values]
        return batches.by_feature(self.engine.layout, values, what, allow_none=allow_missing)

    def _run_forward(self, spec: str, tensors: Sequence[torch.Tensor], lrs: torch.Tensor | None) -> list[torch.Tensor]:
        if spec.startswith("!"):
            _raise_error_spec(spec)
        kinds, mode = spec.split("|")
        training = mode == "T"
        engine = self.engine
        layout = engine.layout
        feats, weights, wanted, k = [], [], {}, 0
        for i, (name, f, kind) in enumerate(zip(self._names, layout.features, kinds.split(";"))):
            n = (1 if kind.startswith("d") else 2) + ("w" in kind[-2:])
            x, w = _engine_input(name, kind, tensors[k:k + n], f.output_shape)
            feats.append(x)
            weights.append(w)
            if kind.endswith("g"):
                wanted[i] = tensors[k + n - 1]
            k += n
        lr_list = None if lrs is None else steps.check_learning_rates(layout, lrs.detach().cpu().reshape(-1),
                                                                         engine.backend)
        # config-order lists, in the engine's structure (a dict when the config's features were);
        # this forward's own batch: nothing of the engine's (its pending batch) is touched
        pending = steps.prepare_on(engine.backend, engine.key_layout, batches.structured(layout, feats),
                                   None if all(w is None for w in weights) else batches.structured(layout, weights),
                                   training=training)
        with self._update_lock:  # rows as of one update, never half of another thread's
            if engine.vocabularies:  # dynamic tables: keys -> rows; rows awaiting a backward are kept
                if wanted:
                    raise InputError("Per-id weights with requires_grad are not supported with dynamic "
                                     "vocabulary tables (keys without a row leave the batch). Fix: pass "
                                     "weights without requires_grad.")
                kept = [entry[0] for entry in self._batches.values()] + [entry[0] for entry in self._accumulated]
                pending = engine.map_batch(pending, keep=kept)
            acts = steps.lookup(engine.backend, engine.state, pending)
            engine.flush()  # pipelined: the previous step's update, right after this lookup
            jacobians = {i: self._weight_jacobian(i, pending, acts[i], feats[i], weights[i]) + (wt.shape, wt.dtype)
                         for i, wt in wanted.items()}
        keep = training or bool(jacobians)
        token = torch.tensor(next(_TOKENS) if keep else 0, dtype=torch.int64)
        if keep:
            key = int(token)
            self._batches[key] = (pending, lr_list, jacobians, training)
            weakref.finalize(token, self._batches.pop, key, None)
        return [a if a.is_contiguous() else a.contiguous() for a in acts] + [token]

    def _weight_jacobian(self, k: int, batch: Any, act: torch.Tensor, engine_input: Any,
                         weights: np.ndarray) -> tuple:
        """What feature ``k``'s weight gradient needs: ``∂act[slot_j]/∂w_j`` for each id ``j``
        the engine kept (its slot's combiner: sum ``row_j``; mean ``(row_j - act) / Σw``;
        sqrtn ``(row_j - act·w_j/S) / S`` with ``S = sqrt(Σw²)``; zero where the normaliser is),
        the slots, which of the given ids were kept, and the weights' count."""
        engine = self.engine
        f = engine.layout.features[k]
        t = engine.layout.tables[f.table]
        d = batch.features[k]
        backend = engine.backend
        rows = precision.lookup_rows(backend, engine.state.tables[t.index][0], batch.device_array(backend, k, "ids"),
                                     precision.array_dtypes(t)[0])  # float32 rows (16-bit storage widened)
        quant = getattr(t.optimizer, "simulated_quantization", None)
        if quant is not None and getattr(quant, "enabled", True):  # the rows the lookup combined
            from meshembed.math import quantize

            lo = -np.inf if quant.lower is None else quant.lower
            hi = np.inf if quant.upper is None else quant.upper
            rows = quantize(backend.xp, rows, lo, hi, quant.num_buckets)
        rows = rows.float().clone()  # gather may hand out a recycled buffer
        slots = torch.from_numpy(np.array(d.slots, dtype=np.int64)).to(rows.device)  # a copy: batches are read-only
        n = weights.shape[0]
        kept = None if d.ids.shape[0] == n else _kept(engine_input, f.output_shape, n)
        w = torch.from_numpy(np.array(weights if kept is None else weights[kept], order="C")).to(rows.device)
        combiner = str(t.combiner).lower()
        if combiner != "sum":
            sq = combiner == "sqrtn"
            sums = torch.zeros(d.num_slots, dtype=torch.float64, device=rows.device)
            sums.index_add_(0, slots, w.double() ** 2 if sq else w.double())
            norm = (sums.sqrt() if sq else sums).float()[slots]
            inv = torch.where(norm != 0, 1.0 / torch.where(norm != 0, norm, 1.0), 0.0)
            a = act.reshape(d.num_slots, -1).float()[slots]
            rows = (rows - a * (w * inv)[:, None] if sq else rows - a) * inv[:, None]
        return slots, rows, None if kept is None else torch.from_numpy(kept).to(rows.device), n

    def _run_backward(self, key: int, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Applies (or keeps) the batch's update; returns the gradients of the weights that
        need one, in feature order."""
        entry = self._batches.pop(key, None)
        if entry is None:
            raise StateError(
                "EmbeddingCollection backward: this batch's lookup is gone (its backward already "
                "ran, or the forward ran in eval()/no_grad mode). Fix: one backward per training forward; "
                "use retain_graph=False."
            )
        pending, lrs, jacobians, training = entry
        weight_grads = []
        for k, (slots, jac, kept, n, shape, dtype) in jacobians.items():
            per_id = (grads[k].reshape(-1, jac.shape[1]).float().index_select(0, slots) * jac).sum(1)
            if kept is not None:
                per_id = per_id.new_zeros(n).masked_scatter_(kept, per_id)
            weight_grads.append(per_id.reshape(shape).to(dtype))
        if training:
            if self.fused_optimizer:
                self._send(pending, list(grads), lrs)
            else:
                self._accumulated.append((pending, [g.detach().clone() for g in grads], lrs))
        return weight_grads

    def _send(self, pending: Any, grads: list, lrs: Any) -> None:
        engine = self.engine
        if lrs is None:
            lrs = self._learning_rates if self._learning_rates is not None else ()
        with self._update_lock:  # applied now, or kept until the next lookup (pipelined)
            engine.send(pending, batches.structured(engine.layout, list(grads)), lrs)


class EmbeddingBagCollection(EmbeddingCollection):
    """torchrec's name for the pooled module: an :class:`EmbeddingCollection` whose features
    are all pooled (``input_shape`` of rank 1: one ``[batch, dim]`` activation per feature, as
    ``nn.EmbeddingBag``). The name only: it takes and returns dicts (or the config's nest),
    not torchrec's ``KeyedJaggedTensor`` / ``KeyedTensor``. A sequence feature is refused."""

    _pooled_only = True


@agreed("apply_gradients", backend_of=first_argument)
def _check_accumulated(backend: Any, layout: Any, kept: list, module_lrs: Any, allow_nonfinite: bool) -> list:
    """Every kept batch's gradients and learning rates checked (agreed by every process)
    before any is applied; returns each batch's learning rates."""
    out = []
    for i, (_, grads, lrs) in enumerate(kept):
        try:
            steps.check_gradients(backend, layout, batches.structured(layout, grads), check_now=not allow_nonfinite)
            out.append(steps.check_learning_rates(layout, lrs if lrs is not None else
                                                  module_lrs if module_lrs is not None else (), backend))
        except InputError as exc:
            raise type(exc)(
                f"apply_gradients(): batch {i + 1} of the {len(kept)} kept: {exc} Nothing was applied; the batches "
                "stay kept. Fix: apply_gradients() again once the cause is fixed (e.g. set_learning_rates), or "
                "discard_gradients() to drop them all.") from None
    validated(backend)
    return out


def _checked_backend(backend: Any) -> Any:
    if backend.device.type == "meta":
        raise ConfigError(
            "Invalid `device`: EmbeddingCollection cannot be built on the meta device: its tables are data "
            "(the config's initializers fill them at construction; lookups and state_dict read them). Fix: "
            "build it on 'cpu' or 'cuda' (there is no meta-then-materialize step).")
    return backend


def _state_array(key: str, v: Any, shape: tuple[int, int], table: str) -> np.ndarray:
    """A state_dict entry as a host array of the whole logical table (the engine's load
    checks its dtype and values); anything else an InputError naming the key."""
    expected = f"expected a tensor of shape {shape} (the whole logical table {table!r})"
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_nested or v.device.type == "meta":
            raise InputError(
                f"Invalid state_dict entry {key!r}: {expected}, dense and holding data. Received: a "
                f"{v.layout} tensor on {v.device}{' (nested)' if v.is_nested else ''}. Nothing was loaded.")
        v = v.detach().cpu()
        arr = (v.float() if v.dtype == torch.bfloat16 else v).numpy()  # NumPy has no bfloat16
    elif isinstance(v, np.ndarray):
        arr = v
    else:
        raise InputError(
            f"Invalid state_dict entry {key!r}: {expected}. Received: {type(v).__name__}. Nothing was loaded.")
    if arr.shape != shape:
        raise InputError(
            f"Invalid state_dict entry {key!r}: {expected}. Received: shape={arr.shape}. Nothing was loaded.")
    return arr


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
    flat = flat_features(nest)
    untrained = [p or "<top>" for p, f in flat if getattr(f.table, "optimizer", None) is None]
    if optimizer is None and untrained:
        raise ConfigError(
            f"Invalid `optimizer`: the tables of features {untrained} have no optimizer, and the module trains "
            "them in backward. Fix: pass optimizer= (used by every table without one), or give each "
            "me.tpu.TableConfig(optimizer=...).")
    unknown = [p or "<top>" for p, f in flat if f.output_shape is None]
    if unknown and batch_size is None:
        raise ConfigError(
            f"Invalid `batch_size`: features {unknown} have no output shape, and the module needs every "
            "shape when it is built (its ops have static shapes). Fix: pass batch_size=, or give "
            "me.tpu.FeatureConfig(output_shape=...).")
    emb = TFEmbedding(nest, optimizer, **engine_args)
    if batch_size is not None:
        emb.build(per_replica_batch_size=batch_size)
    return emb.engine
