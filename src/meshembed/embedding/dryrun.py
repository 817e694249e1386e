"""A dry run of the TPU's embedding input limits on the host, on prepared batches.

The TPU host preprocessing (TensorFlow's ``tpu_embedding_v3`` kernels, jax-tpu-embedding's
``input_preprocessing``) splits each batch over the SparseCores, sends every id to the
SparseCore that owns its row (``id % num_sparse_cores``), deduplicates the ids of one sample,
sorts them and checks them against per-partition limits; with ``allow_id_dropping`` the ids
over a limit are dropped. That only shows on the accelerator, so this module replays it on
a :class:`~meshembed.embedding.batch.Batch` and says which ids would be lost, in order.

Every rule below names its source; docs/dryrun.md lists them with the assumptions.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping

import numpy as np

from meshembed.embedding.batch import Batch
from meshembed.embedding.layout import Layout, TableSpec
from meshembed.errors import ConfigError, InputError
from meshembed.sharding.placement import Placement

__all__ = ["ALGORITHMS", "PRESETS", "Limits", "Topology", "DryRunReport", "analyze", "plan_drops",
           "resolve_limits", "resolve_topology", "SCHEMA"]

SCHEMA = "meshembed.dryrun/1"
#: Every partition's ids are padded to a multiple of 8 (jax-tpu-embedding's
#: TPU_VECTOR_REGISTER_ALIGNMENT_SIZE, TF's xla_pad_size in ConvertToSparseCoreCsrWrappedCooTensor).
ALIGN = 8
#: ``jax-tpu-embedding``: per-partition limits, the ids over them dropped (sort_and_group_coo_tensors_impl.h).
#: ``tensorflow``: per-partition limits are errors; drops happen at the chip buffer
#: ``max_ids_per_chip_per_sample * samples`` (sparse_core_preprocess_ops.cc).
ALGORITHMS = ("jax-tpu-embedding", "tensorflow")
#: TF's ``TPUEmbeddingV2.DEFAULT_MAX_IDS_PER_TABLE`` / ``DEFAULT_MAX_UNIQUE_IDS_PER_TABLE`` and
#: jax-tpu-embedding's ``TableSpec`` defaults; TF's ``max_minibatches_per_sc``.
DEFAULT_MAX_IDS, DEFAULT_MAX_UNIQUE, DEFAULT_IDS_PER_CHIP_PER_SAMPLE, MAX_MINIBATCHES = 256, 256, 64, 64

_GIB = 1 << 30


@dataclass(frozen=True)
class Topology:
    """The target: ``chips`` chips with ``sparse_cores_per_chip`` SparseCores each (0: the
    TensorCore-era embedding, partitioned over ``tensor_cores_per_chip`` cores per chip)."""

    name: str
    chips: int = 1
    sparse_cores_per_chip: int = 4
    tensor_cores_per_chip: int = 1
    hbm_bytes_per_chip: int | None = None
    source: str = ""

    @property
    def sparse_core(self) -> bool:
        return self.sparse_cores_per_chip > 0

    @property
    def units_per_chip(self) -> int:
        """SparseCores (or TensorCores) per chip: each takes a slice of every batch."""
        return self.sparse_cores_per_chip if self.sparse_core else self.tensor_cores_per_chip

    @property
    def partitions(self) -> int:
        """Shards of every table: one per SparseCore (or TensorCore) of the slice."""
        return self.chips * self.units_per_chip


#: Published figures, each with its source (checked 2026; docs/dryrun.md, "Presets").
PRESETS: dict[str, Topology] = {
    "v3": Topology("v3", sparse_cores_per_chip=0, tensor_cores_per_chip=2, hbm_bytes_per_chip=32 * _GIB,
                   source="https://cloud.google.com/tpu/docs/v3 (2 TensorCores, 32 GiB HBM per chip; no SparseCore)"),
    "v4": Topology("v4", sparse_cores_per_chip=4, hbm_bytes_per_chip=32 * _GIB,
                   source="https://openxla.org/xla/sparsecore (4 SparseCores, 32 GiB HBM per chip)"),
    "v5p": Topology("v5p", sparse_cores_per_chip=4, hbm_bytes_per_chip=95 * _GIB,
                    source="https://openxla.org/xla/sparsecore (4 SparseCores per chip); "
                           "https://docs.cloud.google.com/tpu/docs/tpu7x (95 GiB HBM per chip)"),
    "v6e": Topology("v6e", sparse_cores_per_chip=2, hbm_bytes_per_chip=32 * _GIB,
                    source="https://openxla.org/xla/sparsecore (Trillium: 2 SparseCores, 32 GiB HBM per chip)"),
    "tpu7x": Topology("tpu7x", sparse_cores_per_chip=4, hbm_bytes_per_chip=192 * _GIB,
                      source="https://docs.cloud.google.com/tpu/docs/tpu7x (Ironwood: 4 SparseCores, "
                             "192 GiB HBM per chip)"),
}


def resolve_topology(topology: str | Topology = "v5p", chips: int | None = None,
                     sparse_cores_per_chip: int | None = None) -> Topology:
    """A preset name (or a :class:`Topology`) with ``chips`` / ``sparse_cores_per_chip`` overridden."""
    if isinstance(topology, str):
        if topology not in PRESETS:
            raise ConfigError(f"Invalid `topology`. Expected one of {sorted(PRESETS)} or a Topology. "
                              f"Received: topology={topology!r}")
        topology = PRESETS[topology]
    if not isinstance(topology, Topology):
        raise ConfigError(f"Invalid `topology`. Expected a preset name or a Topology. Received: {topology!r}")
    if chips is not None:
        topology = replace(topology, chips=_positive(chips, "chips"))
    if sparse_cores_per_chip is not None:
        topology = replace(topology, sparse_cores_per_chip=_positive(sparse_cores_per_chip, "sparse_cores_per_chip", 0))
    if topology.sparse_core and topology.partitions & (topology.partitions - 1):
        raise ConfigError(
            f"Invalid topology: {topology.partitions} SparseCores in all. Expected a power of two "
            "(TF's ConvertToListOfSparseCoreCooTensors and jax-tpu-embedding both require it). "
            f"Received: chips={topology.chips}, sparse_cores_per_chip={topology.sparse_cores_per_chip}")
    return topology


def _positive(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"Invalid `{name}`. Expected an integer >= {minimum}. Received: {name}={value!r}")
    return int(value)


@dataclass(frozen=True)
class Limits:
    """One table's limits. ``None`` means unlimited (the TensorCore era publishes none)."""

    max_ids_per_partition: int | None = DEFAULT_MAX_IDS
    max_unique_ids_per_partition: int | None = DEFAULT_MAX_UNIQUE
    #: TF only (``SparseCoreEmbeddingConfig.max_ids_per_chip_per_sample``): the chip buffer.
    max_ids_per_chip_per_sample: int = DEFAULT_IDS_PER_CHIP_PER_SAMPLE


