// Matmuls with quantized weights for the CPU, as XLA FFI custom calls.
//
// A quantized weight W [K, N] (in_features x out_features, the model's layout) is stored
// as codes and per-group scales along K (group size gs = K / G):
//   8-bit: codes int8 [K, N];                      W[k, n] = scale[k / gs, n] * q[k, n]
//   8-bit asymmetric: codes int8 [K, N] and        W[k, n] = scale[k / gs, n] * q[k, n]
//          zero [G, N];                                     + zero[k / gs, n]
//   4-bit: codes uint8 [K / 2, N], two per byte    W[k, n] = scale[k / gs, n] * q[k, n]
//          (row 2i in the low nibble of byte row i,         + zero[k / gs, n]
//          row 2i + 1 in the high nibble), q in 0..15.
// Or packed by panels of 64 columns (``quantized_matmul.pack_panels``): codes
// [N / 64, K or K / 2, 64], scale and zero [N / 64, G, 64], the same values, each panel
// contiguous. One row of a decode step reads the packed layout ~1.6x as fast.
//
// Why hand-written: XLA's CPU backend converts int8 to float32 at ~1 ns an element when
// the result feeds a dot (measured: a decode step of SmolLM2's shapes at batch 1 took
// 37 ms against 3.6 ms in float32), so weight-only quantization in plain jnp would make
// every decode step 10x slower on the CPU instead of reading 4x fewer bytes.
//
// JaxpageQMatmulS8 / JaxpageQMatmulS8Z (with a zero) / JaxpageQMatmulU4: y [M, N] =
// x [M, K] @ W, for any M; the rows at or past the `rows` operand (a batch's padding) are
// not computed and come out as zeros. Work items are panels of 64 columns of W times
// blocks of rows, claimed by the calling thread and XLA's CPU pool. An item converts its
// panel once into a [K, 64] float buffer of its thread (reading the codes, 1/4 or 1/8 of
// the float bytes, with software prefetch) and runs the register tiles of
// ``_cpu_tiles.h`` over it, prefetching the next item's codes meanwhile.
// An item of up to 18 rows of 4-bit codes, or 6 of 8-bit (a decode step's few rows),
// converts each row of codes in registers and uses it at once instead, in passes of up to
// 6 rows (FusedTile).
// The sums are those of ``dense_matmul`` on the dequantized weight, bit for bit: one FMA
// chain per output over k in order, whatever M is.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>

#include "_cpu_parallel.h"
#include "_cpu_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


using jaxpage::kPanel;
using jaxpage::kTileRows;
using jaxpage::kVectors;
using jaxpage::PrefetchLines;

constexpr int64_t kAheadRows = 48;    // rows of codes prefetched ahead while dequantizing
constexpr int64_t kAheadGroups = 3;   // groups whose scales are prefetched ahead
// Rows converted in registers (Fused): up to 3 passes of 6 for 4-bit codes; for 8-bit
// codes, whose conversion is cheap, the buffered panel is as fast from 7 rows on, and
// faster when the codes stream from memory (an LM head of 49,152 columns: 2.2-2.3 against
// 2.4 ms at 8 rows, 2.9-3.0 against 3.7 at 16).
template <bool kFour>
constexpr int64_t kFusedPasses = kFour ? 3 : 1;
constexpr int64_t kChunk = 2048;      // rows of k dequantized at a time (512 KB, in L2)

// A weight's layout: plain, codes [K or K / 2, N] and scales [G, N] (a panel's rows N
// apart); or packed by panels, codes [N / 64, K or K / 2, 64] and scales [N / 64, G, 64]
// (each panel's codes, and its scales, contiguous: read as one stream, which the hardware
// prefetches, where the plain layout's rows N bytes apart each cost a miss).
struct Dims {
  int64_t m, k, n, groups, group_size;
  bool packed = false;

  // Elements between a panel's consecutive rows of codes or of scales.
  int64_t ld() const { return packed ? kPanel : n; }
  int64_t code_rows(bool four) const { return four ? k / 2 : k; }
  // Offsets of the panel starting at column n0: its first row of codes, of scales.
  int64_t CodeBase(bool four, int64_t n0) const { return packed ? n0 * code_rows(four) : n0; }
  int64_t ScaleBase(int64_t n0) const { return packed ? n0 * groups : n0; }
};

