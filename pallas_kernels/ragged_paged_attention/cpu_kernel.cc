// Ragged paged attention for the CPU, float32, as an XLA FFI custom call.
//
// Same contract as reference.py: the new tokens of sequence s are the last
// q_len = cu_q_lens[s+1] - cu_q_lens[s] of its kv_lens[s] cached tokens and attend
// causally (and within sliding_window when it is > 0); rows of padding tokens are zero.
//
// Why a hand-written kernel: XLA's CPU backend runs the attention's many tiny batched
// matmuls (a GQA group of query heads against one sequence's keys) at a few GFLOP/s, and
// a dense formulation must pad every row to the longest block table of the batch. This
// kernel reads each sequence's own keys and values once, through its block table, only
// up to its own length.
//
// Work is split into items (sequence, tile of query tokens) run in parallel on XLA's own
// CPU thread pool (no second pool competing with XLA's for the cores). Each item keeps an online softmax (running max m, sum l, accumulator acc) for
// its query rows (tokens x heads of the GQA group) and walks the KV blocks it needs.
// Block ids and lengths are clamped into range, as jnp indexing would clamp them.
//
// Byte caches (int8 / fp8 KV, pallas_kernels/kv_quant.py) have their own two handlers
// (...Bytes): the same code, each block's bytes converted through a 256-entry table and
// multiplied by their per-channel scales.
//
// Two handlers share the attention: JaxpageRaggedPagedAttentionF32 only reads the caches
// [N, B, Hkv, D]; JaxpageWriteAndAttendF32 takes every layer's caches [L, N, B, Hkv, D],
// first writes one layer's new keys and values into their slots, then attends over that
// layer. XLA passes the caches in and out as the same buffers (input_output_aliases), so
// the model's layers form one chain of in-place updates of the whole cache: no reshape, no
// scatter, nothing for XLA's copy insertion to copy (it copied the whole cache, twice per
// layer, around a separate scatter in some decode loops, and around reshapes of it).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxTileRows = 64;  // query rows (tokens x query heads) per work item

struct Shape {
  int64_t num_tokens, num_q_heads, head_dim;  // q: [T, Hq, D]
  int64_t num_blocks, block_size, num_kv_heads;  // caches: [N, B, Hkv, D]
  int64_t max_blocks;  // block_tables: [S, M]
  int64_t group;  // Hq / Hkv
};

// How a byte cache (int8 / fp8 KV) is read: `lut` [256] is the value of each byte, and the
// cache holds k / k_scale and v / v_scale, scales per KV head and channel [Hkv * D]. With
// per-token scales (pallas_kernels/kv_token_scale.py; `k_token` non-null) each slot's
// bytes are also divided by its own scale, one code per slot and KV head ([slots][Hkv],
// the same slots as the caches), whose value is `token_table` [256] of the code.
struct ByteCache {
  const float* lut;
  const float* k_scale;
  const float* v_scale;
  const uint8_t* k_token = nullptr;
  const uint8_t* v_token = nullptr;
  const float* token_table = nullptr;
};

struct WorkItem {
  int32_t seq, first_token, num_tokens;
};

// exp(x) for x <= 0 (and -inf -> 0), to within ~2 float ulps: x = n ln2 + r with |r| <=
// ln2 / 2, a degree-6 polynomial for exp(r), and n put into the exponent bits. Plain
// arithmetic and selects, so loops over it vectorize (the library's expf is a call per
// element: it took a third of a prefill's attention).
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: the smallest normal; -inf lands here too
  // Round to nearest by adding and removing 1.5 * 2^23 (no call, so it vectorizes).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float poly = 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &poly, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return x <= -87.0f ? 0.0f : result;
}

inline float Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  // Eight independent partial sums: the FMA chains overlap instead of waiting on each other.
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) part[k] += a[i + k] * b[i + k];
  float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// p[j] = q . kt[:, j] for the B lanes of a transposed key block kt [D][B]. A fixed B keeps
// the B partial sums in registers across the D multiply-adds.
template <int64_t kB>
inline void ScoresFixed(const float* __restrict qr, const float* __restrict kt, int64_t D,
                        float* __restrict p) {
  float sums[kB] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float qd = qr[d];
    const float* __restrict lane = kt + d * kB;
#pragma omp simd
    for (int64_t j = 0; j < kB; ++j) sums[j] += qd * lane[j];
  }
  for (int64_t j = 0; j < kB; ++j) p[j] = sums[j];
}

// Scores of up to kRows query rows that share one KV head, over the B lanes of its
// transposed key block kt [D][B]: out[i][j] = q_i . kt[:, j]. Each key lane loaded is used
// by every row, and the rows' sums are independent chains of multiply-adds, so the loop
// runs at the FMA units' throughput rather than one chain's latency (one row at a time
// reached ~40 GFLOP/s in prefill). Rows past `n` repeat row 0 and are not stored.
constexpr int kRows = 8;

