"""Differential conformance: the same config, ids and gradients through meshembed and a
foreign implementation for a few CPU steps; per table and slot the largest difference in
ulps and relative terms, next to the gap report that should explain it.

A row is ``exact`` (0 ulp), ``rounding`` (nonzero but within ``ROUNDING`` of the array's
largest value: float32 operation order), ``explained`` (larger, and the translation reported
a gap for that table's optimizer) or ``FINDING`` (larger with no gap to explain it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshembed.errors import ConfigError
from meshembed.interop._gaps import GapReport

#: A difference whose size, relative to the largest value of the array, is at
#: most 2**-20 (8 float32 ulps of that value) is float32 operation order (the order a bag's
#: rows or a row's gradients are summed in), not semantics: status ``rounding``.
ROUNDING = 2.0 ** -20

__all__ = ["ROUNDING", "ConformanceReport", "ConformanceRow", "compare_keras_rs", "compare_torchrec", "run_conformance", "ulp_distance"]


def ulp_distance(a: Any, b: Any) -> np.ndarray:
    """Elementwise distance in units in the last place (float32 or float64): the number of
    representable values between ``a`` and ``b``. Equal NaNs are 0 apart, NaN vs a number is
    the largest distance; +0 and -0 are 0 apart."""
    a, b = np.asarray(a), np.asarray(b)
    dtype = np.result_type(a.dtype, b.dtype)
    if dtype not in (np.float32, np.float64):
        dtype = np.dtype(np.float64)
    a, b = np.broadcast_arrays(a.astype(dtype), b.astype(dtype))
    ints = np.int32 if dtype == np.float32 else np.int64

    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.view(ints).astype(np.int64) if dtype == np.float32 else x.view(ints).astype(object)
        sign_min = np.int64(np.iinfo(ints).min)
        return np.where(i < 0, sign_min - i, i)

    d = np.abs(ordered(a) - ordered(b)).astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    d = np.where(nan_a & nan_b, 0.0, d)
    return np.where(nan_a ^ nan_b, np.inf, d)


@dataclass(frozen=True)
class ConformanceRow:
    case: str  #: e.g. ``"torchrec exact_adagrad/mean"``
    table: str
    slot: str  #: ``parameters``, a slot name, or ``activations``
    max_ulp: float
    max_rel: float
    explained_by: tuple[str, ...]  #: gap fields that explain a difference
    normwise: float = 0.0  #: ``max|a - b| / max|b|`` over the whole array

    @property
    def status(self) -> str:
        if self.max_ulp == 0:
            return "exact"
        if self.normwise <= ROUNDING:
            return "rounding"
        return "explained" if self.explained_by else "FINDING"


class ConformanceReport(tuple):
    """A tuple of ``ConformanceRow`` with the gap reports; ``str()`` is a table."""

    gaps: dict[str, GapReport]

    def __new__(cls, rows: Sequence[ConformanceRow], gaps: dict[str, GapReport]) -> ConformanceReport:
        self = super().__new__(cls, rows)
        self.gaps = gaps
        return self

    @property
    def findings(self) -> tuple[ConformanceRow, ...]:
        return tuple(r for r in self if r.status == "FINDING")

    def __str__(self) -> str:
        head = f"{'case':34} {'table':8} {'slot':14} {'max ulp':>10} {'max rel':>10} {'normwise':>10}  status"
        lines = [head, "-" * len(head)]
        for r in self:
            why = f" ({', '.join(r.explained_by)})" if r.status == "explained" else ""
            lines.append(f"{r.case:34} {r.table:8} {r.slot:14} {r.max_ulp:>10.0f} {r.max_rel:>10.2e} {r.normwise:>10.2e}  {r.status}{why}")
        for case, report in self.gaps.items():
            lines.append(f"\n{case} gap report:\n  " + str(report).replace("\n", "\n  "))
        return "\n".join(lines)


def _diff(a: Any, b: Any) -> tuple[float, float, float]:
    """(max ulp, max elementwise relative, normwise relative) difference of two arrays."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.size == 0:
        return 0.0, 0.0, 0.0
    ulp = float(ulp_distance(a, b).max())
    err = np.abs(a.astype(np.float64) - b)
    scale = np.maximum(np.abs(a), np.abs(b)).astype(np.float64)
    rel = np.where(scale > 0, err / np.where(scale > 0, scale, 1), 0.0)
    top = float(scale.max())
    return ulp, float(rel.max()), float(err.max() / top) if top > 0 else 0.0