_LIMIT_KEYS = ("max_ids_per_partition", "max_unique_ids_per_partition", "max_ids_per_chip_per_sample")


def _limits_from(value: Any, base: Limits, where: str) -> Limits:
    if isinstance(value, Limits):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"Invalid `limits` for {where}. Expected a Limits or a dict with keys {list(_LIMIT_KEYS)}. "
                          f"Received: {value!r}")
    unknown = sorted(set(value) - set(_LIMIT_KEYS))
    if unknown:
        raise ConfigError(f"Invalid `limits` for {where}: unknown keys {unknown}. Expected some of {list(_LIMIT_KEYS)}.")
    checked = {k: None if v is None else _positive(v, k) for k, v in value.items()}
    return replace(base, **checked)


def resolve_limits(layout: Layout, limits: Any, topology: Topology) -> tuple[dict[str, Limits], bool | None]:
    """Each table's :class:`Limits`, and the ``allow_id_dropping`` the limits object carries.

    ``limits``: None (the defaults; none for the TensorCore era), one Limits / dict for every
    table, ``{table_name: Limits or dict}``, or TF's ``SparseCoreEmbeddingConfig`` (read by its
    attribute names: ``max_ids_per_table`` and ``max_unique_ids_per_table`` are TF's
    per-SparseCore-partition limits despite their names)."""
    base = Limits() if topology.sparse_core else Limits(None, None)
    names = [t.name for t in layout.tables]
    if limits is None:
        return {n: base for n in names}, None
    if hasattr(limits, "max_ids_per_table") or hasattr(limits, "max_unique_ids_per_table"):
        ids = dict(getattr(limits, "max_ids_per_table", None) or {})
        uniques = dict(getattr(limits, "max_unique_ids_per_table", None) or {})
        base = replace(base, max_ids_per_chip_per_sample=_positive(
            getattr(limits, "max_ids_per_chip_per_sample", DEFAULT_IDS_PER_CHIP_PER_SAMPLE), "max_ids_per_chip_per_sample"))
        out = {n: replace(base, max_ids_per_partition=ids.get(n, DEFAULT_MAX_IDS),
                          max_unique_ids_per_partition=uniques.get(n, DEFAULT_MAX_UNIQUE)) for n in names}
        allow = getattr(limits, "allow_id_dropping", None)
        return out, None if allow is None else bool(allow)
    if isinstance(limits, Limits) or (isinstance(limits, Mapping) and set(limits) <= set(_LIMIT_KEYS)
                                      and not set(limits) & set(names)):
        one = _limits_from(limits, base, "every table")
        return {n: one for n in names}, None
    if isinstance(limits, Mapping):
        unknown = sorted(set(limits) - set(names), key=str)
        if unknown:
            raise ConfigError(f"Invalid `limits`: unknown tables {unknown}. Expected some of {names}.")
        return {n: _limits_from(limits[n], base, f"table {n!r}") if n in limits else base for n in names}, None
    raise ConfigError(f"Invalid `limits`. Expected None, a Limits, a dict, or a SparseCoreEmbeddingConfig. "
                      f"Received: {type(limits).__name__}")


