// W2's memory floor, measured: the dense Adadelta step's exact access pattern (read g; read and
// write p, a and u in place, each element once, in order) with no math, on `threads` OpenMP
// threads in contiguous blocks. bytes = 7 * 4 * n (benchmarks.common.w2_bytes); the time of this
// loop is the least any implementation of the step can take on this machine. A copy (what
// common.bandwidth_gbs times) writes to lines it never read, so the CPU reads them first
// (write-allocate) and a third of its traffic goes uncounted: its bound is looser than this one.
#include <cstdint>

extern "C" void w2_stream(float* p, float* a, float* u, const float* g, int64_t n, int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const float x = g[j];
    p[j] += x;
    a[j] += x;
    u[j] += x;
  }
}
