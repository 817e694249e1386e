// Row kernels for the JAX backend on CPU, called from jit-compiled code through XLA's FFI.
//
// XLA's CPU gathers and scatters walk rows element by element on one thread; these do the
// same data movement row by row on XLA's own intra-op thread pool. They move and sum rows
// only: the optimizer formula is the core's, compiled by XLA or, in the fused updates
// (FusedUpdateImpl, DenseUpdateImpl), generated from the core's math as C++
// (meshembed_native.codegen) and called through the address the caller passes.
// Semantics match the pure-XLA kernels in kernels/__init__.py (rows >= m are "not owned": read as
// zeros, never written; sums run in batch order, so results are deterministic).
//
// Built on first use by native.py (g++ -O3, headers from jax.ffi.include_dir()).

#include <algorithm>
#include <climits>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <thread>
#include <vector>

#include "drivers.h"  // includes row_kernels.h
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Runs body(chunk) for chunk in [0, n_chunks) on the caller and the pool's threads.
// Deadlock-free whatever the pool is doing: the caller never waits for a chunk nobody has
// claimed, and a helper that starts late finds no chunk left (it only touches `state`).
// Subnormals are kept while a thread runs chunks (meshembed::KeepSubnormals: XLA's threads
// flush them), so every kernel here computes what the NumPy reference does.
template <class Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n_chunks, const Body& body) {
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n_chunks - 1);
  if (helpers <= 0) {
    meshembed::KeepSubnormals ieee;
    for (int64_t c = 0; c < n_chunks; ++c) body(c);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  const Body* work = &body;
  auto run = [state, work, n_chunks]() {
    meshembed::KeepSubnormals ieee;
    for (int64_t c; (c = state->next.fetch_add(1)) < n_chunks;) {
      (*work)(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(run)(run));
  run();
  while (state->done.load(std::memory_order_acquire) < n_chunks) std::this_thread::yield();
}

// Splits [0, n) into about `target`-sized ranges: calls body(lo, hi) in parallel.
template <class Body>
void ParallelRanges(ffi::ThreadPool& pool, int64_t n, int64_t target, const Body& body) {
  if (n <= 0) return;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((n + target - 1) / target, 64));
  int64_t step = (n + chunks - 1) / chunks;
  ParallelFor(pool, chunks, [&](int64_t c) {
    int64_t lo = c * step, hi = std::min(n, lo + step);
    if (lo < hi) body(lo, hi);
  });
}

int64_t Rows(const ffi::AnyBuffer& b) { return b.dimensions().size() ? b.dimensions()[0] : 1; }
int64_t Dim(const ffi::AnyBuffer& b) {
  return b.dimensions().size() > 1 ? b.element_count() / std::max<int64_t>(Rows(b), 1) : 1;
}

bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::F64; }
bool IsIndex(ffi::DataType t) { return t == ffi::DataType::S32 || t == ffi::DataType::S64; }

ffi::Error Unsupported(const char* what) {
  return ffi::Error::InvalidArgument(std::string("meshembed cpu kernel: unsupported ") + what +
                                     " (expected float32/float64 rows and int32/int64 ids)");
}

// Calls f(T{}, I{}) with the float type of `rows` and the integer type of `ids`.
template <class F>
ffi::Error Dispatch(ffi::DataType rows, ffi::DataType ids, F&& f) {
  if (!IsFloat(rows) || !IsIndex(ids)) return Unsupported("dtype");
  bool f64 = rows == ffi::DataType::F64, i64 = ids == ffi::DataType::S64;
  if (f64 && i64) f(double{}, int64_t{});
  else if (f64) f(double{}, int32_t{});
  else if (i64) f(float{}, int64_t{});
  else f(float{}, int32_t{});
  return ffi::Error::Success();
}

constexpr int64_t kRowsPerTask = 2048;

// Batch positions grouped by destination row, stable (counting sort): the positions of
// destination s are order[start[s] .. start[s+1]), in batch order. Positions whose
// destination is negative or >= n_dest are left out.
struct Groups {
  std::vector<int64_t> start;
  std::vector<int32_t> order;

  template <class Dest>
  void Build(int64_t n, int64_t n_dest, const Dest& dest) {
    start.assign(n_dest + 2, 0);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t s = dest(k);
      if (s >= 0 && s < n_dest) ++start[s + 2];
    }
    for (int64_t s = 2; s < n_dest + 2; ++s) start[s] += start[s - 1];
    order.resize(n);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t s = dest(k);
      if (s >= 0 && s < n_dest) order[start[s + 1]++] = int32_t(k);
    }  // now start[s] .. start[s + 1] is destination s
  }
};