template <int64_t kB>
inline void ScoresRowsFixed(const float* const* qrs, int n, const float* __restrict kt,
                            int64_t D, float* const* outs) {
  float sums[kRows][kB] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* __restrict lane = kt + d * kB;
    for (int i = 0; i < kRows; ++i) {
      const float qd = qrs[i][d];
#pragma omp simd
      for (int64_t j = 0; j < kB; ++j) sums[i][j] += qd * lane[j];
    }
  }
  for (int i = 0; i < n; ++i)
    for (int64_t j = 0; j < kB; ++j) outs[i][j] = sums[i][j];
}

inline void Scores(const float* __restrict qr, const float* __restrict kt, int64_t D, int64_t B,
                   float* __restrict p);

// Scores of rows `n` (<= kRows) sharing a KV head, any block size.
inline void ScoresRows(const float* const* qrs, int n, const float* kt, int64_t D, int64_t B,
                       float* const* outs) {
  const float* padded[kRows];
  for (int i = 0; i < kRows; ++i) padded[i] = qrs[i < n ? i : 0];
  if (B == 16) return ScoresRowsFixed<16>(padded, n, kt, D, outs);
  if (B == 32) return ScoresRowsFixed<32>(padded, n, kt, D, outs);
  for (int i = 0; i < n; ++i) Scores(qrs[i], kt, D, B, outs[i]);
}

inline void Scores(const float* __restrict qr, const float* __restrict kt, int64_t D, int64_t B,
                   float* __restrict p) {
  if (B == 16) return ScoresFixed<16>(qr, kt, D, p);
  if (B == 32) return ScoresFixed<32>(qr, kt, D, p);
  for (int64_t j = 0; j < B; ++j) p[j] = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = qr[d];
    const float* __restrict lane = kt + d * B;
#pragma omp simd
    for (int64_t j = 0; j < B; ++j) p[j] += qd * lane[j];
  }
}

// ar = ar * correction + sum over visible keys j of p[j] * v[j] (v[j] = v_first + j *
// stride). A fixed D keeps the accumulator in registers across the keys.
template <int64_t kD>
inline void AccumulateFixed(float* __restrict ar, float correction, const float* __restrict p,
                            const float* v_first, int64_t first, int64_t last, int64_t stride) {
  float sums[kD];
#pragma omp simd
  for (int64_t d = 0; d < kD; ++d) sums[d] = ar[d] * correction;
  for (int64_t j = first; j < last; ++j) {
    const float w = p[j];
    const float* __restrict vj = v_first + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) sums[d] += w * vj[d];
  }
#pragma omp simd
  for (int64_t d = 0; d < kD; ++d) ar[d] = sums[d];
}

inline void Accumulate(float* __restrict ar, float correction, const float* __restrict p,
                       const float* v_first, int64_t first, int64_t last, int64_t stride,
                       int64_t D) {
  if (D == 64) return AccumulateFixed<64>(ar, correction, p, v_first, first, last, stride);
  if (D == 128) return AccumulateFixed<128>(ar, correction, p, v_first, first, last, stride);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
  for (int64_t j = first; j < last; ++j) {
    const float w = p[j];
    const float* __restrict vj = v_first + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ar[d] += w * vj[d];
  }
}

