// Float32 matmuls of few rows for the CPU, as an XLA FFI custom call:
//
//   JaxpageDenseMatmulF32(x f32 [M, K], w f32 [K, N], rows s32 [1]) -> y f32 [M, N]
//
// y[:rows] = x[:rows] @ w; the rows past `rows` (a batch's padding) are not computed and
// come out as zeros.
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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "_cpu_parallel.h"
#include "_cpu_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpage::kPanel;
using jaxpage::kTileRows;
using jaxpage::PrefetchLines;

constexpr int64_t kAhead = 8;          // rows of w prefetched ahead of the first tile

struct Shape {
  int64_t m, k, n;
};

// Prefetching for one tile: the first tile of an item streams its panel of w (8 rows
// ahead, into L1); every tile fetches the next claimed item's panel into L2, one row every
// `every` k steps (`due` counts down to the next one; a counter, not k % every, which cost
// a division per k step).
struct StreamHook {
  bool stream;
  const float* next;
  int64_t ldw, k_size, every;
  int64_t& next_k;
  int64_t& due;
  void operator()(int64_t k, const float* wk) {
    if (stream && k + kAhead < k_size) PrefetchLines(wk + kAhead * ldw, 4, 0);
    if (next != nullptr && next_k < k_size && --due == 0) {
      PrefetchLines(next + next_k++ * ldw, 4, 1);
      due = every;
    }
  }
};

// y[m0:m1, n0:n0+64] = x[m0:m1, :] @ w[:, n0:n0+64]; `next`: the next item's panel.
void Item(const float* x, const float* w, float* y, const Shape& s, int64_t n0, int64_t m0,
          int64_t m1, const float* next) {
  const jaxpage::TileArgs args{x + m0 * s.k, s.k, s.k, w + n0, s.n, y + m0 * s.n + n0, s.n,
                               std::min(kPanel, s.n - n0)};
  // The next item's panel is fetched over all of this item's tiles, the first included
  // (whose own panel streams too): one row of it every `tiles` k steps.
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  int64_t next_k = 0, due = 1;
  jaxpage::MultiplyPanel(args, m1 - m0, [&](bool first) {
    return StreamHook{first, next, s.n, s.k, tiles, next_k, due};
  });
}

void Matmul(const float* x, const float* w, float* y, const Shape& s, ffi::ThreadPool& pool) {
  jaxpage::ForEachPanel(s.m, s.n, pool, [=](int64_t n0, int64_t m0, int64_t m1, int64_t next) {
    Item(x, w, y, s, n0, m0, m1, next >= 0 ? w + next : nullptr);
  });
}

ffi::Error DenseMatmulF32(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                          ffi::ThreadPool pool) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("dense matmul: x must be [M, K] and w [K, N]");
  if (rows.element_count() != 1)
    return ffi::Error::InvalidArgument("dense matmul: rows must hold one value");
  // Rows at or past `rows` are padding: not computed, written as zeros.
  const int64_t live = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  std::fill(y->typed_data() + live * wd[1], y->typed_data() + xd[0] * wd[1], 0.0f);
  const Shape s{live, xd[1], wd[1]};
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  Matmul(x.typed_data(), w.typed_data(), y->typed_data(), s, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageDenseMatmulF32, DenseMatmulF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]: live rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());