// Table rows are random reads and writes (mostly cache misses): loops prefetch every line
// of the rows ahead (meshembed::PrefetchAhead).
// Rows ix[j + ...] of a [m, d] array ahead of position j (meshembed::PrefetchAhead); ids
// outside [0, m) have none.
template <class T, class I>
inline void PrefetchRowsAhead(const T* base, const I* ix, int64_t j, int64_t hi, int64_t m, int64_t d, bool write) {
  meshembed::PrefetchAhead(j, hi, int64_t(sizeof(T)) * d, write, [&](int64_t q) -> const T* {
    const int64_t r = int64_t(ix[q]);
    return r >= 0 && r < m ? base + r * d : nullptr;
  });
}

// Row s of dst (for s in [lo, hi)) = sum over the group's positions p of scale(p) * src(p),
// in batch order, summed in a LocalRow; each destination row is written once, by one task.
template <int D, bool Scaled, class T, class Src, class Scale>
void SumGroupsWidth(const Groups& gr, int64_t lo, int64_t hi, int64_t d, T* dst, const Src& src, const Scale& scale) {
  meshembed::LocalRow<D, T> sum(d);
  const int64_t end = gr.start[hi], row_bytes = int64_t(sizeof(T)) * d;
  for (int64_t s = lo; s < hi; ++s) {
    sum.Zero();
    for (int64_t p = gr.start[s], e = gr.start[s + 1]; p < e; ++p) {
      meshembed::PrefetchAhead(p, end, row_bytes, false, [&](int64_t q) { return src(gr.order[q]); });
      const int32_t k = gr.order[p];
      sum.template Add<Scaled>(src(k), Scaled ? scale(k) : T(1));
    }
    sum.Store(dst + s * d);
  }
}

template <bool Scaled, class T, class Src, class Scale>
void SumGroups(const Groups& gr, int64_t lo, int64_t hi, int64_t d, T* dst, const Src& src, const Scale& scale) {
  meshembed::WithWidth(d, [&](auto width) { SumGroupsWidth<width.value, Scaled>(gr, lo, hi, d, dst, src, scale); });
}

// The pooled lookup of sorted destinations: out row s (s in [lo, hi)) = sum of scale(p) *
// table[id[p]] over the run of `seg` equal to s (found by binary search), ids outside [0, m)
// adding nothing; in batch order in a LocalRow, stored once; the rows ahead prefetched
// (row_kernels.h, PrefetchPooled, as the torch backend's pooled sum). D: the row width when
// known at compile time (0: d).
template <int D, bool Scaled, class T, class I, class Scale>
void SumSortedWidth(const int32_t* seg, int64_t n, int64_t lo, int64_t hi, int64_t d, T* dst, const T* table,
                    const I* id, int64_t m, const Scale& scale) {
  meshembed::LocalRow<D, T> sum(d);
  const int64_t w = D > 0 ? D : d;
  int64_t p = std::lower_bound(seg, seg + n, int32_t(lo)) - seg;
  const int64_t e = std::lower_bound(seg + p, seg + n, int32_t(hi)) - seg;
  for (int64_t s = lo; s < hi; ++s) {
    sum.Zero();
    for (; p < e && seg[p] == s; ++p) {
      meshembed::PrefetchPooled(table, uint64_t(m), w, id, p, e);
      const int64_t r = int64_t(id[p]);
      if (uint64_t(r) < uint64_t(m)) sum.template Add<Scaled>(table + r * w, Scaled ? scale(p) : T(1));
    }
    sum.Store(dst + s * w);
  }
}

template <bool Scaled, class T, class I, class Scale>
void SumSorted(const int32_t* seg, int64_t n, int64_t lo, int64_t hi, int64_t d, T* dst, const T* table,
               const I* id, int64_t m, const Scale& scale) {
  meshembed::WithWidth(d, [&](auto width) { SumSortedWidth<width.value, Scaled>(seg, n, lo, hi, d, dst, table, id, m, scale); });
}

// Whether segs[0..n) never decreases: one pass without an early exit, which the compiler
// vectorises (std::is_sorted's scalar loop: ~80 us over W1's 131,072 segments, before the
// parallel part; this ~10 us).
inline bool NonDecreasing(const int32_t* segs, int64_t n) {
  int32_t down = 0;
  for (int64_t i = 1; i < n; ++i) down |= segs[i] < segs[i - 1];
  return down == 0;
}