// Attend `item`'s query rows (its tokens x every query head) to their sequence's keys and
// values, block by block, and write their outputs. Row r is token r / Hq, head r % Hq.
//
// With many rows per KV head (prefill tiles), each block's keys are first transposed into
// kt [Hkv][D][B], so a row's scores over the block are D broadcast multiply-adds over B
// lanes (no horizontal sums); with few (decodes) a dot product per key reads them in
// place. Scores are then masked, exponentiated and accumulated into the row's online
// softmax.
//
// Byte caches (`bytes` given: int8 or fp8 KV, see pallas_kernels/kv_quant.py) are read
// through the byte table and multiplied by their scales: each block's keys and values are
// converted once into scratch and the float code below runs on it unchanged.
void AttendItem(const Shape& s, const WorkItem& item, const float* q, const void* k_cache,
                const void* v_cache, const ByteCache* bytes, const int32_t* block_table,
                int64_t kv_len, int64_t q_len, int64_t first_seq_token, float sm_scale,
                int64_t sliding_window, float soft_cap, float* out) {
  const int64_t D = s.head_dim, G = s.group, B = s.block_size, Hq = s.num_q_heads;
  const int64_t Hkv = s.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(item.num_tokens) * Hq;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Scratch reused across calls; plain pointers below keep thread-local lookups out of
  // the inner loops.
  thread_local std::vector<float> m_buf, l_buf, acc_buf, p_buf, kt_buf, kconv_buf, vconv_buf,
      scores_buf;
  thread_local std::vector<int64_t> pos_buf;
  m_buf.assign(rows, neg_inf);
  l_buf.assign(rows, 0.f);
  acc_buf.assign(rows * D, 0.f);
  p_buf.resize(B);
  kt_buf.resize(Hkv * D * B);
  scores_buf.resize(rows * B);
  pos_buf.resize(item.num_tokens);
  if (bytes != nullptr) {
    kconv_buf.resize(B * Hkv * D);
    vconv_buf.resize(B * Hkv * D);
  }
  float* __restrict m = m_buf.data();
  float* __restrict l = l_buf.data();
  float* __restrict acc = acc_buf.data();
  float* p_row = p_buf.data();      // a decode row's scores (no transpose)
  float* scores = scores_buf.data();  // [rows][B]: every row's scores (transpose)
  float* __restrict kt = kt_buf.data();
  int64_t* __restrict q_pos = pos_buf.data();
  for (int64_t t = 0; t < item.num_tokens; ++t)
    q_pos[t] = kv_len - q_len + (item.first_token + t - first_seq_token);
  const int64_t hi = std::min(q_pos[item.num_tokens - 1], s.max_blocks * B - 1);
  int64_t lo = 0;
  if (sliding_window > 0) lo = std::max<int64_t>(0, q_pos[0] - sliding_window + 1);
  const int64_t stride = Hkv * D;  // between consecutive positions of a head
  const bool transpose = rows >= 4 * Hkv;  // enough rows share each transposed head

  // The next block's keys and values are asked for while this block is worked on, a
  // share of their cache lines before each row. A sequence's blocks lie scattered through
  // the cache, so the hardware prefetcher starts over at each one, and a decode row does
  // too little work per block to hide the misses: this made decode attention over pages
  // not in the CPU's caches 8-20% faster (docs/benchmarks/kernels.md).
  const int64_t block_bytes = B * stride * (bytes != nullptr ? 1 : sizeof(float));
  const int64_t block_lines = (block_bytes + 63) / 64;
  for (int64_t block = lo / B; hi >= lo && block <= hi / B; ++block) {
    const int64_t id = std::clamp<int64_t>(block_table[block], 0, s.num_blocks - 1);
    const int64_t next = block + 1 <= hi / B
        ? std::clamp<int64_t>(block_table[block + 1], 0, s.num_blocks - 1) : -1;
    const char* next_k = next < 0 ? nullptr
        : static_cast<const char*>(k_cache) + next * block_bytes;
    const char* next_v = next < 0 ? nullptr
        : static_cast<const char*>(v_cache) + next * block_bytes;
    const int64_t start = std::max(lo, block * B), stop = std::min(hi, block * B + B - 1);
    const int64_t count = stop - start + 1;
    const int64_t first_slot = id * B + start - block * B;
    const float* k_block;
    const float* v_block;
    if (bytes != nullptr) {
      const uint8_t* kb = static_cast<const uint8_t*>(k_cache) + first_slot * stride;
      const uint8_t* vb = static_cast<const uint8_t*>(v_cache) + first_slot * stride;
      float* __restrict kc = kconv_buf.data();
      float* __restrict vc = vconv_buf.data();
      const float* __restrict lut = bytes->lut;
      const float* __restrict ks = bytes->k_scale;
      const float* __restrict vs = bytes->v_scale;
      // per-token scales (one pass with the conversion): each slot's own, per KV head
      const uint8_t* kt_codes = bytes->k_token ? bytes->k_token + first_slot * Hkv : nullptr;
      const uint8_t* vt_codes = bytes->v_token ? bytes->v_token + first_slot * Hkv : nullptr;
      for (int64_t j = 0; j < count; ++j)
        for (int64_t h = 0; h < Hkv; ++h) {
          const float k_mul = kt_codes ? bytes->token_table[kt_codes[j * Hkv + h]] : 1.f;
          const float v_mul = vt_codes ? bytes->token_table[vt_codes[j * Hkv + h]] : 1.f;
          const int64_t row = j * stride + h * D;
          for (int64_t d = 0; d < D; ++d) {
            kc[row + d] = lut[kb[row + d]] * ks[h * D + d] * k_mul;
            vc[row + d] = lut[vb[row + d]] * vs[h * D + d] * v_mul;
          }
        }
      k_block = kc;
      v_block = vc;
    } else {
      k_block = static_cast<const float*>(k_cache) + first_slot * stride;
      v_block = static_cast<const float*>(v_cache) + first_slot * stride;
    }
    // kt[h][d][j] = key j of head h, dimension d; lanes past `count` are zero.
    for (int64_t h = 0; transpose && h < Hkv; ++h)
      for (int64_t d = 0; d < D; ++d) {
        float* __restrict lane = kt + (h * D + d) * B;
        for (int64_t j = 0; j < count; ++j) lane[j] = k_block[j * stride + h * D + d];
        for (int64_t j = count; j < B; ++j) lane[j] = 0.f;
      }
    if (transpose) {
      // Every visible row's scores over this block first, kRows rows of one KV head at a
      // time (the G heads of consecutive tokens), into scores [rows][B].
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* qrs[kRows];
        float* outs[kRows];
        int n = 0;
        for (int64_t token = 0; token < item.num_tokens; ++token) {
          if (start > q_pos[token]) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = token * Hq + h * G + g;
            qrs[n] = q + ((item.first_token + token) * Hq + h * G + g) * D;
            outs[n] = scores + r * B;
            if (++n == kRows) {
              ScoresRows(qrs, n, kt + h * D * B, D, B, outs);
              n = 0;
            }
          }
        }
        if (n > 0) ScoresRows(qrs, n, kt + h * D * B, D, B, outs);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (next_k != nullptr) {  // this row's share of the next block's lines
        const int64_t end = (r + 1) * block_lines / rows;
        for (int64_t line = r * block_lines / rows; line < end; ++line) {
          __builtin_prefetch(next_k + line * 64);
          __builtin_prefetch(next_v + line * 64);
        }
      }
      const int64_t token = r / Hq, head = r % Hq, kv_head = head / G;
      const int64_t pos = q_pos[token];
      if (start > pos) continue;  // this row sees nothing in this block (causal)
      const float* __restrict qr = q + ((item.first_token + token) * Hq + head) * D;
      float* __restrict p = transpose ? scores + r * B : p_row;
      if (!transpose) {
        for (int64_t j = 0; j < count; ++j) p[j] = Dot(qr, k_block + j * stride + kv_head * D, D);
      }
      // Visible keys: start + j <= pos, within the window; the rest score -inf.
      const int64_t last = std::min<int64_t>(count, pos - start + 1);
      const int64_t first = sliding_window > 0
          ? std::clamp<int64_t>(pos - sliding_window + 1 - start, 0, last) : 0;
      if (soft_cap > 0.f) {
        for (int64_t j = 0; j < count; ++j) p[j] = soft_cap * std::tanh(p[j] * sm_scale / soft_cap);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < count; ++j) p[j] *= sm_scale;
      }
      float block_max = neg_inf;
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < count; ++j) {
        const float score = (j >= first && j < last) ? p[j] : neg_inf;
        p[j] = score;
        block_max = score > block_max ? score : block_max;
      }
      if (block_max == neg_inf) continue;  // this row sees nothing in this block
      const float new_max = std::max(m[r], block_max);
      const float correction = m[r] == neg_inf ? 0.f : ExpNonPositive(m[r] - new_max);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < count; ++j) {  // hidden positions: exp(-inf) = 0
        p[j] = ExpNonPositive(p[j] - new_max);
        sum += p[j];
      }
      Accumulate(acc + r * D, correction, p, v_block + kv_head * D, first, last, stride, D);
      l[r] = l[r] * correction + sum;
      m[r] = new_max;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (item.first_token * Hq + r) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float* __restrict ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = ar[d] * inv;
  }
}

