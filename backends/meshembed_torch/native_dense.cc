// The torch backend's bindings of the dense drivers of meshembed_native/drivers.h (the JAX
// backend binds the same ones through XLA's FFI): a C ABI for ctypes, float32 or float64 by
// element size, on OpenMP threads (which resolve to the libgomp torch has loaded, so the
// drivers run on torch's own intra-op threads). No formula here: the update calls a generated
// row kernel (meshembed_native/codegen.py).
#include <algorithm>
#include <cstdint>

#include "drivers.h"

namespace {

// Threads for `elements` of work: one per 256K elements at most, so a small step runs on the
// calling thread alone (waking a second thread costs more than it saves, and far more when the
// cores are shared with other processes).
int threads_for(int64_t elements, int threads) {
  const int64_t most = std::max<int64_t>(1, elements >> 18);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, most)));
}

// body(c) for c in [0, n) on `threads` OpenMP threads, each taking the next c when it is free
// (dynamic): on cores shared with other processes a thread that loses its core for a time
// slice leaves its chunks to the other instead of holding the whole step up (with static
// blocks the step waited for the preempted thread's half: docs/benchmarks.md, W2 profile).
// A task is a chunk of 256 KiB or more, so claiming one (an atomic add) costs nothing.
struct OmpRun {
  int threads;
  template <class Body>
  void operator()(int64_t n, const Body& body) const {
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t c = 0; c < n; ++c) body(c);
  }
};

template <class T>
void dense_update(int64_t fn, const meshembed::DenseChunks& chunks, int64_t count, int64_t n_arrays,
                  const int64_t* numels, char* const* grads, char* const* targets, const double* hp,
                  int64_t n_params, int64_t chunk, int threads) {
  meshembed::DenseUpdate<T>(reinterpret_cast<meshembed::RowKernel<T>>(fn), chunks, numels, n_arrays,
                            reinterpret_cast<const T* const*>(grads),
                            [&](int64_t k, int64_t n) { return reinterpret_cast<T*>(targets[k * count + n]); }, hp,
                            n_params, chunk, OmpRun{threads_for(chunks.elements, threads)});
}

}  // namespace

// fn: the kernel's address; numels[n]: elements of tensor n; grads[n]: its gradient;
// targets[k * count + n]: array k (the variable, then the slots) of tensor n; hp[n * n_params ..]:
// the parameter block of tensor n (n_params is only the stride: 0 when every tensor reads one
// block). Returns the number of chunks run (0 for nothing to do).
extern "C" int64_t meshembed_dense_update(int64_t fn, int64_t count, int64_t n_arrays, int64_t elem_size,
                                          const int64_t* numels, char* const* grads, char* const* targets,
                                          const double* hp, int64_t n_params, int64_t chunk, int threads) {
  if (count <= 0 || n_arrays <= 0 || n_arrays > meshembed::kMaxArrays || chunk <= 0) return 0;
  const meshembed::DenseChunks chunks(count, numels, chunk);
  if (elem_size == 8) dense_update<double>(fn, chunks, count, n_arrays, numels, grads, targets, hp, n_params, chunk, threads);
  else dense_update<float>(fn, chunks, count, n_arrays, numels, grads, targets, hp, n_params, chunk, threads);
  return chunks.size();
}

// Whether every element of the `count` arrays (float32 if elem_size == 4, else float64) is
// finite, in one pass over OpenMP threads. 1: all finite.
extern "C" int meshembed_all_finite(int64_t count, int64_t elem_size, const int64_t* numels, char* const* ptrs,
                                    int64_t chunk, int threads) {
  if (count <= 0 || chunk <= 0) return 1;
  const meshembed::DenseChunks chunks(count, numels, chunk);
  const bool f64 = elem_size != 4;
  return meshembed::AllFinite(chunks, numels, reinterpret_cast<const void* const*>(ptrs),
                              [&](int64_t) { return f64; }, chunk, OmpRun{threads_for(chunks.elements / 7, threads)});
}