// out[s] = sum over i with segs[i] == s of w[i] * table[ids[i]]  (ids[i] >= m: no row).
ffi::Error GatherCombineImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::AnyBuffer ids,
                             ffi::AnyBuffer segs, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out,
                             bool weighted) {
  if (segs.element_type() != ffi::DataType::S32) return Unsupported("segment dtype");
  if (weighted && w.element_type() != table.element_type()) return Unsupported("weight dtype");
  return Dispatch(table.element_type(), ids.element_type(), [&](auto t, auto i) {
    using T = decltype(t);
    using I = decltype(i);
    const int64_t m = Rows(table), d = Dim(table), n = ids.element_count(), s_all = Rows(*out);
    const T* tab = static_cast<const T*>(table.untyped_data());
    const I* id = static_cast<const I*>(ids.untyped_data());
    const int32_t* sg = static_cast<const int32_t*>(segs.untyped_data());
    const T* wt = static_cast<const T*>(w.untyped_data());
    T* o = static_cast<T*>(out->untyped_data());
    auto keep = [&](int64_t k) { return id[k] >= 0 && id[k] < m; };
    auto src = [&](int64_t k) { return tab + int64_t(id[k]) * d; };
    auto scale = [&](int64_t k) { return wt[k]; };
    if (NonDecreasing(sg, n)) {  // the engine's sample-major batches: no grouping pass
      ParallelRanges(pool, s_all, kRowsPerTask, [&](int64_t lo, int64_t hi) {
        if (weighted) SumSorted<true, T>(sg, n, lo, hi, d, o, tab, id, m, scale);
        else SumSorted<false, T>(sg, n, lo, hi, d, o, tab, id, m, scale);
      });
      return;
    }
    thread_local Groups per_thread;
    Groups& groups = per_thread;  // the tasks below run on other threads: share this one
    groups.Build(n, s_all, [&](int64_t k) { return keep(k) ? int64_t(sg[k]) : int64_t(-1); });
    ParallelRanges(pool, s_all, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      if (weighted) SumGroups<true, T>(groups, lo, hi, d, o, src, scale);
      else SumGroups<false, T>(groups, lo, hi, d, o, src, scale);
    });
  });
}

using meshembed::DedupBitmap;  // row_kernels.h

// Unique owned rows in first-occurrence order, with an open-addressing hash map sized by
// the batch (for shards too large for a bitmap). Same contract as DedupBitmap.
template <class I>
int64_t DedupHash(const I* id, int64_t n, int64_t m, int64_t cap, I* uniq, int32_t* slot_of) {
  thread_local std::vector<int32_t> map_slot;
  thread_local std::vector<I> map_key;
  int64_t size = 16;
  while (size < 2 * n) size <<= 1;
  map_key.assign(size, I(-1));
  map_slot.resize(size);
  const uint64_t mask = size - 1;
  int32_t next = 0;
  for (int64_t k = 0; k < n; ++k) {
    const I r = id[k];
    if (r < 0 || r >= m) {
      slot_of[k] = -1;
      continue;
    }
    for (uint64_t h = (uint64_t(r) * 0x9E3779B97F4A7C15ull) >> 20;; ++h) {
      const uint64_t b = h & mask;
      if (map_key[b] == r) {
        slot_of[k] = map_slot[b];
        break;
      }
      if (map_key[b] == I(-1)) {
        map_key[b] = r;
        map_slot[b] = slot_of[k] = next;
        if (next < cap) uniq[next] = r;
        ++next;
        break;
      }
    }
  }
  return next;
}

// A bitmap of the shard's rows costs m / 8 bytes per call: used up to 2^27 rows (16 MiB).
constexpr int64_t kBitmapMaxRows = int64_t(1) << 27;