// Every weight is converted exactly as ``reference.dequantize`` (and GGUF's own
// dequantization) computes it: 8-bit q * scale; with a zero (8-bit asymmetric, 4-bit)
// fma(q, scale, zero). For GGUF's blocks (float16 scales times codes of 4-8 bits) the
// product is exact, so the fma and numpy's d * q + m round once, to the same float.
//
// Template parameters: kFour, 4-bit codes (two per byte, always with a zero); kZero, a
// zero is added (kFour implies it; without kFour, 8-bit asymmetric codes).

#ifdef __AVX512F__
// 16 columns of two rows of 4-bit codes (the low and high nibbles of 16 bytes) as
// weights: fma(q, scale, zero).
inline void ConvertU4(__m128i bytes, __m512 s, __m512 z, __m512& lo, __m512& hi) {
  const __m512i q = _mm512_cvtepu8_epi32(bytes);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), s, z);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), s, z);
}

// 16 columns of one row of 8-bit codes as weights: q * scale, or fma(q, scale, zero).
template <bool kZero>
inline __m512 ConvertS8(__m128i bytes, __m512 s, __m512 z) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  return kZero ? _mm512_fmadd_ps(q, s, z) : _mm512_mul_ps(q, s);
}
#endif

// buf [kc, 64] = W[k0 : k0 + kc, n0 : n0 + width] as floats (columns past width unset);
// k0 and kc even for 4-bit codes.
template <bool kFour, bool kZero>
void DequantRows(const void* codes, const float* scale, const float* zero, const Dims& d,
                 int64_t n0, int64_t width, int64_t k0, int64_t kc, float* buf) {
  const int64_t step = kFour ? 2 : 1;  // rows of W per row of codes
  const int64_t code_rows = d.code_rows(kFour), ld = d.ld();
  codes = static_cast<const uint8_t*>(codes) + d.CodeBase(kFour, n0);
  scale += d.ScaleBase(n0);
  if constexpr (kZero) zero += d.ScaleBase(n0);
#ifdef __AVX512F__
  if (width == kPanel) {
    int64_t g = k0 / d.group_size, group_end = (g + 1) * d.group_size;
    __m512 sv[kVectors], zv[kVectors];
    auto load_group = [&] {
      for (int j = 0; j < kVectors; ++j) {
        sv[j] = _mm512_loadu_ps(scale + g * ld + 16 * j);
        zv[j] = kZero ? _mm512_loadu_ps(zero + g * ld + 16 * j) : _mm512_setzero_ps();
      }
      // the scales of a group ahead: in the plain layout rows N floats apart, which the
      // hardware does not fetch ahead by itself (a miss per group stalled small-M calls)
      if (g + kAheadGroups < d.groups) {
        PrefetchLines(scale + (g + kAheadGroups) * ld, kVectors, 0);
        if (kZero) PrefetchLines(zero + (g + kAheadGroups) * ld, kVectors, 0);
      }
    };
    for (int64_t ahead = 1; ahead < kAheadGroups && g + ahead < d.groups; ++ahead) {
      PrefetchLines(scale + (g + ahead) * ld, kVectors, 0);
      if (kZero) PrefetchLines(zero + (g + ahead) * ld, kVectors, 0);
    }
    load_group();
    for (int64_t k = k0; k < k0 + kc; k += step) {
      if (k == group_end) {
        ++g;
        group_end += d.group_size;
        load_group();
      }
      const int64_t row = k / step;
      const uint8_t* src = static_cast<const uint8_t*>(codes) + row * ld;
      if (row + kAheadRows < code_rows) PrefetchLines(src + kAheadRows * ld, 1, 0);
      float* out = buf + (k - k0) * kPanel;
      for (int j = 0; j < kVectors; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * j));
        if constexpr (kFour) {
          __m512 lo, hi;
          ConvertU4(bytes, sv[j], zv[j], lo, hi);
          _mm512_store_ps(out + 16 * j, lo);
          _mm512_store_ps(out + kPanel + 16 * j, hi);
        } else {
          _mm512_store_ps(out + 16 * j, ConvertS8<kZero>(bytes, sv[j], zv[j]));
        }
      }
    }
    return;
  }
