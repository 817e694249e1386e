// Fused sparse update of one embedding table on the CPU: dedup of the looked-up rows,
// per-row gradient sums (in batch order, as the core's reference) and the optimizer, with
// no intermediate tensor. The optimizer is not written here: it is a row kernel generated
// from the core's math (meshembed_native/codegen.py), passed in as a function pointer with
// its parameter block. A registered optimisation of the torch backend
// (meshembed_torch/fused_cpu.py); tests compare it with the core function and NumPy.
//
// Plain C ABI (called through ctypes with tensors' data pointers), float or double rows, no
// torch headers. Threads: OpenMP, which resolves to the libgomp torch has loaded, so the
// driver runs on torch's own intra-op threads (a second pool would compete with torch's
// spinning workers for the same cores). Each thread owns a contiguous range of unique rows —
// for the sums balanced by contribution count, for the updates by row count — so no two
// threads write the same row.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "drivers.h"  // includes row_kernels.h

namespace {

using meshembed::kMaxArrays;
using meshembed::RowKernel;

template <class T>
struct Problem {
  RowKernel<T> kernel;
  const double* hp;
  int n_arrays;
  T* const* arrays;           // the table, then its slots, each [num_rows, dim] ...
  int64_t dim;
  int row_mask;               // ... but [num_rows, 1] where bit k is set (a row-wise slot)
  const T* grads;
  int64_t n;                  // contributions, in batch order:
  const int32_t* rank;        // ... the unique row each one adds to,
  const int64_t* grad_index;  // ... its row of `grads` (nullptr: i),
  const T* weights;           // ... and its weight (nullptr: 1)
  const int64_t* uniq;        // unique rows, ascending
  T* sums;                    // [unique, dim] gradient sums
  bool check;                 // check every element of grads (see fused_update)
};

// Sums of unique rows [lo, hi), in batch order (row_kernels.h). Returns false if p.check
// and a gradient row read here holds a NaN or Inf. Without grad_index every row of grads is
// read exactly once (by the owner of its row), so checking the rows read checks them all.
template <class T>
bool sum_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  thread_local std::vector<int32_t> own;  // this thread's contributions
  own.resize(p.n);
  const int64_t count = meshembed::OwnedContributions(p.rank, p.n, lo, hi, own.data());
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * p.dim; };
  auto sum = [&](auto scaled, auto check, const auto& scale) {
    return meshembed::SumOwnedInBatchOrder<decltype(scaled)::value, decltype(check)::value>(
        p.rank, own.data(), count, lo, hi, p.dim, p.sums, src, scale);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  const bool check = p.check && !p.grad_index;
  if (p.weights) {
    auto w = [&](int64_t i) { return p.weights[i]; };
    return check ? sum(Yes{}, Yes{}, w) : sum(Yes{}, No{}, w);
  }
  auto one = [](int64_t) { return T(1); };
  return check ? sum(No{}, Yes{}, one) : sum(No{}, No{}, one);
}

// The optimizer on unique rows [lo, hi), their rows prefetched ahead (PrefetchUpdateRows).
template <class T>
void update_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  T* rows[kMaxArrays];
  int64_t width[kMaxArrays];
  for (int k = 0; k < p.n_arrays; ++k) width[k] = (p.row_mask >> k) & 1 ? 1 : p.dim;
  for (int64_t u = lo; u < hi; ++u) {
    if (p.row_mask == 0) {
      meshembed::PrefetchUpdateRows(p.arrays, p.n_arrays, p.uniq, u, hi, p.dim);
    } else {
      for (int k = 0; k < p.n_arrays; ++k) meshembed::PrefetchUpdateRows(p.arrays + k, 1, p.uniq, u, hi, width[k]);
    }
    for (int k = 0; k < p.n_arrays; ++k) rows[k] = p.arrays[k] + p.uniq[u] * width[k];
    p.kernel(rows, p.sums + u * p.dim, p.dim, p.hp);
  }
}

