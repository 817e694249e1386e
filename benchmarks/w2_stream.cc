// W2's memory floor, measured: the dense Adadelta step's exact access pattern (read g; read and
// write p, a and u in place, each element once, in order) with no math, over `count` tensors
// (n[t] elements each) in one OpenMP region on `threads` threads, each tensor in contiguous
// blocks. bytes = 7 * 4 * sum(n) (benchmarks.common.w2_bytes); the time of this loop is the
// least any implementation of the step can take on this machine. A copy (what
// common.bandwidth_gbs times) writes to lines it never read, so the CPU reads them first
// (write-allocate) and a third of its traffic goes uncounted: its bound is looser than this one.
#include <cstdint>

extern "C" void w2_stream(float* const* p, float* const* a, float* const* u, const float* const* g, const int64_t* n,
                          int64_t count, int threads) {
#pragma omp parallel num_threads(threads)
  for (int64_t t = 0; t < count; ++t) {
    float* __restrict pt = p[t];
    float* __restrict at = a[t];
    float* __restrict ut = u[t];
    const float* __restrict gt = g[t];
#pragma omp for simd schedule(static) nowait
    for (int64_t j = 0; j < n[t]; ++j) {
      const float x = gt[j];
      pt[j] += x;
      at[j] += x;
      ut[j] += x;
    }
  }
}