// Attention of every sequence's new tokens over the caches (the shared body of both
// handlers). Shapes were checked by ShapeOf.
void Attend(const Shape& s, const float* qp, const void* kp, const void* vp,
            const ByteCache* bytes,
            const int32_t* lens, const int32_t* tables, const int32_t* cu, int64_t max_seqs,
            int32_t num_seqs, float sm_scale, int32_t sliding_window, float soft_cap,
            float* o, ffi::ThreadPool& pool) {
  std::memset(o, 0, sizeof(float) * s.num_tokens * s.num_q_heads * s.head_dim);
  const int64_t seqs = std::clamp<int64_t>(num_seqs, 0, max_seqs);
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxTileRows / s.num_q_heads);
  std::vector<WorkItem> items;
  for (int64_t seq = 0; seq < seqs; ++seq) {
    const int64_t begin = std::clamp<int64_t>(cu[seq], 0, s.num_tokens);
    const int64_t end = std::clamp<int64_t>(cu[seq + 1], begin, s.num_tokens);
    if (end == begin || lens[seq] <= 0) continue;
    for (int64_t t = begin; t < end; t += tile_tokens)
      items.push_back({static_cast<int32_t>(seq), static_cast<int32_t>(t),
                       static_cast<int32_t>(std::min(tile_tokens, end - t))});
  }
  // Workers claim items from a shared counter. The calling thread works too and then
  // waits only for items already claimed, so it never waits on a task the pool has not
  // started (no deadlock whatever the pool's size or whether the caller is in it). Tasks
  // that start late find no item left and touch nothing but the shared state.
  struct Shared {
    std::vector<WorkItem> items;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->items = std::move(items);
  const int64_t num_items = static_cast<int64_t>(shared->items.size());
  auto work = [shared, num_items, s, qp, kp, vp, bytes, tables, lens, cu, sm_scale,
               sliding_window, soft_cap, o]() {
    for (int64_t i = shared->next.fetch_add(1); i < num_items; i = shared->next.fetch_add(1)) {
      const WorkItem& item = shared->items[i];
      const int64_t seq = item.seq;
      AttendItem(s, item, qp, kp, vp, bytes, tables + seq * s.max_blocks, lens[seq],
                 cu[seq + 1] - cu[seq], cu[seq], sm_scale, sliding_window, soft_cap, o);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_items - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;  // each task owns a copy
    pool.Schedule(std::move(task));
  }
  work();
  while (shared->done.load(std::memory_order_acquire) < num_items) std::this_thread::yield();
}

// The shape of a call from q [T, Hq, D], a cache [N, B, Hkv, D] and block_tables [S, M];
// an error message when they disagree.
const char* ShapeOf(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                    ffi::Span<const int64_t> td, Shape* s) {
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return "ragged paged attention: unexpected ranks";
  *s = Shape{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1], 0};
  if (s->num_kv_heads <= 0 || s->num_q_heads % s->num_kv_heads != 0 || kd[3] != s->head_dim)
    return "ragged paged attention: head shapes disagree";
  s->group = s->num_q_heads / s->num_kv_heads;
  return nullptr;
}

