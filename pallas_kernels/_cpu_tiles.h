// Register tiles of a float32 matmul for the C++ CPU kernels: y[r, c] = sum over k, in
// order, of x[r, k] * w[k, c], one FMA chain per output. Shared by ``dense_matmul`` (w
// read where it lies) and ``quantized_matmul`` (w a panel dequantized into a buffer), so
// the two give bit-identical sums for the same float weights. Included by each kernel's
// cpu_kernel.cc; ``_cpu_build`` hashes this header with the kernel's source.
//
// A panel is 64 columns of w (four 16-float vectors). A tile keeps R x 4 accumulators in
// registers while k runs over all of K: each k step loads the 4 vectors of w's row k and
// broadcasts R values of x. Without AVX-512 a plain loop computes the same sums.

#ifndef JAXPAGE_CPU_TILES_H_
#define JAXPAGE_CPU_TILES_H_

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "_cpu_parallel.h"

namespace jaxpage {

constexpr int kTileRows = 6;
constexpr int kVectors = 4;                // 16-float vectors per panel
constexpr int64_t kPanel = 16 * kVectors;  // columns per panel

// Where a tile's operands lie: x rows of `ldx` floats, w rows of `ldw` floats starting at
// the panel's first column, y rows of `ldy` floats starting at the panel's first column.
struct TileArgs {
  const float* x;
  int64_t ldx, k;
  const float* w;
  int64_t ldw;
  float* y;
  int64_t ldy;
  int64_t width;  // columns of the panel that exist (<= kPanel)
};

#ifdef __AVX512F__
inline void PanelMasks(int64_t width, __mmask16* masks) {
  for (int j = 0; j < kVectors; ++j) {
    const int64_t c = std::clamp<int64_t>(width - 16 * j, 0, 16);
    masks[j] = c == 16 ? 0xFFFF : static_cast<__mmask16>((1u << c) - 1);
  }
}

// Rows [0, R) of a tile. `hook(k, wk)` runs before each k step (prefetching; wk is w's
// row k). kMasked: the panel is narrower than 64 columns (loads and stores masked).
// kResume: the sums go on from the values in y (a chain over K split into runs of k:
// the same FMAs in the same order, so the same floats as one run).
template <int R, bool kMasked, bool kResume, typename Hook>
inline void Tile(const TileArgs& a, const __mmask16* masks, Hook& hook) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      const float* from = a.y + r * a.ldy + 16 * j;
      acc[r][j] = !kResume ? _mm512_setzero_ps()
                  : kMasked ? _mm512_maskz_loadu_ps(masks[j], from) : _mm512_loadu_ps(from);
    }
  for (int64_t k = 0; k < a.k; ++k) {
    const float* wk = a.w + k * a.ldw;
    hook(k, wk);
    __m512 b[kVectors];
    for (int j = 0; j < kVectors; ++j)
      b[j] = kMasked ? _mm512_maskz_loadu_ps(masks[j], wk + 16 * j) : _mm512_loadu_ps(wk + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(a.x[r * a.ldx + k]);
      for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_fmadd_ps(xv, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVectors; ++j) {
      float* out = a.y + r * a.ldy + 16 * j;
      if (kMasked) _mm512_mask_storeu_ps(out, masks[j], acc[r][j]);
      else _mm512_storeu_ps(out, acc[r][j]);
    }
}

// Rows [0, rows) of a panel in tiles of up to kTileRows. make_hook(first) gives the hook
// of each tile (`first`: the tile that reads the panel first).
template <bool kMasked, bool kResume, typename MakeHook>
inline void PanelRows(TileArgs a, int64_t rows, MakeHook&& make_hook) {
  __mmask16 masks[kVectors];
  PanelMasks(a.width, masks);
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    auto hook = make_hook(r0 == 0);
    switch (std::min<int64_t>(kTileRows, rows - r0)) {
#define JAXPAGE_TILE(R)                 \
  case R:                               \
    Tile<R, kMasked, kResume>(a, masks, hook); \
    break;
      JAXPAGE_TILE(1) JAXPAGE_TILE(2) JAXPAGE_TILE(3) JAXPAGE_TILE(4) JAXPAGE_TILE(5)
      JAXPAGE_TILE(6)
#undef JAXPAGE_TILE
    }
    a.x += kTileRows * a.ldx;
    a.y += kTileRows * a.ldy;
  }
}

// Rows [0, rows) of a panel, masked or not as its width asks; `resume`: go on from y's
// sums (see Tile).
template <typename MakeHook>
inline void MultiplyPanel(const TileArgs& a, int64_t rows, MakeHook&& make_hook,
                          bool resume = false) {
  if (a.width == kPanel) {
    if (resume) PanelRows<false, true>(a, rows, make_hook);
    else PanelRows<false, false>(a, rows, make_hook);
  } else {
    if (resume) PanelRows<true, true>(a, rows, make_hook);
    else PanelRows<true, false>(a, rows, make_hook);
  }
}
#else
// The same sums without AVX-512 (hooks unused).
template <typename MakeHook>
inline void MultiplyPanel(const TileArgs& a, int64_t rows, MakeHook&&, bool resume = false) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    if (resume)
      for (int64_t c = 0; c < a.width; ++c) acc[c] = a.y[r * a.ldy + c];
    for (int64_t k = 0; k < a.k; ++k) {
      const float xv = a.x[r * a.ldx + k];
      const float* wk = a.w + k * a.ldw;
      for (int64_t c = 0; c < a.width; ++c) acc[c] = __builtin_fmaf(xv, wk[c], acc[c]);
    }
    for (int64_t c = 0; c < a.width; ++c) a.y[r * a.ldy + c] = acc[c];
  }
}
#endif

// Prefetch `lines` cache lines from p into L1 (hint_l2 == 0) or L2.
inline void PrefetchLines(const void* p, int lines, int hint_l2) {
#ifdef __AVX512F__
  const char* c = static_cast<const char*>(p);
  for (int line = 0; line < lines; ++line) {
    if (hint_l2) _mm_prefetch(c + 64 * line, _MM_HINT_T1);
    else _mm_prefetch(c + 64 * line, _MM_HINT_T0);
  }
#else
  (void)p, (void)lines, (void)hint_l2;
#endif
}

// The work items of an M x N product: panels of 64 columns times blocks of rows, claimed by
// the calling thread and XLA's pool (ParallelForAhead), panel-major within a row block
// (neighbours share x's rows; a worker's next item is usually the next panel). Rows are
// split only when the panels are fewer than about 16 items, and only into blocks of at
// least 4 tiles: below that an item is bound by reading its panel, which a split reads
// twice. body(n0, m0, m1, next_n0): next_n0 is the first column of the panel the same
// worker does next (-1: none), for prefetching.
template <typename Body>
void ForEachPanel(int64_t m, int64_t n, xla::ffi::ThreadPool& pool, Body body) {
  constexpr int64_t kItemsWanted = 16;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t blocks =
      std::clamp<int64_t>((kItemsWanted + panels - 1) / panels, 1, std::max<int64_t>(1, tiles / 4));
  const int64_t block_rows = ((tiles + blocks - 1) / blocks) * kTileRows;
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  ParallelForAhead(panels * row_blocks, pool, [=](int64_t item, int64_t after) {
    const int64_t n0 = (item % panels) * kPanel, m0 = (item / panels) * block_rows;
    body(n0, m0, std::min(m, m0 + block_rows), after >= 0 ? (after % panels) * kPanel : -1);
  });
}

}  // namespace jaxpage

#endif  // JAXPAGE_CPU_TILES_H_
