// The dense optimizer's fused CPU step for the torch backend: one call updates `count`
// tensors (a variable and its slots each) with a generated row kernel
// (meshembed_native/codegen.py), the tensors cut into chunks spread over OpenMP threads.
// The kernel holds the formula (generated from the core's math); this file only moves
// pointers: no formula here.
#include <algorithm>
#include <cstdint>
#include <vector>

typedef void (*row_fn)(char* const* rows, const char* g, int64_t dim, const double* hp);

namespace {

// The `count` tensors cut into chunks of `chunk` elements, numbered tensor by tensor.
struct Chunks {
  std::vector<int64_t> first;  // first[n]: the number of tensor n's first chunk
  int64_t elements = 0;
  const int64_t* numels;
  int64_t chunk;

  Chunks(int64_t count, const int64_t* numels_, int64_t chunk_) : first(count + 1, 0), numels(numels_), chunk(chunk_) {
    for (int64_t n = 0; n < count; ++n) {
      first[n + 1] = first[n] + (numels[n] + chunk - 1) / chunk;
      elements += numels[n];
    }
  }
  int64_t total() const { return first.back(); }
  // Chunk c: its tensor n, first element and length.
  void locate(int64_t c, int64_t* n, int64_t* start, int64_t* len) const {
    *n = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
    *start = (c - first[*n]) * chunk;
    *len = std::min(chunk, numels[*n] - *start);
  }
};

// Threads for `elements` of work: one per 256K elements at most, so a small step runs on the
// calling thread alone (waking a second thread costs more than it saves, and far more when the
// cores are shared with other processes).
int threads_for(int64_t elements, int threads) {
  const int64_t most = std::max<int64_t>(1, elements >> 18);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, most)));
}

// Whether every element is finite: a value is NaN or ±Inf exactly when its exponent bits are
// all ones; an integer OR over the chunk says it (associative, so it vectorises, unlike a
// floating-point sum).
template <class U>
int all_finite(int64_t count, const int64_t* numels, char* const* ptrs, int64_t chunk, int threads, U mask) {
  const Chunks chunks(count, numels, chunk);
  int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads_for(chunks.elements / 7, threads)) reduction(| : bad)
  for (int64_t c = 0; c < chunks.total(); ++c) {
    int64_t n, start, len;
    chunks.locate(c, &n, &start, &len);
    const U* x = reinterpret_cast<const U*>(ptrs[n]) + start;
    U any = 0;
    for (int64_t j = 0; j < len; ++j) any |= static_cast<U>((x[j] & mask) == mask);
    bad |= any != 0;
  }
  return !bad;
}

}  // namespace

// fn: the kernel's address; numels[n]: elements of tensor n; grads[n]: its gradient;
// targets[k * count + n]: array k (the variable, then the slots) of tensor n; hp[n * n_params ..]:
// the parameter block of tensor n. Returns the number of chunks run (0 for nothing to do).
extern "C" int64_t meshembed_dense_update(int64_t fn, int64_t count, int64_t n_arrays, int64_t elem_size,
                                          const int64_t* numels, char* const* grads, char* const* targets,
                                          const double* hp, int64_t n_params, int64_t chunk, int threads) {
  if (count <= 0 || n_arrays <= 0 || n_arrays > 8 || chunk <= 0) return 0;
  row_fn kernel = reinterpret_cast<row_fn>(fn);
  const Chunks chunks(count, numels, chunk);
#pragma omp parallel for schedule(static) num_threads(threads_for(chunks.elements, threads))
  for (int64_t c = 0; c < chunks.total(); ++c) {
    int64_t n, start, len;
    chunks.locate(c, &n, &start, &len);
    char* rows[8];
    for (int64_t k = 0; k < n_arrays; ++k) rows[k] = targets[k * count + n] + start * elem_size;
    kernel(rows, grads[n] + start * elem_size, len, hp + n * n_params);
  }
  return chunks.total();
}

// Whether every element of the `count` arrays (float32 if elem_size == 4, else float64) is
// finite, in one pass over OpenMP threads. 1: all finite.
extern "C" int meshembed_all_finite(int64_t count, int64_t elem_size, const int64_t* numels, char* const* ptrs,
                                    int64_t chunk, int threads) {
  if (count <= 0 || chunk <= 0) return 1;
  return elem_size == 4 ? all_finite<uint32_t>(count, numels, ptrs, chunk, threads, 0x7f800000u)
                        : all_finite<uint64_t>(count, numels, ptrs, chunk, threads, 0x7ff0000000000000ull);
}