// Sums and updates of unique rows [lo, hi) in one pass (the pooled W1 step's path): row u's
// contributions order[start[u], start[u + 1]) (batch order) summed in registers (LocalRow),
// then the row kernel on that sum, the rows of the next rows and contributions prefetched.
// No [unique, dim] buffer of sums is written and read back, and each thread walks only its
// own contributions (no scan of all n). Same additions in the same order as sum_range.
template <class T>
void sum_update_range(const Problem<T>& p, const int32_t* order, const int64_t* start, int64_t lo, int64_t hi) {
  T* rows[kMaxArrays];
  int64_t width[kMaxArrays];
  for (int k = 0; k < p.n_arrays; ++k) width[k] = (p.row_mask >> k) & 1 ? 1 : p.dim;
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * p.dim; };
  const int64_t row_bytes = p.dim * int64_t(sizeof(T)), end = start[hi];
  meshembed::WithWidth(p.dim, [&](auto w) {
    constexpr int D = decltype(w)::value;
    meshembed::LocalRow<D, T> acc(p.dim);
    thread_local std::vector<T> g;
    g.resize(p.dim);
    for (int64_t u = lo; u < hi; ++u) {
      if (p.row_mask == 0) {
        meshembed::PrefetchUpdateRows(p.arrays, p.n_arrays, p.uniq, u, hi, p.dim);
      } else {
        for (int k = 0; k < p.n_arrays; ++k) meshembed::PrefetchUpdateRows(p.arrays + k, 1, p.uniq, u, hi, width[k]);
      }
      acc.Zero();
      for (int64_t c = start[u]; c < start[u + 1]; ++c) {
        meshembed::PrefetchAhead(c, end, row_bytes, false,
                                 [&](int64_t q) -> const void* { return src(order[q]); });
        const int64_t i = order[c];
        if (p.weights) acc.template Add<true>(src(i), p.weights[i]);
        else acc.template Add<false>(src(i), T(1));
      }
      acc.Store(g.data());
      for (int k = 0; k < p.n_arrays; ++k) rows[k] = p.arrays[k] + p.uniq[u] * width[k];
      p.kernel(rows, g.data(), p.dim, p.hp);
    }
  });
}

