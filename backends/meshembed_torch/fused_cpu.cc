// Fused sparse update of one embedding table on the CPU: dedup of the looked-up rows,
// per-row gradient sums (in batch order, as the core's reference) and the optimizer's
// element-wise formula, with no intermediate tensor. A registered optimisation of the torch
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
#include <cmath>
#include <cstdint>
#include <vector>

#include "row_kernels.h"

namespace {

enum Algorithm : int { kSgd = 0, kAdagrad = 1, kAdadelta = 2 };

struct Problem {
  int algorithm;
  const float* grads;
  int64_t dim;
  float* table;
  float* slot0;
  float* slot1;
  float lr, rho, epsilon, one_minus_rho;  // 1 - rho rounded once from double, as the core's
                                         // Python-float hyper-parameters are
  int64_t n;                  // contributions, in batch order:
  const int32_t* rank;        // ... the unique row each one adds to,
  const int64_t* grad_index;  // ... its row of `grads` (nullptr: i),
  const float* weights;       // ... and its weight (nullptr: 1)
  const int64_t* uniq;        // unique rows, ascending
  float* sums;                // [unique, dim] gradient sums
};

// The optimizer on one row, with the formulas of meshembed/math written out in float32
// in the same operation order (no fused multiply-adds: -ffp-contract=off). Scalars are
// copied to locals and pointers are restrict: a store to a row could otherwise alias
// them, which forces a reload per element and stops vectorisation.
void update_row(const Problem& p, int64_t row, const float* __restrict g) {
  const int64_t dim = p.dim;
  const float lr = p.lr, rho = p.rho, eps = p.epsilon, one_minus_rho = p.one_minus_rho;
  float* __restrict w = p.table + row * dim;
  switch (p.algorithm) {
    case kSgd:
      for (int64_t d = 0; d < dim; ++d) w[d] = w[d] - lr * g[d];
      break;
    case kAdagrad: {
      float* __restrict acc = p.slot0 + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float a = acc[d] + g[d] * g[d];
        acc[d] = a;
        w[d] = w[d] - lr * g[d] / std::sqrt(a);
      }
      break;
    }
    case kAdadelta: {
      float* __restrict acc = p.slot0 + row * dim;
      float* __restrict upd = p.slot1 + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float a = rho * acc[d] + one_minus_rho * (g[d] * g[d]);
        const float step = std::sqrt(upd[d] + eps) / std::sqrt(a + eps) * g[d];
        upd[d] = rho * upd[d] + one_minus_rho * (step * step);
        acc[d] = a;
        w[d] = w[d] - lr * step;
      }
      break;
    }
  }
}

constexpr int64_t kAhead = 8;

// Sums of unique rows [lo, hi), in batch order (row_kernels.h).
void sum_range(const Problem& p, int64_t lo, int64_t hi) {
  auto src = [&](int64_t i) { return p.grads + (p.grad_index ? p.grad_index[i] : i) * p.dim; };
  if (p.weights) {
    meshembed::SumInBatchOrder<true>(p.rank, p.n, lo, hi, p.dim, p.sums, src, [&](int64_t i) { return p.weights[i]; });
  } else {
    meshembed::SumInBatchOrder<false>(p.rank, p.n, lo, hi, p.dim, p.sums, src, [](int64_t) { return 1.0f; });
  }
}

// The optimizer on unique rows [lo, hi). They ascend but lie far apart in the table:
// prefetch the table's (and slots') row kAhead on.
void update_range(const Problem& p, int64_t lo, int64_t hi) {
  const int64_t dim = p.dim, row_bytes = dim * int64_t(sizeof(float));
  for (int64_t u = lo; u < hi; ++u) {
    if (u + kAhead < hi) {
      const int64_t ahead = p.uniq[u + kAhead] * dim;
      for (float* base : {p.table, p.slot0, p.slot1})
        if (base)
          meshembed::PrefetchBytes(base + ahead, row_bytes, true);
    }
    update_row(p, p.uniq[u], p.sums + u * dim);
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

  Problem p{algorithm, grads, dim, table, slot0, slot1, float(hp[0]), float(hp[1]), float(hp[2]), float(1.0 - hp[1]),
            n, rank.data(), grad_index, weights, uniq.data(), sums.data()};
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
