// Row kernels shared by the backends' C++ code (the JAX backend's FFI kernels, the torch
// backend's fused CPU updates): bitmap dedup of table rows, per-row gradient sums in batch
// order (with an optional NaN/Inf check), row prefetch, streaming row copies. No optimizer formula: the per-row update is a kernel generated from the
// core's math (meshembed_native/codegen.py). Header-only; built in by meshembed_native/build.py,
// which puts this directory on the include path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace meshembed {

// Unique owned rows (ids[k] in [0, m)) in ascending order, from a bitmap of the m rows:
// slot of row r = number of owned rows below r (popcounts). Ascending slots make later
// gathers and scatters walk the table in address order (faster than a hashed order: see
// docs/benchmarks.md). Returns the count; slot_of[k] = slot, or -1
// for an id outside [0, m); uniq gets the rows when count <= cap. Scratch is kept per
// calling thread: fresh megabytes every call would cost a page fault per 4 KiB.
template <class I>
int64_t DedupBitmap(const I* id, int64_t n, int64_t m, int64_t cap, I* uniq, int32_t* slot_of) {
  thread_local std::vector<uint64_t> bits;
  thread_local std::vector<int32_t> base;
  const int64_t words = (m + 63) / 64;
  bits.assign(words, 0);
  base.resize(words);
  for (int64_t k = 0; k < n; ++k) {
    const I r = id[k];
    if (r >= 0 && r < m) bits[r >> 6] |= uint64_t(1) << (r & 63);
  }
  int64_t total = 0;
  for (int64_t w = 0; w < words; ++w) {
    base[w] = int32_t(total);
    total += __builtin_popcountll(bits[w]);
  }
  for (int64_t k = 0; k < n; ++k) {
    const I r = id[k];
    slot_of[k] = (r >= 0 && r < m)
                     ? base[r >> 6] + __builtin_popcountll(bits[r >> 6] & ((uint64_t(1) << (r & 63)) - 1))
                     : -1;
  }
  if (total <= cap) {
    int64_t s = 0;
    for (int64_t w = 0; w < words; ++w)
      for (uint64_t b = bits[w]; b; b &= b - 1) uniq[s++] = I(w * 64 + __builtin_ctzll(b));
  }
  return total;
}

// Prefetch the `bytes` at p, a cache line at a time (write: for writing). The empty asm
// keeps the loop: GCC otherwise deletes a loop whose only statements are prefetches, which
// it treats as side-effect free (it did, silently, in every kernel here before).
// Locality 3 fills L1; 1 stops at L2 (see PrefetchAhead).
template <int Locality = 3>
inline void PrefetchBytes(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (write) __builtin_prefetch(c + b, 1, Locality);
    else __builtin_prefetch(c + b, 0, Locality);
    asm volatile("" : : "r"(c + b));
  }
}

// Rows read at random from beyond the caches are prefetched twice: kFarAhead positions on
// into L2, which keeps many more misses in flight than L1's few fill buffers, and kNearAhead
// on into L1. row_at(q): the row at position q of the loop (positions < end), or nullptr
// for none. (Why two distances: docs/benchmarks.md, "Two prefetch distances".)
constexpr int64_t kFarAhead = 64, kNearAhead = 8;
template <class RowAt>
inline void PrefetchAhead(int64_t p, int64_t end, int64_t bytes, bool write, const RowAt& row_at) {
  if (p + kFarAhead < end)
    if (const void* r = row_at(p + kFarAhead)) PrefetchBytes<1>(r, bytes, write);
  if (p + kNearAhead < end)
    if (const void* r = row_at(p + kNearAhead)) PrefetchBytes<3>(r, bytes, write);
}

// The pooled lookup (a sum of table rows per segment, both backends) prefetches each row once,
// kPooledAhead positions on, into L1, where the gradient sums take two distances: a Zipf batch's
// table rows are often in the caches already. W1 lookup, stand-alone C++ copy of the torch loop,
// 2 threads, medians of 200 passes: 0.41 ms at 32 rows ahead into L1, 0.42-0.45 at 24 / 48 / 64,
// 0.49-0.51 with PrefetchAhead's two distances, 0.55-0.59 without prefetches.
constexpr int64_t kPooledAhead = 32;
template <class T, class I>
inline void PrefetchPooled(const T* table, uint64_t rows, int64_t width, const I* ids, int64_t p, int64_t end) {
  if (p + kPooledAhead >= end) return;
  const int64_t r = int64_t(ids[p + kPooledAhead]);
  if (uint64_t(r) < rows) PrefetchBytes<3>(table + r * width, width * int64_t(sizeof(T)), false);
}