// Returns the number of unique rows updated, or (before writing anything) -1 if a row is
// outside [0, num_rows), -2 if a gradient index is outside [0, grad_rows), -3 if n_arrays is
// outside [1, kMaxArrays], -4 if `check` and an element of grads is NaN or Inf — any of its
// grad_rows rows, whether a contribution reads it or not (the engine's NaN/Inf policy, checked
// before the first write: with grad_index in a pass over grads of its own, split between the
// threads; without, in the sum phase, which then ends before the updates).
// Without grad_index, grad_rows must equal n. row_mask: bit k set = array k holds one value per
// row (a row-wise rule's slot, RowKernel.widths); never the table (bit 0).
template <class T>
int64_t fused_update(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,
                     const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights, const T* grads,
                     int64_t grad_rows, int64_t dim, int threads, int check, int row_mask) {
  if (n_arrays < 1 || n_arrays > kMaxArrays || (!grad_index && grad_rows != n) || (row_mask & 1) ||
      row_mask < 0 || row_mask >= (1 << n_arrays))
    return -3;
  // Unique rows ascending (so the updates walk the table in address order) and the rank of
  // each contribution's row among them: the bitmap dedup the JAX kernels use too.
  thread_local std::vector<int64_t> uniq;
  thread_local std::vector<int32_t> rank;
  thread_local std::vector<T> sums;
  uniq.resize(n);
  rank.resize(n);
  const int64_t unique = meshembed::DedupBitmap(rows, n, num_rows, n, uniq.data(), rank.data());
  // start[u + 1] - start[u]: contributions of row u, counted in the pass that checks the input
  thread_local std::vector<int64_t> start;
  start.assign(unique + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (rank[i] < 0) return -1;
    if (grad_index && (grad_index[i] < 0 || grad_index[i] >= grad_rows)) return -2;
    ++start[rank[i] + 1];
  }
  for (int64_t u = 0; u < unique; ++u) start[u + 1] += start[u];

  Problem<T> p{reinterpret_cast<RowKernel<T>>(kernel), hp, n_arrays, arrays, dim, row_mask, grads, n, rank.data(),
               grad_index, weights, uniq.data(), nullptr, check != 0};
  const int t_count = int(std::max<int64_t>(1, std::min<int64_t>(threads, unique / 256)));
  if (!check || grad_index) {
    // One pass: the contributions grouped by row (a stable counting sort: batch order kept
    // within a row), then each thread sums and updates a range of rows, the ranges of about
    // equal cost (a contribution, or a row's update: the update costs about two
    // contributions' sums).
    thread_local std::vector<int32_t> order;
    thread_local std::vector<int64_t> next;
    order.resize(n);
    next.assign(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[next[rank[i]]++] = int32_t(i);
    std::vector<int64_t> cut(t_count + 1, unique);
    cut[0] = 0;
    for (int t = 1; t < t_count; ++t) {
      const int64_t goal = (n + 2 * unique) * t / t_count;
      int64_t a = 0, b = unique;  // the first row u with start[u] + 2u >= goal
      while (a < b) {
        const int64_t m = (a + b) / 2;
        if (start[m] + 2 * m < goal) a = m + 1;
        else b = m;
      }
      cut[t] = a;
    }
    std::vector<char> finite(t_count, 1);
    // the scratch is thread_local: its addresses taken here, on the calling thread
    const int32_t* order_of = order.data();
    const int64_t* start_of = start.data();
#pragma omp parallel num_threads(t_count)
    {
      if (check) {
#pragma omp for schedule(static, 1)
        for (int t = 0; t < t_count; ++t)
          finite[t] = meshembed::RowsFinite(grads, grad_rows * t / t_count, grad_rows * (t + 1) / t_count, dim);
      }
      const bool ok = std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
#pragma omp for schedule(static, 1)
      for (int t = 0; t < t_count; ++t)
        if (ok) sum_update_range(p, order_of, start_of, cut[t], cut[t + 1]);
    }
    return std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; }) ? unique : -4;
  }

  // Checked without grad_index (a per-id gradient, every row read once): the sums first, each
  // gradient element checked as it is added (no pass of its own), then the updates.
  sums.resize(unique * dim);
  p.sums = sums.data();
  // Sums: the unique rows split into ranges of about equal contribution counts;
  // updates: ranges of equal row counts.
  std::vector<int64_t> cut(t_count + 1, unique);
  cut[0] = 0;
  for (int t = 1; t < t_count; ++t)
    cut[t] = std::lower_bound(start.begin(), start.end() - 1, n * t / t_count) - start.begin();
  std::vector<char> finite(t_count, 1);
#pragma omp parallel num_threads(t_count)
  {
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t) finite[t] = sum_range(p, cut[t], cut[t + 1]);
    // the barrier closing the loop above publishes every finite[t]: all threads agree
    const bool ok = std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t)
      if (ok) update_range(p, unique * t / t_count, unique * (t + 1) / t_count);
  }
  return std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; }) ? unique : -4;
}

}  // namespace

// One entry point per row dtype; `kernel` is a generated row kernel of the same dtype.
#define MESHEMBED_FUSED_UPDATE(T, NAME)                                                                        \
  extern "C" int64_t NAME(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,     \
                          const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights,         \
                          const T* grads, int64_t grad_rows, int64_t dim, int threads, int check,              \
                          int row_mask) {                                                                      \
    return fused_update<T>(kernel, hp, n_arrays, arrays, num_rows, rows, n, grad_index, weights, grads,        \
                           grad_rows, dim, threads, check, row_mask);                                         \
  }
MESHEMBED_FUSED_UPDATE(float, meshembed_fused_update_float32)
MESHEMBED_FUSED_UPDATE(double, meshembed_fused_update_float64)

