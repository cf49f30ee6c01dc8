// The last step of sampling for the CPU, as an XLA FFI custom call: one token per row.
//
// JaxpageSampleRows(logits f32 [S, V], temperature f32 [S], threshold f32 [S],
//                   min_p f32 [S], seeds u32 [S], index s32 [S]) -> tokens s32 [S]
//
// Per row, the same rule as reference.py's ``sample_rows``:
//   temperature == 0: the first index of the row's maximum logit (greedy);
//   else: scaled = logits / temperature; token v is kept when logits[v] >= threshold
//         (unscaled: a top-k / top-p cut) and, with min_p > 0, scaled[v] >= max(scaled)
//         + log(min_p); the token is the first argmax of scaled + gumbel(seed, index, v)
//         over the kept v (Gumbel-max: a draw from softmax of the kept scaled logits).
// The Gumbel noise is reference.py's counter-based hash, bit for bit up to the two
// logarithms (a polynomial here, XLA's own there: within ~1 ulp), so a row's draw depends
// only on its seed, its sample index and the token id, never on the batch.
//
// Why hand-written: XLA:CPU's reductions over a 49k vocabulary run at a few GB/s, and the
// sampler made four passes (max, where, min, and the noise), ~11 ms for 48 rows on a
// 2-core machine; this is one pass per row, vectorized, rows spread over XLA's CPU pool.
// Vectorized for AVX-512, or AVX2 with FMA (two registers of 8 lanes); other CPUs take
// the scalar loop (~11x slower than AVX2 for 48 rows of a 49k vocabulary).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "_cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxpage::ParallelFor;

constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr int kLanes = 16;  // elements per vector step (one AVX-512 register of floats)
constexpr float kInf = std::numeric_limits<float>::infinity();

inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// Natural logarithm of a positive, finite, normal float: x = m * 2^e with m in
// [sqrt(1/2), sqrt(2)), log(x) = e * ln 2 + log1p(f), f = m - 1, and
// log1p(f) = f - f^2 / 2 + f^3 * P(f), P a degree-7 least-squares fit (max error ~1 ulp).
// P's coefficients, highest degree first (Horner's rule; every path below uses them in
// this order, so the vector paths give the scalar path's values).
constexpr int kLogPolyTerms = 8;
constexpr float kLogPoly[kLogPolyTerms] = {
    -0.0810227021574974f, 0.1271267831325531f, -0.12972144782543182f, 0.14202114939689636f,
    -0.166422501206398f, 0.20001471042633057f, -0.2500029504299164f, 0.333333283662796f};
// The mantissa is folded into [sqrt(1/2), sqrt(2)); ln 2 is added back in two parts (a
// short high part, exact times any exponent, and the rest).
constexpr float kSqrt2 = 1.41421356f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;

inline float LogPositive(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int32_t e = ((bits >> 23) & 255) - 127;
  int32_t mbits = (bits & 0x7FFFFF) | (127 << 23);
  float m;
  std::memcpy(&m, &mbits, sizeof m);
  const bool big = m > kSqrt2;
  m = big ? m * 0.5f : m;
  e += big ? 1 : 0;
  const float f = m - 1.0f;
  float p = kLogPoly[0];
  for (int i = 1; i < kLogPolyTerms; ++i) p = p * f + kLogPoly[i];
  const float ef = static_cast<float>(e);
  const float r = f * f * f * p - 0.5f * f * f + f;
  return (r + ef * kLn2Low) + ef * kLn2High;
}

// The row's draw key: reference.py's gumbel_noise key for (seed, index).
inline uint32_t DrawKey(uint32_t seed, int32_t index) {
  return Mix32(Mix32(seed) ^ (static_cast<uint32_t>(index) * kGolden + 0x7F4A7C15u));
}

// The score of token v in a row: its logit (greedy), or its scaled logit plus its Gumbel
// noise when the row keeps v (logit >= threshold, scaled >= floor), else -inf (sampled).
struct RowRule {
  const float* logits;
  float temperature;  // > 0: sampled
  float threshold;    // on logits
  float floor;        // on scaled logits (min-p; -inf: none)
  uint32_t key;       // DrawKey(seed, index)
};