ffi::Error RaggedPagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                                    ffi::Buffer<ffi::F32> v_cache,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> block_tables,
                                    ffi::Buffer<ffi::S32> cu_q_lens,
                                    ffi::Buffer<ffi::S32> num_seqs,
                                    ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                    int32_t sliding_window, float soft_cap,
                                    ffi::ThreadPool pool) {
  Shape s;
  if (const char* error = ShapeOf(q.dimensions(), k_cache.dimensions(),
                                  block_tables.dimensions(), &s))
    return ffi::Error::InvalidArgument(error);
  Attend(s, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), nullptr,
         kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(), block_tables.dimensions()[0],
         num_seqs.typed_data()[0], sm_scale, sliding_window, soft_cap,
         out->typed_data(), pool);
  return ffi::Error::Success();
}

// Copy row t of `rows` [T, width] into slot slot_mapping[t] of `cache` [num_slots, width];
// slots out of [0, num_slots) (-1 marks padding) are skipped.
// (Rows of `width` elements of `element` bytes each.)
void WriteSlots(const void* rows, const int32_t* slot_mapping, int64_t num_rows,
                int64_t width, int64_t num_slots, void* cache, int64_t element) {
  const int64_t row_bytes = width * element;
  for (int64_t t = 0; t < num_rows; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) continue;
    std::memcpy(static_cast<char*>(cache) + slot * row_bytes,
                static_cast<const char*>(rows) + t * row_bytes, row_bytes);
  }
}

// Per-token scale codes of a write-and-attend call: the new tokens' [T, Hkv], and every
// layer's caches [L, N, B, Hkv] in (operands) and out (their aliased results).
struct TokenScaleWrite {
  const uint8_t* k_new;
  const uint8_t* v_new;
  const uint8_t* k_in;
  const uint8_t* v_in;
  uint8_t* k_all;
  uint8_t* v_all;
  const float* table;  // [256]: the scale of each code
};