// Dedup of the owned rows, then the per-row gradient sums:
//   plain:    g[slot(i)] += grads[i]
//   combined: g[slot(i)] += w[i] * grads[segs[i]]     (the combiner's backward pass)
// uniq[slot] = row (m for unused slots), count = number of unique owned rows; each slot's
// sum runs in batch order. When count exceeds the capacity, every uniq entry is m: the
// caller writes nothing and reports it.
ffi::Error DedupSumImpl(ffi::ThreadPool pool, ffi::AnyBuffer ids, ffi::AnyBuffer grads, ffi::AnyBuffer segs,
                        ffi::AnyBuffer w, int64_t m, bool combined, bool weighted,
                        ffi::Result<ffi::AnyBuffer> uniq, ffi::Result<ffi::AnyBuffer> g,
                        ffi::Result<ffi::AnyBuffer> count) {
  if (uniq->element_type() != ids.element_type()) return Unsupported("unique-id dtype");
  if (g->element_type() != grads.element_type()) return Unsupported("gradient dtype");
  if (count->element_type() != ffi::DataType::S32) return Unsupported("count dtype");
  if (combined && segs.element_type() != ffi::DataType::S32) return Unsupported("segment dtype");
  if (weighted && w.element_type() != grads.element_type()) return Unsupported("weight dtype");
  return Dispatch(grads.element_type(), ids.element_type(), [&](auto t, auto i) {
    using T = decltype(t);
    using I = decltype(i);
    const int64_t n = ids.element_count(), cap = Rows(*uniq), d = Dim(grads), s_all = Rows(grads);
    const I* id = static_cast<const I*>(ids.untyped_data());
    I* u = static_cast<I*>(uniq->untyped_data());
    T* gs = static_cast<T*>(g->untyped_data());
    const T* gr = static_cast<const T*>(grads.untyped_data());
    const int32_t* sg = static_cast<const int32_t*>(segs.untyped_data());
    const T* wt = static_cast<const T*>(w.untyped_data());

    thread_local std::vector<int32_t> slot_store;  // slot of every batch position, -1: none
    slot_store.resize(n);
    int32_t* so = slot_store.data();
    const int64_t next = m <= kBitmapMaxRows ? DedupBitmap(id, n, m, cap, u, so) : DedupHash(id, n, m, cap, u, so);
    *static_cast<int32_t*>(count->untyped_data()) = int32_t(next);
    const bool overflow = next > cap;
    for (int64_t s = overflow ? 0 : next; s < cap; ++s) u[s] = I(m);
    if (overflow) {
      std::memset(gs, 0, sizeof(T) * cap * d);
      return;
    }
    auto in_range = [&](int64_t k) { return combined ? (sg[k] >= 0 && sg[k] < s_all) : true; };
    thread_local Groups per_thread;
    Groups& groups = per_thread;  // the tasks below run on other threads: share this one
    groups.Build(n, next, [&](int64_t k) { return in_range(k) ? int64_t(so[k]) : int64_t(-1); });
    auto src = [&](int64_t k) { return gr + (combined ? int64_t(sg[k]) : k) * d; };
    ParallelRanges(pool, cap, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      const int64_t used = std::min<int64_t>(hi, next);  // slots >= next stay zero
      if (lo < used) {
        if (weighted) SumGroups<true, T>(groups, lo, used, d, gs, src, [&](int64_t k) { return wt[k]; });
        else SumGroups<false, T>(groups, lo, used, d, gs, src, [](int64_t) { return T(1); });
      }
      const int64_t z = std::max(lo, used);
      if (z < hi) std::memset(gs + z * d, 0, sizeof(T) * (hi - z) * d);
    });
  });
}

// Ranges of the destinations [0, n_dest) of `gr` holding about equal work (contributions
// plus a few per destination for its own row): in a Zipf batch a few hot rows hold half of
// the contributions, so ranges of equal row counts would leave one thread with most of it.
inline std::vector<int64_t> WorkCuts(const Groups& gr, int64_t n_dest, int64_t parts) {
  constexpr int64_t kRowCost = 4;
  const int64_t total = gr.start[n_dest] + kRowCost * n_dest;
  std::vector<int64_t> cut(parts + 1, n_dest);
  cut[0] = 0;
  for (int64_t t = 1; t < parts; ++t) {  // first s whose work before it reaches total * t / parts
    int64_t lo = cut[t - 1], hi = n_dest;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (gr.start[mid] + kRowCost * mid < total * t / parts) lo = mid + 1;
      else hi = mid;
    }
    cut[t] = lo;
  }
  return cut;
}

// A generated row kernel (meshembed_native.codegen): the rule's formula over one row of the
// table and of each slot, in place, with the summed gradient row g and the parameter block hp.
template <class T>
using RowFn = meshembed::RowKernel<T>;

constexpr size_t kMaxArrays = meshembed::kMaxArrays;  // a table and up to 7 slots

// The parameter block as doubles: F64 as is, U32/S32 pairs holding the doubles' bits (the
// engine's values, exact without jax_enable_x64), or F32 widened (traced float32 values).
bool ReadParams(const ffi::AnyBuffer& hp, int64_t blocks, std::vector<double>& out) {
  const int64_t n = hp.element_count();
  switch (hp.element_type()) {
    case ffi::DataType::F64:
      out.assign(static_cast<const double*>(hp.untyped_data()), static_cast<const double*>(hp.untyped_data()) + n);
      break;
    case ffi::DataType::U32:
    case ffi::DataType::S32:
      if (n % 2) return false;
      out.resize(n / 2);
      std::memcpy(out.data(), hp.untyped_data(), sizeof(double) * (n / 2));
      break;
    case ffi::DataType::F32: {
      const float* f = static_cast<const float*>(hp.untyped_data());
      out.assign(f, f + n);
      break;
    }
    default:
      return false;
  }
  return blocks > 0 && int64_t(out.size()) % blocks == 0;
}

