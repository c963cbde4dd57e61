// Causal attention of a flattened variable-length batch straight from the paged KV cache, on a CPU.
//
// One call per layer serves every request of the batch: decode steps (1 new token), verification
// (anchor + drafts) and prefill chunks alike. Work is split over (request, KV head) pairs; each
// pair reads its request's keys and values once, block by block through the block table, and
// reuses them for all of the request's new tokens times the query heads of its KV group, so memory
// traffic is the K/V of the contexts, read once, with no gathered copy and no per-request launch.
//
// Shapes (T = total new tokens, R = requests, H = query heads, KVH = KV heads, D = head_dim):
//   q             [T, H, D]                      the new tokens' queries (after RoPE)
//   k_cache       [num_blocks, block_size, KVH, D]  one layer's keys (this step's already written)
//   v_cache       [num_blocks, block_size, KVH, D]
//   block_tables  [R, max_blocks] int64          request r's blocks in order (unused tail: any value)
//   query_start   [R + 1] int64                  request r owns q rows query_start[r] .. query_start[r+1]-1
//   context_lens  [R] int64                      cached + new tokens of request r
//   out           [T, H, D]                      written (rows of skipped requests: left as they are)
//   long_min_q_len  a request with at least this many new tokens (a prompt chunk) is skipped, its
//                 rows left to the caller (0: none is skipped): SDPA's flash kernel runs such a
//                 long causal attention faster than this kernel's per-(request, KV head) loops,
//                 which are made for the few new tokens of decode and verification.
// New token i of request r (0-based among its q_len new tokens) sits at position
// context_len - q_len + i and attends to positions 0 .. that position.
//
// Arithmetic in float32 whatever the storage dtype: scores (q * scale).k (for bf16 caches on
// AVX512-BF16 CPUs, scale * (q.k) with the bf16 products summed into float32 by VDPBF16PS), a
// max-subtracted softmax over each query's visible positions (exp by a polynomial as accurate as
// float32's rounding, so that it vectorises), then the softmax-weighted sum of values. Equal to
// SDPA's math up to float rounding (another summation order).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::copy(src, src + n, dst);
}

// bf16 is the upper half of a float32: widening is a shift of the raw bits, which the compiler
// vectorises (c10's element-wise conversion does not).
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}

