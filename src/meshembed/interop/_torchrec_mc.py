"""meshembed dynamic tables <-> torchrec's managed-collision modules (``MCHManagedCollisionModule``
in a ``ManagedCollisionCollection``), config and vocabulary state.

What maps: the capacity (MCH's ``zch_size`` = capacity + 1: its last slot is a shared row for
ids without a slot), the pressure order (LRU <-> ``LRU_EvictionPolicy``, LFU <->
``LFU_EvictionPolicy``), and the state (resident keys, their rows, counts, last steps). What
does not: MCH's decisions (when and whom it admits and evicts), listed as gaps; TTL, NormBelow,
Probability, DistanceLFU and torchrec's other filters are refused. docs/interop.md has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshembed.config import EmbeddingConfig
from meshembed.embedding import dynamic as dv
from meshembed.errors import ConfigError, InputError
from meshembed.interop._gaps import Translation, _Gaps

__all__ = ["OccurrenceThreshold", "export_torchrec_mc_state", "from_torchrec_mc", "import_torchrec_mc_state",
           "to_torchrec_mc"]

EMPTY = np.iinfo(np.int64).max  #: MCH's empty-slot key (``_mch_sorted_raw_ids``)


@dataclass(frozen=True)
class OccurrenceThreshold:
    """An MCH ``threshold_filtering_func`` keeping ids with at least ``count`` occurrences in
    the eviction window: the nearest torchrec form of ``AfterOccurrences(count)``."""

    count: int

    def __call__(self, id_counts: Any) -> tuple[Any, float]:
        return id_counts >= self.count, float(self.count - 1)


def _shared_gaps(gaps: _Gaps, table: str, interval: int) -> None:
    """The semantic differences every MCH translation has (docs/interop.md)."""
    gaps.add("unknown_ids", "MCH remaps an id without a slot to its last row (zch_size - 1), shared and "
             "trained; meshembed drops it (zeros, no update)", "the table has capacity + 1 rows; the state "
             "transfer writes zeros into the shared row", table)
    gaps.add("decisions", f"MCH admits and evicts every eviction_interval={interval} training forwards over the "
             "window's ids, ranking candidates against residents (a new id can lose; ties by sorted position and "
             "window frequency); meshembed decides at every training batch, admitted keys in first-occurrence "
             "order taking free rows lowest first", "policies mapped by kind: the same keys and rows are not "
             "kept once the table is full (state transfers are exact)", table)
    gaps.add("evicted_rows", "torchrec 1.8's unsharded ManagedCollisionEmbedding(Bag)Collection does not reset an "
             "evicted row (its evict() is a no-op: the new id inherits the row); meshembed re-initialises it "
             "keyed by the new key", "not reproducible by a translation", table)


# --------------------------------------------------------------------- meshembed -> torchrec
def _policy_to_torchrec(spec: dv.DynamicVocabulary, table: str, gaps: _Gaps) -> Any:
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy

    for p in spec.policies:
        if isinstance(p, dv.TTL):
            raise ConfigError(
                f"Table {table!r}: eviction TTL(steps={p.steps}) has no torchrec MCH form. MCH has no time-to-live, "
                "and torchrec's TTL (HashZchManagedCollisionModule, HashZchEvictionConfig.single_ttl) counts wall-"
                "clock hours (time.time() / 3600), not steps. Fix: drop TTL from `eviction` before translating.")
        if isinstance(p, dv.NormBelow):
            raise ConfigError(
                f"Table {table!r}: eviction NormBelow(threshold={p.threshold}) has no torchrec form (MCH ranks ids "
                "by counts or access iterations, never by row norms). Fix: drop NormBelow from `eviction`.")
    adm = spec.admission
    if isinstance(adm, dv.Probability):
        raise ConfigError(
            f"Table {table!r}: admission Probability(p={adm.p}) has no reproducible torchrec form "
            "(probabilistic_threshold_filter draws torch.rand from the global RNG, per window count). "
            "Fix: use Always() or AfterOccurrences(n).")
    threshold = None
    if isinstance(adm, dv.AfterOccurrences):
        threshold = OccurrenceThreshold(adm.count)
        gaps.add("admission", f"AfterOccurrences({adm.count}) counts a key's occurrences over all batches in a "
                 "sketch; MCH's threshold_filtering_func sees one eviction window's counts, and also filters "
                 "resident ids (their counters then do not move)", f"OccurrenceThreshold({adm.count})", table)
    if isinstance(spec.order, dv.LFU):
        return LFU_EvictionPolicy(threshold_filtering_func=threshold)
    if isinstance(spec.order, dv.LRU):
        return LRU_EvictionPolicy(decay_exponent=1.0, threshold_filtering_func=threshold)
    raise ConfigError(f"Table {table!r}: eviction {spec.eviction!r} has no pressure order; MCH always ranks by "
                      "one (LRU or LFU). Fix: use eviction=LRU() or LFU().")


def _bag_configs(config: EmbeddingConfig, names: set[str], gaps: _Gaps) -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    from meshembed.interop._torchrec import Uniform

    out = []
    for t in config.tables:
        if t.name not in names:
            continue
        features = []
        for i, f in enumerate(config.features):
            if f.table_name == t.name:
                if f.is_sequence:
                    raise ConfigError(f"Table {t.name!r}: sequence feature {f.name!r}; to_torchrec_mc builds "
                                      "EmbeddingBagConfigs (pooled). Expected pooled features.")
                features.append(f.name or f"{t.name}_feature_{i}")
        if t.combiner not in ("sum", "mean"):
            gaps.add("combiner", f"{t.combiner}: torchrec pools only SUM or MEAN", "SUM", t.name)
        kwargs: dict[str, Any] = {}
        if isinstance(t.initializer, Uniform):
            kwargs = {"weight_init_min": t.initializer.minval, "weight_init_max": t.initializer.maxval}
        out.append(EmbeddingBagConfig(num_embeddings=t.vocabulary_size + 1, embedding_dim=t.dimension, name=t.name,
                                      feature_names=features, **kwargs,
                                      pooling=PoolingType.MEAN if t.combiner == "mean" else PoolingType.SUM))
    return out


def to_torchrec_mc(config: EmbeddingConfig, *, eviction_interval: int = 1, device: Any = None,
                   strict: bool = False) -> Translation:
    """``EmbeddingConfig`` -> ``(ManagedCollisionCollection, gaps)``: one
    ``MCHManagedCollisionModule`` (``zch_size`` = capacity + 1) per dynamic table, over
    ``EmbeddingBagConfig``s of capacity + 1 rows. Build the trainable module with
    ``ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(mcc.embedding_configs()), mcc)``.
    TTL, NormBelow and Probability are refused (``ConfigError`` naming the policy)."""
    import torch
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    if not isinstance(config, EmbeddingConfig):
        raise ConfigError(f"Invalid `config`. Expected a meshembed EmbeddingConfig. Received: {type(config).__name__}")
    interval = dv._int("eviction_interval", eviction_interval, 1, "to_torchrec_mc")
    specs = {t.name: t.dynamic for t in config.tables if t.dynamic is not None}
    if not specs:
        raise ConfigError("Invalid `config` for to_torchrec_mc: no table has a dynamic vocabulary. Expected "
                          "TableConfig(..., dynamic=me.embedding.DynamicVocabulary(...)).")
    gaps = _Gaps("meshembed -> torchrec MCH", strict)
    device = torch.device("cpu") if device is None else torch.device(device)
    modules = {}
    for t in config.tables:
        if t.name in specs:
            policy = _policy_to_torchrec(specs[t.name], t.name, gaps)
            _shared_gaps(gaps, t.name, interval)
            modules[t.name] = MCHManagedCollisionModule(zch_size=t.vocabulary_size + 1, device=device,
                                                        eviction_policy=policy, eviction_interval=interval,
                                                        name=t.name)
    tables = _bag_configs(config, set(specs), gaps)
    return gaps.finish(ManagedCollisionCollection(modules, tables))


# --------------------------------------------------------------------- torchrec -> meshembed
def _collection(module: Any) -> Any:
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    mcc = getattr(module, "_managed_collision_collection", module)
    if not isinstance(mcc, ManagedCollisionCollection):
        raise ConfigError(f"Invalid `module`. Expected a torchrec ManagedCollisionCollection or a "
                          f"ManagedCollisionEmbedding(Bag)Collection. Received: {type(module).__name__}")
    return mcc


def _mch(mcc: Any, table: str) -> Any:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    m = mcc._managed_collision_modules[table]
    if not isinstance(m, MCHManagedCollisionModule):
        ttl = " (its TTL counts wall-clock hours)" if "HashZch" in type(m).__name__ else ""
        raise ConfigError(f"Table {table!r}: managed-collision module {type(m).__name__}{ttl} has no meshembed "
                          "translation. Expected an MCHManagedCollisionModule.")
    return m


def _spec_from_mch(m: Any, table: str, gaps: _Gaps) -> dv.DynamicVocabulary:
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, LRU_EvictionPolicy

    policy = m._eviction_policy
    if type(policy) is LFU_EvictionPolicy:
        order: Any = dv.LFU()
    elif type(policy) is LRU_EvictionPolicy:
        if not policy._decay_exponent > 0:
            raise ConfigError(f"Table {table!r}: LRU_EvictionPolicy(decay_exponent={policy._decay_exponent}) does "
                              "not rank by recency (the exponent must be > 0). Expected decay_exponent > 0.")
        order = dv.LRU()  # -(iter - last + 1) ** d ranks as the age for any d > 0
    else:
        raise ConfigError(f"Table {table!r}: eviction policy {type(policy).__name__} has no meshembed form "
                          "(DistanceLFU's counts / distance ** decay is neither LRU nor LFU). Expected "
                          "LRU_EvictionPolicy or LFU_EvictionPolicy.")
    fn = policy._threshold_filtering_func
    if fn is None:
        admission: Any = dv.Always()
    elif isinstance(fn, OccurrenceThreshold):
        admission = dv.AfterOccurrences(fn.count)
        gaps.add("admission", "MCH's threshold filters one eviction window's counts (residents too); "
                 f"AfterOccurrences({fn.count}) counts over all batches", f"AfterOccurrences({fn.count})", table)
    else:
        name = getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__)
        raise ConfigError(f"Table {table!r}: threshold_filtering_func {name} has no meshembed admission (dynamic and "
                          "average thresholds depend on the window's count distribution; the probabilistic one draws "
                          "from torch's global RNG). Expected None or me.interop.OccurrenceThreshold(n).")
    if m._input_hash_func is not None:
        gaps.add("input_hash_func", "MCH hashes ids before remapping", "dropped: hash the ids yourself before "
                 "enqueue (meshembed takes any int64 key)", table)
    _shared_gaps(gaps, table, m._eviction_interval)
    return dv.DynamicVocabulary(admission=admission, eviction=order)


def from_torchrec_mc(module: Any, optimizer: Any = None, optimizer_kwargs: Mapping[str, Any] | None = None, *,
                     batch_size: int, max_sequence_length: int | None = None, strict: bool = False
                     ) -> Translation:
    """A ``ManagedCollisionCollection`` (or a ``ManagedCollisionEmbedding(Bag)Collection``) + the
    optimizer it is trained with -> ``(EmbeddingConfig, gaps)``: ``from_torchrec`` of its tables
    (``max_sequence_length`` for unpooled ones), each a dynamic table of capacity ``zch_size - 1``. Refused (``ConfigError`` naming it): any
    policy or module other than MCH with LRU/LFU, any filter other than ``OccurrenceThreshold``."""
    from meshembed.interop._torchrec import from_torchrec

    mcc = _collection(module)
    gaps = _Gaps("torchrec MCH -> meshembed", strict)
    specs = {}
    for t in mcc.embedding_configs():
        m = _mch(mcc, t.name)
        if m._zch_size < 2 or m._zch_size != t.num_embeddings or m._output_global_offset != 0:
            raise ConfigError(f"Table {t.name!r}: MCH zch_size={m._zch_size}, offset {m._output_global_offset} for a "
                              f"table of {t.num_embeddings} rows. Expected an unsharded module (offset 0) with "
                              "zch_size = num_embeddings >= 2.")
        specs[t.name] = _spec_from_mch(m, t.name, gaps)
    base, table_gaps = from_torchrec(list(mcc.embedding_configs()), optimizer, optimizer_kwargs,
                                     batch_size=batch_size, max_sequence_length=max_sequence_length)
    for g in table_gaps:
        gaps.add(g.field, g.differs, g.done, g.table)
    tables = [t.replace(vocabulary_size=t.vocabulary_size - 1, dynamic=specs[t.name]) for t in base.tables]
    return gaps.finish(base.replace(tables=tuple(tables)))


# --------------------------------------------------------------------- vocabulary state
def _module_state(m: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in m.state_dict().items()}


def _check_pair(engine: Any, mcc: Any, table: str) -> tuple[Any, dv.DynamicVocabularyState]:
    state = engine.vocabulary(table)
    if table not in mcc._managed_collision_modules:
        raise InputError(f"Table {table!r}: the torchrec collection has no managed-collision module for it "
                         f"(tables: {sorted(mcc._managed_collision_modules)}). Expected one built by to_torchrec_mc.")
    m = _mch(mcc, table)
    want = type(_policy_to_torchrec(state.spec, table, _Gaps("check", False)))
    if m._zch_size != state.capacity + 1 or type(m._eviction_policy) is not want:
        raise InputError(f"Table {table!r}: MCH zch_size={m._zch_size} with {type(m._eviction_policy).__name__}; "
                         f"the engine's vocabulary needs zch_size={state.capacity + 1} with {want.__name__}. "
                         "Expected the collection to_torchrec_mc(engine.config) made.")
    return m, state


def _weight(module: Any, table: str) -> Any:
    emb = getattr(module, "_embedding_module", None)
    if emb is None:
        return None
    params = dict(emb.named_parameters())
    for key in (f"embedding_bags.{table}.weight", f"embeddings.{table}.weight"):
        if key in params:
            return params[key]
    raise InputError(f"Table {table!r}: the torchrec module's embedding collection has no weight for it "
                     f"(parameters: {sorted(params)}).")


def export_torchrec_mc_state(engine: Any, module: Any) -> None:
    """Write ``engine``'s dynamic vocabularies into a ``ManagedCollisionCollection`` (or an
    MC-EBC, then also the rows; its shared last row gets zeros) in place: resident keys keep
    their rows; counts (LFU) and ``last_access_iter = last_seen + 1`` (LRU) are copied and
    the module's iteration counter set to ``engine.step``. Everything is checked first."""
    import torch

    mcc = _collection(module)
    writes = []
    for table in engine.vocabularies:
        if table not in mcc._managed_collision_modules:
            continue
        m, st = _check_pair(engine, mcc, table)
        keys, rows = st.resident()
        if keys.size and keys[-1] == EMPTY:
            raise InputError(f"Table {table!r}: key {EMPTY} (int64 max) is MCH's empty-slot marker and cannot be "
                             "exported. Expected keys below 2**63 - 1.")
        n = st.capacity
        free = np.flatnonzero(~st.used)
        sorted_ids = np.concatenate([keys, np.full(free.size + 1, EMPTY, np.int64)])
        mapping = np.concatenate([rows, free, [n]]).astype(np.int64)
        new = _module_state(m)
        new["_mch_sorted_raw_ids"], new["_mch_remapped_ids_mapping"] = sorted_ids, mapping
        if "_mch_counts" in new:
            new["_mch_counts"] = np.concatenate([st.count[rows], np.zeros(free.size + 1, np.int64)])
        if "_mch_last_access_iter" in new:
            new["_mch_last_access_iter"] = np.concatenate([st.last_seen[rows] + 1, np.zeros(free.size + 1, np.int64)])
        new["_current_iter_tensor"] = np.array([engine.step], np.int64)
        w = _weight(module, table)
        values = None
        if w is not None:
            if tuple(w.shape) != (n + 1, engine.layout.table(table).dimension):
                raise InputError(f"Table {table!r}: torchrec weight of shape {tuple(w.shape)}; expected "
                                 f"({n + 1}, dimension): capacity + 1 rows.")
            values = np.concatenate([engine.retrieve_parameters(table)["parameters"],
                                     np.zeros((1, w.shape[1]), np.float32)])
        writes.append((m, new, w, values))
    if not writes:
        raise InputError(f"The torchrec module manages none of the engine's dynamic tables {sorted(engine.vocabularies)}.")
    with torch.no_grad():
        for m, new, w, values in writes:
            m.load_state_dict({k: torch.as_tensor(v) for k, v in new.items()})
            m._current_iter = -1  # re-read from _current_iter_tensor at the next training forward
            if w is not None:
                w.copy_(torch.as_tensor(values, dtype=w.dtype))