// The shared body of the write-and-attend handlers: caches of float32 (bytes == nullptr)
// or of bytes (ByteCache), with per-token scales where `tokens` is given.
template <typename Cache>
ffi::Error WriteAndAttendBody(const float* q, ffi::Span<const int64_t> qd, const Cache* k_new,
                              ffi::Span<const int64_t> nd, const Cache* v_new, size_t v_rank,
                              const int32_t* slots, ffi::Span<const int64_t> sd,
                              const Cache* k_in, const Cache* v_in, ffi::Span<const int64_t> cd,
                              const ByteCache* bytes, const int32_t* lens,
                              const int32_t* tables,
                              ffi::Span<const int64_t> td, const int32_t* cu, int32_t num_seqs,
                              float* out, Cache* k_all, Cache* v_all, int32_t layer,
                              float sm_scale, int32_t sliding_window, float soft_cap,
                              ffi::ThreadPool& pool, const TokenScaleWrite* tokens = nullptr) {
  // The caches hold every layer, [L, N, B, Hkv, D]; this call reads and writes layer
  // `layer`'s [N, B, Hkv, D] part, which slot_mapping and block_tables address.
  if (cd.size() != 5 || layer < 0 || layer >= cd[0])
    return ffi::Error::InvalidArgument("write and attend: caches must be [L, N, B, Hkv, D] "
                                       "with 0 <= layer < L");
  const int64_t layer_dims[4] = {cd[1], cd[2], cd[3], cd[4]};
  Shape s;
  if (const char* error = ShapeOf(qd, ffi::Span<const int64_t>(layer_dims, 4), td, &s))
    return ffi::Error::InvalidArgument(error);
  if (nd.size() != 3 || nd[0] != s.num_tokens || nd[1] != s.num_kv_heads ||
      nd[2] != s.head_dim || v_rank != 3 || sd.size() != 1 || sd[0] != s.num_tokens)
    return ffi::Error::InvalidArgument("write and attend: new keys, values or slots disagree");
  const int64_t width = s.num_kv_heads * s.head_dim;
  const int64_t num_slots = s.num_blocks * s.block_size;  // in one layer
  const int64_t total = cd[0] * num_slots * width;
  // The outputs alias the cache operands (input_output_aliases); should XLA ever hand
  // over distinct buffers, start the outputs from the operands.
  if (k_all != k_in) std::memcpy(k_all, k_in, sizeof(Cache) * total);
  if (v_all != v_in) std::memcpy(v_all, v_in, sizeof(Cache) * total);
  Cache* kc = k_all + layer * num_slots * width;
  Cache* vc = v_all + layer * num_slots * width;
  WriteSlots(k_new, slots, s.num_tokens, width, num_slots, kc, sizeof(Cache));
  WriteSlots(v_new, slots, s.num_tokens, width, num_slots, vc, sizeof(Cache));
  ByteCache layer_bytes;
  if (tokens != nullptr) {  // the per-token scale codes: [L, N, B, Hkv], likewise
    const int64_t heads = s.num_kv_heads, all = cd[0] * num_slots * heads;
    if (tokens->k_all != tokens->k_in) std::memcpy(tokens->k_all, tokens->k_in, all);
    if (tokens->v_all != tokens->v_in) std::memcpy(tokens->v_all, tokens->v_in, all);
    uint8_t* kt = tokens->k_all + layer * num_slots * heads;
    uint8_t* vt = tokens->v_all + layer * num_slots * heads;
    WriteSlots(tokens->k_new, slots, s.num_tokens, heads, num_slots, kt, 1);
    WriteSlots(tokens->v_new, slots, s.num_tokens, heads, num_slots, vt, 1);
    layer_bytes = *bytes;
    layer_bytes.k_token = kt;
    layer_bytes.v_token = vt;
    layer_bytes.token_table = tokens->table;
    bytes = &layer_bytes;
  }
  Attend(s, q, kc, vc, bytes, lens, tables, cu, td[0], num_seqs, sm_scale, sliding_window,
         soft_cap, out, pool);
  return ffi::Error::Success();
}

ffi::Error WriteAndAttendImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                              ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> slot_mapping,
                              ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                              ffi::Buffer<ffi::S32> kv_lens,
                              ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> cu_q_lens,
                              ffi::Buffer<ffi::S32> num_seqs,
                              ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> k_out,
                              ffi::ResultBuffer<ffi::F32> v_out, int32_t layer, float sm_scale,
                              int32_t sliding_window, float soft_cap, ffi::ThreadPool pool) {
  return WriteAndAttendBody<float>(
      q.typed_data(), q.dimensions(), k_new.typed_data(), k_new.dimensions(),
      v_new.typed_data(), v_new.dimensions().size(), slot_mapping.typed_data(),
      slot_mapping.dimensions(), k_cache.typed_data(), v_cache.typed_data(),
      k_cache.dimensions(), nullptr, kv_lens.typed_data(), block_tables.typed_data(),
      block_tables.dimensions(), cu_q_lens.typed_data(), num_seqs.typed_data()[0],
      out->typed_data(), k_out->typed_data(), v_out->typed_data(), layer, sm_scale,
      sliding_window, soft_cap, pool);
}

