"""torchrec / fbgemm TBE <-> meshembed: configs, optimizer and trained state.

torchrec and fbgemm are imported only inside the functions that need them (the ``interop``
extra). The mapping and every gap are listed in docs/interop.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshembed.config import EmbeddingConfig, FeatureConfig, TableConfig
from meshembed.config.common import parsing_proto
from meshembed.config.optimizers import SGD, Adagrad, AdagradMomentum, DynamicLearningRate
from meshembed.config.rowwise import RowWiseAdagrad, slot_width
from meshembed.errors import ConfigError, InputError
from meshembed.interop._gaps import Translation, _Gaps

__all__ = ["TorchrecConfig", "Uniform", "export_torchrec_state", "from_torchrec", "import_torchrec_state",
           "to_torchrec"]

#: fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` defaults for the kwargs we read.
FBGEMM_DEFAULTS = {"learning_rate": 0.01, "eps": 1.0e-8, "weight_decay": 0.0, "gradient_clipping": False,
                   "max_gradient": 1.0, "max_norm": 0.0, "stochastic_rounding": True,
                   "momentum": 0.9, "beta1": 0.9, "beta2": 0.999, "weight_decay_mode": None}
_POOLING = {"SUM": "sum", "MEAN": "mean"}
_CPU_OPTIMIZERS = ("exact_sgd", "sgd", "exact_adagrad", "exact_row_wise_adagrad", "row_wise_adagrad")


@dataclass(frozen=True)
class Uniform:
    """``U(minval, maxval)`` initialiser: torchrec's default is ``U(±sqrt(1/num_embeddings))``."""

    minval: float
    maxval: float

    def __call__(self, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
        return rng.uniform(self.minval, self.maxval, size=shape).astype(np.float32)


@dataclass
class TorchrecConfig:
    """What ``to_torchrec`` returns: torchrec table configs and the fbgemm optimizer.

    ``optimizer`` is an fbgemm ``EmbOptimType``; ``optimizer_kwargs`` its TBE kwargs
    (``learning_rate``, ``eps``, ...); ``initial_accumulators`` the value each table's
    Adagrad accumulator starts at (fbgemm starts at 0; ``build`` fills it in).
    """

    tables: list[Any]
    optimizer: Any
    optimizer_kwargs: dict[str, Any]
    initial_accumulators: dict[str, float] = field(default_factory=dict)

    def build(self, device: Any = None) -> Any:
        """A ``FusedEmbeddingBagCollection`` (CPU by default) with the accumulators filled in."""
        import torch
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        kwargs = dict(self.optimizer_kwargs)
        ebc = FusedEmbeddingBagCollection(self.tables, _torch_optimizer_class(self.optimizer), kwargs,
                                          device=device)
        state = ebc.fused_optimizer().state_dict()["state"]
        with torch.no_grad():
            for name, value in self.initial_accumulators.items():
                state[f"{name}.weight"][f"{name}.weight.momentum_1"].fill_(value)
        return ebc


def _torch_optimizer_class(opt: Any) -> Any:
    import torch
    import torchrec.optim as trec_optim

    return {"exact_sgd": torch.optim.SGD, "exact_adagrad": torch.optim.Adagrad,
            "exact_row_wise_adagrad": trec_optim.RowWiseAdagrad}[str(opt)]


# --------------------------------------------------------------------- torchrec -> meshembed
def _optimizer_from(optimizer: Any, kwargs: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """(EmbOptimType value, TBE kwargs) from an EmbOptimType or a torch.optim class (as
    ``FusedEmbeddingBagCollection`` takes them), names checked."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kwargs = dict(kwargs or {})
    if isinstance(optimizer, str):
        try:
            optimizer = EmbOptimType(optimizer)
        except ValueError:
            optimizer = None
    if not isinstance(optimizer, EmbOptimType):
        from torchrec.modules.fused_embedding_modules import convert_optimizer_type_and_kwargs

        converted = convert_optimizer_type_and_kwargs(optimizer, kwargs) if isinstance(optimizer, type) else None
        if converted is None:
            raise ConfigError(
                f"Invalid `optimizer`. Expected an fbgemm EmbOptimType or one of torch.optim.SGD, "
                f"torch.optim.Adagrad, torchrec.optim.RowWiseAdagrad, torch.optim.Adam. Received: "
                f"optimizer={optimizer!r}")
        optimizer, kwargs = converted
    if "lr" in kwargs:
        kwargs["learning_rate"] = kwargs.pop("lr")
    unknown = sorted(set(kwargs) - set(FBGEMM_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"Invalid optimizer kwargs {unknown} for fbgemm {optimizer.value}. Expected a subset of "
            f"{sorted(FBGEMM_DEFAULTS)} (fbgemm's TBE takes no others; torch.optim's lr_decay, "
            "initial_accumulator_value, ... do not reach it).")
    return optimizer.value, {**FBGEMM_DEFAULTS, **kwargs}


def _adagrad_like(lr: float, eps: float) -> Adagrad | AdagradMomentum:
    """fbgemm Adagrad: TPU Adagrad when eps == 0, else AdagradMomentum(momentum=0, beta2=1,
    exponent=2) with the epsilon under the root (TPU Adagrad has none)."""
    with parsing_proto():  # fbgemm's values (eps=0, accumulators from 0) are in the engine's domain
        if eps == 0.0:  # then fbgemm's rule is TPU Adagrad's, with accumulators from 0
            return Adagrad(learning_rate=lr, initial_accumulator_value=0.0)
        return AdagradMomentum(learning_rate=lr, momentum=0.0, use_nesterov=False, exponent=2.0,
                               beta2=1.0, epsilon=eps * eps)


def _meshembed_optimizer(opt: str, kw: dict[str, Any], gaps: _Gaps) -> Any:
    lr = float(kw["learning_rate"])
    if opt in ("exact_sgd", "sgd"):
        if opt == "sgd":
            gaps.add("optimizer", "fbgemm SGD adds duplicate ids' gradients to a row one at a time "
                     "(atomic, unordered); TPU sums them first", "mapped to SGD (same values up to rounding)")
        spec: Any = SGD(learning_rate=lr)
    elif "row_wise" in opt and float(kw["eps"]) > 0.0:  # fbgemm's rule itself: one accumulator per row
        spec = RowWiseAdagrad(learning_rate=lr, epsilon=float(kw["eps"]))
        if opt == "row_wise_adagrad":
            gaps.add("optimizer", "non-exact row-wise Adagrad applies duplicate ids one at a time",
                     "duplicates are summed first, as exact_row_wise_adagrad")
    elif opt in ("exact_adagrad", "exact_row_wise_adagrad", "row_wise_adagrad"):
        eps = float(kw["eps"])
        spec = _adagrad_like(lr, eps)
        if eps != 0.0:
            gaps.add("optimizer.eps", f"fbgemm divides by sqrt(acc) + eps (eps={eps:g}); TPU Adagrad has no "
                     "epsilon", f"AdagradMomentum(momentum=0, epsilon=eps²={eps * eps:g}) puts it under "
                     "the root: relative difference <= eps/sqrt(acc) per step")
        if "row_wise" in opt:  # eps == 0: RowWiseAdagrad refuses it (a zero row's update is 0/0)
            gaps.add("optimizer.rowwise", "fbgemm row-wise Adagrad with eps=0 divides a row whose gradients "
                     "are all zero by sqrt(0); me.embedding.RowWiseAdagrad needs eps > 0",
                     "trained element-wise (acc += g² per element); imported row accumulators are "
                     "broadcast over the row, exported ones averaged over it")
        if opt == "row_wise_adagrad":
            gaps.add("optimizer", "non-exact row-wise Adagrad applies duplicate ids one at a time",
                     "duplicates are summed first, as exact_row_wise_adagrad")
    else:
        raise ConfigError(
            f"fbgemm optimizer {opt!r} has no meshembed translation. Expected one of {list(_CPU_OPTIMIZERS)} "
            "(the ones fbgemm's CPU TBE trains).")
    if float(kw["weight_decay"]) != 0.0:
        gaps.add("optimizer.weight_decay", f"fbgemm weight_decay={kw['weight_decay']} (mode "
                 f"{kw['weight_decay_mode']}) adds to the gradient or the row", "dropped")
    if kw["gradient_clipping"]:
        gaps.add("optimizer.gradient_clipping", f"fbgemm clips each row's gradient norm to "
                 f"max_gradient={kw['max_gradient']}", "dropped (meshembed clips element-wise: clipvalue)")
    if float(kw["max_norm"]) != 0.0:
        gaps.add("optimizer.max_norm", f"fbgemm renormalises looked-up rows to max_norm={kw['max_norm']}",
                 "dropped")
    return spec


def _tables_and_optimizer(tables: Any, optimizer: Any, optimizer_kwargs: Any) -> tuple[list[Any], Any, Any]:
    """Accept a (Fused)EmbeddingBagCollection / EmbeddingCollection as well as config lists."""
    for getter in ("embedding_bag_configs", "embedding_configs"):
        if hasattr(tables, getter):
            module = tables
            tables = list(getattr(module, getter)())
            if optimizer is None and hasattr(module, "_optimizer_type"):
                optimizer, optimizer_kwargs = module._optimizer_type, module._optimizer_kwargs
            break
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence) or not tables:
        raise ConfigError(f"Invalid `tables`. Expected a non-empty list of torchrec EmbeddingBagConfig / "
                          f"EmbeddingConfig or an EmbeddingBagCollection. Received: tables={tables!r}")
    if optimizer is None:
        raise ConfigError("Missing `optimizer`: torchrec's EmbeddingBagCollection has no fused optimizer; pass "
                          "optimizer=EmbOptimType.EXACT_ADAGRAD (and optimizer_kwargs) as its fused_params say.")
    return list(tables), optimizer, optimizer_kwargs


def _default_init(t: Any) -> bool:
    import torch

    fn = t.init_fn
    return (isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_
            and fn.keywords == {"a": t.get_weight_init_min(), "b": t.get_weight_init_max()})


def from_torchrec(tables: Any, optimizer: Any = None, optimizer_kwargs: Mapping[str, Any] | None = None, *,
                  batch_size: int, max_sequence_length: int | None = None, strict: bool = False) -> Translation:
    """torchrec tables (or an EmbeddingBagCollection) + fbgemm optimizer -> ``(EmbeddingConfig, gaps)``.

    ``batch_size`` fixes the features' ``input_shape`` (torchrec batches are dynamic).
    ``EmbeddingBagConfig`` features are pooled ``(batch_size,)``. ``EmbeddingConfig``
    (unpooled, jagged) features become sequence features ``(batch_size, max_sequence_length)``
    (gap ``max_sequence_length``); without ``max_sequence_length`` they are refused.
    """
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig as TrecEmbeddingConfig

    tables, optimizer, optimizer_kwargs = _tables_and_optimizer(tables, optimizer, optimizer_kwargs)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"Invalid `batch_size`. Expected an integer >= 1. Received: batch_size={batch_size!r}")
    gaps = _Gaps("torchrec -> meshembed", strict)
    opt, kw = _optimizer_from(optimizer, optimizer_kwargs)
    spec = _meshembed_optimizer(opt, kw, gaps)
    me_tables, features = [], []
    if max_sequence_length is not None and (isinstance(max_sequence_length, bool) or
                                            not isinstance(max_sequence_length, int) or max_sequence_length < 1):
        raise ConfigError(f"Invalid `max_sequence_length`. Expected None or an integer >= 1. Received: "
                          f"max_sequence_length={max_sequence_length!r}")
    for t in tables:
        sequence = isinstance(t, TrecEmbeddingConfig)
        if not isinstance(t, EmbeddingBagConfig) and not sequence:
            raise ConfigError(f"Table {getattr(t, 'name', t)!r}: expected a torchrec EmbeddingBagConfig or "
                              f"EmbeddingConfig. Received: {type(t).__name__}")
        if sequence and max_sequence_length is None:
            raise ConfigError(f"Table {t.name!r}: an unpooled EmbeddingConfig returns jagged per-id embeddings, "
                              "which a TPU config has no shape for. Pass max_sequence_length=M for (batch, M) "
                              "sequence features.")
        if not t.name:
            raise ConfigError("A torchrec table has no name. Expected EmbeddingBagConfig(name=...).")
        pooling = "SUM" if sequence else t.pooling.value
        if pooling not in _POOLING:
            raise ConfigError(f"Table {t.name!r}: pooling {pooling} has no TPU combiner. Expected SUM or MEAN.")
        if sequence:
            gaps.add("max_sequence_length", "torchrec's EmbeddingCollection returns one embedding per id (jagged)",
                     f"padded (batch_size, {max_sequence_length}): ids past position {max_sequence_length} dropped, "
                     "missing positions zero", t.name)
        if t.data_type != DataType.FP32:
            gaps.add("data_type", f"{t.data_type.value} rows", "trained as float32", t.name)
        for name in ("num_embeddings_post_pruning", "total_num_buckets", "input_dim"):
            if getattr(t, name) is not None:
                gaps.add(name, f"{name}={getattr(t, name)} has no TPU meaning", "dropped", t.name)
        for name in ("need_pos", "use_virtual_table", "enable_embedding_update", "stash_weights"):
            if getattr(t, name):
                gaps.add(name, f"{name}=True has no TPU meaning", "dropped", t.name)
        if _default_init(t):
            init: Any = Uniform(t.get_weight_init_min(), t.get_weight_init_max())
        else:
            init = None
            gaps.add("init_fn", "a custom torchrec init_fn cannot be carried over",
                     "meshembed's default (truncated normal, stddev 1/sqrt(dim)); import the trained state "
                     "with import_torchrec_state", t.name)
        me_tables.append(TableConfig(name=t.name, vocabulary_size=t.num_embeddings, dimension=t.embedding_dim,
                                     optimizer=spec, combiner=_POOLING[pooling], initializer=init))
        if not t.feature_names:
            gaps.add("feature_names", "the table has no feature", "it gets no feature", t.name)
        shape = (batch_size, max_sequence_length) if sequence else (batch_size,)
        features += [FeatureConfig(table=t.name, input_shape=shape, name=f) for f in t.feature_names]
    return gaps.finish(EmbeddingConfig(tables=me_tables, features=features))


# --------------------------------------------------------------------- meshembed -> torchrec
def _fbgemm_optimizer(spec: Any, table: str, gaps: _Gaps) -> tuple[str, dict[str, Any], float | None]:
    lr = spec.learning_rate
    if isinstance(lr, DynamicLearningRate) or callable(lr) or lr is None:
        raise ConfigError(f"Table {table!r}: a dynamic learning rate has no fbgemm form. Expected a float "
                          "(set the fused optimizer's param_groups[0]['lr'] yourself between steps).")
    algo = spec.algorithm
    if algo == "stochastic_gradient_descent":
        out = ("exact_sgd", {"learning_rate": float(lr)}, None)
    elif algo == "adagrad":
        out = ("exact_adagrad", {"learning_rate": float(lr), "eps": 0.0}, float(spec.initial_accumulator_value))
    elif (algo == "adagrad_momentum" and spec.momentum == 0.0 and spec.beta2 == 1.0 and spec.exponent == 2.0
          and not spec.use_nesterov):
        eps = math.sqrt(spec.epsilon)
        if spec.epsilon != 0.0:
            gaps.add("optimizer.epsilon", f"TPU AdagradMomentum adds epsilon={spec.epsilon:g} under the root; "
                     "fbgemm adds eps outside it", f"eps=sqrt(epsilon)={eps:g}: relative difference "
                     "<= eps/sqrt(acc) per step", table)
        out = ("exact_adagrad", {"learning_rate": float(lr), "eps": eps}, None)
    elif algo == "row_wise_adagrad":
        out = ("exact_row_wise_adagrad", {"learning_rate": float(lr), "eps": float(spec.epsilon)},
               float(spec.initial_accumulator_value))
    else:
        raise ConfigError(
            f"Table {table!r}: optimizer {type(spec).__name__} has no fbgemm CPU equivalent. Expected SGD, Adagrad, "
            "AdagradMomentum(momentum=0, beta2=1, exponent=2) or RowWiseAdagrad (fbgemm's CPU TBE trains SGD and "
            "(row-wise) Adagrad only).")
    options = {"clip_weight_min": spec.clip_weight_min, "clip_weight_max": spec.clip_weight_max,
               "clipvalue": spec.clipvalue, "weight_decay_factor": spec.weight_decay_factor or None,
               "simulated_quantization": spec.simulated_quantization}
    for name, value in options.items():
        if value is not None:
            gaps.add(f"optimizer.{name}", f"{name}={value!r} has no fbgemm TBE option", "dropped", table)
    if spec.use_gradient_accumulation is False:
        gaps.add("optimizer.use_gradient_accumulation", "False (TPU applies each id's gradient in turn)",
                 "fbgemm's exact optimizers sum duplicate ids first (as accumulation on)", table)
    return out


def to_torchrec(config: EmbeddingConfig, *, strict: bool = False) -> Translation:
    """``EmbeddingConfig`` -> ``(TorchrecConfig, gaps)``: EmbeddingBagConfigs + EmbOptimType + kwargs.

    One fbgemm optimizer serves all tables of a ``FusedEmbeddingBagCollection``, so tables
    whose optimizers translate differently are refused (build one collection per group).
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_configs import EmbeddingConfig as TrecEmbeddingConfig

    if not isinstance(config, EmbeddingConfig):
        raise ConfigError(f"Invalid `config`. Expected a meshembed EmbeddingConfig. Received: {type(config).__name__}")
    gaps = _Gaps("meshembed -> torchrec", strict)
    names: dict[str, list[str]] = {t.name: [] for t in config.tables}
    sequence: dict[str, set[bool]] = {t.name: set() for t in config.tables}
    for i, f in enumerate(config.features):
        sequence[f.table_name].add(f.is_sequence)
        if len(sequence[f.table_name]) > 1:
            raise ConfigError(f"Table {f.table_name!r} has pooled and sequence features; a torchrec table is either "
                              "an EmbeddingBagConfig or an EmbeddingConfig. Expected one kind per table.")
        if f.is_sequence:
            gaps.add("input_shape", f"sequence feature {f.name!r} is padded to {f.input_shape[1]} positions",
                     "an EmbeddingConfig (jagged: no padding, no truncation)", f.table_name)
        name = f.name or f"{f.table_name}_feature_{i}"
        if not f.name:
            gaps.add("feature.name", f"feature {i} has no name; torchrec keys features by name",
                     f"named {name!r}", f.table_name)
        names[f.table_name].append(name)
    chosen, tables, accumulators = None, [], {}
    for t in config.tables:
        spec = t.optimizer if t.optimizer is not None else config.optimizer
        if spec is None or not hasattr(spec, "hyperparameters"):
            raise ConfigError(f"Table {t.name!r}: optimizer {spec!r} has no fbgemm form. Expected SGD or Adagrad.")
        opt, kw, acc = _fbgemm_optimizer(spec, t.name, gaps)
        if chosen is not None and chosen != (opt, kw):
            raise ConfigError(f"Table {t.name!r}: optimizer {opt} {kw} differs from the other tables' {chosen}; one "
                              "FusedEmbeddingBagCollection has one fbgemm optimizer. Give every table the same one.")
        chosen = (opt, kw)
        if acc is not None:
            accumulators[t.name] = acc
        if t.combiner == "sqrtn" and True not in sequence[t.name]:
            gaps.add("combiner", "sqrtn: torchrec pools only SUM or MEAN", "SUM; pass per-sample weights "
                     "1/sqrt(bag size) (is_weighted=True) to reproduce sqrtn", t.name)
        if t.dtype != "float32":
            raise ConfigError(f"Table {t.name!r}: dtype {t.dtype} has no trainable fbgemm form. Expected float32.")
        if t.dimension % 4:
            raise ConfigError(f"Table {t.name!r}: dimension {t.dimension} is not a multiple of 4, which fbgemm's "
                              "TBE requires. Expected dimension % 4 == 0.")
        kwargs: dict[str, Any] = {}
        if isinstance(t.initializer, Uniform):
            kwargs = {"weight_init_min": t.initializer.minval, "weight_init_max": t.initializer.maxval}
        else:
            gaps.add("initializer", f"{'TF2 truncated normal' if t.initializer is None else t.initializer!r} has no "
                     "torchrec form", "torchrec's default U(±sqrt(1/num_embeddings)); copy rows with "
                     "export_torchrec_state", t.name)
        rows = t.vocabulary_size
        if t.dynamic is not None:  # keys -> rows is MCH's job; its last row is shared by unknown ids
            rows += 1
            gaps.add("dynamic", "a dynamic vocabulary maps raw keys to rows; a torchrec table takes row ids",
                     f"{rows} rows (capacity + MCH's shared row); to_torchrec_mc(config) builds the "
                     "ManagedCollisionCollection that maps the keys", t.name)
        common = dict(num_embeddings=rows, embedding_dim=t.dimension, name=t.name,
                      feature_names=names[t.name], **kwargs)
        if True in sequence[t.name]:
            tables.append(TrecEmbeddingConfig(**common))
        else:
            tables.append(EmbeddingBagConfig(pooling=PoolingType.MEAN if t.combiner == "mean" else PoolingType.SUM,
                                             **common))
    assert chosen is not None  # an EmbeddingConfig has at least one table
    return gaps.finish(TorchrecConfig(tables, EmbOptimType(chosen[0]), dict(chosen[1]), accumulators))


# --------------------------------------------------------------------- trained state
def check_finite(array: np.ndarray, table: str, name: str) -> None:
    """Refuse NaN/Inf before any table is written (load_parameters would refuse it midway)."""
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise InputError(f"Table {table!r}: the imported {name} hold NaN or Inf. Expected finite values (load them "
                         "with engine.load_parameters(..., allow_nonfinite=True) if that is intended).")


def _fused_state(module: Any) -> dict[str, dict[str, Any]]:
    if not hasattr(module, "fused_optimizer"):
        return {}
    return module.fused_optimizer().state_dict()["state"]


def import_torchrec_state(engine: Any, module: Any) -> None:
    """Copy a torchrec collection's rows and fused optimizer state into ``engine`` (an
    ``me.TPUEmbedding`` built from ``from_torchrec``'s config); save it with ``engine.save``.

    Row-wise accumulators (shape ``[V]``) are broadcast over the row (gap ``optimizer.rowwise``).
    Every array is checked before the first table is written.
    """
    weights = module.state_dict()
    state = _fused_state(module)
    loads = []
    for name in engine.table_names:
        key = next((k for k in (f"embedding_bags.{name}.weight", f"embeddings.{name}.weight") if k in weights), None)
        if key is None:
            raise InputError(f"Table {name!r}: the torchrec module has no weight for it. Expected "
                             f"'embedding_bags.{name}.weight' in its state_dict (keys: {sorted(weights)}).")
        arrays = {"parameters": weights[key].detach().cpu().numpy()}
        slots = engine.table_slot_names(name)
        moment = state.get(f"{name}.weight", {}).get(f"{name}.weight.momentum_1")
        if slots:
            if moment is None:
                raise InputError(f"Table {name!r}: the engine has slots {slots} but the torchrec module has no fused "
                                 "optimizer state for it. Expected a FusedEmbeddingBagCollection with Adagrad.")
            acc = moment.detach().cpu().numpy()
            if acc.ndim == 1:  # per row: RowWiseAdagrad's (V, 1), else broadcast over the row
                spec = engine.layout.table(name)
                acc = acc[:, None] if slot_width(spec.optimizer, slots[0], spec.dimension) == 1 else np.broadcast_to(
                    acc[:, None], arrays["parameters"].shape)
            arrays[slots[0]] = acc
            for extra in slots[1:]:
                arrays[extra] = np.zeros_like(arrays["parameters"])
        loads.append((name, arrays))
    for name, arrays in loads:  # check every table first (same shapes as the engine's)
        have = engine.retrieve_parameters(name)
        for k, v in arrays.items():
            if tuple(v.shape) != tuple(have[k].shape):
                raise InputError(f"Table {name!r}: torchrec {k} has shape {tuple(v.shape)}, the engine "
                                 f"{tuple(have[k].shape)}. Expected the config from_torchrec made for this module.")
            check_finite(v, name, k)
    for name, arrays in loads:
        engine.load_parameters(name, **arrays)


def export_torchrec_state(engine: Any, module: Any) -> None:
    """Write ``engine``'s rows and Adagrad accumulators into a torchrec collection in place
    (row-wise accumulators get the row mean: lossless only where the row's columns agree)."""
    import torch

    weights = dict(module.named_parameters())
    state = _fused_state(module)
    pairs = []
    for name in engine.table_names:
        key = next((k for k in (f"embedding_bags.{name}.weight", f"embeddings.{name}.weight") if k in weights), None)
        if key is None:
            raise InputError(f"Table {name!r}: the torchrec module has no such table. Expected one built by "
                             "to_torchrec(engine.config).result.build().")
        got = engine.retrieve_parameters(name)
        pairs.append((weights[key], got["parameters"]))
        slots = engine.table_slot_names(name)
        moment = state.get(f"{name}.weight", {}).get(f"{name}.weight.momentum_1")
        if slots and moment is not None:
            acc = got[slots[0]]
            pairs.append((moment, acc[:, 0] if acc.shape[1] == 1 else acc.mean(axis=1) if moment.ndim == 1 else acc))
    for dst, src in pairs:
        if tuple(dst.shape) != tuple(src.shape):
            raise InputError(f"Shape mismatch exporting to torchrec: {tuple(src.shape)} into {tuple(dst.shape)}.")
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(torch.as_tensor(np.ascontiguousarray(src), dtype=dst.dtype))