// The rule's kernel applied to row `row` of the table and its slots; width[k]: array k's row
// length (dim, or 1 for a row-wise rule's per-row slot: codegen's RowKernel.widths).
template <class T>
struct GeneratedUpdate {
  RowFn<T> fn;
  int64_t dim;
  size_t n;
  T* base[kMaxArrays];
  const double* hp;
  int64_t width[kMaxArrays];
  bool rowwise;

  void Apply(int64_t row, const T* g) const {
    T* rows[kMaxArrays];
    for (size_t k = 0; k < n; ++k) rows[k] = base[k] + row * width[k];
    fn(rows, g, dim, hp);
  }
  // D: the row width when known at compile time (0: dim)
  template <int D, class I>
  void Prefetch(const I* uniq, int64_t s, int64_t hi) const {
    if (!rowwise) return meshembed::PrefetchUpdateRows(base, int64_t(n), uniq, s, hi, D > 0 ? D : dim);
    for (size_t k = 0; k < n; ++k) meshembed::PrefetchUpdateRows(base + k, 1, uniq, s, hi, width[k]);
  }
};

// Unique rows [lo, hi) of the fused update: each row's contributions summed in batch order
// in a LocalRow, then the kernel applied to the table row and its slots at once. D: the row
// width when known at compile time (0: upd.dim), in the prefetches too (as the torch backend's
// sum_update_rows; src's addresses are the caller's).
template <int D, bool Scaled, class T, class I, class Src, class Scale>
void FusedRows(const GeneratedUpdate<T>& upd, const Groups& gr, const I* uniq, int64_t lo, int64_t hi,
               const Src& src, const Scale& scale) {
  meshembed::LocalRow<D, T> sum(upd.dim);
  const int64_t end = gr.start[hi], row_bytes = int64_t(sizeof(T)) * (D > 0 ? D : upd.dim);
  for (int64_t s = lo; s < hi; ++s) {
    upd.template Prefetch<D>(uniq, s, hi);
    sum.Zero();
    for (int64_t p = gr.start[s], e = gr.start[s + 1]; p < e; ++p) {
      meshembed::PrefetchAhead(p, end, row_bytes, false, [&](int64_t q) { return src(gr.order[q]); });
      const int32_t k = gr.order[p];
      sum.template Add<Scaled>(src(k), Scaled ? scale(k) : T(1));
    }
    upd.Apply(int64_t(uniq[s]), sum.Data());
  }
}

