// The dense optimizer's fused CPU step for the torch backend: one call updates `count`
// tensors (a variable and its slots each) with a generated row kernel
// (meshembed_native/codegen.py), the tensors cut into chunks spread over OpenMP threads.
// The kernel holds the formula (generated from the core's math); this file only moves
// pointers: no formula here.
#include <algorithm>
#include <cstdint>

typedef void (*row_fn)(char* const* rows, const char* g, int64_t dim, const double* hp);

// fn: the kernel's address; numels[n]: elements of tensor n; grads[n]: its gradient;
// targets[k * count + n]: array k (the variable, then the slots) of tensor n; hp[n * n_params ..]:
// the parameter block of tensor n. Returns the number of chunks run (0 for nothing to do).
extern "C" int64_t meshembed_dense_update(int64_t fn, int64_t count, int64_t n_arrays, int64_t elem_size,
                                          const int64_t* numels, char* const* grads, char* const* targets,
                                          const double* hp, int64_t n_params, int64_t chunk, int threads) {
  if (count <= 0 || n_arrays <= 0 || n_arrays > 8 || chunk <= 0) return 0;
  row_fn kernel = reinterpret_cast<row_fn>(fn);
  // first[n] = index of tensor n's first chunk; chunks of one tensor are consecutive.
  int64_t* first = new int64_t[count + 1];
  first[0] = 0;
  for (int64_t n = 0; n < count; ++n) first[n + 1] = first[n] + (numels[n] + chunk - 1) / chunk;
  const int64_t total = first[count];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < total; ++c) {
    const int64_t n = std::upper_bound(first, first + count + 1, c) - first - 1;
    const int64_t start = (c - first[n]) * chunk;
    const int64_t len = std::min(chunk, numels[n] - start);
    char* rows[8];
    for (int64_t k = 0; k < n_arrays; ++k) rows[k] = targets[k * count + n] + start * elem_size;
    kernel(rows, grads[n] + start * elem_size, len, hp + n * n_params);
  }
  delete[] first;
  return total;
}