// Byte caches (int8 / fp8 KV): new keys and values arrive already encoded, as bytes.
ffi::Error WriteAndAttendBytesImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_new,
                                   ffi::Buffer<ffi::U8> v_new,
                                   ffi::Buffer<ffi::S32> slot_mapping,
                                   ffi::Buffer<ffi::U8> k_cache, ffi::Buffer<ffi::U8> v_cache,
                                   ffi::Buffer<ffi::F32> lut, ffi::Buffer<ffi::F32> k_scale,
                                   ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> block_tables,
                                   ffi::Buffer<ffi::S32> cu_q_lens,
                                   ffi::Buffer<ffi::S32> num_seqs,
                                   ffi::ResultBuffer<ffi::F32> out,
                                   ffi::ResultBuffer<ffi::U8> k_out,
                                   ffi::ResultBuffer<ffi::U8> v_out, int32_t layer,
                                   float sm_scale, int32_t sliding_window, float soft_cap,
                                   ffi::ThreadPool pool) {
  const auto cd = k_cache.dimensions();
  if (lut.element_count() != 256 || cd.size() != 5 ||
      k_scale.element_count() != cd[3] * cd[4] || v_scale.element_count() != cd[3] * cd[4])
    return ffi::Error::InvalidArgument("write and attend: the byte table must have 256 entries "
                                       "and the scales [Hkv, D]");
  const ByteCache bytes{lut.typed_data(), k_scale.typed_data(), v_scale.typed_data()};
  return WriteAndAttendBody<uint8_t>(
      q.typed_data(), q.dimensions(), k_new.typed_data(), k_new.dimensions(),
      v_new.typed_data(), v_new.dimensions().size(), slot_mapping.typed_data(),
      slot_mapping.dimensions(), k_cache.typed_data(), v_cache.typed_data(),
      k_cache.dimensions(), &bytes, kv_lens.typed_data(), block_tables.typed_data(),
      block_tables.dimensions(), cu_q_lens.typed_data(), num_seqs.typed_data()[0],
      out->typed_data(), k_out->typed_data(), v_out->typed_data(), layer, sm_scale,
      sliding_window, soft_cap, pool);
}

ffi::Error RaggedPagedAttentionBytesImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_cache,
                                         ffi::Buffer<ffi::U8> v_cache, ffi::Buffer<ffi::F32> lut,
                                         ffi::Buffer<ffi::F32> k_scale,
                                         ffi::Buffer<ffi::F32> v_scale,
                                         ffi::Buffer<ffi::S32> kv_lens,
                                         ffi::Buffer<ffi::S32> block_tables,
                                         ffi::Buffer<ffi::S32> cu_q_lens,
                                         ffi::Buffer<ffi::S32> num_seqs,
                                         ffi::ResultBuffer<ffi::F32> out, float sm_scale,
                                         int32_t sliding_window, float soft_cap,
                                         ffi::ThreadPool pool) {
  Shape s;
  if (const char* error = ShapeOf(q.dimensions(), k_cache.dimensions(),
                                  block_tables.dimensions(), &s))
    return ffi::Error::InvalidArgument(error);
  const int64_t width = s.num_kv_heads * s.head_dim;
  if (lut.element_count() != 256 || k_scale.element_count() != width ||
      v_scale.element_count() != width)
    return ffi::Error::InvalidArgument("ragged paged attention: the byte table must have 256 "
                                       "entries and the scales [Hkv, D]");
  const ByteCache bytes{lut.typed_data(), k_scale.typed_data(), v_scale.typed_data()};
  Attend(s, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), &bytes,
         kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(),
         block_tables.dimensions()[0], num_seqs.typed_data()[0], sm_scale, sliding_window,
         soft_cap, out->typed_data(), pool);
  return ffi::Error::Success();
}

// Byte caches with per-token scales (int8 KV, pallas_kernels/kv_token_scale.py): the
// scale codes of the new tokens are written with their bytes, into code caches
// [L, N, B, Hkv] aliased like the byte caches.
ffi::Error WriteAndAttendTokenScaledImpl(
    ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_new, ffi::Buffer<ffi::U8> v_new,
    ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::U8> k_cache,
    ffi::Buffer<ffi::U8> v_cache, ffi::Buffer<ffi::F32> lut, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::U8> k_token_new,
    ffi::Buffer<ffi::U8> v_token_new, ffi::Buffer<ffi::U8> k_tokens,
    ffi::Buffer<ffi::U8> v_tokens, ffi::Buffer<ffi::F32> token_table,
    ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables,
    ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
    ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::U8> k_out,
    ffi::ResultBuffer<ffi::U8> v_out, ffi::ResultBuffer<ffi::U8> k_tokens_out,
    ffi::ResultBuffer<ffi::U8> v_tokens_out, int32_t layer, float sm_scale,
    int32_t sliding_window, float soft_cap, ffi::ThreadPool pool) {
  const auto cd = k_cache.dimensions();
  const auto nd = k_new.dimensions();
  if (lut.element_count() != 256 || token_table.element_count() != 256 || cd.size() != 5 ||
      k_scale.element_count() != cd[3] * cd[4] || v_scale.element_count() != cd[3] * cd[4])
    return ffi::Error::InvalidArgument("write and attend: the byte and scale tables must have "
                                       "256 entries and the scales [Hkv, D]");
  const int64_t code_count = cd[0] * cd[1] * cd[2] * cd[3];
  if (nd.size() != 3 || k_token_new.element_count() != nd[0] * cd[3] ||
      v_token_new.element_count() != nd[0] * cd[3] ||
      k_tokens.element_count() != code_count || v_tokens.element_count() != code_count)
    return ffi::Error::InvalidArgument("write and attend: token scale codes must be [T, Hkv] "
                                       "(new) and [L, N, B, Hkv] (caches)");
  const ByteCache bytes{lut.typed_data(), k_scale.typed_data(), v_scale.typed_data()};
  const TokenScaleWrite tokens{k_token_new.typed_data(), v_token_new.typed_data(),
                               k_tokens.typed_data(), v_tokens.typed_data(),
                               k_tokens_out->typed_data(), v_tokens_out->typed_data(),
                               token_table.typed_data()};
  return WriteAndAttendBody<uint8_t>(
      q.typed_data(), q.dimensions(), k_new.typed_data(), nd,
      v_new.typed_data(), v_new.dimensions().size(), slot_mapping.typed_data(),
      slot_mapping.dimensions(), k_cache.typed_data(), v_cache.typed_data(), cd, &bytes,
      kv_lens.typed_data(), block_tables.typed_data(), block_tables.dimensions(),
      cu_q_lens.typed_data(), num_seqs.typed_data()[0], out->typed_data(),
      k_out->typed_data(), v_out->typed_data(), layer, sm_scale, sliding_window, soft_cap,
      pool, &tokens);
}

