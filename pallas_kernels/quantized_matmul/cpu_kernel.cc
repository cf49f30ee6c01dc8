// Matmuls with quantized weights for the CPU, as XLA FFI custom calls.
//
// A quantized weight W [K, N] (in_features x out_features, the model's layout) is stored
// as codes and per-group scales along K (group size gs = K / G):
//   8-bit: codes int8 [K, N];                      W[k, n] = scale[k / gs, n] * q[k, n]
//   4-bit: codes uint8 [K / 2, N], two per byte    W[k, n] = scale[k / gs, n] * q[k, n]
//          (row 2i in the low nibble of byte row i,         + zero[k / gs, n]
//          row 2i + 1 in the high nibble), q in 0..15.
//
// Why hand-written: XLA's CPU backend converts int8 to float32 at ~1 ns an element when
// the result feeds a dot (measured: a decode step of SmolLM2's shapes at batch 1 took
// 37 ms against 3.6 ms in float32), so weight-only quantization in plain jnp would make
// every decode step 10x slower on the CPU instead of reading 4x fewer bytes.
//
// Two kinds of call:
// * JaxpageQMatmulS8 / JaxpageQMatmulU4: y [M, N] = x [M, K] @ W for the few rows of a
//   decode step. The work is split into column tiles of W; each tile's codes are read
//   once, converted once per row of codes, and applied to all M rows of x.
// * JaxpageDequantS8 / JaxpageDequantU4: W as float32 [K, N], for prefill-sized M, where
//   XLA's own dot of the float weight is faster than the loop above.
// Both run on XLA's CPU thread pool (no second pool competing with XLA's for the cores).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "_cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpage::ParallelFor;

constexpr int64_t kTileCols = 64;  // output columns per work item
constexpr int64_t kTileRows = 8;   // rows of x handled together (accumulators in L1)

struct Dims {
  int64_t m, k, n, groups, group_size;
};

// Codes of one row of W (columns [n0, n0 + nb)) as floats.
inline void RowS8(const int8_t* q, int64_t row, const Dims& d, int64_t n0, int64_t nb,
                  float* w) {
  const int8_t* src = q + row * d.n + n0;
  for (int64_t j = 0; j < nb; ++j) w[j] = static_cast<float>(src[j]);
}

// Codes of rows 2 * pair and 2 * pair + 1 of W (columns [n0, n0 + nb)) as floats.
inline void RowPairU4(const uint8_t* q, int64_t pair, const Dims& d, int64_t n0, int64_t nb,
                      float* lo, float* hi) {
  const uint8_t* src = q + pair * d.n + n0;
  for (int64_t j = 0; j < nb; ++j) {
    lo[j] = static_cast<float>(src[j] & 15);
    hi[j] = static_cast<float>(src[j] >> 4);
  }
}

// y[m0 : m0 + mb, n0 : n0 + nb] for 8-bit codes (zero == nullptr) or 4-bit codes.
template <bool kFour>
void MatmulTile(const float* x, const void* codes, const float* scale, const float* zero,
                const Dims& d, int64_t m0, int64_t mb, int64_t n0, int64_t nb, float* y) {
  alignas(64) float acc[kTileRows][kTileCols];
  alignas(64) float part[kTileRows][kTileCols];
  alignas(64) float w0[kTileCols], w1[kTileCols];
  float xsum[kTileRows];
  for (int64_t r = 0; r < mb; ++r) std::fill(acc[r], acc[r] + nb, 0.0f);
  for (int64_t g = 0; g < d.groups; ++g) {
    for (int64_t r = 0; r < mb; ++r) {
      std::fill(part[r], part[r] + nb, 0.0f);
      xsum[r] = 0.0f;
    }
    const int64_t k_begin = g * d.group_size, k_end = k_begin + d.group_size;
    if constexpr (kFour) {
      for (int64_t k = k_begin; k < k_end; k += 2) {
        RowPairU4(static_cast<const uint8_t*>(codes), k / 2, d, n0, nb, w0, w1);
        for (int64_t r = 0; r < mb; ++r) {
          const float a = x[(m0 + r) * d.k + k], b = x[(m0 + r) * d.k + k + 1];
          xsum[r] += a + b;
          float* p = part[r];
          for (int64_t j = 0; j < nb; ++j) p[j] += a * w0[j] + b * w1[j];
        }
      }
    } else {
      // Four rows of codes per pass over the accumulators (one pass per row made the
      // loads and stores of `part`, not the codes, the bound: slower than float32).
      alignas(64) float w2[kTileCols], w3[kTileCols];
      const int8_t* q8 = static_cast<const int8_t*>(codes);
      int64_t k = k_begin;
      for (; k + 4 <= k_end; k += 4) {
        RowS8(q8, k, d, n0, nb, w0);
        RowS8(q8, k + 1, d, n0, nb, w1);
        RowS8(q8, k + 2, d, n0, nb, w2);
        RowS8(q8, k + 3, d, n0, nb, w3);
        for (int64_t r = 0; r < mb; ++r) {
          const float* xr = x + (m0 + r) * d.k + k;
          const float a = xr[0], b = xr[1], c = xr[2], e = xr[3];
          float* p = part[r];
          for (int64_t j = 0; j < nb; ++j) p[j] += a * w0[j] + b * w1[j] + c * w2[j] + e * w3[j];
        }
      }
      for (; k < k_end; ++k) {
        RowS8(q8, k, d, n0, nb, w0);
        for (int64_t r = 0; r < mb; ++r) {
          const float a = x[(m0 + r) * d.k + k];
          float* p = part[r];
          for (int64_t j = 0; j < nb; ++j) p[j] += a * w0[j];
        }
      }
    }
    const float* s = scale + g * d.n + n0;
    const float* z = kFour ? zero + g * d.n + n0 : nullptr;
    for (int64_t r = 0; r < mb; ++r) {
      float* a = acc[r];
      const float* p = part[r];
      if constexpr (kFour) {
        const float xs = xsum[r];
        for (int64_t j = 0; j < nb; ++j) a[j] += p[j] * s[j] + xs * z[j];
      } else {
        for (int64_t j = 0; j < nb; ++j) a[j] += p[j] * s[j];
      }
    }
  }
  for (int64_t r = 0; r < mb; ++r)
    std::memcpy(y + (m0 + r) * d.n + n0, acc[r], sizeof(float) * nb);
}