inline float ScoreOf(const RowRule& r, int64_t v) {
  if (!(r.temperature > 0.0f)) return r.logits[v];
  const float scaled = r.logits[v] / r.temperature;
  const uint32_t bits = Mix32(r.key + static_cast<uint32_t>(v) * kGolden);
  const float uniform = (static_cast<float>(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
  const bool kept = r.logits[v] >= r.threshold && scaled >= r.floor;
  return kept ? scaled - LogPositive(-LogPositive(uniform)) : -kInf;
}

#ifdef __AVX512F__
inline __m512 LogPositive16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(255)),
                               _mm512_set1_epi32(127));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF)), _mm512_set1_epi32(127 << 23)));
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kSqrt2), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_epi32(e, big, e, _mm512_set1_epi32(1));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(kLogPoly[0]);
  for (int i = 1; i < kLogPolyTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kLogPoly[i]));
  const __m512 f2 = _mm512_mul_ps(f, f);
  __m512 r = _mm512_mul_ps(_mm512_mul_ps(f2, f), p);
  r = _mm512_add_ps(_mm512_fnmadd_ps(_mm512_set1_ps(0.5f), f2, r), f);
  const __m512 ef = _mm512_cvtepi32_ps(e);
  return _mm512_fmadd_ps(ef, _mm512_set1_ps(kLn2High),
                         _mm512_fmadd_ps(ef, _mm512_set1_ps(kLn2Low), r));
}

inline __m512i Mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Scores of tokens [v0, v0 + 16) (lanes outside `live` are -inf).
inline __m512 Scores16(const RowRule& r, int64_t v0, __mmask16 live) {
  const __m512 neg_inf = _mm512_set1_ps(-kInf);
  const __m512 logits = _mm512_mask_loadu_ps(neg_inf, live, r.logits + v0);
  if (!(r.temperature > 0.0f)) return logits;
  const __m512 scaled = _mm512_div_ps(logits, _mm512_set1_ps(r.temperature));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i v = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(v0)), lane);
  const __m512i bits = Mix32x16(_mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(r.key)),
      _mm512_mullo_epi32(v, _mm512_set1_epi32(static_cast<int32_t>(kGolden)))));
  const __m512 uniform = _mm512_mul_ps(
      _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(0.5f)),
      _mm512_set1_ps(1.0f / 16777216.0f));
  const __m512 minus_log = _mm512_sub_ps(_mm512_setzero_ps(), LogPositive16(uniform));
  const __m512 noisy = _mm512_sub_ps(scaled, LogPositive16(minus_log));
  const __mmask16 kept = live &
      _mm512_cmp_ps_mask(logits, _mm512_set1_ps(r.threshold), _CMP_GE_OQ) &
      _mm512_cmp_ps_mask(scaled, _mm512_set1_ps(r.floor), _CMP_GE_OQ);
  return _mm512_mask_mov_ps(neg_inf, kept, noisy);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The same lanes on AVX2 machines (most AMD and laptop CPUs): 16 tokens as two registers
// of 8, the operations of the AVX-512 code above in the same order.
#define JAXPAGE_AVX2_SAMPLING 1
inline __m256 LogPositive8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(255)),
                               _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(127 << 23)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(kSqrt2), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  // all-ones lanes: e + 1
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
  __m256 p = _mm256_set1_ps(kLogPoly[0]);
  for (int i = 1; i < kLogPolyTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kLogPoly[i]));
  const __m256 f2 = _mm256_mul_ps(f, f);
  __m256 r = _mm256_mul_ps(_mm256_mul_ps(f2, f), p);
  r = _mm256_add_ps(_mm256_fnmadd_ps(_mm256_set1_ps(0.5f), f2, r), f);
  const __m256 ef = _mm256_cvtepi32_ps(e);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(kLn2High),
                         _mm256_fmadd_ps(ef, _mm256_set1_ps(kLn2Low), r));
}

inline __m256i Mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// Scores of tokens [v0, v0 + 8), all inside the row.
inline __m256 Scores8(const RowRule& r, int64_t v0) {
  const __m256 logits = _mm256_loadu_ps(r.logits + v0);
  if (!(r.temperature > 0.0f)) return logits;
  const __m256 scaled = _mm256_div_ps(logits, _mm256_set1_ps(r.temperature));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i v = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(v0)), lane);
  const __m256i bits = Mix32x8(_mm256_add_epi32(
      _mm256_set1_epi32(static_cast<int32_t>(r.key)),
      _mm256_mullo_epi32(v, _mm256_set1_epi32(static_cast<int32_t>(kGolden)))));
  const __m256 uniform = _mm256_mul_ps(
      _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 8)), _mm256_set1_ps(0.5f)),
      _mm256_set1_ps(1.0f / 16777216.0f));
  const __m256 minus_log = _mm256_sub_ps(_mm256_setzero_ps(), LogPositive8(uniform));
  const __m256 noisy = _mm256_sub_ps(scaled, LogPositive8(minus_log));
  const __m256 kept = _mm256_and_ps(
      _mm256_cmp_ps(logits, _mm256_set1_ps(r.threshold), _CMP_GE_OQ),
      _mm256_cmp_ps(scaled, _mm256_set1_ps(r.floor), _CMP_GE_OQ));
  return _mm256_blendv_ps(_mm256_set1_ps(-kInf), noisy, kept);
}
#endif