def _row(case: str, table: str, slot: str, diff: tuple[float, float, float],
         explained: tuple[str, ...]) -> ConformanceRow:
    return ConformanceRow(case, table, slot, diff[0], diff[1], explained if diff[0] else (), diff[2])


# --------------------------------------------------------------------- torchrec / fbgemm
class _Collection:
    """torchrec's ``FusedEmbeddingBagCollection`` (fbgemm's CPU TBE underneath)."""

    def __init__(self, tables: list[Any], opt: str, kwargs: dict[str, Any]) -> None:
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        from meshembed.interop._torchrec import _torch_optimizer_class

        self.module = FusedEmbeddingBagCollection(tables, _torch_optimizer_class(opt),
                                                  {"lr" if k == "learning_rate" else k: v for k, v in kwargs.items()})

    def weight(self, table: str) -> Any:
        return self.module.embedding_bags[table].weight

    def accumulator(self, table: str) -> Any:
        state = self.module.fused_optimizer().state_dict()["state"].get(f"{table}.weight", {})  # none for SGD
        return state.get(f"{table}.weight.momentum_1")

    def step(self, keys: list[str], lengths: dict[str, np.ndarray], values: dict[str, np.ndarray],
             grads: np.ndarray) -> list[np.ndarray]:
        import torch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.as_tensor(np.concatenate([values[k] for k in keys])),
            lengths=torch.as_tensor(np.concatenate([lengths[k] for k in keys])))
        out = self.module(kjt)
        acts = out.to_dict()
        acts = [acts[k].detach().numpy().copy() for k in keys]
        out.values().backward(torch.as_tensor(grads))
        return acts


class _BareTbe:
    """fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU, one feature_table_map entry per feature."""

    def __init__(self, tables: list[Any], opt: str, kwargs: dict[str, Any]) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        from torchrec.modules.embedding_configs import pooling_type_to_pooling_mode

        poolings = {t.pooling for t in tables}
        if len(poolings) != 1:
            raise ConfigError(f"One TBE op pools one way. Expected the same pooling for every table. Received: "
                              f"{sorted(p.value for p in poolings)}")
        self.names = [t.name for t in tables]
        self.module = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
                             for t in tables],
            feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
            optimizer=EmbOptimType(opt), pooling_mode=pooling_type_to_pooling_mode(poolings.pop()), **kwargs)
        self.dims = [t.embedding_dim for t in tables for _ in t.feature_names]

    def weight(self, table: str) -> Any:
        return self.module.split_embedding_weights()[self.names.index(table)]

    def accumulator(self, table: str) -> Any:
        states = self.module.split_optimizer_states()  # [] for SGD
        states = states[self.names.index(table)] if states else ()
        return states[0] if states else None

    def step(self, keys: list[str], lengths: dict[str, np.ndarray], values: dict[str, np.ndarray],
             grads: np.ndarray) -> list[np.ndarray]:
        import torch

        flat = np.concatenate([lengths[k] for k in keys])
        out = self.module(torch.as_tensor(np.concatenate([values[k] for k in keys]), dtype=torch.int64),
                          torch.as_tensor(np.concatenate([[0], np.cumsum(flat)]), dtype=torch.int64))
        cols = np.cumsum([0, *self.dims])
        acts = [out[:, a:b].detach().numpy().copy() for a, b in zip(cols[:-1], cols[1:])]
        out.backward(torch.as_tensor(grads))
        return acts