# -- one table of one batch, as the host preprocessing sees it -----------------------------
@dataclass
class _Entries:
    """A table's ids of one batch in the TPU's processing order: sorted by (source core,
    partition, id, feature, sample row, input order). ``head``: the first of its (feature, row,
    id) duplicates (the others are merged into it); ``rank``/``urank``: 0-based index of its
    head among the heads, and of its id among the distinct ids, in its (source, partition)."""

    feature: np.ndarray  # index into layout.features
    entry: np.ndarray  # index into batch.features[feature].ids
    slot: np.ndarray
    ids: np.ndarray
    source: np.ndarray
    partition: np.ndarray
    head: np.ndarray
    rank: np.ndarray
    urank: np.ndarray
    counts: np.ndarray  # [sources, partitions] ids after dedup
    uniques: np.ndarray  # [sources, partitions] distinct ids


def _rank_within(flags: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each item: how many flagged items precede-or-are it in its group, minus one."""
    c = np.cumsum(flags)
    before = np.where(start, c - flags, 0)
    return c - np.maximum.accumulate(before) - 1


def _entries(layout: Layout, batch: Batch, table: TableSpec, topo: Topology) -> _Entries:
    n_src, n_part = topo.partitions, topo.partitions
    parts = []
    for f in layout.features_of(table):
        d = batch.features[f.index]
        if d.num_slots % n_src:
            raise InputError(
                f"Feature {f.name!r}: {d.num_slots} samples (rows) do not split evenly over {n_src} "
                f"{'SparseCores' if topo.sparse_core else 'TensorCores'} ({topo.chips} chip(s)). TF and "
                "jax-tpu-embedding require the per-chip batch to be a multiple of the cores per chip. Fix: a "
                "batch size that is a multiple of it, or other `chips`.")
        rows = d.num_slots // n_src  # rows are split contiguously: chip, then core (both libraries)
        ids = d.ids.astype(np.int64)
        if topo.sparse_core:  # SparseCores mod-shard every table (OpenXLA sparsecore.md §7-8)
            part = ids % n_part
        else:  # TensorCore era: the config's MOD/DIV placement over the cores (docs/dryrun.md)
            part = Placement(table.vocabulary_size, n_part, layout.strategy).owner(ids)
        parts.append((np.full(ids.shape, f.index), np.arange(ids.shape[0]), d.slots.astype(np.int64), ids,
                      d.slots // rows, np.asarray(part, np.int64)))
    if parts:
        feat, entry, slot, ids, src, part = (np.concatenate(c) for c in zip(*parts))
    else:
        feat = entry = slot = ids = src = part = np.zeros(0, np.int64)
    order = np.lexsort((entry, slot, feat, ids, part, src))
    feat, entry, slot, ids, src, part = (a[order] for a in (feat, entry, slot, ids, src, part))
    n = ids.shape[0]
    start = np.ones(n, bool)
    new_id = np.ones(n, bool)
    head = np.ones(n, bool)
    if n:
        same_group = (src[1:] == src[:-1]) & (part[1:] == part[:-1])
        start[1:] = ~same_group
        new_id[1:] = ~same_group | (ids[1:] != ids[:-1])
        head[1:] = new_id[1:] | (feat[1:] != feat[:-1]) | (slot[1:] != slot[:-1])
    key = src * n_part + part
    counts = np.bincount(key[head], minlength=n_src * n_part).reshape(n_src, n_part)
    uniques = np.bincount(key[new_id], minlength=n_src * n_part).reshape(n_src, n_part)
    return _Entries(feat, entry, slot, ids, src, part, head, _rank_within(head, start),
                    _rank_within(new_id, start), counts, uniques)


def _dropped(e: _Entries, lim: Limits, topo: Topology, algorithm: str, rows_per_chip: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(mask of dropped entries, reason code per entry: 1 ids, 2 unique ids, 3 chip buffer).

    jax-tpu-embedding (GroupAndDeduplicateCooTensorsForLocalSparseCore): walking a partition
    in sorted order, an id is dropped when it is past the first ``max_ids_per_partition`` ids
    or its id is past the first ``max_unique_ids_per_partition`` distinct ids; the duplicates
    merged into it go with it. TF (ConvertToSparseCoreCsrWrappedCooTensor): each chip packs
    its cores' partitions in order, each padded to 8, into ``max_ids_per_chip_per_sample *
    rows`` slots; what does not fit is dropped."""
    n = e.ids.shape[0]
    reason = np.zeros(n, np.int8)
    if algorithm == "tensorflow":
        cap = lim.max_ids_per_chip_per_sample * rows_per_chip
        per_chip = e.counts.reshape(topo.chips, -1)  # [chip, core * partitions] in packing order
        padded = -(-per_chip // ALIGN) * ALIGN
        start = np.cumsum(padded, axis=1) - padded  # where each partition begins in the chip buffer
        kept = np.clip(cap - start, 0, per_chip).reshape(-1)
        over = e.rank >= kept[e.source * topo.partitions + e.partition]
        reason[over] = 3
        return over, reason
    if lim.max_ids_per_partition is not None:
        reason[e.rank >= lim.max_ids_per_partition] = 1
    if lim.max_unique_ids_per_partition is not None:
        reason[e.urank >= lim.max_unique_ids_per_partition] = 2
    return reason > 0, reason


def _rows_per_chip(layout: Layout, table: TableSpec, topo: Topology) -> int:
    return sum(int(np.prod(f.output_shape)) for f in layout.features_of(table)) // topo.chips


def plan_drops(layout: Layout, batch: Batch, topology: Topology, limits: Mapping[str, Limits],
               algorithm: str = "jax-tpu-embedding") -> dict[int, np.ndarray]:
    """``{feature index: sorted entry indices}`` the TPU would drop from ``batch`` (with
    ``allow_id_dropping``): the input of :func:`meshembed.embedding.id_dropping.drop_ids`."""
    _check_algorithm(algorithm, topology)
    out: dict[int, list[np.ndarray]] = {}
    for t in layout.tables:
        e = _entries(layout, batch, t, topology)
        mask, _ = _dropped(e, limits[t.name], topology, algorithm, _rows_per_chip(layout, t, topology))
        for f in np.unique(e.feature[mask]):
            out.setdefault(int(f), []).append(e.entry[mask & (e.feature == f)])
    return {f: np.sort(np.concatenate(v)) for f, v in out.items()}


def _check_algorithm(algorithm: str, topology: Topology) -> None:
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"Invalid `algorithm`. Expected one of {list(ALGORITHMS)}. Received: algorithm={algorithm!r}")
    if algorithm == "tensorflow" and not topology.sparse_core:
        raise ConfigError(f"Invalid `algorithm`: 'tensorflow' replays TF's SparseCore kernels, but topology "
                          f"{topology.name!r} has no SparseCore. Fix: algorithm='jax-tpu-embedding' (counts only "
                          "on the TensorCore era), or a SparseCore topology.")


# -- the report ---------------------------------------------------------------------------------
_REASONS = {1: "max_ids_per_partition", 2: "max_unique_ids_per_partition", 3: "max_ids_per_chip_per_sample"}


@dataclass
class DryRunReport:
    """The dry run's findings: ``to_dict()`` is the JSON of docs/dryrun.md's schema,
    ``render()`` a readable table (rich's when installed)."""

    data: dict[str, Any]
    #: per batch, ``{feature index: entry indices}`` dropped (what id_dropping.drop_ids takes)
    drops: list[dict[int, np.ndarray]] = field(default_factory=list, repr=False)

    @property
    def tables(self) -> list[dict[str, Any]]:
        return self.data["tables"]

    @property
    def dropped(self) -> list[dict[str, Any]]:
        return self.data["dropped"]

    def table(self, name: str) -> dict[str, Any]:
        for t in self.tables:
            if t["name"] == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.data, indent=indent)

    def render(self, use_rich: bool | None = None, max_dropped: int = 20) -> str:
        """The report as text: one row per table, the first ``max_dropped`` dropped ids, the
        suggested limits. ``use_rich`` None: rich when it is installed."""
        if use_rich is not False:
            try:
                return _render_rich(self, max_dropped)
            except ImportError:
                if use_rich:
                    raise
        return _render_plain(self, max_dropped)