#endif
  for (int64_t k = k0; k < k0 + kc; ++k) {
    const int64_t g = k / d.group_size;
    const float* s = scale + g * ld;
    const float* z = kZero ? zero + g * ld : nullptr;
    float* out = buf + (k - k0) * kPanel;
    if constexpr (kFour) {
      const uint8_t* src = static_cast<const uint8_t*>(codes) + (k / 2) * ld;
      for (int64_t c = 0; c < width; ++c) {
        const float q = static_cast<float>(k % 2 ? src[c] >> 4 : src[c] & 15);
        out[c] = __builtin_fmaf(q, s[c], z[c]);
      }
    } else if constexpr (kZero) {
      const int8_t* src = static_cast<const int8_t*>(codes) + k * ld;
      for (int64_t c = 0; c < width; ++c)
        out[c] = __builtin_fmaf(static_cast<float>(src[c]), s[c], z[c]);
    } else {
      const int8_t* src = static_cast<const int8_t*>(codes) + k * ld;
      for (int64_t c = 0; c < width; ++c) out[c] = static_cast<float>(src[c]) * s[c];
    }
  }
}

// This thread's buffer for one dequantized chunk, kChunk x 64 floats.
float* ChunkBuffer() {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buffer(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kChunk * kPanel)));
  return buffer.get();
}

// Prefetching for one tile over a dequantized chunk (which lies in this core's L2): the
// next claimed item's codes into L2, one row of codes every `every` k steps.
struct NextCodesHook {
  const uint8_t* next;
  int64_t ld, rows, every;
  int64_t& next_row;
  int64_t& due;
  void operator()(int64_t, const float*) {
    if (next != nullptr && next_row < rows && --due == 0) {
      PrefetchLines(next + next_row++ * ld, 1, 1);
      due = every;
    }
  }
};

#ifdef __AVX512F__
// The few rows of a decode step (R <= kTileRows, a full panel): each row of codes is
// converted in registers and used at once, no buffer. The same weights and the same FMA
// chain per output (over k in order) as the buffered path, so the same sums.
template <int R, bool kFour, bool kZero>
void FusedTile(const float* x, const void* codes, const float* scale, const float* zero,
               const Dims& d, int64_t n0, float* y) {
  __m512 acc[R][kVectors];
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < kVectors; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t step = kFour ? 2 : 1, code_rows = d.code_rows(kFour), ld = d.ld();
  const uint8_t* panel = static_cast<const uint8_t*>(codes) + d.CodeBase(kFour, n0);
  scale += d.ScaleBase(n0);
  if constexpr (kZero) zero += d.ScaleBase(n0);
  for (int64_t g = 0; g < d.groups; ++g) {
    const float* s = scale + g * ld;
    const float* z = kZero ? zero + g * ld : nullptr;
    if (g + kAheadGroups < d.groups) {
      PrefetchLines(s + kAheadGroups * ld, kVectors, 0);
      if (kZero) PrefetchLines(z + kAheadGroups * ld, kVectors, 0);
    }
    for (int64_t k = g * d.group_size; k < (g + 1) * d.group_size; k += step) {
      const int64_t row = k / step;
      const uint8_t* src = panel + row * ld;
      if (row + kAheadRows < code_rows) PrefetchLines(src + kAheadRows * ld, 1, 0);
      _Pragma("GCC unroll 16") for (int j = 0; j < kVectors; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * j));
        const __m512 sj = _mm512_loadu_ps(s + 16 * j);
        if constexpr (kFour) {
          __m512 lo, hi;
          ConvertU4(bytes, sj, _mm512_loadu_ps(z + 16 * j), lo, hi);
          _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * d.k + k]), lo, acc[r][j]);
          _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * d.k + k + 1]), hi, acc[r][j]);
        } else {
          const __m512 zj = kZero ? _mm512_loadu_ps(z + 16 * j) : _mm512_setzero_ps();
          const __m512 w = ConvertS8<kZero>(bytes, sj, zj);
          _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * d.k + k]), w, acc[r][j]);
        }
      }
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int j = 0; j < kVectors; ++j)
      _mm512_storeu_ps(y + r * d.n + 16 * j, acc[r][j]);
}