// The fused update of a table and its slots (1..8 arrays, all float32 or all float64), in
// place: dedup of the owned rows, then for each unique row its gradient summed in batch order
// and the rule's generated kernel (attribute `fn`: its address) applied at once. Contribution
// k adds w[k] * grads[segs[k]] (combined) or grads[k] (plain); ids outside [0, m) and
// segments outside the gradient rows add nothing. hp: the kernel's parameter block.
ffi::Error FusedUpdateImpl(ffi::ThreadPool pool, ffi::AnyBuffer hp, ffi::AnyBuffer ids,
                           ffi::AnyBuffer grads, ffi::AnyBuffer segs, ffi::AnyBuffer w, ffi::RemainingArgs tables,
                           ffi::RemainingRets outs, int64_t fn, bool combined, bool weighted) {
  const size_t n_tables = tables.size();
  if (n_tables < 1 || n_tables > kMaxArrays || outs.size() != n_tables)
    return ffi::Error::InvalidArgument("meshembed fused update: expected 1-8 tables and as many results");
  if (fn == 0) return ffi::Error::InvalidArgument("meshembed fused update: no kernel address");
  const ffi::DataType type = grads.element_type();
  std::vector<double> params;
  if (!IsFloat(type) || !ReadParams(hp, 1, params)) return Unsupported("fused update operand");
  if (combined && segs.element_type() != ffi::DataType::S32) return Unsupported("segment dtype");
  if (weighted && w.element_type() != type) return Unsupported("weight dtype");
  void* data[kMaxArrays] = {};
  int64_t width[kMaxArrays] = {};
  int64_t m = 0, d = 0;
  for (size_t t = 0; t < n_tables; ++t) {
    auto in = tables.get<ffi::AnyBuffer>(t);
    auto out = outs.get<ffi::AnyBuffer>(t);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("meshembed fused update: bad table");
    if (in->element_type() != type) return Unsupported("table dtype (tables, slots and gradients must agree)");
    if (t == 0) m = Rows(*in), d = Dim(*in);
    width[t] = Dim(*in);  // a slot of width 1: a row-wise rule's per-row value
    if (Rows(*in) != m || (width[t] != d && (t == 0 || width[t] != 1)) ||
        (*out)->element_count() != in->element_count())
      return ffi::Error::InvalidArgument("meshembed fused update: a table and its slots differ in shape");
    data[t] = (*out)->untyped_data();
    if (data[t] != in->untyped_data()) std::memcpy(data[t], in->untyped_data(), ffi::ByteWidth(type) * m * width[t]);
  }
  const int64_t s_all = Rows(grads);
  if (Dim(grads) != d || (!combined && s_all < ids.element_count()))
    return ffi::Error::InvalidArgument("meshembed fused update: gradient rows do not match the ids and the table");
  return Dispatch(type, ids.element_type(), [&](auto t, auto i) {
    using T = decltype(t);
    using I = decltype(i);
    GeneratedUpdate<T> upd{reinterpret_cast<RowFn<T>>(fn), d, n_tables, {}, params.data(), {}, false};
    for (size_t k = 0; k < n_tables; ++k) {
      upd.base[k] = static_cast<T*>(data[k]);
      upd.width[k] = width[k];
      upd.rowwise |= width[k] != d;
    }
    const int64_t n = ids.element_count();
    const I* id = static_cast<const I*>(ids.untyped_data());
    const T* gr = static_cast<const T*>(grads.untyped_data());
    const int32_t* sg = static_cast<const int32_t*>(segs.untyped_data());
    const T* wt = static_cast<const T*>(w.untyped_data());
    thread_local std::vector<I> uniq_store;
    thread_local std::vector<int32_t> slot_store;
    uniq_store.resize(n);
    slot_store.resize(n);
    I* u = uniq_store.data();
    int32_t* so = slot_store.data();
    const int64_t count = m <= kBitmapMaxRows ? DedupBitmap(id, n, m, n, u, so) : DedupHash(id, n, m, n, u, so);
    auto in_range = [&](int64_t k) { return combined ? (sg[k] >= 0 && sg[k] < s_all) : true; };
    thread_local Groups per_thread;
    Groups& groups = per_thread;  // the tasks below run on other threads: share this one
    groups.Build(n, count, [&](int64_t k) { return in_range(k) ? int64_t(so[k]) : int64_t(-1); });
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(64, count / 256));
    const std::vector<int64_t> cut = WorkCuts(groups, count, parts);
    ParallelFor(pool, parts, [&](int64_t p) {
      const int64_t lo = cut[p], hi = cut[p + 1];
      if (lo >= hi) return;
      meshembed::WithWidth(d, [&](auto width) {
        const int64_t dim = width.value > 0 ? width.value : d;  // a constant where WithWidth knows it
        auto src = [&](int64_t k) { return gr + (combined ? int64_t(sg[k]) : k) * dim; };
        if (weighted) FusedRows<width.value, true>(upd, groups, u, lo, hi, src, [&](int64_t k) { return wt[k]; });
        else FusedRows<width.value, false>(upd, groups, u, lo, hi, src, [](int64_t) { return T(1); });
      });
    });
  });
}