def _summary_rows(report: DryRunReport) -> tuple[list[str], list[list[str]]]:
    head = ["table", "partitions", "max ids/partition (limit)", "max unique/partition (limit)", "CSR entries/chip "
            "(needed / allocated)", "padding", "HBM/chip", "dropped", "status"]
    rows = []
    for t in report.tables:
        lim, obs, csr = t["limits"], t["observed"], t["csr"]
        hbm = t["hbm_bytes_per_chip"]["total"]
        rows.append([t["name"], str(report.data["topology"]["partitions"]),
                     f"{obs['max_ids_per_partition']} ({lim['max_ids_per_partition']})",
                     f"{obs['max_unique_ids_per_partition']} ({lim['max_unique_ids_per_partition']})",
                     f"{csr['required_entries_per_chip']} / {csr['allocated_entries_per_chip']}",
                     f"{100 * t['padding']['overhead']:.1f}%", _bytes(hbm), str(t["dropped_ids"]), t["status"]])
    return head, rows


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _dropped_rows(report: DryRunReport, max_dropped: int) -> list[list[str]]:
    keys = ("batch", "table", "feature", "sample", "position", "id", "chip", "core", "partition", "reason")
    return [[str(d[k]) for k in keys] for d in report.dropped[:max_dropped]]


def _suggestions(report: DryRunReport) -> list[str]:
    lines = []
    for t in report.tables:
        s = ", ".join(f"{k}={v}" for k, v in t["suggested_limits"].items())
        lines.append(f"  {t['name']}: {s}")
    return lines


