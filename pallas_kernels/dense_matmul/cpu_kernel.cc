// Float32 matmuls of few rows for the CPU, as an XLA FFI custom call:
//
//   JaxpageDenseMatmulF32(x f32 [M, K], w f32 [K, N]) -> y f32 [M, N] = x @ w
//
// for a model's float32 projections on the CPU (``__init__.py``): at the 24-64 rows of a
// decode step XLA:CPU's dots reach ~60% of the float32 roof on a 2-core AVX-512 machine,
// this ~80-95%. Every output is one FMA chain over k in order, so a row's result does not
// depend on M or on the other rows (a request samples the same alone or batched).
//
// Work: column panels of 64 (four 16-float vectors) times blocks of rows, claimed from a
// shared counter by the calling thread and XLA's CPU pool. Within an item, tiles of 6 rows
// x 64 columns keep 24 accumulators in registers while k runs over the whole K: each k
// loads 4 vectors of w and broadcasts 6 values of x. The first tile of an item streams
// its panel of w from memory (software prefetch 8 rows of w ahead); the later tiles read
// it from L2 while prefetching the next claimed item's panel, so memory and arithmetic
// overlap. Without AVX-512 a plain loop computes the same sums.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "_cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpage::ParallelForAhead;

constexpr int kTileRows = 6;
constexpr int kVectors = 4;                 // 16-float vectors per panel
constexpr int64_t kPanel = 16 * kVectors;   // columns per panel
constexpr int64_t kAhead = 8;               // rows of w prefetched ahead of the first tile
constexpr int64_t kItemsWanted = 16;        // split rows when the panels are fewer

struct Shape {
  int64_t m, k, n;
};

#ifdef __AVX512F__
inline void PrefetchRow(const float* p, int hint_l2) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int line = 0; line < kVectors; ++line) {
    if (hint_l2) _mm_prefetch(c + 64 * line, _MM_HINT_T1);
    else _mm_prefetch(c + 64 * line, _MM_HINT_T0);
  }
}

// y[0:R, n0:n0+64] = x[0:R, :] @ w[:, n0:n0+64] (columns past `masks` left alone).
// `stream`: prefetch this panel ahead (first tile); `next`/`next_k`: the next item's
// panel, prefetched one row every `every` k steps (`due` counts down to the next one; a
// counter, not k % every, which cost a division per k step).
template <int R, bool kMasked>
void Tile(const float* x, const float* w, float* y, const Shape& s, int64_t n0,
          const __mmask16* masks, bool stream, const float* next, int64_t every,
          int64_t& next_k, int64_t& due) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* wp = w + n0;
  for (int64_t k = 0; k < s.k; ++k) {
    const float* wk = wp + k * s.n;
    if (stream && k + kAhead < s.k) PrefetchRow(wk + kAhead * s.n, 0);
    if (next != nullptr && next_k < s.k && --due == 0) {
      PrefetchRow(next + next_k++ * s.n, 1);
      due = every;
    }
    __m512 b[kVectors];
    for (int j = 0; j < kVectors; ++j)
      b[j] = kMasked ? _mm512_maskz_loadu_ps(masks[j], wk + 16 * j) : _mm512_loadu_ps(wk + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * s.k + k]);
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      float* out = y + r * s.n + n0 + 16 * j;
      if (kMasked) _mm512_mask_storeu_ps(out, masks[j], acc[r][j]);
      else _mm512_storeu_ps(out, acc[r][j]);
    }
}

template <bool kMasked>
void Item(const float* x, const float* w, float* y, const Shape& s, int64_t n0, int64_t m0,
          int64_t m1, const float* next) {
  __mmask16 masks[kVectors];
  const int64_t width = std::min(kPanel, s.n - n0);
  for (int j = 0; j < kVectors; ++j) {
    const int64_t c = std::clamp<int64_t>(width - 16 * j, 0, 16);
    masks[j] = c == 16 ? 0xFFFF : static_cast<__mmask16>((1u << c) - 1);
  }
  // The next item's panel is fetched over all of this item's tiles, the first included
  // (whose own panel streams too): one row of it every `tiles` k steps.
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  int64_t next_k = 0, due = 1;
  for (int64_t r0 = m0; r0 < m1; r0 += kTileRows) {
    const bool first = r0 == m0;
    const float* xr = x + r0 * s.k;
    float* yr = y + r0 * s.n;
    switch (std::min<int64_t>(kTileRows, m1 - r0)) {
#define JAXPAGE_TILE(R)                                                                    \
  case R:                                                                                  \
    Tile<R, kMasked>(xr, w, yr, s, n0, masks, first, next, tiles, next_k, due);                \
    break;
      JAXPAGE_TILE(1) JAXPAGE_TILE(2) JAXPAGE_TILE(3) JAXPAGE_TILE(4) JAXPAGE_TILE(5)
      JAXPAGE_TILE(6)
#undef JAXPAGE_TILE
    }
  }
}
#else
template <bool kMasked>
void Item(const float* x, const float* w, float* y, const Shape& s, int64_t n0, int64_t m0,
          int64_t m1, const float*) {
  const int64_t n1 = std::min(s.n, n0 + kPanel);
  for (int64_t r = m0; r < m1; ++r) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < s.k; ++k) {
      const float a = x[r * s.k + k];
      const float* wk = w + k * s.n;
      for (int64_t c = n0; c < n1; ++c) acc[c - n0] = __builtin_fmaf(a, wk[c], acc[c - n0]);
    }
    for (int64_t c = n0; c < n1; ++c) y[r * s.n + c] = acc[c - n0];
  }
}
#endif

void Matmul(const float* x, const float* w, float* y, const Shape& s, ffi::ThreadPool& pool) {
  const int64_t panels = (s.n + kPanel - 1) / kPanel;
  const int64_t tiles = (s.m + kTileRows - 1) / kTileRows;
  // Rows are split only into blocks of at least 4 tiles: below that the item is bound by
  // reading its panel of w, which a split would read twice.
  const int64_t blocks =
      std::clamp<int64_t>((kItemsWanted + panels - 1) / panels, 1, std::max<int64_t>(1, tiles / 4));
  const int64_t block_rows = ((tiles + blocks - 1) / blocks) * kTileRows;
  const int64_t row_blocks = (s.m + block_rows - 1) / block_rows;
  // Items run panel-major within a row block: neighbours share x rows, and a worker's next
  // item is usually the next panel (the one it prefetches).
  ParallelForAhead(panels * row_blocks, pool, [=](int64_t item, int64_t after) {
    const int64_t n0 = (item % panels) * kPanel, m0 = (item / panels) * block_rows;
    const float* next = after >= 0 ? w + (after % panels) * kPanel : nullptr;
    const int64_t m1 = std::min(s.m, m0 + block_rows);
    if (n0 + kPanel <= s.n) Item<false>(x, w, y, s, n0, m0, m1, next);
    else Item<true>(x, w, y, s, n0, m0, m1, next);
  });
}

ffi::Error DenseMatmulF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("dense matmul: x must be [M, K] and w [K, N]");
  const Shape s{xd[0], xd[1], wd[1]};
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  Matmul(x.typed_data(), w.typed_data(), y->typed_data(), s, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageDenseMatmulF32, DenseMatmulF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());