// The rows of unique row u of an update (the table's and each slot's: `n` arrays of width
// d), prefetched for writing as PrefetchAhead does, fewer positions ahead (each covers up to 8
// rows). Unique rows ascend but lie far apart in the table.
constexpr int64_t kRowsFarAhead = 32, kRowsNearAhead = 8;
template <class T, class I>
inline void PrefetchUpdateRows(T* const* arrays, int64_t n, const I* uniq, int64_t u, int64_t hi, int64_t d) {
  const int64_t bytes = int64_t(sizeof(T)) * d;
  if (u + kRowsFarAhead < hi)
    for (int64_t k = 0; k < n; ++k) PrefetchBytes<1>(arrays[k] + int64_t(uniq[u + kRowsFarAhead]) * d, bytes, true);
  if (u + kRowsNearAhead < hi)
    for (int64_t k = 0; k < n; ++k) PrefetchBytes<3>(arrays[k] + int64_t(uniq[u + kRowsNearAhead]) * d, bytes, true);
}

// f(std::integral_constant<int, D>) with D = d for the common row widths (so loops over a
// row unroll into vector registers) and D = 0 (width known at run time) otherwise.
template <class F>
inline void WithWidth(int64_t d, F&& f) {
  switch (d) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// A row of sums kept in vector registers when its width D is known at compile time
// (D == 0: width d at run time, in a per-thread buffer): a sum of rows that reads and writes
// memory instead runs markedly slower (docs/benchmarks.md).
template <int D, class T>
struct LocalRow {
  T fixed[D > 0 ? D : 1];
  T* dynamic;
  int64_t width;

  explicit LocalRow(int64_t d) : width(D > 0 ? D : d) {
    thread_local std::vector<T> buffer;
    if (D == 0) buffer.resize(d);
    dynamic = buffer.data();
  }
  // the array itself when D > 0 (a pointer kept in a member would stop the compiler from
  // holding the row in registers: measured as slow as a row in memory)
  T* Data() { return D > 0 ? fixed : dynamic; }
  void Zero() {
    T* __restrict acc = Data();
    for (int64_t j = 0; j < width; ++j) acc[j] = T(0);
  }
  template <bool Scaled>
  void Add(const T* __restrict row, T a) {
    T* __restrict acc = Data();
    for (int64_t j = 0; j < width; ++j) acc[j] += Scaled ? a * row[j] : row[j];
  }
  void Store(T* __restrict out) {
    const T* __restrict acc = Data();
    for (int64_t j = 0; j < width; ++j) out[j] = acc[j];
  }
};

// Boundaries of `parts` ranges of the `unique` rows [cut[t], cut[t + 1]) holding about equal
// numbers of contributions (in a Zipf batch a few hot rows hold half of them).
inline std::vector<int64_t> BalancedCuts(const int32_t* slot_of, int64_t n, int64_t unique, int64_t parts) {
  std::vector<int64_t> count(unique + 1, 0);  // count[u + 1]: contributions of row u
  for (int64_t i = 0; i < n; ++i)
    if (slot_of[i] >= 0 && slot_of[i] < unique) ++count[slot_of[i] + 1];
  for (int64_t u = 0; u < unique; ++u) count[u + 1] += count[u];
  std::vector<int64_t> cut(parts + 1, unique);
  cut[0] = 0;
  for (int64_t t = 1; t < parts; ++t)
    cut[t] = std::lower_bound(count.begin(), count.end() - 1, count[unique] * t / parts) - count.begin();
  return cut;
}

// Whether StreamRow may copy rows of `row_bytes` to `out`: row starts 64-byte aligned.
inline bool Streamable(const void* out, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(out) % 64 == 0 && row_bytes % 64 == 0;
}

// out[0, bytes) = src[0, bytes) with non-temporal (streaming) stores: the destination's cache
// lines are written whole, not read first, and do not evict the caches — faster for an output
// larger than the caches (docs/benchmarks.md, "The per-id step"). Requires Streamable; the
// caller runs StreamFence() after its last StreamRow.
inline void StreamRow(void* __restrict out, const void* __restrict src, int64_t bytes) {
  char* o = static_cast<char*>(out);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__)
  for (int64_t b = 0; b < bytes; b += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(o + b), _mm512_loadu_si512(s + b));
#elif defined(__AVX__)
  for (int64_t b = 0; b < bytes; b += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(o + b), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b)));