def import_torchrec_mc_state(engine: Any, module: Any) -> None:
    """Read a ``ManagedCollisionCollection``'s (or MC-EBC's) vocabularies into ``engine`` (built
    from ``from_torchrec_mc``'s config); with an MC-EBC also the rows (its shared last row is
    dropped). Ages are kept: ``last_seen = engine.step - 1 - (iterations - last_access_iter)``
    (at least 0); a counter MCH does not keep (LRU keeps no counts, LFU no access iterations)
    is set to 1 (count) or 0 (last_seen). The slots keep their values; statistics start at 0."""
    mcc = _collection(module)
    loads = []
    for table in engine.vocabularies:
        if table not in mcc._managed_collision_modules:
            continue
        m, st = _check_pair(engine, mcc, table)
        s = _module_state(m)
        n = st.capacity
        ids, mapping = s["_mch_sorted_raw_ids"], s["_mch_remapped_ids_mapping"]
        live = ids != EMPTY
        rows = mapping[live]
        if np.unique(mapping).shape[0] != n + 1 or rows.size and (rows.min() < 0 or rows.max() >= n):
            raise InputError(f"Table {table!r}: the MCH module maps ids to rows {np.unique(rows).tolist()[:8]}...; "
                             f"expected distinct rows in [0, {n}) (row {n} is the shared row).")
        arrays = {k: np.zeros(n, np.int64) for k in ("row_key", "count", "last_seen")}
        arrays["used"] = np.zeros(n, np.uint8)
        arrays["row_key"][rows], arrays["used"][rows] = ids[live], 1
        arrays["count"][rows] = s["_mch_counts"][live] if "_mch_counts" in s else 1
        if "_mch_last_access_iter" in s:
            age = int(s["_current_iter_tensor"][0]) - s["_mch_last_access_iter"][live]
            arrays["last_seen"][rows] = np.maximum(engine.step - 1 - age, 0)
        arrays["scalars"] = np.zeros(len(dv.SCALARS), np.int64)
        for name, (shape, dtype) in dv.state_shapes(st.spec, n).items():
            if name not in arrays:
                arrays[name] = np.zeros(shape, dtype)
        try:
            new = dv.DynamicVocabularyState.from_arrays(st.spec, n, arrays)
        except ValueError as exc:
            raise InputError(f"Table {table!r}: the MCH state is not a valid vocabulary: {exc}.") from None
        w = _weight(module, table)
        values = None
        if w is not None:
            values = w.detach().cpu().numpy()
            if values.shape != (n + 1, engine.layout.table(table).dimension) or not np.isfinite(values).all():
                raise InputError(f"Table {table!r}: torchrec weight of shape {values.shape} (finite: "
                                 f"{bool(np.isfinite(values).all())}); expected finite ({n + 1}, dimension).")
        loads.append((table, new, values))
    if not loads:
        raise InputError(f"The torchrec module manages none of the engine's dynamic tables {sorted(engine.vocabularies)}.")
    for table, new, values in loads:
        engine.load_vocabulary(table, new)
        if values is not None:
            engine.load_parameters(table, parameters=np.ascontiguousarray(values[:-1]))