// First index of the row's maximum score: lane-wise strict maxima (each lane keeps its
// first maximum), then the smallest index among the lanes' ties. Scores of -inf never
// win unless every score is -inf (or NaN): then token 0, as the reference's min of an
// all-equal row gives.
int32_t FirstArgmax(const RowRule& r, int64_t vocab) {
  float best[kLanes];
  int32_t where[kLanes];
#ifdef __AVX512F__
  __m512 best_v = _mm512_set1_ps(-kInf);
  __m512i where_v = _mm512_set1_epi32(static_cast<int32_t>(vocab));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t v0 = 0; v0 < vocab; v0 += kLanes) {
    const int64_t left = vocab - v0;
    const __mmask16 live = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 score = Scores16(r, v0, live);
    const __mmask16 better = _mm512_cmp_ps_mask(score, best_v, _CMP_GT_OQ);
    best_v = _mm512_mask_mov_ps(best_v, better, score);
    where_v = _mm512_mask_mov_epi32(
        where_v, better, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(v0)), lane));
  }
  _mm512_storeu_ps(best, best_v);
  _mm512_storeu_si512(where, where_v);
#else
  for (int j = 0; j < kLanes; ++j) {
    best[j] = -kInf;
    where[j] = static_cast<int32_t>(vocab);
  }
  int64_t v_start = 0;
#ifdef JAXPAGE_AVX2_SAMPLING
  __m256 best_v[2] = {_mm256_set1_ps(-kInf), _mm256_set1_ps(-kInf)};
  __m256i where_v[2] = {_mm256_set1_epi32(static_cast<int32_t>(vocab)),
                        _mm256_set1_epi32(static_cast<int32_t>(vocab))};
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  v_start = vocab - vocab % kLanes;
  for (int64_t v0 = 0; v0 < v_start; v0 += kLanes) {
    for (int h = 0; h < 2; ++h) {
      const int64_t first = v0 + 8 * h;
      const __m256 score = Scores8(r, first);
      const __m256 better = _mm256_cmp_ps(score, best_v[h], _CMP_GT_OQ);
      best_v[h] = _mm256_blendv_ps(best_v[h], score, better);
      const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)), lane);
      where_v[h] = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(where_v[h]), _mm256_castsi256_ps(index), better));
    }
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(best + 8 * h, best_v[h]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(where + 8 * h), where_v[h]);
  }
#endif
  for (int64_t v = v_start; v < vocab; ++v) {
    const float score = ScoreOf(r, v);
    const int j = static_cast<int>(v % kLanes);
    if (score > best[j]) {
      best[j] = score;
      where[j] = static_cast<int32_t>(v);
    }
  }
#endif
  float top = -kInf;
  int32_t index = static_cast<int32_t>(vocab);
  for (int j = 0; j < kLanes; ++j) {
    if (best[j] > top || (best[j] == top && where[j] < index)) {
      top = best[j];
      index = where[j];
    }
  }
  return index < vocab ? index : 0;
}

int32_t SampleRow(const float* logits, int64_t vocab, float temperature, float threshold,
                  float min_p, uint32_t seed, int32_t index) {
  float floor = -kInf;
  if (temperature > 0.0f && min_p > 0.0f) {
    float top = -kInf;
    for (int64_t v = 0; v < vocab; ++v) top = std::max(top, logits[v] / temperature);
    floor = top + std::log(std::max(min_p, 1e-30f));
  }
  return FirstArgmax(RowRule{logits, temperature, threshold, floor, DrawKey(seed, index)},
                     vocab);
}

ffi::Error SampleRows(ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                      ffi::Buffer<ffi::F32> threshold, ffi::Buffer<ffi::F32> min_p,
                      ffi::Buffer<ffi::U32> seeds, ffi::Buffer<ffi::S32> index,
                      ffi::ResultBuffer<ffi::S32> tokens, ffi::ThreadPool pool) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("sample rows: logits must be [S, V]");
  const int64_t rows = dims[0], vocab = dims[1];
  for (auto* b : {&temperature, &threshold, &min_p})
    if (b->element_count() != static_cast<size_t>(rows))
      return ffi::Error::InvalidArgument("sample rows: per-row operands must be [S]");
  if (seeds.element_count() != static_cast<size_t>(rows) ||
      index.element_count() != static_cast<size_t>(rows))
    return ffi::Error::InvalidArgument("sample rows: seeds and index must be [S]");
  const float* l = logits.typed_data();
  const float* t = temperature.typed_data();
  const float* th = threshold.typed_data();
  const float* mp = min_p.typed_data();
  const uint32_t* s = seeds.typed_data();
  const int32_t* ix = index.typed_data();
  int32_t* out = tokens->typed_data();
  if (rows == 0) return ffi::Error::Success();
  ParallelFor(rows, pool, [=](int64_t r) {
    out[r] = SampleRow(l + r * vocab, vocab, t[r], th[r], mp[r], s[r], ix[r]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageSampleRows, SampleRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [S, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // threshold [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p [S]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // seeds [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // index [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // tokens [S]
                                  .Ctx<ffi::ThreadPool>());