// The dense optimizer's fused update, in place: the rule's generated kernel (attribute `fn`)
// over each flat tensor taken as one row, cut into tasks (the kernel is elementwise), in one
// pass that reads every input once and writes every output once (XLA's CPU compiler splits a
// step with several outputs into several loops). `count` tensors per call: args = hp
// [count, n_params] (each tensor's parameter block), the count gradients, then the targets by
// position (the variables, then each slot: target k of tensor n is argument
// 1 + count + k * count + n, result k * count + n); 1..8 targets, float32 or float64.
ffi::Error DenseUpdateImpl(ffi::ThreadPool pool, ffi::AnyBuffer hp, ffi::RemainingArgs args,
                           ffi::RemainingRets outs, int64_t fn, int64_t count) {
  std::vector<double> params;
  if (count < 1 || fn == 0 || !ReadParams(hp, count, params)) return Unsupported("dense update hyper-parameters");
  const int64_t n_params = int64_t(params.size()) / count;
  const int64_t k_targets = int64_t(outs.size()) / count;
  if (k_targets < 1 || k_targets > int64_t(kMaxArrays) || k_targets * count != int64_t(outs.size()) ||
      int64_t(args.size()) != count * (1 + k_targets))
    return ffi::Error::InvalidArgument("meshembed dense update: expected count gradients and 1-8 targets each");
  auto first = args.get<ffi::AnyBuffer>(0);
  if (!first.has_value() || !IsFloat(first->element_type())) return Unsupported("gradient dtype");
  const ffi::DataType type = first->element_type();
  const size_t width = ffi::ByteWidth(type);
  std::vector<const void*> grads(count);
  std::vector<void*> data(count * k_targets, nullptr);
  std::vector<int64_t> size(count);
  for (int64_t n = 0; n < count; ++n) {
    auto g = args.get<ffi::AnyBuffer>(n);
    if (!g.has_value() || g->element_type() != type) return Unsupported("gradient dtype (all must agree)");
    grads[n] = g->untyped_data();
    size[n] = g->element_count();
    for (int64_t k = 0; k < k_targets; ++k) {
      auto in = args.get<ffi::AnyBuffer>(count + k * count + n);
      auto out = outs.get<ffi::AnyBuffer>(k * count + n);
      if (!in.has_value() || !out.has_value() || in->element_type() != type ||
          in->element_count() != size[n] || (*out)->element_count() != size[n])
        return ffi::Error::InvalidArgument("meshembed dense update: a target differs from its gradient");
      void* o = (*out)->untyped_data();
      if (o != in->untyped_data()) std::memcpy(o, in->untyped_data(), width * size[n]);
      data[n * k_targets + k] = o;
    }
  }
  // Tasks of at most kDenseTask elements, so both threads get work with one tensor or many.
  constexpr int64_t kDenseTask = int64_t(1) << 18;
  const meshembed::DenseChunks chunks(count, size.data(), kDenseTask);
  auto on_pool = [&](int64_t n_tasks, const auto& body) { ParallelFor(pool, n_tasks, body); };
  auto run = [&](auto t) {
    using T = decltype(t);
    meshembed::DenseUpdate<T>(reinterpret_cast<RowFn<T>>(fn), chunks, size.data(), k_targets,
                              reinterpret_cast<const T* const*>(grads.data()),
                              [&](int64_t k, int64_t n) { return static_cast<T*>(data[n * k_targets + k]); },
                              params.data(), n_params, kDenseTask, on_pool);
  };
  if (type == ffi::DataType::F64) run(double{});
  else run(float{});
  return ffi::Error::Success();
}

// out = whether every element of every array is finite: the engine's NaN/Inf guard, the
// driver of drivers.h (exponent bits, an integer test that vectorises) on the pool's threads
// (XLA's reduction for the same check runs on one thread: docs/benchmarks.md, "Measurements
// behind design choices in the code", JAX backend).
ffi::Error AllFiniteImpl(ffi::ThreadPool pool, ffi::RemainingArgs arrays, ffi::Result<ffi::AnyBuffer> out) {
  if (out->element_type() != ffi::DataType::PRED) return Unsupported("guard dtype");
  const size_t count = arrays.size();
  std::vector<int64_t> numels(count);
  std::vector<const void*> ptrs(count);
  std::vector<char> f64(count);
  for (size_t a = 0; a < count; ++a) {
    auto x = arrays.get<ffi::AnyBuffer>(a);
    if (!x.has_value() || !IsFloat(x->element_type())) return Unsupported("guard operand dtype");
    numels[a] = x->element_count();
    ptrs[a] = x->untyped_data();
    f64[a] = x->element_type() == ffi::DataType::F64;
  }
  constexpr int64_t kTask = int64_t(1) << 18;
  const meshembed::DenseChunks chunks(int64_t(count), numels.data(), kTask);
  *static_cast<bool*>(out->untyped_data()) = meshembed::AllFinite(
      chunks, numels.data(), ptrs.data(), [&](int64_t n) { return f64[n] != 0; }, kTask,
      [&](int64_t n_tasks, const auto& body) { ParallelFor(pool, n_tasks, body); });
  return ffi::Error::Success();
}