// FusedTile for rows [0, rows) of a full panel, in up to kFusedPasses passes of at most
// kTileRows rows (the panel's codes, 18 KB of 4-bit codes at K = 576, stay in L1 / L2
// after the first); false when it does not apply. One core, SmolLM2's 4-bit shapes: 2.9
// against 4.2 us a panel at 8 rows (the buffered path), 4.7 against 5.8 at 13; the
// buffered path wins from ~20 rows.
template <bool kFour, bool kZero>
bool Fused(const float* x, const void* codes, const float* scale, const float* zero,
           const Dims& d, int64_t n0, int64_t rows, float* y) {
  if (d.n - n0 < kPanel || rows > kFusedPasses<kFour> * kTileRows) return false;
  if (rows > kTileRows) {
    const int64_t passes = (rows + kTileRows - 1) / kTileRows;
    const int64_t first = (rows + passes - 1) / passes;
    Fused<kFour, kZero>(x, codes, scale, zero, d, n0, first, y);
    return Fused<kFour, kZero>(x + first * d.k, codes, scale, zero, d, n0, rows - first,
                               y + first * d.n);
  }
  switch (rows) {
#define JAXPAGE_FUSED(R)                                                \
  case R:                                                               \
    FusedTile<R, kFour, kZero>(x, codes, scale, zero, d, n0, y);        \
    return true;
    JAXPAGE_FUSED(1) JAXPAGE_FUSED(2) JAXPAGE_FUSED(3) JAXPAGE_FUSED(4) JAXPAGE_FUSED(5)
    JAXPAGE_FUSED(6)
#undef JAXPAGE_FUSED
  }
  return false;
}
#else
template <bool kFour, bool kZero>
bool Fused(const float*, const void*, const float*, const float*, const Dims&, int64_t, int64_t,
           float*) {
  return false;
}
#endif

// y[m0:m1, n0:n0+64] = x[m0:m1, :] @ W[:, n0:n0+64], up to kChunk rows of k at a time:
// the chunk is dequantized into a buffer that stays in L2, then the shared register
// tiles (``_cpu_tiles.h``) run over it for all the rows, each tile going on from the sums
// the previous chunk left in y.
template <bool kFour, bool kZero>
void Item(const float* x, const void* codes, const float* scale, const float* zero,
          const Dims& d, int64_t n0, int64_t m0, int64_t m1, int64_t next_n0, float* y) {
  if (Fused<kFour, kZero>(x + m0 * d.k, codes, scale, zero, d, n0, m1 - m0,
                          y + m0 * d.n + n0))
    return;
  float* buf = ChunkBuffer();
  const int64_t width = std::min(kPanel, d.n - n0);
  const int64_t code_rows = d.code_rows(kFour);
  const int64_t tiles = (m1 - m0 + kTileRows - 1) / kTileRows;
  const uint8_t* next =
      next_n0 >= 0 ? static_cast<const uint8_t*>(codes) + d.CodeBase(kFour, next_n0) : nullptr;
  int64_t next_row = 0, due = 1;
  const int64_t every = std::max<int64_t>(1, tiles * d.k / code_rows);
  for (int64_t k0 = 0; k0 < d.k; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, d.k - k0);
    DequantRows<kFour, kZero>(codes, scale, zero, d, n0, width, k0, kc, buf);
    const jaxpage::TileArgs args{x + m0 * d.k + k0, d.k, kc, buf, kPanel,
                                 y + m0 * d.n + n0, d.n, width};
    jaxpage::MultiplyPanel(
        args, m1 - m0,
        [&](bool) { return NextCodesHook{next, d.ld(), code_rows, every, next_row, due}; },
        k0 > 0);
  }
}

template <bool kFour, bool kZero>
void Matmul(const float* x, const void* codes, const float* scale, const float* zero,
            const Dims& d, float* y, ffi::ThreadPool& pool) {
  static_assert(kZero || !kFour, "4-bit codes always have a zero");
  // (a split of the rows converts the panel once per block)
  jaxpage::ForEachPanel(d.m, d.n, pool, [=](int64_t n0, int64_t m0, int64_t m1, int64_t next) {
    Item<kFour, kZero>(x, codes, scale, zero, d, n0, m0, m1, next, y);
  });
}