def compare_torchrec(tables: Any, optimizer: Any, optimizer_kwargs: dict[str, Any] | None = None, *,
                     steps: int = 3, batch_size: int = 4, max_bag_size: int = 3, seed: int = 0,
                     backend: str = "numpy", case: str | None = None, bare_tbe: bool = False) -> ConformanceReport:
    """Train torchrec's ``FusedEmbeddingBagCollection`` (or, ``bare_tbe=True``, fbgemm's
    ``SplitTableBatchedEmbeddingBagsCodegen`` op itself) and a meshembed engine built by
    ``from_torchrec`` from the same rows for ``steps`` steps of random bags and output
    gradients; compare activations each step, then rows and accumulators."""
    import torch

    import meshembed as me
    from meshembed.interop._torchrec import _optimizer_from, from_torchrec

    tables = list(tables)
    cfg, gaps = from_torchrec(tables, optimizer, optimizer_kwargs, batch_size=batch_size)
    opt, kw = _optimizer_from(optimizer, optimizer_kwargs)
    if opt not in ("exact_sgd", "exact_adagrad", "exact_row_wise_adagrad"):
        raise ConfigError(f"compare_torchrec runs fbgemm's exact CPU optimizers. Expected exact_sgd, exact_adagrad or "
                          f"exact_row_wise_adagrad. Received: {opt}")
    given = {"learning_rate" if k == "lr" else k for k in (optimizer_kwargs or {})}
    kwargs = {k: v for k, v in kw.items() if (k in given or k == "learning_rate") and v is not None}
    rng = np.random.default_rng(seed)
    peer = (_BareTbe if bare_tbe else _Collection)(tables, opt, kwargs)
    engine = me.TPUEmbedding(cfg, backend=backend)
    with torch.no_grad():
        for t in cfg.tables:
            w = peer.weight(t.name)
            w.copy_(torch.as_tensor(rng.uniform(-0.5, 0.5, size=tuple(w.shape)).astype(np.float32)))
            arrays = {"parameters": w.detach().numpy()}
            acc = peer.accumulator(t.name)
            slots = engine.table_slot_names(t.name)
            if slots and acc is not None:  # fbgemm starts at 0, the translated spec too
                width = engine.retrieve_parameters(t.name)[slots[0]].shape[1]  # 1: RowWiseAdagrad
                arrays[slots[0]] = np.broadcast_to(acc.detach().numpy().reshape(t.vocabulary_size, -1),
                                                   (t.vocabulary_size, width))
            engine.load_parameters(t.name, **arrays)
    kind = "fbgemm TBE" if bare_tbe else "torchrec"
    name = case or f"{kind} {opt}/{'+'.join(sorted({c.combiner for c in cfg.tables}))}"
    feature_table = {f.name: f.table_name for f in cfg.features}
    by_name = {t.name: t for t in cfg.tables}
    act = {t: (0.0, 0.0, 0.0) for t in by_name}
    keys = [f.name for f in cfg.features]
    for _ in range(steps):
        lengths = {k: rng.integers(1, max_bag_size + 1, size=batch_size) for k in keys}
        values = {k: rng.integers(0, by_name[feature_table[k]].vocabulary_size, size=int(lengths[k].sum()))
                  for k in keys}
        per_feature = [rng.standard_normal((batch_size, by_name[feature_table[k]].dimension)).astype(np.float32)
                       for k in keys]
        engine.enqueue([me.RaggedIds(np.concatenate([[0], np.cumsum(lengths[k])]), values[k]) for k in keys])
        mine = engine.dequeue()
        theirs = peer.step(keys, lengths, values, np.concatenate(per_feature, axis=1))
        for k, a, b in zip(keys, mine, theirs):
            d = _diff(np.asarray(engine.backend.to_numpy(a)), b)
            act[feature_table[k]] = tuple(max(x, y) for x, y in zip(act[feature_table[k]], d))
        engine.apply_gradients(per_feature)
    rows = []
    for t in cfg.tables:
        explained = tuple(f for f in gaps.fields(t.name) if f.startswith("optimizer"))
        rows.append(_row(name, t.name, "activations", act[t.name], explained))
        mine = engine.retrieve_parameters(t.name)
        rows.append(_row(name, t.name, "parameters", _diff(mine["parameters"], peer.weight(t.name).detach().numpy()),
                         explained))
        slots = engine.table_slot_names(t.name)
        acc = peer.accumulator(t.name)
        if slots and acc is not None:
            theirs_acc = np.broadcast_to(acc.detach().numpy().reshape(t.vocabulary_size, -1), mine[slots[0]].shape)
            rows.append(_row(name, t.name, slots[0], _diff(mine[slots[0]], theirs_acc), explained))
    return ConformanceReport(rows, {name: gaps})