// out[i] = table[ids[i]] for rows of `row_bytes` bytes (any dtype: a copy of bits), or -1 if
// an id is outside [0, num_rows) (out is then partly written). The driver of drivers.h
// (GatherRowRange), each thread a contiguous range of ids; with 64-byte aligned rows the stores
// stream past the caches, for outputs larger than the caches (the caller decides:
// fused_cpu.gather_rows).
extern "C" int64_t meshembed_gather_rows(const char* table, int64_t num_rows, const int64_t* ids, int64_t n,
                                         int64_t row_bytes, char* out, int threads) {
  const bool stream = meshembed::Streamable(out, row_bytes);
  const int parts = std::max(1, threads);
  int64_t bad = 0;
#pragma omp parallel for schedule(static, 1) num_threads(parts) reduction(+ : bad)
  for (int t = 0; t < parts; ++t)
    bad += meshembed::GatherRowRange(table, num_rows, ids, n * t / parts, n * (t + 1) / parts, row_bytes, out, stream);
  return bad ? -1 : n;
}

namespace {

// out[s] = sum of table[ids[i]] over the positions i of segment s, for the segments [lo, hi) of
// sorted `slots` (positions found by binary search), each summed in registers (LocalRow) in
// position order from 0 and stored once, the rows ahead prefetched. Returns whether every id
// read is in [0, num_rows) (an id outside adds nothing).
template <int D, class T>
bool PooledRange(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots, int64_t n,
                 int64_t lo, int64_t hi, T* out) {
  meshembed::LocalRow<D, T> acc(d);
  const int64_t w = D > 0 ? D : d, row_bytes = w * int64_t(sizeof(T));
  int64_t p = std::lower_bound(slots, slots + n, lo) - slots;
  const int64_t e = std::lower_bound(slots + p, slots + n, hi) - slots;
  const uint64_t rows = uint64_t(num_rows);
  uint64_t bad = 0;
  auto row = [&](int64_t q) -> const void* {
    return uint64_t(ids[q]) < rows ? table + ids[q] * w : nullptr;
  };
  for (int64_t s = lo; s < hi; ++s) {
    acc.Zero();
    for (; p < e && slots[p] == s; ++p) {
      meshembed::PrefetchAhead(p, e, row_bytes, false, row);
      const int64_t id = ids[p];
      if (uint64_t(id) < rows) acc.template Add<false>(table + id * w, T(1));
      else bad = 1;
    }
    acc.Store(out + s * w);
  }
  return !bad;
}

template <class T>
int64_t pooled_sum(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots, int64_t n,
                   int64_t num_segments, T* out, int threads) {
  for (int64_t i = 1; i < n; ++i)
    if (slots[i] < slots[i - 1]) return -2;
  if (n && (slots[0] < 0 || slots[n - 1] >= num_segments)) return -2;
  // threads for at least 16 Ki ids each: a parallel region of less work costs more than it saves
  const int parts = int(std::max<int64_t>(1, std::min<int64_t>(threads, n >> 14)));
  int64_t bad = 0;
#pragma omp parallel for schedule(static, 1) num_threads(parts) reduction(+ : bad)
  for (int t = 0; t < parts; ++t) {
    const int64_t lo = num_segments * t / parts, hi = num_segments * (t + 1) / parts;
    meshembed::WithWidth(d, [&](auto width) {
      bad += !PooledRange<decltype(width)::value>(table, num_rows, d, ids, slots, n, lo, hi, out);
    });
  }
  return bad ? -1 : 0;
}

}  // namespace

// out[s] = sum over i with slots[i] == s of table[ids[i]] (sum-mode pooling of sorted segments,
// the pooled lookup's forward), in position order from 0. Returns 0, or -1 if an id is outside
// [0, num_rows), -2 if the slots are not non-decreasing in [0, num_segments) (nothing written).
#define MESHEMBED_POOLED(T, NAME)                                                                               \
  extern "C" int64_t NAME(const T* table, int64_t num_rows, int64_t d, const int64_t* ids, const int64_t* slots, \
                          int64_t n, int64_t num_segments, T* out, int threads) {                               \
    return pooled_sum<T>(table, num_rows, d, ids, slots, n, num_segments, out, threads);                        \
  }
MESHEMBED_POOLED(float, meshembed_pooled_sum_float32)
MESHEMBED_POOLED(double, meshembed_pooled_sum_float64)
