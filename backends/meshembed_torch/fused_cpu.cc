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
#include <vector>

#include "row_kernels.h"

namespace {

constexpr int kMaxArrays = 8;  // codegen.MAX_ARRAYS: the table and up to 7 slots
constexpr int64_t kAhead = 8;  // rows prefetched ahead of the update

// The generated kernel's C ABI (codegen.py): rows[k] = this row of array k, g = its summed
// gradient, hp = the dynamic values.
template <class T>
using RowKernel = void (*)(T* const* rows, const T* g, int64_t dim, const double* hp);

template <class T>
struct Problem {
  RowKernel<T> kernel;
  const double* hp;
  int n_arrays;
  T* const* arrays;           // the table, then its slots, each [num_rows, dim]
  int64_t dim;
  const T* grads;
  int64_t n;                  // contributions, in batch order:
  const int32_t* rank;        // ... the unique row each one adds to,
  const int64_t* grad_index;  // ... its row of `grads` (nullptr: i),
  const T* weights;           // ... and its weight (nullptr: 1)
  const int64_t* uniq;        // unique rows, ascending
  T* sums;                    // [unique, dim] gradient sums
};

// Sums of unique rows [lo, hi), in batch order (row_kernels.h).
template <class T>
void sum_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * p.dim; };
  if (p.weights) {
    meshembed::SumInBatchOrder<true>(p.rank, p.n, lo, hi, p.dim, p.sums, src, [&](int64_t i) { return p.weights[i]; });
  } else {
    meshembed::SumInBatchOrder<false>(p.rank, p.n, lo, hi, p.dim, p.sums, src, [](int64_t) { return T(1); });
  }
}

// The optimizer on unique rows [lo, hi). They ascend but lie far apart in the table:
// prefetch the rows (table and slots) kAhead on.
template <class T>
void update_range(const Problem<T>& p, int64_t lo, int64_t hi) {
  const int64_t bytes = p.dim * int64_t(sizeof(T));
  T* rows[kMaxArrays];
  for (int64_t u = lo; u < hi; ++u) {
    if (u + kAhead < hi)
      for (int k = 0; k < p.n_arrays; ++k) meshembed::PrefetchBytes(p.arrays[k] + p.uniq[u + kAhead] * p.dim, bytes, true);
    for (int k = 0; k < p.n_arrays; ++k) rows[k] = p.arrays[k] + p.uniq[u] * p.dim;
    p.kernel(rows, p.sums + u * p.dim, p.dim, p.hp);
  }
}

// Returns the number of unique rows updated, or (before writing anything) -1 if a row is
// outside [0, num_rows), -2 if a gradient index is outside [0, grad_rows), -3 if n_arrays is
// outside [1, kMaxArrays].
template <class T>
int64_t fused_update(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,
                     const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights, const T* grads,
                     int64_t grad_rows, int64_t dim, int threads) {
  if (n_arrays < 1 || n_arrays > kMaxArrays) return -3;
  // Unique rows ascending (so the updates walk the table in address order) and the rank of
  // each contribution's row among them: the bitmap dedup the JAX kernels use too.
  thread_local std::vector<int64_t> uniq;
  thread_local std::vector<int32_t> rank;
  thread_local std::vector<T> sums;
  uniq.resize(n);
  rank.resize(n);
  const int64_t unique = meshembed::DedupBitmap(rows, n, num_rows, n, uniq.data(), rank.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rank[i] < 0) return -1;
    if (grad_index && (grad_index[i] < 0 || grad_index[i] >= grad_rows)) return -2;
  }
  sums.resize(unique * dim);

  Problem<T> p{reinterpret_cast<RowKernel<T>>(kernel), hp, n_arrays, arrays, dim, grads, n, rank.data(),
               grad_index, weights, uniq.data(), sums.data()};
  // Sums: the unique rows split into ranges of about equal contribution counts;
  // updates: ranges of equal row counts.
  const int t_count = int(std::max<int64_t>(1, std::min<int64_t>(threads, unique / 256)));
  const std::vector<int64_t> cut = meshembed::BalancedCuts(rank.data(), n, unique, t_count);
#pragma omp parallel num_threads(t_count)
  {
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t) sum_range(p, cut[t], cut[t + 1]);
#pragma omp for schedule(static, 1)
    for (int t = 0; t < t_count; ++t) update_range(p, unique * t / t_count, unique * (t + 1) / t_count);
  }
  return unique;
}

}  // namespace

// One entry point per row dtype; `kernel` is a generated row kernel of the same dtype.
#define MESHEMBED_FUSED_UPDATE(T, NAME)                                                                        \
  extern "C" int64_t NAME(void* kernel, const double* hp, int n_arrays, T* const* arrays, int64_t num_rows,     \
                          const int64_t* rows, int64_t n, const int64_t* grad_index, const T* weights,         \
                          const T* grads, int64_t grad_rows, int64_t dim, int threads) {                       \
    return fused_update<T>(kernel, hp, n_arrays, arrays, num_rows, rows, n, grad_index, weights, grads,        \
                           grad_rows, dim, threads);                                                          \
  }
MESHEMBED_FUSED_UPDATE(float, meshembed_fused_update_float32)
MESHEMBED_FUSED_UPDATE(double, meshembed_fused_update_float64)