# --------------------------------------------------------------------- keras-rs (Keras path)
_KERAS_SLOTS = {"accumulators": "_accumulators", "momenta": "_momentums", "velocities": "_velocities",
                "linears": "_linears"}


def compare_keras_rs(feature_configs: Any, *, steps: int = 3, max_bag_size: int = 3, seed: int = 0,
                     backend: str = "numpy", case: str | None = None) -> ConformanceReport:
    """keras-rs off SparseCore looks tables up with its own layer and trains each table as a
    Keras variable. On the TensorFlow Keras backend this runs the real
    ``keras_rs.layers.DistributedEmbedding`` (its gradients reach the table's Keras optimizer
    as ``IndexedSlices``, one slice per id); on another Keras backend it emulates that path
    with the dense table gradient (what JAX and torch autodiff give). Next to it runs
    meshembed's engine built by ``from_keras_rs``; activations, rows and slots are compared."""
    import keras
    import keras_rs

    import meshembed as me
    from meshembed.interop._keras_rs import _features, from_keras_rs

    feats = _features(feature_configs)
    cfg, gaps = from_keras_rs(feats)
    rng = np.random.default_rng(seed)
    ktables = {f.table.name: f.table for f in feats}
    by_name = {t.name: t for t in cfg.tables}
    real = keras.backend.backend() == "tensorflow"
    if real:
        import tensorflow as tf

        layer = keras_rs.layers.DistributedEmbedding({f.name: f for f in feats})
        layer({f.name: tf.RaggedTensor.from_row_splits(np.zeros(f.input_shape[0], np.int64),
                                                       np.arange(f.input_shape[0] + 1)) for f in cfg.features})
        found = {t: [v for v in layer.trainable_variables if v.path.split("/")[-2:-1] == [t]] for t in by_name}
        if any(len(v) != 1 for v in found.values()):
            raise ConfigError(f"keras-rs' layer variables {[v.path for v in layer.trainable_variables]} do not match "
                              f"the tables {sorted(by_name)} one to one.")
    engine = me.TPUEmbedding(cfg, backend=backend)
    variables, optimizers, slot_map = {}, {}, {}
    for t in cfg.tables:
        rows = rng.uniform(-0.5, 0.5, size=(t.vocabulary_size, t.dimension)).astype(np.float32)
        engine.load_parameters(t.name, parameters=rows)
        if real:
            variables[t.name] = found[t.name][0]
            variables[t.name].assign(rows)
        else:
            variables[t.name] = keras.Variable(rows, name=t.name)
        opt = ktables[t.name].optimizer
        opt = keras.optimizers.get(opt) if isinstance(opt, str) else opt
        opt = opt.__class__.from_config(opt.get_config())  # a fresh optimizer per comparison
        opt.build([variables[t.name]])
        optimizers[t.name] = opt
        names = engine.table_slot_names(t.name)  # keras' slot starts (e.g. Adagrad's) into the engine
        slot_map[t.name] = {n: getattr(opt, _KERAS_SLOTS[n])[0] for n in names
                            if n in _KERAS_SLOTS and getattr(opt, _KERAS_SLOTS[n], None)}
        if slot_map[t.name]:
            engine.load_parameters(t.name, **{n: np.asarray(v) for n, v in slot_map[t.name].items()})
    name = case or "keras_rs " + "+".join(sorted({type(optimizers[t.name]).__name__ for t in cfg.tables}))
    act = {t.name: (0.0, 0.0, 0.0) for t in cfg.tables}
    for _ in range(steps):
        batches, grads = [], []
        for f in cfg.features:
            t = by_name[f.table_name]
            lengths = rng.integers(1, max_bag_size + 1, size=f.input_shape[0])
            ids = rng.integers(0, t.vocabulary_size, size=int(lengths.sum()))
            batches.append((np.concatenate([[0], np.cumsum(lengths)]), ids))
            grads.append(rng.standard_normal((f.input_shape[0], t.dimension)).astype(np.float32))
        engine.enqueue([me.RaggedIds(splits, ids) for splits, ids in batches])
        mine = engine.dequeue()
        if real:
            inputs = {f.name: tf.RaggedTensor.from_row_splits(ids, splits) for f, (splits, ids) in zip(cfg.features,
                                                                                                      batches)}
            with tf.GradientTape() as tape:
                out = layer(inputs)
            theirs = [np.asarray(out[f.name]) for f in cfg.features]
            table_vars = [variables[t] for t in by_name]
            table_grads = dict(zip(by_name, tape.gradient([out[f.name] for f in cfg.features], table_vars,
                                                          output_gradients=[tf.constant(g) for g in grads])))
        else:
            theirs, table_grads = _emulated_keras_path(cfg, by_name, variables, batches, grads)
        for f, a, b in zip(cfg.features, mine, theirs):
            d = _diff(np.asarray(engine.backend.to_numpy(a)), b)
            act[f.table_name] = tuple(max(x, y) for x, y in zip(act[f.table_name], d))
        engine.apply_gradients(grads)
        for t in by_name:
            optimizers[t].apply_gradients([(table_grads[t], variables[t])])
    rows = []
    for t in cfg.tables:
        explained = tuple(f for f in gaps.fields(t.name) if f.startswith("optimizer"))
        mine = engine.retrieve_parameters(t.name)
        rows.append(_row(name, t.name, "activations", act[t.name], explained))
        rows.append(_row(name, t.name, "parameters", _diff(mine["parameters"], np.asarray(variables[t.name])),
                         explained))
        for slot, var in slot_map[t.name].items():
            rows.append(_row(name, t.name, slot, _diff(mine[slot], np.asarray(var)), explained))
    return ConformanceReport(rows, {name: gaps})