def _header(report: DryRunReport) -> str:
    topo, d = report.data["topology"], report.data
    kind = f"{topo['sparse_cores_per_chip']} SparseCores" if topo["sparse_cores_per_chip"] else \
        f"{topo['tensor_cores_per_chip']} TensorCores (no SparseCore)"
    return (f"meshembed dry run: {topo['name']}, {topo['chips']} chip(s) x {kind} per chip = {topo['partitions']} "
            f"partitions; {d['num_batches']} batch(es); algorithm {d['algorithm']}; allow_id_dropping="
            f"{d['allow_id_dropping']}")


def _render_plain(report: DryRunReport, max_dropped: int) -> str:
    head, rows = _summary_rows(report)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [_header(report), "", line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    if report.dropped:
        out += ["", f"dropped ids ({len(report.dropped)}, in the order the TPU drops them; first {max_dropped}):"]
        out += ["  " + " ".join(r) for r in [["batch", "table", "feature", "sample", "position", "id", "chip", "core",
                                              "partition", "reason"]] + _dropped_rows(report, max_dropped)]
    out += ["", "suggested limits:"] + _suggestions(report)
    return "\n".join(out)


def _render_rich(report: DryRunReport, max_dropped: int) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=160, file=_Null())
    head, rows = _summary_rows(report)
    table = Table(title=_header(report))
    for h in head:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if report.dropped:
        drops = Table(title=f"dropped ids ({len(report.dropped)}, in the order the TPU drops them; first {max_dropped})")
        for h in ("batch", "table", "feature", "sample", "position", "id", "chip", "core", "partition", "reason"):
            drops.add_column(h)
        for r in _dropped_rows(report, max_dropped):
            drops.add_row(*r)
        console.print(drops)
    console.print("suggested limits:\n" + "\n".join(_suggestions(report)))
    return console.export_text()


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