template <bool kFour>
void Matmul(const float* x, const void* codes, const float* scale, const float* zero,
            const Dims& d, float* y, ffi::ThreadPool& pool) {
  const int64_t col_tiles = (d.n + kTileCols - 1) / kTileCols;
  const int64_t row_tiles = (d.m + kTileRows - 1) / kTileRows;
  ParallelFor(col_tiles * row_tiles, pool, [=](int64_t item) {
    const int64_t n0 = (item % col_tiles) * kTileCols, m0 = (item / col_tiles) * kTileRows;
    MatmulTile<kFour>(x, codes, scale, zero, d, m0, std::min(kTileRows, d.m - m0), n0,
                      std::min(kTileCols, d.n - n0), y);
  });
}

template <bool kFour>
void Dequantize(const void* codes, const float* scale, const float* zero, const Dims& d,
                float* w, ffi::ThreadPool& pool) {
  const int64_t step = kFour ? 2 : 1;  // rows of W per work item's row of codes
  const int64_t rows_per_item = std::max<int64_t>(step, (16384 / std::max<int64_t>(d.n, 1)) /
                                                            step * step);
  const int64_t items = (d.k + rows_per_item - 1) / rows_per_item;
  ParallelFor(items, pool, [=](int64_t item) {
    const int64_t k_end = std::min(d.k, (item + 1) * rows_per_item);
    for (int64_t k = item * rows_per_item; k < k_end; k += step) {
      const int64_t g = k / d.group_size;
      const float* s = scale + g * d.n;
      float* out = w + k * d.n;
      if constexpr (kFour) {
        const float* z = zero + g * d.n;
        RowPairU4(static_cast<const uint8_t*>(codes), k / 2, d, 0, d.n, out, out + d.n);
        for (int64_t j = 0; j < d.n; ++j) {
          out[j] = out[j] * s[j] + z[j];
          out[d.n + j] = out[d.n + j] * s[j] + z[j];
        }
      } else {
        RowS8(static_cast<const int8_t*>(codes), k, d, 0, d.n, out);
        for (int64_t j = 0; j < d.n; ++j) out[j] *= s[j];
      }
    }
  });
}

// Shapes of a call: codes [K or K / 2, N], scale (and zero) [G, N]; K from x when given.
const char* DimsOf(bool four, int64_t x_rows, int64_t x_cols, ffi::Span<const int64_t> cd,
                   ffi::Span<const int64_t> sd, Dims* d) {
  if (cd.size() != 2 || sd.size() != 2) return "quantized matmul: codes and scales must be 2-D";
  const int64_t k = four ? 2 * cd[0] : cd[0];
  if (x_cols >= 0 && x_cols != k) return "quantized matmul: x and codes disagree on K";
  if (sd[1] != cd[1] || sd[0] <= 0 || k % sd[0] != 0)
    return "quantized matmul: scales must be [G, N] with G dividing K";
  *d = Dims{x_rows, k, cd[1], sd[0], k / sd[0]};
  if (four && d->group_size % 2 != 0) return "quantized matmul: 4-bit groups must be even";
  return nullptr;
}

ffi::Error QMatmulS8(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quantized matmul: x must be [M, K]");
  Dims d;
  if (const char* e = DimsOf(false, xd[0], xd[1], q.dimensions(), scale.dimensions(), &d))
    return ffi::Error::InvalidArgument(e);
  Matmul<false>(x.typed_data(), q.typed_data(), scale.typed_data(), nullptr, d,
                y->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::Error QMatmulU4(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> zero, ffi::ResultBuffer<ffi::F32> y,
                     ffi::ThreadPool pool) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quantized matmul: x must be [M, K]");
  Dims d;
  if (const char* e = DimsOf(true, xd[0], xd[1], q.dimensions(), scale.dimensions(), &d))
    return ffi::Error::InvalidArgument(e);
  Matmul<true>(x.typed_data(), q.typed_data(), scale.typed_data(), zero.typed_data(), d,
               y->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::Error DequantS8(ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::ResultBuffer<ffi::F32> w, ffi::ThreadPool pool) {
  Dims d;
  if (const char* e = DimsOf(false, 0, -1, q.dimensions(), scale.dimensions(), &d))
    return ffi::Error::InvalidArgument(e);
  Dequantize<false>(q.typed_data(), scale.typed_data(), nullptr, d, w->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::Error DequantU4(ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> zero, ffi::ResultBuffer<ffi::F32> w,
                     ffi::ThreadPool pool) {
  Dims d;
  if (const char* e = DimsOf(true, 0, -1, q.dimensions(), scale.dimensions(), &d))
    return ffi::Error::InvalidArgument(e);
  Dequantize<true>(q.typed_data(), scale.typed_data(), zero.typed_data(), d, w->typed_data(),
                   pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQMatmulS8, QMatmulS8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQMatmulU4, QMatmulU4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [K / 2, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // zero [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageDequantS8, DequantS8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // W [K, N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageDequantU4, DequantU4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [K / 2, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // zero [G, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // W [K, N]
                                  .Ctx<ffi::ThreadPool>());