// Shapes of a call: codes [K or K / 2, N], scale (and zero) [G, N]; or packed by panels,
// codes [N / 64, K or K / 2, 64], scale (and zero) [N / 64, G, 64]. K from x when given.
const char* DimsOf(bool four, int64_t x_rows, int64_t x_cols, ffi::Span<const int64_t> cd,
                   ffi::Span<const int64_t> sd, Dims* d) {
  const bool packed = cd.size() == 3;
  if (packed) {
    if (sd.size() != 3 || cd[2] != kPanel || sd[2] != kPanel || sd[0] != cd[0])
      return "quantized matmul: packed codes and scales must be [P, K or K / 2, 64] and "
             "[P, G, 64]";
  } else if (cd.size() != 2 || sd.size() != 2) {
    return "quantized matmul: codes and scales must be 2-D, or 3-D packed by panels";
  }
  const int64_t rows = cd[packed ? 1 : 0], groups = sd[packed ? 1 : 0];
  const int64_t n = packed ? cd[0] * kPanel : cd[1];
  const int64_t k = four ? 2 * rows : rows;
  if (x_cols >= 0 && x_cols != k) return "quantized matmul: x and codes disagree on K";
  if ((!packed && sd[1] != cd[1]) || groups <= 0 || k % groups != 0)
    return "quantized matmul: scales must be [G, N] with G dividing K";
  *d = Dims{x_rows, k, n, groups, k / groups, packed};
  if (four && d->group_size % 2 != 0) return "quantized matmul: 4-bit groups must be even";
  return nullptr;
}

// Rows at or past rows[0] (a batch's padding) are not computed: zeros. -> live rows, or -1
// when `rows` is malformed.
int64_t LiveRows(const Dims& d, ffi::Buffer<ffi::S32>& rows, float* y) {
  if (rows.element_count() != 1) return -1;
  const int64_t live = std::clamp<int64_t>(rows.typed_data()[0], 0, d.m);
  std::fill(y + live * d.n, y + d.m * d.n, 0.0f);
  return live;
}

// y = x @ W for codes `q` (int8, or uint8 two per byte when kFour) and scale, and zero
// when kZero (else nullptr).
template <bool kFour, bool kZero, typename Codes>
ffi::Error Run(ffi::Buffer<ffi::F32>& x, Codes& q, ffi::Buffer<ffi::F32>& scale,
               const float* zero, ffi::Buffer<ffi::S32>& rows, ffi::ResultBuffer<ffi::F32>& y,
               ffi::ThreadPool& pool) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quantized matmul: x must be [M, K]");
  Dims d;
  if (const char* e = DimsOf(kFour, xd[0], xd[1], q.dimensions(), scale.dimensions(), &d))
    return ffi::Error::InvalidArgument(e);
  d.m = LiveRows(d, rows, y->typed_data());
  if (d.m < 0) return ffi::Error::InvalidArgument("quantized matmul: rows must hold one value");
  if (d.m == 0 || d.n == 0) return ffi::Error::Success();
  Matmul<kFour, kZero>(x.typed_data(), q.typed_data(), scale.typed_data(), zero, d,
                       y->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::Error QMatmulS8(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                     ffi::ThreadPool pool) {
  return Run<false, false>(x, q, scale, nullptr, rows, y, pool);
}

ffi::Error QMatmulS8Z(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zero,
                      ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                      ffi::ThreadPool pool) {
  return Run<false, true>(x, q, scale, zero.typed_data(), rows, y, pool);
}

ffi::Error QMatmulU4(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> zero, ffi::Buffer<ffi::S32> rows,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  return Run<true, true>(x, q, scale, zero.typed_data(), rows, y, pool);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQMatmulS8, QMatmulS8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [K, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]: live rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQMatmulS8Z, QMatmulS8Z,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // codes [K, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // zero [G, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]: live rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageQMatmulU4, QMatmulU4,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes [K / 2, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // zero [G, N] (or packed)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]: live rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Ctx<ffi::ThreadPool>());