# -- the analysis -------------------------------------------------------------------------------
def _round_up(n: int, k: int) -> int:
    return -(-int(n) // k) * k


def analyze(layout: Layout, batches: Iterable[Batch], topology: Topology, *, limits: Any = None,
            allow_id_dropping: bool | None = None, algorithm: str = "jax-tpu-embedding",
            headroom: float = 0.0, assumptions: Iterable[str] = ()) -> DryRunReport:
    """Replay the TPU host preprocessing on every batch and report per table and partition."""
    _check_algorithm(algorithm, topology)
    table_limits, allow_from_limits = resolve_limits(layout, limits, topology)
    allow = bool(allow_from_limits) if allow_id_dropping is None else bool(allow_id_dropping)
    if headroom < 0 or not math.isfinite(headroom):
        raise ConfigError(f"Invalid `headroom`. Expected a finite number >= 0. Received: headroom={headroom!r}")
    P, per_chip = topology.partitions, topology.units_per_chip
    acc = {t.name: dict(max_ids=np.zeros(P, np.int64), max_uniq=np.zeros(P, np.int64), total=np.zeros(P, np.int64),
                        input_ids=0, after_dedup=0, dropped=0, required=0, padded=0, unpadded=0, chip_needed=0)
           for t in layout.tables}
    dropped: list[dict[str, Any]] = []
    drops: list[dict[int, np.ndarray]] = []
    n_batches = 0
    for b, batch in enumerate(batches):
        n_batches += 1
        if batch.layout != layout:
            raise InputError(f"Batch {b} was prepared for another config.")
        batch_drops: dict[int, list[np.ndarray]] = {}
        for t in layout.tables:
            a, lim = acc[t.name], table_limits[t.name]
            e = _entries(layout, batch, t, topology)
            a["max_ids"] = np.maximum(a["max_ids"], e.counts.max(axis=0))
            a["max_uniq"] = np.maximum(a["max_uniq"], e.uniques.max(axis=0))
            a["total"] += e.counts.sum(axis=0)
            a["input_ids"] += int(e.ids.shape[0])
            a["after_dedup"] += int(e.head.sum())
            padded = -(-e.counts // ALIGN) * ALIGN  # [sources, partitions]
            a["padded"] += int(padded.sum())
            a["unpadded"] += int(e.counts.sum())
            # jax-tpu-embedding's required_buffer_size: per core, its partitions padded to 8;
            # a chip's buffer is split evenly over its cores, so the fullest core sets it.
            a["required"] = max(a["required"], per_chip * int(padded.sum(axis=1).max(initial=0)))
            # TF's chip buffer holds every core's partitions one after the other.
            a["chip_needed"] = max(a["chip_needed"], int(padded.reshape(topology.chips, -1).sum(axis=1).max(initial=0)))
            over = ((lim.max_ids_per_partition is not None and e.counts.max(initial=0) > lim.max_ids_per_partition)
                    or (lim.max_unique_ids_per_partition is not None
                        and e.uniques.max(initial=0) > lim.max_unique_ids_per_partition))
            if not (allow and topology.sparse_core) or (algorithm == "tensorflow" and over):
                continue  # nothing is dropped (a limit overflow is then an error, reported in `status`)
            mask, reason = _dropped(e, lim, topology, algorithm, _rows_per_chip(layout, t, topology))
            a["dropped"] += int(mask.sum())
            positions = {int(k): _positions(batch.features[int(k)].slots) for k in np.unique(e.feature[mask])}
            for k in np.flatnonzero(mask):
                f = layout.features[int(e.feature[k])]
                inner = int(np.prod(f.output_shape[1:]))
                slot = int(e.slot[k])
                dropped.append(dict(batch=b, table=t.name, feature=f.name, sample=slot // inner,
                                    position=int(positions[f.index][e.entry[k]]) if inner == 1 else slot % inner,
                                    id=int(e.ids[k]),
                                    chip=int(e.source[k]) // per_chip, core=int(e.source[k]) % per_chip,
                                    partition=int(e.partition[k]), reason=_REASONS[int(reason[k])]))
            for f in np.unique(e.feature[mask]):
                batch_drops.setdefault(int(f), []).append(e.entry[mask & (e.feature == f)])
        drops.append({f: np.sort(np.concatenate(v)) for f, v in batch_drops.items()})
    if n_batches == 0:
        raise InputError("Invalid `batches`: no batch was given. Fix: pass at least one sample batch.")
    tables = [_table_report(layout, t, acc[t.name], table_limits[t.name], topology, algorithm, allow, headroom)
              for t in layout.tables]
    data = dict(schema=SCHEMA, topology=dict(asdict(topology), partitions=P), algorithm=algorithm,
                allow_id_dropping=allow, num_batches=n_batches, tables=tables, dropped=dropped,
                assumptions=list(assumptions) + ASSUMPTIONS)
    return DryRunReport(data, drops)


def _positions(slots: np.ndarray) -> np.ndarray:
    """Each id's position among its sample's ids, in input order (pooled features)."""
    order = np.argsort(slots, kind="stable")
    s = slots[order]
    idx = np.arange(s.shape[0])
    start = np.ones(s.shape[0], bool)
    start[1:] = s[1:] != s[:-1]
    out = np.empty_like(idx)
    out[order] = idx - np.maximum.accumulate(np.where(start, idx, 0))
    return out


def _table_report(layout: Layout, t: TableSpec, a: dict[str, Any], lim: Limits, topo: Topology, algorithm: str,
                  allow: bool, headroom: float) -> dict[str, Any]:
    P, per_chip = topo.partitions, topo.units_per_chip
    max_ids, max_uniq = int(a["max_ids"].max(initial=0)), int(a["max_uniq"].max(initial=0))
    rows = _rows_per_chip(layout, t, topo)
    over_ids = lim.max_ids_per_partition is not None and max_ids > lim.max_ids_per_partition
    over_uniq = lim.max_unique_ids_per_partition is not None and max_uniq > lim.max_unique_ids_per_partition
    if algorithm == "tensorflow":
        allocated = lim.max_ids_per_chip_per_sample * rows
        row_pointers = MAX_MINIBATCHES * per_chip * _round_up(P, ALIGN)
        over_chip = a["chip_needed"] > allocated
        status = "error" if over_ids or over_uniq or (over_chip and not allow) else "drops" if a["dropped"] else "ok"
    else:
        mip = lim.max_ids_per_partition
        allocated = None if mip is None else _round_up(mip, ALIGN) * per_chip * P  # ComputeTheoreticalMaxCooBufferSize
        row_pointers = max(P, ALIGN) * per_chip
        status = "ok" if not (over_ids or over_uniq) else "drops" if allow and topo.sparse_core else "error"
    dim_padded = _round_up(t.dimension, ALIGN)  # rows padded to 32 bytes (OpenXLA sparsecore.md §10)
    vocab_padded = _round_up(t.vocabulary_size, P) if topo.sparse_core else t.vocabulary_size
    slots = len(getattr(t.optimizer, "slot_names", ()) or ())
    tables_bytes = vocab_padded * dim_padded * 4 * (1 + slots) // topo.chips
    entries = allocated if allocated is not None else a["required"]
    csr_bytes = 12 * entries + 4 * row_pointers  # embedding ids, sample ids (int32), gains (float32)
    uniq_for_stack = lim.max_unique_ids_per_partition or max_uniq
    stack = max((2 * dim_padded + 1) * uniq_for_stack * P * 4, 3 * dim_padded * uniq_for_stack * P * 4)
    acts = 2 * rows * t.dimension * 4  # activations and their gradients of the chip's samples
    total = tables_bytes + csr_bytes + stack + acts
    grow = lambda n: max(1, math.ceil(n * (1 + headroom)))  # noqa: E731
    suggested: dict[str, int] = {"max_ids_per_partition": grow(max_ids),
                                 "max_unique_ids_per_partition": grow(max_uniq)}
    if algorithm == "tensorflow":
        need = grow(a["chip_needed"])
        m = max(1, math.ceil(need / max(rows, 1)))
        while (m * rows) % ALIGN:  # TF requires max_ids_per_chip to be a multiple of 8
            m += 1
        suggested["max_ids_per_chip_per_sample"] = m
    else:
        suggested["suggested_coo_buffer_size_per_device"] = _round_up(grow(a["required"]), ALIGN * per_chip)
    return dict(
        name=t.name, vocabulary_size=t.vocabulary_size, dimension=t.dimension,
        features=[f.name for f in layout.features_of(t)],
        limits=asdict(lim), status=status, over_limit=dict(ids=over_ids, unique_ids=over_uniq),
        ids=dict(input=a["input_ids"], after_dedup=a["after_dedup"]), dropped_ids=a["dropped"],
        observed=dict(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_uniq),
        partitions=[dict(partition=p, max_ids=int(a["max_ids"][p]), max_unique_ids=int(a["max_uniq"][p]),
                         total_ids=int(a["total"][p])) for p in range(P)],
        csr=dict(allocated_entries_per_chip=allocated, required_entries_per_chip=a["required"]
                 if algorithm != "tensorflow" else a["chip_needed"], row_pointers_per_chip=row_pointers,
                 bytes_per_chip=csr_bytes),
        padding=dict(ids=a["unpadded"], padded_slots=a["padded"],
                     overhead=0.0 if not a["padded"] else 1 - a["unpadded"] / a["padded"],
                     feature_dimension=t.dimension, padded_dimension=dim_padded, vocabulary_padded=vocab_padded),
        hbm_bytes_per_chip=dict(tables_and_slots=tables_bytes, csr_buffers=csr_bytes, stack=stack,
                                activations_and_gradients=acts, total=total,
                                fraction_of_hbm=None if topo.hbm_bytes_per_chip is None else total / topo.hbm_bytes_per_chip),
        suggested_limits=suggested,
    )


#: What the dry run assumes (docs/dryrun.md explains each with its source).
ASSUMPTIONS = [
    "No table stacking: each table is its own stacked table (TF: disable_table_stacking=True); a stack shares one "
    "set of partition counts with shard rotation.",
    "No minibatching (jax-tpu-embedding enable_minibatching=False; TF's minibatching kernels are libtpu-only).",
    "Each batch is the global batch: split contiguously over chips, then over each chip's cores.",
    "SparseCores mod-shard every table over all SparseCores (id % partitions), whatever the config's "
    "sharding_strategy; the TensorCore era uses the config's MOD/DIV placement over the TensorCores.",
    "Ids of one sample of one feature are deduplicated (their gains summed) before counting.",
    "HBM: rows padded to 8 floats, vocabulary to a multiple of the partitions (SparseCore), float32 tables and slots; "
    "the stack term is OpenXLA's formula with max_unique_nz_per_row read as max_unique_ids_per_partition and "
    "logical_replica_count as the partitions.",
]