// exp(x) for x <= 0 (softmax after subtracting the row maximum), written so that the compiler
// vectorises a loop of it: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
// (relative error below 2e-7, about float32 rounding), 2^n put into the exponent bits. Below
// -87.3 (where exp underflows float32's normal range) it returns 0. Forced inline: a call in the
// loop would keep it scalar.
#define DSPARK_INLINE inline __attribute__((always_inline))
DSPARK_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// s[0 .. visible) = its softmax, s[visible .. ctx_len) = 0 (positions the row does not see).
// Written so that GCC vectorises every loop: the maximum runs in 16 independent lanes (a single
// running maximum waits on each comparison before the next), and exp_nonpositive is inlined.
inline void softmax_row(float* __restrict s, int64_t visible, int64_t ctx_len) {
  constexpr int kLanes = 16;
  float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = -std::numeric_limits<float>::infinity();
  int64_t p = 0;
  for (; p + kLanes <= visible; p += kLanes)
    for (int i = 0; i < kLanes; ++i) lanes[i] = lanes[i] > s[p + i] ? lanes[i] : s[p + i];
  float mx = lanes[0];
  for (int i = 1; i < kLanes; ++i) mx = std::max(mx, lanes[i]);
  for (; p < visible; ++p) mx = std::max(mx, s[p]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (p = 0; p < visible; ++p) {
    s[p] = exp_nonpositive(s[p] - mx);
    sum += s[p];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (p = 0; p < visible; ++p) s[p] *= inv;
  for (p = visible; p < ctx_len; ++p) s[p] = 0.f;
}

// Rows of a (request, KV head) from which scores are computed against transposed key tiles: the
// transposition of each tile is then shared by enough rows to pay for itself (verification blocks
// and prefill chunks); below it (decode: one new token times the query heads of a group) each
// key row is dotted with the few query rows directly.
constexpr int64_t kTileRows = 8;
// Positions per key tile: one AVX-512 register of float32 (two AVX2 ones).
constexpr int64_t kTile = 16;

// A SIMD path for float32 and bf16 caches with head_dim 32, 64 or 128, on CPUs with AVX-512
// (16 float32 lanes) or else AVX2 + FMA (8 lanes): the query rows of a (request, KV head) are
// taken a few at a time with their queries and outputs in registers. Scores: for W positions at a
// time (W = lanes), each row's W dot products are accumulated as W vectors and summed across
// lanes together (`reduce`: a few operations a position instead of a horizontal sum each);
// values: the weighted sum accumulates in registers over all positions, not in memory. Same
// arithmetic as the portable code (float32), another summation order. `Isa` below is the widest
// of the two the compiler targets (-march=native); without either, only the portable loops exist.
#if defined(__AVX512F__)
#define DSPARK_SIMD 1
struct Isa {
  using vec = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  static vec zero() { return _mm512_setzero_ps(); }
  static vec set1(float x) { return _mm512_set1_ps(x); }
  static vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static vec load(const c10::BFloat16* p) {  // bf16 -> the upper half of f32
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  // out lane t = the sum of v[t]'s 16 lanes.
  static DSPARK_INLINE vec reduce(const vec* v) {
    __m512 w[4];
    for (int g = 0; g < 4; ++g) {  // w[g], 128-bit chunk c, lane i: v[4g + i] summed over chunk c
      const __m512* a = v + 4 * g;
      const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
      const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
      w[g] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    // chunk g of the result: w[g] summed over its 4 chunks
    const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define DSPARK_SIMD 1
struct Isa {
  using vec = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;
  static vec zero() { return _mm256_setzero_ps(); }
  static vec set1(float x) { return _mm256_set1_ps(x); }
  static vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static vec load(const c10::BFloat16* p) {  // bf16 -> the upper half of f32
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  // out lane t = the sum of v[t]'s 8 lanes.
  static DSPARK_INLINE vec reduce(const vec* v) {
    // hadd pairs lanes within each 128-bit half: after two rounds, half c of s0123 holds
    // v[0..3] each summed over its half c (s4567: v[4..7]); adding the halves finishes the sums.
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
  }
};
#endif

#if defined(DSPARK_SIMD)
using vec = Isa::vec;
constexpr int W = Isa::kLanes;
static_assert(kTile % W == 0, "a row of scores is padded to whole vectors");

// keys[t] = the key of position tile + t; a tile's positions past the context repeat its last
// key, so that every tile is a whole one (their scores, past ctx_len, are never read).
template <typename scalar_t>
DSPARK_INLINE void tile_keys(const scalar_t* k_ptr, const int64_t* slots, int64_t tile,
                             int64_t ctx_len, const scalar_t** keys) {
  for (int t = 0; t < W; ++t) keys[t] = k_ptr + slots[std::min<int64_t>(tile + t, ctx_len - 1)];
}

// How scores_simd multiplies a query row by a key, DotT::kWidth numbers a register:
// Float32Dot loads the keys as float32 (widening bf16 ones) and multiply-adds W lanes, the
// queries in float32 and already scaled.
template <typename scalar_t>
struct Float32Dot {
  using query_t = float;
  using reg = vec;
  static constexpr int kWidth = W;
  static reg load_query(const float* p) { return Isa::load(p); }
  static vec accumulate(vec acc, reg q, const scalar_t* key) { return Isa::fmadd(q, Isa::load(key), acc); }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DSPARK_BF16_DOT 1
// Bf16Dot, for bf16 queries against a bf16 cache: VDPBF16PS multiplies bf16 pairs and adds both
// products into a float32 lane. A product of two bf16 numbers is exact in float32, so this is the
// float32 path's arithmetic in another summation order, with a third of its instructions (no
// widening of the keys, 32 products an instruction instead of 16). The queries are the raw bf16
// numbers, unscaled: the scale multiplies the finished scores, so that no query is rounded.
struct Bf16Dot {
  using query_t = c10::BFloat16;
  using reg = __m512bh;
  static constexpr int kWidth = 32;
  static reg load_query(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static vec accumulate(vec acc, reg q, const c10::BFloat16* key) {
    return _mm512_dpbf16_ps(acc, q, (__m512bh)_mm512_loadu_si512(key));
  }
};
#endif

// Software prefetch of the K/V cache. A decode step reads each layer's keys and values once, and
// between two reads of a layer it streams ~96 MB of weights, so they come from memory (at 16
// streams of ~120 positions, 2.9 MB a layer). Read a position at a time through the block table,
// with only the hardware prefetcher, they arrived at ~6 GB/s, a quarter of what one core streams.
// So the scores pass of a (request, KV head) asks for its keys kPrefetchTiles tiles ahead and
// for the values of the tile it is on (which the values pass reads next), into L2 (locality 2;
// into L1, locality 3, gained nothing). A task asks for its own head's bytes only: the first head
// of a request asking for every head's (whole slot rows) was no faster than no prefetch.
// Prefetches change no arithmetic.
constexpr int64_t kPrefetchTiles = 2;

// Asks for the cache lines of positions [from, min(to, ctx_len)) of `base` (keys or values):
// `row_bytes` from each slot, this KV head's.
template <typename scalar_t>
DSPARK_INLINE void prefetch_positions(const scalar_t* base, const int64_t* slots, int64_t from,
                                      int64_t to, int64_t ctx_len, int64_t row_bytes) {
  for (int64_t pos = from; pos < std::min(to, ctx_len); ++pos) {
    const char* row = reinterpret_cast<const char*>(base + slots[pos]);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
  }
}

// scores[j, 0 .. ctx_len rounded up to W) = scale * queries[j] . key(pos) for NR rows (positions
// past ctx_len: anything). NV = head_dim / DotT::kWidth registers a row. `slots[pos]`: the offset
// of position pos's key (and value) in the cache, this KV head's. `prefetch`: ask for the keys
// ahead and the values of v_ptr (the first block of rows of a (request, KV head) does).
template <typename DotT, typename scalar_t, int NV, int NR>
inline void scores_simd(const typename DotT::query_t* queries, const scalar_t* k_ptr,
                        const int64_t* slots, int64_t ctx_len, int64_t head_dim, int64_t stride,
                        float scale, float* scores, const scalar_t* v_ptr, bool prefetch) {
  typename DotT::reg q[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NV; ++c) q[r][c] = DotT::load_query(queries + r * head_dim + DotT::kWidth * c);
  const vec vscale = Isa::set1(scale);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
  if (prefetch) prefetch_positions(k_ptr, slots, 0, kPrefetchTiles * W, ctx_len, row_bytes);
  const scalar_t* keys[W];
  for (int64_t tile = 0; tile < ctx_len; tile += W) {
    if (prefetch) {
      const int64_t ahead = tile + kPrefetchTiles * W;
      prefetch_positions(k_ptr, slots, ahead, ahead + W, ctx_len, row_bytes);
      prefetch_positions(v_ptr, slots, tile, tile + W, ctx_len, row_bytes);
    }
    tile_keys(k_ptr, slots, tile, ctx_len, keys);
    for (int r = 0; r < NR; ++r) {
      vec acc[W];
#pragma GCC unroll 16
      for (int t = 0; t < W; ++t) {
        acc[t] = Isa::zero();
        for (int c = 0; c < NV; ++c) acc[t] = DotT::accumulate(acc[t], q[r][c], keys[t] + DotT::kWidth * c);
      }
      Isa::store(scores + r * stride + tile, Isa::reduce(acc) * vscale);
    }
  }
}

// out rows = weights @ values for NR rows (weights 0 where a row does not see a position).
template <typename scalar_t, int DV, int NR>
inline void values_simd(const float* weights, const scalar_t* v_ptr, const int64_t* slots,
                        int64_t ctx_len, int64_t stride, float* out, int64_t head_dim) {
  vec acc[NR][DV];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = Isa::zero();
  for (int64_t pos = 0; pos < ctx_len; ++pos) {
    const scalar_t* value = v_ptr + slots[pos];
    vec v[DV];
    for (int c = 0; c < DV; ++c) v[c] = Isa::load(value + W * c);
    for (int r = 0; r < NR; ++r) {
      const vec w = Isa::set1(weights[r * stride + pos]);
      for (int c = 0; c < DV; ++c) acc[r][c] = Isa::fmadd(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DV; ++c) Isa::store(out + r * head_dim + W * c, acc[r][c]);
}

// Rows a register block holds: queries (scores) or accumulators (values), DV vectors each, in the
// registers left beside the W score accumulators (1 to 4: AVX-512 takes 4, 4, 2 rows at head_dim
// 32, 64, 128; AVX2 2, 1, 1).
template <int DV>
constexpr int kRowsPerBlock = std::max(1, std::min(4, (Isa::kRegisters - W) / DV));

template <typename scalar_t, int DV>
void rows_simd(const float* queries, const scalar_t* k_ptr, const scalar_t* v_ptr, const int64_t* slots,
               int64_t num_rows, int64_t ctx_len, int64_t head_dim, int64_t stride, float* scores,
               float* accum, bool values) {
  constexpr int NR = kRowsPerBlock<DV>;
  for (int64_t j = 0; j < num_rows; j += NR) {
    const int64_t n = std::min<int64_t>(NR, num_rows - j);
    const float* qj = queries + j * head_dim;
    float* sj = scores + j * stride;
    float* aj = accum + j * head_dim;
#define DSPARK_ROWS(N)                                                                      \
  if (values) values_simd<scalar_t, DV, N>(sj, v_ptr, slots, ctx_len, stride, aj, head_dim); \
  else scores_simd<Float32Dot<scalar_t>, scalar_t, DV, N>(qj, k_ptr, slots, ctx_len, head_dim, stride, 1.f, sj, \
                                                            v_ptr, j == 0);
    switch (n) {
      case 1: DSPARK_ROWS(1) break;
      case 2: if constexpr (NR >= 2) { DSPARK_ROWS(2) } break;
      case 3: if constexpr (NR >= 3) { DSPARK_ROWS(3) } break;
      default: if constexpr (NR >= 4) { DSPARK_ROWS(4) } break;
    }
#undef DSPARK_ROWS
  }
}

#if defined(DSPARK_BF16_DOT)
// The scores of num_rows bf16 query rows (Bf16Dot), 4 rows a register block.
template <int DB>
void score_rows_bf16_dot(const c10::BFloat16* queries, const c10::BFloat16* k_ptr, const c10::BFloat16* v_ptr,
                         const int64_t* slots, int64_t num_rows, int64_t ctx_len, int64_t head_dim, int64_t stride,
                         float scale, float* scores) {
  for (int64_t j = 0; j < num_rows; j += 4) {
    const c10::BFloat16* qj = queries + j * head_dim;
    float* sj = scores + j * stride;
    switch (std::min<int64_t>(4, num_rows - j)) {
      case 1: scores_simd<Bf16Dot, c10::BFloat16, DB, 1>(qj, k_ptr, slots, ctx_len, head_dim, stride, scale, sj, v_ptr, j == 0); break;
      case 2: scores_simd<Bf16Dot, c10::BFloat16, DB, 2>(qj, k_ptr, slots, ctx_len, head_dim, stride, scale, sj, v_ptr, j == 0); break;
      case 3: scores_simd<Bf16Dot, c10::BFloat16, DB, 3>(qj, k_ptr, slots, ctx_len, head_dim, stride, scale, sj, v_ptr, j == 0); break;
      default: scores_simd<Bf16Dot, c10::BFloat16, DB, 4>(qj, k_ptr, slots, ctx_len, head_dim, stride, scale, sj, v_ptr, j == 0); break;
    }
  }
}
#endif

template <typename scalar_t>
constexpr bool kHasSimdPath = std::is_same<scalar_t, float>::value ||
                              std::is_same<scalar_t, c10::BFloat16>::value;
#endif

template <typename scalar_t>
void paged_attention_kernel(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& query_start, const torch::Tensor& context_lens,
                            double scale, int64_t long_min_q_len, torch::Tensor& out) {
  const int64_t num_requests = context_lens.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();

  // Strides in elements (the cache and q are contiguous, checked by the caller).
  const int64_t q_token_stride = num_heads * head_dim;
  const int64_t kv_slot_stride = num_kv_heads * head_dim;
  const int64_t kv_block_stride = block_size * kv_slot_stride;
  const float fscale = static_cast<float>(scale);
#if defined(DSPARK_SIMD)
  const bool simd = kHasSimdPath<scalar_t> && (head_dim == 32 || head_dim == 64 || head_dim == 128);
#endif
#if defined(DSPARK_BF16_DOT)
  // scores from the raw bf16 queries (Bf16Dot): the float32 queries are not needed
  const bool bf16_dot = simd && std::is_same<scalar_t, c10::BFloat16>::value;
#else
  const bool bf16_dot = false;
#endif

  at::parallel_for(0, num_requests * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries, scores, accum, row(head_dim), key_tile(head_dim * kTile);
    std::vector<int64_t> slots;  // [ctx_len] each position's offset in the cache, this KV head's
    std::vector<c10::BFloat16> queries_bf16;  // [num_rows, head_dim] (the bf16 dot path)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads;
      const int64_t h = task % num_kv_heads;
      const int64_t q_first = starts[r];
      const int64_t q_len = starts[r + 1] - q_first;
      const int64_t ctx_len = ctx_lens[r];
      if (q_len == 0) continue;
      if (long_min_q_len > 0 && q_len >= long_min_q_len) continue;
      const int64_t num_rows = q_len * group;  // query rows of this (request, KV head)
      const int64_t first_pos = ctx_len - q_len;
      const int64_t stride = (ctx_len + kTile - 1) / kTile * kTile;  // of a row of scores
      const int64_t* table = tables + r * max_blocks;
      auto slot = [&](int64_t pos) {
        return table[pos / block_size] * kv_block_stride + (pos % block_size) * kv_slot_stride + h * head_dim;
      };
      // once a task, not once a row block and position (a division by block_size each)
      slots.resize(ctx_len);
      for (int64_t pos = 0; pos < ctx_len; ++pos) slots[pos] = slot(pos);
      // queries [num_rows, head_dim] in float32, times the scale; row j = (new token j / group,
      // head h*group + j % group)
      queries.resize(bf16_dot ? 0 : num_rows * head_dim);
      for (int64_t j = 0; j < num_rows && !bf16_dot; ++j) {
        const scalar_t* src = q_ptr + (q_first + j / group) * q_token_stride + (h * group + j % group) * head_dim;
        float* dst = queries.data() + j * head_dim;
        load_row(src, dst, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= fscale;
      }
      // scores [num_rows, stride]; row j sees positions 0 .. first_pos + j / group
      scores.resize(num_rows * stride);
      accum.assign(num_rows * head_dim, 0.f);
#if defined(DSPARK_SIMD)
      // head_dim 32, 64 or 128 (DV = head_dim / W vectors a row); scores (values = false) or
      // values (true)
      auto simd_rows = [&](bool values) {
        if constexpr (kHasSimdPath<scalar_t>) {
          const float* qs = queries.data();
          const int64_t* ss = slots.data();
          if (head_dim == 32)
            rows_simd<scalar_t, 32 / W>(qs, k_ptr, v_ptr, ss, num_rows, ctx_len, head_dim, stride,
                                        scores.data(), accum.data(), values);
          else if (head_dim == 64)
            rows_simd<scalar_t, 64 / W>(qs, k_ptr, v_ptr, ss, num_rows, ctx_len, head_dim, stride,
                                        scores.data(), accum.data(), values);
          else
            rows_simd<scalar_t, 128 / W>(qs, k_ptr, v_ptr, ss, num_rows, ctx_len, head_dim, stride,
                                         scores.data(), accum.data(), values);
        }
      };
#if defined(DSPARK_BF16_DOT)
      // bf16 scores by VDPBF16PS from the raw (unscaled) bf16 queries
      auto bf16_dot_scores = [&] {
        if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
          queries_bf16.resize(num_rows * head_dim);
          for (int64_t j = 0; j < num_rows; ++j)
            std::copy_n(q_ptr + (q_first + j / group) * q_token_stride + (h * group + j % group) * head_dim,
                        head_dim, queries_bf16.data() + j * head_dim);
          const c10::BFloat16* qs = queries_bf16.data();
          if (head_dim == 32)
            score_rows_bf16_dot<1>(qs, k_ptr, v_ptr, slots.data(), num_rows, ctx_len, head_dim, stride, fscale, scores.data());
          else if (head_dim == 64)
            score_rows_bf16_dot<2>(qs, k_ptr, v_ptr, slots.data(), num_rows, ctx_len, head_dim, stride, fscale, scores.data());
          else
            score_rows_bf16_dot<4>(qs, k_ptr, v_ptr, slots.data(), num_rows, ctx_len, head_dim, stride, fscale, scores.data());
        }
      };
      if (bf16_dot) {
        bf16_dot_scores();
      } else
#endif
      if (simd) {
        simd_rows(false);
      } else
#endif
      if (num_rows < kTileRows) {
        for (int64_t pos = 0; pos < ctx_len; ++pos) {
          load_row(k_ptr + slots[pos], row.data(), head_dim);
          // rows that see `pos`: new token index i >= pos - first_pos
          const int64_t first_row = std::max<int64_t>(0, pos - first_pos) * group;
          for (int64_t j = first_row; j < num_rows; ++j) {
            const float* __restrict qj = queries.data() + j * head_dim;
            const float* __restrict kr = row.data();
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * kr[d];
            scores[j * stride + pos] = dot;
          }
        }
      } else {
        for (int64_t tile = 0; tile < ctx_len; tile += kTile) {
          // key_tile [head_dim, kTile]: the tile's keys transposed, so that a query's scores
          // against it are head_dim multiply-adds of kTile-wide vectors, with no horizontal sums
          const int64_t width = std::min(kTile, ctx_len - tile);
          for (int64_t t = 0; t < width; ++t) {
            load_row(k_ptr + slots[tile + t], row.data(), head_dim);
            for (int64_t d = 0; d < head_dim; ++d) key_tile[d * kTile + t] = row[d];
          }
          for (int64_t t = width; t < kTile; ++t)
            for (int64_t d = 0; d < head_dim; ++d) key_tile[d * kTile + t] = 0.f;
          const int64_t first_row = std::max<int64_t>(0, tile - first_pos) * group;
          for (int64_t j = first_row; j < num_rows; ++j) {
            const float* __restrict qj = queries.data() + j * head_dim;
            float acc[kTile] = {0.f};
            for (int64_t d = 0; d < head_dim; ++d) {
              const float qd = qj[d];
              const float* __restrict kd = key_tile.data() + d * kTile;
#pragma omp simd
              for (int64_t t = 0; t < kTile; ++t) acc[t] += qd * kd[t];
            }
            std::copy(acc, acc + kTile, scores.data() + j * stride + tile);
          }
        }
      }
      // softmax per row over its visible positions, in place
      for (int64_t j = 0; j < num_rows; ++j)
        softmax_row(scores.data() + j * stride, first_pos + j / group + 1, ctx_len);
      // accum [num_rows, head_dim] = weights @ values
#if defined(DSPARK_SIMD)
      if (simd) {
        simd_rows(true);
      } else
#endif
      for (int64_t pos = 0; pos < ctx_len; ++pos) {
        load_row(v_ptr + slots[pos], row.data(), head_dim);
        const int64_t first_row = std::max<int64_t>(0, pos - first_pos) * group;
        for (int64_t j = first_row; j < num_rows; ++j) {
          const float w = scores[j * stride + pos];
          float* __restrict acc = accum.data() + j * head_dim;
          const float* __restrict vr = row.data();
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * vr[d];
        }
      }
      for (int64_t j = 0; j < num_rows; ++j) {
        scalar_t* dst = out_ptr + (q_first + j / group) * q_token_stride + (h * group + j % group) * head_dim;
        const float* acc = accum.data() + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start, const torch::Tensor& context_lens,
                              double scale, int64_t long_min_q_len) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [T,H,D], caches [NB,BS,KVH,D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches differ in dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "head shapes");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && query_start.scalar_type() == torch::kLong &&
              context_lens.scalar_type() == torch::kLong, "int64 metadata");
  TORCH_CHECK(block_tables.is_contiguous() && query_start.is_contiguous() && context_lens.is_contiguous(),
              "contiguous metadata");
  const int64_t num_requests = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == num_requests + 1 && block_tables.size(0) == num_requests,
              "metadata lengths");
  // Bounds: every block a context reads lies in the cache, every query row in q.
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[num_requests] == q.size(0), "query_start must span q");
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    TORCH_CHECK(q_len >= 0 && ctx[r] >= q_len, "request ", r, ": context shorter than its new tokens");
    const int64_t blocks = (ctx[r] + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= max_blocks, "request ", r, ": context beyond its block table");
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t id = tables[r * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "request ", r, ": block id ", id, " outside the cache");
    }
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    paged_attention_kernel<scalar_t>(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, long_min_q_len, out);
  });
  return out;
}

namespace {

// Half-rotation RoPE of the q and k heads of a fused q|k|v projection, with the exact roundings
// of transformers' `x * cos + rotate_half(x) * sin` in float32 (each product rounded, then the sum:
// no fused multiply-add, hence fp-contract off), q into `q_out`, k and v into their cache slots.
//   qkv [T, (H + 2 KVH) * D], cos / sin [T, D], q_out [T, H, D]; slot t of a cache layer is
//   its rows t * KVH * D .. of [num_blocks * block_size, KVH, D].
__attribute__((optimize("fp-contract=off")))
void rope_write_f32(const float* qkv, const float* cos, const float* sin, const int64_t* slots,
                    int64_t T, int64_t H, int64_t KVH, int64_t D, float* q_out, float* k_cache,
                    float* v_cache) {
  const int64_t half = D / 2, row_len = (H + 2 * KVH) * D, slot_len = KVH * D;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv + t * row_len;
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t head = 0; head < H + KVH; ++head) {
      const float* x = row + head * D;
      float* dst = head < H ? q_out + (t * H + head) * D : k_cache + slots[t] * slot_len + (head - H) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float a = x[d] * c[d];
        const float b = -x[d + half] * s[d];
        dst[d] = a + b;
      }
      for (int64_t d = half; d < D; ++d) {
        const float a = x[d] * c[d];
        const float b = x[d - half] * s[d];
        dst[d] = a + b;
      }
    }
    std::memcpy(v_cache + slots[t] * slot_len, row + (H + KVH) * D, sizeof(float) * slot_len);
  }
}

}  // namespace

// One layer's work between its q|k|v product and its o product, for a float32 cache: RoPE of q
// and k, the K/V write at `slot_mapping`, then `paged_attention`. The same numbers as those
// three steps done apart (apply_rope, PagedKVCache.write, paged_attention), in one call.
//   qkv [T, (H + 2 KVH) * D] float32; cos, sin [T, D] float32; slot_mapping [T] int64;
//   the rest as paged_attention. Returns out [T, H, D].
torch::Tensor rope_write_attention(const torch::Tensor& qkv, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& k_cache,
                                   const torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables, const torch::Tensor& query_start,
                                   const torch::Tensor& context_lens, int64_t num_heads, double scale,
                                   int64_t long_min_q_len) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches [NB,BS,KVH,D] of one shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const int64_t num_kv_heads = k_cache.size(2), D = k_cache.size(3), T = qkv.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32, "rope_write_attention: float32 tensors");
  TORCH_CHECK(D % 2 == 0 && num_heads > 0 && num_heads % num_kv_heads == 0, "head shapes");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "qkv [T, (H + 2 KVH) * D] contiguous");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == T && sin.size(0) == T && cos.size(1) == D &&
              sin.size(1) == D && cos.is_contiguous() && sin.is_contiguous(), "cos, sin [T, D] contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == T && slot_mapping.is_contiguous(), "slot_mapping [T] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  rope_write_f32(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slots, T, num_heads,
                 num_kv_heads, D, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, long_min_q_len);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "causal attention of a flattened batch from a paged KV cache (CPU)");
  m.def("rope_write_attention", &rope_write_attention,
        "RoPE of q and k from a fused q|k|v row, the K/V cache write, then paged_attention (float32, CPU)");
}
