// Fused sparse update of one embedding table on the CPU: dedup of the looked-up rows,
// per-row gradient sums (in batch order, as the core's reference) and the optimizer's
// element-wise formula (meshembed::RowUpdate in row_kernels.h, shared with the JAX
// backend's fused kernel), with no intermediate tensor. A registered optimisation of the torch
// backend (meshembed_torch/fused_cpu.py); tests/test_torch_fused.py compares it with the
// core function and the NumPy reference.
//
// Plain C ABI (called through ctypes with tensors' data pointers), float32 rows, no torch
// headers. Threads: OpenMP, which resolves to the libgomp torch has loaded, so the kernel
// runs on torch's own intra-op threads (a second pool would compete with torch's spinning
// workers for the same cores). Each thread owns a contiguous range of unique rows — for the
// sums balanced by contribution count, for the updates by row count — so no two threads
// write the same row.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "row_kernels.h"

namespace {

struct Problem {
  meshembed::RowUpdate rows;  // the table, its slots and the formula (row_kernels.h)
  const float* grads;
  int64_t n;                  // contributions, in batch order:
  const int32_t* rank;        // ... the unique row each one adds to,
  const int64_t* grad_index;  // ... its row of `grads` (nullptr: i),
  const float* weights;       // ... and its weight (nullptr: 1)
  const int64_t* uniq;        // unique rows, ascending
  float* sums;                // [unique, dim] gradient sums
};

constexpr int64_t kAhead = 8;

// Sums of unique rows [lo, hi), in batch order (row_kernels.h).
void sum_range(const Problem& p, int64_t lo, int64_t hi) {
  const int64_t dim = p.rows.dim;
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * dim; };
  if (p.weights) {
    meshembed::SumInBatchOrder<true>(p.rank, p.n, lo, hi, dim, p.sums, src, [&](int64_t i) { return p.weights[i]; });
  } else {
    meshembed::SumInBatchOrder<false>(p.rank, p.n, lo, hi, dim, p.sums, src, [](int64_t) { return 1.0f; });
  }
}

// The optimizer on unique rows [lo, hi). They ascend but lie far apart in the table:
// prefetch the table's (and slots') row kAhead on.
void update_range(const Problem& p, int64_t lo, int64_t hi) {
  for (int64_t u = lo; u < hi; ++u) {
    if (u + kAhead < hi) p.rows.Prefetch(p.uniq[u + kAhead]);
    p.rows.Apply(p.uniq[u], p.sums + u * p.rows.dim);
  }
}

}  // namespace

// Returns the number of unique rows updated, or (before writing anything) -1 if a row is
// outside [0, num_rows), -2 if a gradient index is outside [0, grad_rows).
// hp: learning rate, rho, epsilon (the ones the algorithm uses).
extern "C" int64_t meshembed_fused_update(int algorithm, const int64_t* rows, int64_t n,
                                          const int64_t* grad_index, const float* weights,
                                          const float* grads, int64_t grad_rows, int64_t dim, float* table,
                                          int64_t num_rows, float* slot0, float* slot1,
                                          const double* hp, int threads) {
  // Unique rows ascending (so the updates walk the table in address order) and the rank of
  // each contribution's row among them: the bitmap dedup the JAX kernels use too.
  thread_local std::vector<int64_t> uniq;
  thread_local std::vector<int32_t> rank;
  thread_local std::vector<float> sums;
  uniq.resize(n);
  rank.resize(n);
  const int64_t unique = meshembed::DedupBitmap(rows, n, num_rows, n, uniq.data(), rank.data());
  for (int64_t i = 0; i < n; ++i) {
    if (rank[i] < 0) return -1;
    if (grad_index && (grad_index[i] < 0 || grad_index[i] >= grad_rows)) return -2;
  }
  sums.resize(unique * dim);

  Problem p{meshembed::RowUpdate(algorithm, dim, table, slot0, slot1, hp), grads, n, rank.data(), grad_index,
            weights, uniq.data(), sums.data()};
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