#elif defined(__SSE2__)
  for (int64_t b = 0; b < bytes; b += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(o + b), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
#else
  std::copy(s, s + bytes, o);
#endif
}

// Orders this thread's streaming stores before what follows (they are weakly ordered).
inline void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// The contributions i (ascending) whose slot_of[i] lies in [lo, hi), written to `own` (room for
// n); returns their count. Branch-free (always write, advance when owned): with two owners, a
// branch that skips the other's contributions mispredicts on about every other one.
inline int64_t OwnedContributions(const int32_t* slot_of, int64_t n, int64_t lo, int64_t hi, int32_t* own) {
  const uint32_t span = uint32_t(hi - lo);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    own[k] = int32_t(i);
    k += uint32_t(int64_t(slot_of[i]) - lo) < span;
  }
  return k;
}

// Sums of unique rows [lo, hi): sums[r] = sum of scale(i) * src(i) over the contributions i
// with slot_of[i] == r, added in batch order (the order of the core's reference, so the same
// sums to the last bit). Whoever owns a range sums only its `count` contributions `own` (from
// OwnedContributions, ascending): no two threads write one row, and the gradient rows are read
// in batch order (a sample's row stays in cache for its ids; prefetching the next ones
// measured no faster).
// With Check, also checks every element of every gradient row it reads and returns false if
// one is NaN or +-Inf (the sums are then meaningless): it adds row[j] * 0 — 0 for a finite
// element, NaN otherwise — into a row of checks of its own, so it costs no extra pass over
// the gradients and is not fooled by finite sums that overflow.
template <bool Scaled, bool Check, class T, class Src, class Scale>
bool SumOwnedInBatchOrder(const int32_t* slot_of, const int32_t* own, int64_t count, int64_t lo, int64_t hi,
                          int64_t d, T* sums, const Src& src, const Scale& scale) {
  constexpr int kLanes = 64 / sizeof(T);
  std::fill(sums + lo * d, sums + hi * d, T(0));
  bool finite = true;
  WithWidth(d, [&](auto width) {
    // the whole loop inside one width (not a dispatch per row), so the checks stay in
    // registers: a row of them when D is known (one add per element, no chain across a
    // row's vectors), kLanes otherwise
    constexpr int D = decltype(width)::value;
    constexpr int C = D > 0 ? D : kLanes;
    const int64_t w = D > 0 ? D : d;
    T check[C] = {};
    for (int64_t k = 0; k < count; ++k) {
      const int64_t i = own[k];
      const T* __restrict row = src(i);
      T* __restrict out = sums + int64_t(slot_of[i]) * w;
      const T a = Scaled ? scale(i) : T(1);
      for (int64_t j = 0; j < w; ++j) {
        out[j] += Scaled ? a * row[j] : row[j];
        if (Check) check[D > 0 ? j : j % C] += row[j] * T(0);
      }
    }
    if (Check) {
      T all = T(0);
      for (int l = 0; l < C; ++l) all += check[l];
      finite = all == T(0);
    }
  });
  return finite;
}

// Whether every element of rows [lo, hi) of the `d`-wide `rows` is finite (see above).
template <class T>
bool RowsFinite(const T* rows, int64_t lo, int64_t hi, int64_t d) {
  constexpr int C = 4 * 64 / sizeof(T);  // four vectors of checks: four independent chains
  T check[C] = {};
  const T* __restrict p = rows + lo * d;
  const int64_t count = (hi - lo) * d;
  int64_t j = 0;
  for (; j + C <= count; j += C)
    for (int l = 0; l < C; ++l) check[l] += p[j + l] * T(0);
  for (; j < count; ++j) check[0] += p[j] * T(0);
  T all = T(0);
  for (int l = 0; l < C; ++l) all += check[l];
  return all == T(0);
}

}  // namespace meshembed
