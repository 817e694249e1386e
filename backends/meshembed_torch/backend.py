"""The Torch backend: tables and slots as torch tensors, on CPU or CUDA, one process or many.

* One process: every logical shard of a table lives in one tensor on one device (a MOD/DIV
  placement is an index computation, see :class:`meshembed_torch.kernels.RowMap`).
* ``torch.distributed`` initialised (gloo on CPU, NCCL on CUDA): shard ``s`` lives on rank
  ``s % world_size`` (shard id = rank when ``num_shards == world_size``), over a 1-D
  ``DeviceMesh``. ``gather``/``scatter``/``update_rows`` route ids and rows to the owners with
  all-to-all (:mod:`meshembed_torch.distributed`); ``unshard`` all-gathers. They are
  collective: every rank calls them in the same order.

torch is imported lazily (in ``__init__`` and the helper modules), so this module imports
without torch and :meth:`TorchBackend.unavailable_reason` says what is missing.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Sequence

import numpy as np

from meshembed.backend.env import env_choice, env_flag
from meshembed.backend.protocol import Backend, Capabilities, RowUpdate, check_rule, occurrence_rounds, walk_blocks
from meshembed.errors import InputError, NonFiniteError
from meshembed.math.rule import UpdateRule
from meshembed.sharding.placement import Placement
from meshembed.sharding.placement import unshard as unshard_numpy
from meshembed_torch import native
from meshembed_torch.dense import TorchDenseMixin  # imports torch lazily, like this module
from meshembed_torch.table import TorchShardedTable, empty_table

DEVICE_ENV = "MESHEMBED_TORCH_DEVICE"
COMPILE_ENV = "MESHEMBED_TORCH_COMPILE"
FUSED_ENV = "MESHEMBED_TORCH_FUSED"
_COMPILE_MODES = {"auto": "auto", "1": "always", "true": "always", "always": "always",
                  "0": "never", "false": "never", "never": "never"}


class TorchBackend(TorchDenseMixin, Backend):
    """meshembed on PyTorch. ``TorchBackend(device="cuda:0")`` pins a device; by default the
    device comes from ``$MESHEMBED_TORCH_DEVICE``, else CUDA under an NCCL process group,
    else CPU."""

    name = "torch"
    environment = (DEVICE_ENV, COMPILE_ENV, FUSED_ENV)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import torch
        except ImportError as exc:
            return f"torch is not installed ({exc})"
        wanted = os.environ.get(DEVICE_ENV, "")
        if wanted.startswith("cuda") and not torch.cuda.is_available():
            return f"{DEVICE_ENV}={wanted} but torch sees no CUDA device"
        return None

    def __init__(self, device: Any = None, compile: str | bool | None = None, process_group: Any = None,
                 fused: bool | None = None):
        """``compile``: ``"auto"`` (default; ``$MESHEMBED_TORCH_COMPILE``), ``True``/``"always"``
        or ``False``/``"never"`` — whether ``update_rows`` runs the optimizer step through
        ``torch.compile``. ``process_group``: the ranks tables are sharded over (any
        ``dist.new_group`` this rank is in); None = the default (world) group. ``fused``:
        whether the C++ kernels generated from the rules run where they apply (the fused
        sparse and dense updates, the one-pass finite check, the streaming gather); None =
        ``$MESHEMBED_TORCH_FUSED``, default on. The environment is read here, once: set the
        attribute ``fused`` to switch an existing backend."""
        import torch

        from meshembed_torch import distributed, kernels

        self._torch = torch
        self._k = kernels
        self._dist = distributed
        self._device_option = device if device is not None else (os.environ.get(DEVICE_ENV) or None)
        self._group = process_group
        self._dtypes: dict[Any, Any] = {}
        self._capabilities: dict[tuple, Capabilities] = {}  # see capabilities
        if compile is None:
            compile = env_choice(COMPILE_ENV, tuple(_COMPILE_MODES), "auto")
        mode = {True: "always", False: "never"}.get(compile) if isinstance(compile, bool) else \
            _COMPILE_MODES.get(str(compile).lower())
        if mode is None:
            raise ValueError(
                f"Invalid `compile`. Expected one of ['auto', 'always', 'never'] or a bool. Received: compile={compile!r}"
            )
        self.fused = env_flag(FUSED_ENV, True) if fused is None else bool(fused)
        # when and what torch.compile compiles (gather -> rule -> scatter by rule and row
        # layout); the C++ fused row updates (native.py) are cached by the codegen, not here
        self._compiler = kernels.UpdateCompiler(mode, self.xp)
        self._compile_mode = mode
        self._compiled_updates = self._compiler.entries
        self._stats: collections.Counter[str] = collections.Counter()  # see stats()

    # -- discovery -----------------------------------------------------------------------
    @property
    def device(self) -> Any:
        """Where new tables and converted arrays live (decided per call, so a process group
        initialised after the backend was created is still honoured)."""
        torch = self._torch
        if self._device_option is not None:
            return torch.device(self._device_option)
        if self._dist.is_initialized() and torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def capabilities(self) -> Capabilities:
        """Made once per state it depends on (a process group, the device, ``fused``): the dense
        optimizer asks once per variable, and building it took ~10 us (64 variables: 0.7 of a
        1.8 ms step)."""
        distributed = self._dist.is_initialized()
        devices = self._torch.distributed.get_world_size(self._group) if distributed else 1
        device = self.device.type
        key = (distributed, devices, device, self.fused)
        found = self._capabilities.get(key)
        if found is None:
            cpu = device == "cpu"
            found = self._capabilities[key] = Capabilities(
                devices=devices,
                float64=device != "mps",
                in_place=True,
                deterministic_scatter=cpu,  # CUDA index_add_/embedding_bag backward use atomics
                autodiff=True,
                compiles=True,
                distributed=True,
                checked_updates=not distributed,
                generated_kernels=self.fused and cpu and not distributed,
            )
        return found

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        if self._compiler.compiled_calls:
            out["compiled_calls"] = self._compiler.compiled_calls
        return out

    @property
    def _compile_broken(self) -> bool:
        """Whether torch.compile failed once (the backend then runs eager for good)."""
        return self._compiler.broken

    @property
    def xp(self) -> Any:
        import array_api_compat.torch as xp_torch

        return xp_torch

    # -- dense arrays ----------------------------------------------------------------------
    def torch_dtype(self, dtype: Any) -> Any:
        """A torch dtype from a torch dtype, NumPy dtype or string such as ``"float32"``."""
        torch = self._torch
        if isinstance(dtype, torch.dtype):
            return dtype
        key = np.dtype(dtype)
        if key not in self._dtypes:
            self._dtypes[key] = torch.from_numpy(np.empty(0, dtype=key)).dtype
        return self._dtypes[key]

    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """A tensor on this backend's device. Tensors pass through without a copy (detached
        from autograd, so ``loss.backward()`` gradients can be fed straight in); NumPy arrays
        are shared, not copied, when their layout allows."""
        torch = self._torch
        tdtype = None if dtype is None else self.torch_dtype(dtype)
        device = self.device
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                x = x.detach()
            if (tdtype is None or x.dtype == tdtype) and x.device == device:
                return x
            return x.to(device=device, dtype=tdtype)
        if not isinstance(x, (np.ndarray, np.generic, list, tuple, int, float, bool, complex)) and hasattr(x, "__dlpack__"):
            try:  # JAX / CuPy arrays: zero-copy when the device matches
                t = torch.from_dlpack(x)
                return t.to(device=device, dtype=tdtype)
            except (RuntimeError, TypeError, BufferError):
                pass
        arr = np.asarray(x, dtype=None if dtype is None or isinstance(dtype, torch.dtype) else np.dtype(dtype))
        if arr.dtype == object:
            raise InputError(f"Invalid array: cannot convert {type(x).__name__} to a tensor. Received: {x!r:.80}")
        if not arr.flags.writeable or not arr.dtype.isnative or any(s < 0 for s in arr.strides):
            arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), copy=True)
        t = torch.from_numpy(arr)
        if tdtype is not None and t.dtype != tdtype:
            t = t.to(tdtype)
        return t if t.device == device else t.to(device)

    def to_numpy(self, x: Any) -> np.ndarray:
        torch = self._torch
        if isinstance(x, torch.Tensor):
            if hasattr(x, "full_tensor") and type(x).__name__ == "DTensor":
                x = x.full_tensor()
            x = x.detach()
            if x.device.type != "cpu":
                x = x.cpu()
            if x.dtype == torch.bfloat16:
                x = x.float()
            return x.resolve_conj().resolve_neg().numpy()
        return np.asarray(x)

    def is_native(self, x: Any) -> bool:
        return isinstance(x, self._torch.Tensor)

    def bitcast(self, x: Any, dtype: Any) -> Any:
        return self.asarray(x).contiguous().view(self.torch_dtype(dtype))

    def real_view_aliases(self, x: Any) -> bool:
        return isinstance(x, self._torch.Tensor)  # view_as_real is a view at any strides

    def real_view(self, x: Any) -> Any:
        """``torch.view_as_real``: a view of ``x``'s storage."""
        return self._torch.view_as_real(x)

    def from_real_view(self, x: Any) -> Any:
        return self._torch.view_as_complex(x.contiguous())

    # -- sharded row tables ----------------------------------------------------------------
    def _rank_group(self) -> Any:
        """The RankGroup of the current process group, or None in a single process."""
        if not self._dist.is_initialized():
            return None
        return self._dist.RankGroup(self.device.type, self._group)

    def create_table(self, values: np.ndarray, placement: Placement) -> TorchShardedTable:
        """Keep only the shards this process holds (every shard, in a single process)."""
        torch = self._torch
        vals = self.to_numpy(values) if isinstance(values, torch.Tensor) else np.asarray(values)
        if vals.ndim != 2 or vals.shape[0] != placement.vocabulary_size:
            raise ValueError(
                f"Invalid table values: expected shape ({placement.vocabulary_size}, dim). "
                f"Received: shape={vals.shape}"
            )
        table = empty_table(vals.shape[1], self.torch_dtype(vals.dtype), placement, self._rank_group(), self.device)
        table.write_block(0, vals)
        return table

    def create_table_from_blocks(self, shape: tuple[int, int], blocks: Any, placement: Placement,
                                 dtype: Any = "float32") -> TorchShardedTable:
        table = empty_table(shape[1], self.torch_dtype(dtype), placement, self._rank_group(), self.device)
        walk_blocks(shape, blocks, table.write_block)
        return table

    def unshard(self, table: TorchShardedTable) -> np.ndarray:
        """The logical table as a new NumPy array (collective: all-gather of every shard)."""
        p = table.placement
        if table.group is None:
            if table.rowmap.identity:
                return self.to_numpy(table.data).copy()
            shards = table.shards
            return unshard_numpy([self.to_numpy(shards[s]) for s in range(p.num_shards)], p)
        group = table.group
        held_by = [tuple(s for s in range(p.num_shards) if s % group.world == r) for r in range(group.world)]
        rows_by = [sum(p.rows_in_shard(s) for s in held) for held in held_by]
        parts = group.all_gather_rows("unshard", table.data, max(rows_by))
        shards: dict[int, np.ndarray] = {}
        for r, part in enumerate(parts):
            arr, start = self.to_numpy(part), 0
            for s in held_by[r]:
                n = p.rows_in_shard(s)
                shards[s] = arr[start:start + n]
                start += n
        return unshard_numpy([shards[s] for s in range(p.num_shards)], p)

    def _ids(self, ids: Any, table: TorchShardedTable) -> Any:
        """Ids as a 1-D int64 tensor on the table's device, checked against its vocabulary
        (:meth:`TorchShardedTable.checked_ids`)."""
        return table.checked_ids(self.asarray(ids))[0]

    def gather(self, table: TorchShardedTable, ids: Any) -> Any:
        try:
            ids = self._ids(ids, table)
        except Exception as exc:
            table.refuse("gather", exc)
            raise
        if table.group is None:
            # a per-id lookup's rows are >= 32 MiB at W1 sizes: glibc maps such blocks fresh
            # every step, so they are recycled once released (docs/benchmarks.md)
            rows = self.__dict__.setdefault("_recycled_rows", self._k.RecycledRows())
            out = rows.empty((ids.shape[0], table.data.shape[1]), table.data.dtype, table.data.device)
            index = table.rowmap.local_index(ids)
            # large outputs: streaming stores (native.gather_rows)
            if self.fused and native.gather_rows(table.data, index, out):
                return out
            return self._torch.index_select(table.data, 0, index, out=out)
        seg = self._k.segments(ids)  # send each distinct id once
        route = self._dist.Route(table.group, table.owner_rank(seg.unique), "gather")
        asked = route.send("ids", seg.unique)
        rows = route.reply("rows", table.data.index_select(0, table.rowmap.local_index(asked)))
        return rows.index_select(0, self._k.inverse(seg))

    def scatter(self, table: TorchShardedTable, ids: Any, rows: Any) -> TorchShardedTable:
        try:
            ids = self._ids(ids, table)
            rows = self.asarray(rows).to(device=table.data.device, dtype=table.data.dtype)
            rows = rows.reshape(ids.shape[0], table.data.shape[1])
        except Exception as exc:
            table.refuse("scatter", exc)
            raise
        if table.group is not None:
            route = self._dist.Route(table.group, table.owner_rank(ids), "scatter")
            rows = route.send("rows", rows)
            ids = route.send("ids", ids)
        table.data.index_copy_(0, table.rowmap.local_index(ids), rows)
        return table

    def segment_sum(self, ids: Any, values: Any) -> tuple[Any, Any]:
        ids = self.asarray(ids)
        return self._k.segment_sum(ids.to(self._torch.int64), self.asarray(values))

    def segment_sum_to(self, values: Any, segment_ids: Any, num_segments: int) -> Any:
        seg = self.asarray(segment_ids).to(self._torch.int64)
        return self._k.segment_sum_to(self.asarray(values), seg, int(num_segments))

    def gather_combine(self, table: TorchShardedTable, ids: Any, segment_ids: Any, num_segments: int,
                       weights: Any = None, *, offsets: Any = None) -> Any:
        """``segment_sum_to(weights[:, None] * gather(table, ids), segment_ids, num_segments)``
        in one ``embedding_bag`` pass: the ``[len(ids), D]`` rows are never materialised.

        An optional fast path for the engine's forward combiner (not in the protocol)."""
        torch = self._torch
        data = table.data
        if (weights is None and self.fused and table.group is None and table.rowmap.identity
                and data.device.type == "cpu" and data.dtype in (torch.float32, torch.float64)):
            # gather + sum of sorted segments in one C++ pass, the ids' range check folded in
            # (native.pooled_sum: embedding_bag's bits); None: the general path below (it
            # also reports bad ids)
            out = native.pooled_sum(data, ids, segment_ids, int(num_segments), torch.get_num_threads(),
                                    None if offsets is None else self.asarray(offsets, dtype="int64"))
            if out is not None:
                return out
        try:
            ids = self._ids(ids, table)
            seg_ids = self.asarray(segment_ids).to(torch.int64).reshape(-1)
            w = None if weights is None else self.asarray(weights).reshape(-1).to(table.data.dtype)
        except Exception as exc:
            table.refuse("gather_combine", exc)
            raise
        if w is not None and self._k.all_ones(w):
            w = None
        if table.group is None:
            source, index = table.data, table.rowmap.local_index(ids)
        else:
            seg = self._k.segments(ids)
            route = self._dist.Route(table.group, table.owner_rank(seg.unique), "gather_combine")
            asked = route.send("ids", seg.unique)
            source = route.reply("rows", table.data.index_select(0, table.rowmap.local_index(asked)))
            index = self._k.inverse(seg)
        if source.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            rows = source.index_select(0, index)
            return self.segment_sum_to(rows if w is None else rows * w[:, None], seg_ids, num_segments)
        small = source.shape[0] < 2**31 and index.numel() < 2**31  # the int32 bag kernel is faster
        if seg_ids.numel() == 0:
            offsets = self._k.bag_offsets(seg_ids, num_segments, int32=small)
        else:
            try:
                offsets = self._k.sorted_offsets(seg_ids, num_segments, int32=small)
                if offsets is None:  # not sample-major: group the ids by segment first
                    seg_ids, perm = torch.sort(seg_ids, stable=True)
                    index = index.index_select(0, perm)
                    w = None if w is None else w.index_select(0, perm)
                    offsets = self._k.sorted_offsets(seg_ids, num_segments, int32=small)
            except IndexError as exc:
                raise InputError(str(exc)) from None
        if small:
            index = index.to(torch.int32)
        return torch.nn.functional.embedding_bag(index, source, offsets, mode="sum", per_sample_weights=w)

    def gather_widened(self, table: TorchShardedTable, ids: Any, dtype: str) -> Any:
        """One C++ pass that gathers and widens (``native.gather_rows_16``); None where it does not
        apply (fused kernels off, sharded, not the CPU, a bad id): the generic path then runs."""
        data = table.data
        if not (self.fused and table.group is None and table.rowmap.identity and data.device.type == "cpu"):
            return None
        ids = self.asarray(ids)
        if ids.dtype != self._torch.int64 or ids.dim() != 1:
            return None
        out = native.gather_rows_16(data, ids, dtype, self._torch.get_num_threads())
        if out is not None:
            self._stats["widened_low_precision_gathers"] += 1
        return out

    def gather_combine_low_precision(self, table: TorchShardedTable, ids: Any, segment_ids: Any, num_segments: int,
                                     dtype: str, *, offsets: Any = None) -> Any:
        """One C++ pass that widens each 16-bit element as it adds it (``native.pooled_sum_16``:
        the bits of the widen-then-``segment_sum_to`` path, without its ``[len(ids), D]`` rows);
        None where it does not apply (fused kernels off, sharded, not the CPU, unsorted slots,
        a bad id): the generic path then runs and reports."""
        data = table.data
        if not (self.fused and table.group is None and table.rowmap.identity and data.device.type == "cpu"):
            return None
        out = native.pooled_sum_16(data, ids, segment_ids, int(num_segments), dtype, self._torch.get_num_threads(),
                                   None if offsets is None else self.asarray(offsets, dtype="int64"))
        if out is not None:
            self._stats["pooled_low_precision_lookups"] += 1
        return out

    def apply_update(self, u: RowUpdate) -> list[TorchShardedTable]:
        """Dedup → gather params and slots → the rule ``fn`` with ``values`` once per unique
        row → scatter. ``check_finite``: the protocol's; the fused kernel checks while it sums
        the gradients, every other path first.

        The sums come from one stable sort + ``embedding_bag`` (see :mod:`.kernels`), one
        storage index serves every table's gather and scatter. Distributed: each rank sums its
        own duplicates, sends (id, row-gradient) pairs to the owners (all-to-all), and each
        owner sums what every rank sent (spec §3.1: sum across replicas) before ``fn``.

        With ``grad_index`` the gradient of ``ids[i]`` is ``grad_weights[i] *
        grads[grad_index[i]]`` — e.g. per-sample gradients of a combiner — summed without
        expanding ``grads`` to one row per id.
        """
        torch = self._torch
        tables, ids, grads, fn, check_finite = list(u.tables), u.ids, u.grads, u.rule, u.check_finite
        grad_index, grad_weights = u.grad_index, u.grad_weights
        if not tables:
            return []
        first = tables[0]
        try:
            values = check_rule(fn, u.values, self.name)
            ids = self.asarray(ids)
            # The fused kernel checks the ids' range in its first pass (a bad id: nothing written,
            # then checked_ids' InputError): no pass of their own here. Every other path checks now.
            deferred = (u.guard is None and self.fused and first.group is None and first.rowmap.identity
                        and isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1
                        and ids.device == first.data.device and 0 < ids.numel() < 2**31)
            id_range = None
            if not deferred:
                ids, id_range = first.checked_ids(ids)
            g_src = self.asarray(grads).to(first.data.device)
            rows_of = None if grad_index is None else self.asarray(grad_index).to(torch.int64).reshape(-1)
            w = None if grad_weights is None else self.asarray(grad_weights).reshape(-1)
            if rows_of is None and g_src.shape[0] != ids.shape[0]:
                if deferred:
                    first.checked_ids(ids)  # a bad id is reported first, as on every path
                raise InputError(
                    f"Invalid `grads`: expected one row per id ({ids.shape[0]}). Received: shape={tuple(g_src.shape)}"
                )
            kernel = None
            if self.fused and first.group is None and ids.numel() and ids.numel() < 2**31:
                kernel = native.kernel_for(fn, values, [t.data for t in tables], g_src, ids.numel(), rows_of, w)
            if deferred and kernel is None:
                ids, id_range = first.checked_ids(ids)
            if check_finite and kernel is None and not self.all_finite(g_src):
                raise NonFiniteError()
        except Exception as exc:
            first.refuse("update_rows", exc)
            raise
        if u.guard is not None and not bool(u.guard):  # the protocol's guard: write nothing
            return tables
        if kernel is not None:  # a fused row update generated from the rule (see native.py)
            rows = ids if first.rowmap.identity else first.rowmap.local_index(ids)
            try:
                native.update(kernel, rows, g_src, rows_of, w, [t.data for t in tables], torch.get_num_threads(),
                                 check_finite=check_finite)
            except native.RowOutside:
                first.checked_ids(ids)  # its InputError names the vocabulary and the ids' range
                raise
            self._stats["fused_updates"] += 1
            return list(tables)
        seg = self._k.segments(ids, id_range)
        if first.group is None and seg.unique.numel():
            flat = g_src.reshape(g_src.shape[0], -1)
            if self._k.bag_sums(flat):
                # One compiled function sums the gradients (embedding_bag) and runs gather →
                # fn → scatter: inductor writes the new rows into the sums' buffer instead of
                # a fresh one (docs/benchmarks.md, "Measurements behind design choices").
                psw = None if w is None or self._k.all_ones(w) else w.reshape(-1)
                small = flat.shape[0] < 2**31 and seg.perm.numel() < 2**31  # int32 bag indices
                index = first.rowmap.local_index(seg.unique)
                datas = [t.data for t in tables]
                layout = tuple((d.shape[1], d.dtype) for d in datas) + (
                    flat.dtype, psw is not None, rows_of is not None, small)
                compiler = self._compiler
                compiled = compiler.entry(fn, index.shape[0] * first.data.shape[1], first.data.device,
                                          layout, self._k.bag_update_scatter)
                if compiled is not None:
                    compiler.run(compiled, self._k.bag_update_scatter, compiler.update_fn(fn),
                                 compiler.hyper(values, first.data.device),
                                 flat, seg.perm, seg.starts, rows_of, psw, small, index, *datas)
                    return list(tables)
        g = self._k.sum_segments(seg, g_src, weights=w, rows=rows_of)
        uids = seg.unique
        if first.group is not None:  # owners sum the contributions of every rank
            uids, g = first.to_owners(uids, g)
            seg = self._k.segments(uids)
            uids, g = seg.unique, self._k.sum_segments(seg, g)
        self._update_held(tables, uids, g, fn, values)
        return list(tables)

    def apply_rule_rows(self, rule: Any, values: Sequence[Any], grads: Any, rows: Sequence[Any]) -> list[Any]:
        """A 16-bit table's rule math with NumPy's bits (torch ops are not, e.g. ``torch.pow``):
        the generated C++ row kernel, or NumPy's own math on the same rows (:func:`.kernels.rule_rows`);
        the protocol's torch ops where neither applies."""
        from meshembed_torch import kernels

        new = kernels.rule_rows(self, rule, values, grads, rows)
        return super().apply_rule_rows(rule, values, grads, rows) if new is None else new

    def update_rows_in_order(self, tables: Sequence[TorchShardedTable], ids: Any, grads: Any,
                             fn: UpdateRule, *, values: Sequence[Any] = (),
                             groups: Any = None, guard: Any = None) -> list[TorchShardedTable]:
        """Gradient accumulation off. Distributed, every (id, row, group) goes to its owner
        unsummed (one route, the same collectives on every rank whatever its ids); the owner
        receives them grouped by source rank, each in input order, sorts them stably by group
        — the order of the batch concatenated feature by feature, then rank — and applies them
        in occurrence rounds on its own, so the number of rounds (which differs per rank)
        needs no agreement. One process: the protocol's rounds."""
        if not tables or tables[0].group is None:
            return super().update_rows_in_order(tables, ids, grads, fn, values=values, groups=groups, guard=guard)
        torch = self._torch
        first = tables[0]
        try:
            values = check_rule(fn, values, self.name)
            ids = self._ids(ids, first)
            g = self.asarray(grads).to(first.data.device)
            keys = torch.zeros_like(ids) if groups is None else self.asarray(groups).to(ids).reshape(-1)
            if g.shape[0] != ids.shape[0] or keys.shape[0] != ids.shape[0]:
                raise InputError(
                    f"Invalid `grads`/`groups`: expected one row and one group per id ({ids.shape[0]}). "
                    f"Received: shapes {tuple(g.shape)}, {tuple(keys.shape)}"
                )
        except Exception as exc:
            first.refuse("update_rows_in_order", exc)
            raise
        route = self._dist.Route(first.group, first.owner_rank(ids), "update_rows_in_order")
        g = route.send("gradients", g.reshape(ids.shape[0], first.data.shape[1]))
        ids, keys = route.send("ids", ids), route.send("groups", keys)
        order = torch.sort(keys, stable=True)[1]  # by group; source rank, then position, within it
        ids, g = ids.index_select(0, order), g.index_select(0, order)
        rounds = torch.from_numpy(occurrence_rounds(ids.cpu().numpy())).to(ids.device)
        for r in range(int(rounds.max()) + 1 if rounds.numel() else 0):
            pick = (rounds == r).nonzero().reshape(-1)
            self._update_held(tables, ids.index_select(0, pick), g.index_select(0, pick), fn, values)
        return list(tables)

    def _update_held(self, tables: Sequence[TorchShardedTable], uids: Any, g: Any, fn: UpdateRule,
                     values: Sequence[Any]) -> None:
        """``fn`` on the rows of *unique* ids held here: gather → fn → scatter in place."""
        self._compiler.update_rows([t.data for t in tables], tables[0].rowmap.local_index(uids), g, fn, values)

    # -- processes -------------------------------------------------------------------------------
    @property
    def processes(self) -> int:
        """The process group's size (1 when ``torch.distributed`` is not initialised)."""
        return self._torch.distributed.get_world_size(self._group) if self._dist.is_initialized() else 1

    def agree(self, status: int = 0) -> tuple[int, ...]:
        """Every rank's status, by rank: one ``all_reduce`` of a ``[world]`` vector. Collective."""
        if not self._dist.is_initialized():
            return (int(status),)
        return self._rank_group().statuses(int(status), self.device)

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes shared files (checkpoints); True in a single process."""
        return not self._dist.is_initialized() or self._torch.distributed.get_rank(self._group) == 0

    def barrier(self, ok: bool = True) -> bool:
        """Every rank waits here; returns whether every rank passed ``ok=True`` (one
        ``all_reduce(MIN)`` of a flag, so it is a barrier and a vote at once). Collective."""
        group = self._rank_group()
        if group is None:
            return bool(ok)
        return group.all_ok(bool(ok), self.device)

    # -- compilation ---------------------------------------------------------------------------
    def compile(self, fn: Callable, **options: Any) -> Callable:
        """``torch.compile`` where it pays (:meth:`meshembed_torch.kernels.UpdateCompiler.function`):
        ``force=True`` always compiles; otherwise the function runs eager on small inputs and
        compiled once its tensor arguments hold a million elements together on CPU."""
        return self._compiler.function(fn, options)