def _emulated_keras_path(cfg: Any, by_name: dict[str, Any], variables: dict[str, Any], batches: list[Any],
                         grads: list[np.ndarray]) -> tuple[list[np.ndarray], dict[str, Any]]:
    """keras-rs' default-device lookup (gather, weight by the combiner, sum per sample) and
    the dense table gradient autodiff gives for it: the foreign side's reference."""
    import keras

    theirs, dense = [], {t: np.zeros((by_name[t].vocabulary_size, by_name[t].dimension), np.float32)
                         for t in by_name}
    for f, (splits, ids), g in zip(cfg.features, batches, grads):
        t = by_name[f.table_name]
        lengths = np.diff(splits)
        w = {"sum": np.ones(len(lengths)), "mean": 1.0 / lengths, "sqrtn": 1.0 / np.sqrt(lengths)}[t.combiner]
        w = np.repeat(w, lengths).astype(np.float32)
        theirs.append(np.add.reduceat(np.asarray(variables[t.name])[ids] * w[:, None], splits[:-1], axis=0))
        np.add.at(dense[t.name], ids, np.repeat(g, lengths, axis=0) * w[:, None])
    return theirs, {t: keras.ops.convert_to_tensor(v) for t, v in dense.items()}


def _keras_rs_cases(backend: str, steps: int) -> ConformanceReport:
    """SGD, Adagrad, Adam and Ftrl, each on a sum and a mean table."""
    import keras
    import keras_rs

    rows, gaps = [], {}
    for make in (lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adagrad(0.1),
                 lambda: keras.optimizers.Adagrad(0.1, epsilon=0.0), lambda: keras.optimizers.Adam(0.01),
                 lambda: keras.optimizers.Ftrl(0.1)):
        feats = []
        for combiner, vocab, dim in (("sum", 20, 8), ("mean", 7, 4)):
            t = keras_rs.layers.TableConfig(name=f"t_{combiner}", vocabulary_size=vocab, embedding_dim=dim,
                                            optimizer=make(), combiner=combiner,
                                            initializer=keras.initializers.TruncatedNormal(stddev=dim ** -0.5))
            feats.append(keras_rs.layers.FeatureConfig(name=f"f_{combiner}", table=t, input_shape=(4,),
                                                       output_shape=(4, dim)))
        opt = feats[0].table.optimizer
        eps = f" eps={opt.epsilon:g}" if isinstance(opt, keras.optimizers.Adagrad) else ""
        report = compare_keras_rs(feats, steps=steps, backend=backend, case=f"keras_rs {type(opt).__name__}{eps}")
        rows += list(report)
        gaps.update(report.gaps)
    return ConformanceReport(rows, gaps)