// rows[j] = table[idx[j]] on the pool's threads, zeros where idx[j] is outside [0, m): the
// driver of drivers.h (GatherRowRange). A fresh output of >= 32 MiB is a new mmap (glibc) every
// call, one first-touch fault per 4 KiB written (most of a per-id lookup's time:
// docs/benchmarks.md, "The per-id (sequence-feature) step"): asked for 2 MiB pages before the
// first write. An output beyond the caches (a per-id lookup) is written with streaming stores:
// its lines are not read first (as torch's gather).
ffi::Error GatherRows(ffi::ThreadPool& pool, ffi::AnyBuffer table, ffi::AnyBuffer idx,
                      ffi::Result<ffi::AnyBuffer>& rows) {
  if (rows->element_type() != table.element_type()) return Unsupported("row dtype");
  if (rows->element_count() != idx.element_count() * Dim(table))
    return ffi::Error::InvalidArgument("meshembed gather rows: the result needs one row per index");
  return Dispatch(table.element_type(), idx.element_type(), [&](auto t, auto i) {
    using T = decltype(t);
    using I = decltype(i);
    const int64_t m = Rows(table), d = Dim(table), c = idx.element_count();
    const char* tab = static_cast<const char*>(table.untyped_data());
    const I* ix = static_cast<const I*>(idx.untyped_data());
    char* o = static_cast<char*>(rows->untyped_data());
    const int64_t row_bytes = int64_t(sizeof(T)) * d;
    meshembed::AdviseHugePages(o, row_bytes * c);
    const bool stream = row_bytes * c >= meshembed::kStreamMinBytes && meshembed::Streamable(o, row_bytes);
    ParallelRanges(pool, c, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      meshembed::GatherRowRange(tab, m, ix, lo, hi, row_bytes, o, stream);
    });
  });
}

// `dst` (optional, the one remaining argument): a released earlier result the caller donates
// (the output aliases it). Every row is written, so nothing of its old content survives; a
// 32 MiB per-id lookup then touches no fresh page (docs/benchmarks.md, "The per-id step").
ffi::Error GatherRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::AnyBuffer idx, ffi::RemainingArgs dst,
                          ffi::Result<ffi::AnyBuffer> rows) {
  if (dst.size() > 1) return ffi::Error::InvalidArgument("meshembed gather rows: at most one destination");
  if (dst.size() == 1) {
    auto into = dst.get<ffi::AnyBuffer>(0);
    if (!into.has_value() || into->element_type() != rows->element_type() ||
        into->element_count() != rows->element_count())
      return Unsupported("destination shape");
  }
  return GatherRows(pool, table, idx, rows);
}

// table[idx[j]] = rows[j] in place (the output aliases the donated table); idx[j] outside
// [0, m) is skipped. The indices are unique (they come from the dedup), so tasks never
// write the same row.
ffi::Error ScatterRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::AnyBuffer idx, ffi::AnyBuffer rows,
                           ffi::Result<ffi::AnyBuffer> out) {
  if (rows.element_type() != table.element_type()) return Unsupported("row dtype");
  return Dispatch(table.element_type(), idx.element_type(), [&](auto t, auto i) {
    using T = decltype(t);
    using I = decltype(i);
    const int64_t m = Rows(table), d = Dim(table), c = idx.element_count();
    T* o = static_cast<T*>(out->untyped_data());
    if (o != table.untyped_data()) std::memcpy(o, table.untyped_data(), sizeof(T) * m * d);  // not aliased
    const I* ix = static_cast<const I*>(idx.untyped_data());
    const T* src = static_cast<const T*>(rows.untyped_data());
    ParallelRanges(pool, c, kRowsPerTask, [&](int64_t lo, int64_t hi) {
      for (int64_t j = lo; j < hi; ++j) {
        PrefetchRowsAhead(o, ix, j, hi, m, d, true);
        const int64_t r = ix[j];
        if (r >= 0 && r < m) std::memcpy(o + r * d, src + j * d, sizeof(T) * d);
      }
    });
  });
}

}  // namespace

// The host side of a batch's int64 ids or slots without x64 (JaxBackend._narrow_ids): out[i] =
// int32(in[i]) in one pass that also finds the range (NumPy's min, max and astype: three
// passes over the int64 array). Returns whether every value fits int32; lo / hi: the range
// (n > 0). The caller refuses the batch, with nothing sent to a device, when it does not fit.
extern "C" int meshembed_narrow_int64(const int64_t* in, int32_t* out, int64_t n, int64_t* lo, int64_t* hi) {
  int64_t mn = n ? in[0] : 0, mx = mn;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = in[i];
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    out[i] = int32_t(v);
  }
  *lo = mn;
  *hi = mx;
  return mn >= INT32_MIN && mx <= INT32_MAX;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedGatherCombine, GatherCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("weighted"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedDedupSum, DedupSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("m")
                                  .Attr<bool>("combined")
                                  .Attr<bool>("weighted")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedFusedUpdate, FusedUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("fn")
                                  .Attr<bool>("combined")
                                  .Attr<bool>("weighted"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedDenseUpdate, DenseUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("fn")
                                  .Attr<int64_t>("count"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedAllFinite, AllFiniteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedGatherRows, GatherRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshembedScatterRows, ScatterRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