ffi::Error RaggedPagedAttentionTokenScaledImpl(
    ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_cache, ffi::Buffer<ffi::U8> v_cache,
    ffi::Buffer<ffi::F32> lut, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
    ffi::Buffer<ffi::U8> k_tokens, ffi::Buffer<ffi::U8> v_tokens,
    ffi::Buffer<ffi::F32> token_table, ffi::Buffer<ffi::S32> kv_lens,
    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out, float sm_scale,
    int32_t sliding_window, float soft_cap, ffi::ThreadPool pool) {
  Shape s;
  if (const char* error = ShapeOf(q.dimensions(), k_cache.dimensions(),
                                  block_tables.dimensions(), &s))
    return ffi::Error::InvalidArgument(error);
  const int64_t width = s.num_kv_heads * s.head_dim;
  const int64_t code_count = s.num_blocks * s.block_size * s.num_kv_heads;
  if (lut.element_count() != 256 || token_table.element_count() != 256 ||
      k_scale.element_count() != width || v_scale.element_count() != width ||
      k_tokens.element_count() != code_count || v_tokens.element_count() != code_count)
    return ffi::Error::InvalidArgument("ragged paged attention: the byte and scale tables must "
                                       "have 256 entries, the scales [Hkv, D] and the token "
                                       "scale codes [N, B, Hkv]");
  ByteCache bytes{lut.typed_data(), k_scale.typed_data(), v_scale.typed_data()};
  bytes.k_token = k_tokens.typed_data();
  bytes.v_token = v_tokens.typed_data();
  bytes.token_table = token_table.typed_data();
  Attend(s, q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), &bytes,
         kv_lens.typed_data(), block_tables.typed_data(), cu_q_lens.typed_data(),
         block_tables.dimensions()[0], num_seqs.typed_data()[0], sm_scale, sliding_window,
         soft_cap, out->typed_data(), pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageRaggedPagedAttentionF32, RaggedPagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageWriteAndAttendF32, WriteAndAttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new [T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new [T, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T], -1 = skip
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_cache, aliased
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v_cache, aliased
                                  .Attr<int32_t>("layer")
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageRaggedPagedAttentionBytes, RaggedPagedAttentionBytesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut [256]: byte -> value
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageWriteAndAttendBytes, WriteAndAttendBytesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_new [T, Hkv, D], encoded
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_new [T, Hkv, D], encoded
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T], -1 = skip
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut [256]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [Hkv, D] (this layer)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // k_cache, aliased
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v_cache, aliased
                                  .Attr<int32_t>("layer")
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageWriteAndAttendTokenScaled, WriteAndAttendTokenScaledImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_new [T, Hkv, D], encoded
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_new [T, Hkv, D], encoded
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T], -1 = skip
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_cache [L, N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut [256]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [Hkv, D] (this layer)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k scale codes [T, Hkv] (new)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v scale codes [T, Hkv] (new)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k codes [L, N, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes [L, N, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // token_table [256]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Ret<ffi::Buffer<ffi::U8>>()   // k_cache, aliased
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v_cache, aliased
                                  .Ret<ffi::Buffer<ffi::U8>>()   // k codes, aliased
                                  .Ret<ffi::Buffer<ffi::U8>>()   // v codes, aliased
                                  .Attr<int32_t>("layer")
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpageRaggedPagedAttentionTokenScaled,
                              RaggedPagedAttentionTokenScaledImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hq, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_cache [N, B, Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lut [256]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [Hkv, D]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k codes [N, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v codes [N, B, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // token_table [256]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ctx<ffi::ThreadPool>());