def _torchrec_cases(backend: str, steps: int, bare_tbe: bool = False) -> ConformanceReport:
    """SGD, Adagrad and row-wise Adagrad, each with SUM and MEAN pooling, two tables."""
    import torch
    import torchrec.optim as trec_optim
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    rows, gaps = [], {}
    for opt, kw in ((torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1, "eps": 0.0}),
                    (torch.optim.Adagrad, {"lr": 0.1}), (trec_optim.RowWiseAdagrad, {"lr": 0.1})):
        for pooling in (PoolingType.SUM, PoolingType.MEAN):
            tables = [EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t0", feature_names=["f0", "f1"],
                                         pooling=pooling),
                      EmbeddingBagConfig(num_embeddings=7, embedding_dim=4, name="t1", feature_names=["f2"],
                                         pooling=pooling)]
            eps = f" eps={kw['eps']:g}" if "eps" in kw else ""
            case = f"{'fbgemm TBE' if bare_tbe else 'torchrec'} {opt.__name__}{eps}/{pooling.value.lower()}"
            report = compare_torchrec(tables, opt, kw, steps=steps, backend=backend, case=case, bare_tbe=bare_tbe)
            rows += list(report)
            gaps.update(report.gaps)
    return ConformanceReport(rows, gaps)


def run_conformance(against: Sequence[str], *, backend: str = "numpy", steps: int = 3) -> ConformanceReport:
    """The CLI's ``meshembed conformance --against torchrec,keras_rs``: every built-in case."""
    runners = {"torchrec": _torchrec_cases, "fbgemm": lambda b, s: _torchrec_cases(b, s, bare_tbe=True),
               "keras_rs": _keras_rs_cases}
    unknown = [a for a in against if a not in runners]
    if unknown or not against:
        raise ConfigError(f"Invalid `--against` {list(against)}. Expected a comma-separated subset of "
                          f"{sorted(runners)}.")
    rows, gaps = [], {}
    for name in dict.fromkeys(against):
        report = runners[name](backend, steps)
        rows += list(report)
        gaps.update(report.gaps)
    return ConformanceReport(rows, gaps)


def cli_main(args: Any) -> int:
    """``meshembed conformance --against ...``: print the report (and ``--json``); exit 1 on a finding."""
    import json

    against = [a.strip() for a in args.against.split(",") if a.strip()]
    report = run_conformance(against, backend=args.backends or "numpy", steps=args.steps)
    print(report)
    if args.json:
        rows = [{**r.__dict__, "explained_by": list(r.explained_by), "status": r.status} for r in report]
        gaps = {case: [g.__dict__ for g in rep] for case, rep in report.gaps.items()}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "gaps": gaps}, fh, indent=1)
    return 1 if report.findings else 0
