// y[rows, out] = x[rows, in] @ W^T + b, with W read from GGUF quantised blocks as they are.
//
// Block formats (ggml's block_q4_1 / block_q8_0, 32 weights of one output row each):
//   Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes qs; weight j (0..15)  = d * (qs[j] & 15) + m,
//                                                weight j + 16      = d * (qs[j] >> 4) + m.
//   Q8_0, 34 bytes: fp16 d, 32 int8 q;          weight j           = d * q[j].
// W's row n is blocks [n, 0 .. in/32 - 1], stored back to back ([out, in/32 * block bytes] uint8).
//
// Every weight is widened in registers to exactly the float32 value of the dequantised model
// (d * q is exact in float32: an 11-bit by a 4- or 8-bit integer; Q4_1 then rounds once on + m,
// by one fused multiply-add, as the float32 dequantiser's separate multiply and add do), so the
// product is the float32 model's, in another summation order than a float32 GEMM's.
//
// Fixed reduction order (batch invariance): every (row, output) pair has 16 float32 lanes s[16];
// block b adds x[32b + i] * w[32b + i] into s[i], then x[32b + 16 + i] * w[32b + 16 + i] into
// s[i], by one fused multiply-add each, blocks in order from 0. Then the 16 lanes are summed by
// halving: s[i] += s[i + 8], s[i] += s[i + 4], s[i] += s[i + 2], s[0] + s[1]; then + bias. The number of rows in the call, the row and output
// tiling, the thread count and the instruction set (AVX-512, AVX2, portable) change only which
// pairs are computed together, never this order: a row's outputs are bit-identical alone, in 8 or
// in 64, and across the three paths.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;
constexpr int64_t Q4_1_BYTES = 20;
constexpr int64_t Q8_0_BYTES = 34;
constexpr int ROW_CHUNK = 32;  // rows of x kept hot while a thread's outputs stream past

enum class Format { Q4_1, Q8_0 };

inline float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return c10::detail::fp16_ieee_to_fp32_value(h);
}

constexpr int64_t block_bytes(Format f) { return f == Format::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES; }

// ---- the 32 weights of one block, widened: lo = weights 0..15, hi = weights 16..31 -------------
#if defined(__AVX512F__)
using Vec = __m512;
inline __m128 halves(const uint8_t* p) {  // [fp16 at p, fp16 at p + 2, ...] -> float32 lanes (F16C, exact)
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}
// The 32 weights from d and m in float32 lanes (Q8_0: m unused).
inline void widen_from(Format f, const uint8_t* blk, __m512 d, __m512 m, Vec& lo, Vec& hi) {
    if (f == Format::Q4_1) {
        // table[k] = d * k + m (k = 0..15), then each weight is table[its nibble]: vpermps reads
        // only an index's low 4 bits, so the low nibble needs no mask.
        const __m512 table = _mm512_fmadd_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
        lo = _mm512_permutexvar_ps(q, table);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    } else {
        const __m128i* q = reinterpret_cast<const __m128i*>(blk + 2);
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    }
}
inline void widen(Format f, const uint8_t* blk, Vec& lo, Vec& hi) {
    const __m128 dm = halves(blk);
    widen_from(f, blk, _mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)), lo, hi);
}
// The same widening from d (and m) already in float32 (`block_scales`), read by broadcasts from
// memory: the one-row tile's block then takes 3 shuffle-port instructions instead of 7 (the fp16
// conversion and the register broadcasts of d and m; an Intel core has one 512-bit shuffle port).
// A step's one-row products ran 1.08-1.24x faster on a 2-core Xeon (amx_bf16), one thread;
// the few-row and strip tiles gained nothing from it there, and keep `widen`.
inline void widen_scaled(Format f, const uint8_t* blk, const float* dm, Vec& lo, Vec& hi) {
    widen_from(f, blk, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]), lo, hi);
}
// dm[2i], dm[2i + 1] = the fp16 pair at the start of block i (`count` blocks from `first`, `bb`
// bytes apart) in float32, exactly (F16C): Q4_1's d and m; Q8_0's d and two quants read as an fp16
// (unused). Eight blocks a gather and one conversion.
inline void block_scales(const uint8_t* first, int64_t bb, int64_t count, float* dm) {
    const __m256i offsets = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(static_cast<int>(bb)));
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256i pairs = _mm256_i32gather_epi32(reinterpret_cast<const int*>(first + i * bb), offsets, 1);
        _mm512_storeu_ps(dm + 2 * i, _mm512_cvtph_ps(pairs));
    }
    for (; i < count; ++i) _mm_storel_pi(reinterpret_cast<__m64*>(dm + 2 * i), halves(first + i * bb));
}
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// Keeps a loaded value in its register: without it GCC folds the load into every multiply-add
// that uses it (one load per FMA, twice the loads the core can issue beside the FMAs).
inline void pin(Vec& v) { asm volatile("" : "+v"(v)); }
inline float finish(Vec s) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#elif defined(__AVX2__)
struct Vec { __m256 a, b; };  // lanes 0..7 and 8..15 of the 16
inline void widen(Format f, const uint8_t* blk, Vec& lo, Vec& hi) {
    int32_t v;
    std::memcpy(&v, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(v));  // F16C: d, m exactly
    const __m256 d = _mm256_broadcastss_ps(dm);
    if (f == Format::Q4_1) {
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m256i mask = _mm256_set1_epi32(15);
        const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4)));
        const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 12)));
        lo.a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, mask)), m);
        lo.b = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, mask)), m);
        hi.a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m);
        hi.b = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m);
    } else {
        auto part = [&](int k) {
            return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k)))));
        };
        lo.a = part(0); lo.b = part(1); hi.a = part(2); hi.b = part(3);
    }
}
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
inline void pin(Vec&) {}  // 16 ymm hold no tile of whole Vecs: the AVX2 strip tile pins halves
inline float finish(Vec s) {
    const __m256 s8 = _mm256_add_ps(s.a, s.b);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
struct Vec { float v[16]; };
inline void widen(Format f, const uint8_t* blk, Vec& lo, Vec& hi) {
    const float d = half_at(blk);
    if (f == Format::Q4_1) {
        const float m = half_at(blk + 2);
        for (int i = 0; i < 16; ++i) {
            lo.v[i] = std::fma(d, static_cast<float>(blk[4 + i] & 15), m);
            hi.v[i] = std::fma(d, static_cast<float>(blk[4 + i] >> 4), m);
        }
    } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 16; ++i) {
            lo.v[i] = d * static_cast<float>(q[i]);
            hi.v[i] = d * static_cast<float>(q[16 + i]);
        }
    }
}
inline Vec zero() { Vec z; for (float& v : z.v) v = 0.0f; return z; }
inline Vec load(const float* p) { Vec z; std::memcpy(z.v, p, sizeof z.v); return z; }
inline void store(float* p, Vec v) { std::memcpy(p, v.v, sizeof v.v); }
inline Vec fma(Vec a, Vec b, Vec c) {
    Vec r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
}
inline void pin(Vec&) {}
inline float finish(Vec acc) {
    float s[16];
    std::memcpy(s, acc.v, sizeof s);
    for (int i = 0; i < 8; ++i) s[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; ++i) s[i] = s[i] + s[i + 4];
    for (int i = 0; i < 2; ++i) s[i] = s[i] + s[i + 2];
    return s[0] + s[1];
}
#endif

#if !defined(__AVX512F__)
// AVX2 and portable: each block's fp16 scales converted as it is widened (`widen`). Converting a
// chunk's scales first (AVX-512's way, then in every tile) made a step's products 1.02-1.12x
// slower in an AVX2 build (-mno-avx512f, on the same Xeon).
inline void block_scales(const uint8_t*, int64_t, int64_t, float*) {}
inline void widen_scaled(Format f, const uint8_t* blk, const float*, Vec& lo, Vec& hi) { widen(f, blk, lo, hi); }
#endif

const char* isa_name() {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "portable";
#endif
}

// Weights are read PREFETCH_ROWS outputs ahead of the ones being widened: each loop over a tile's
// blocks also asks for the cache lines of the outputs PREFETCH_ROWS further on, in the order they
// will be read, so the memory reads of the next tiles overlap this tile's arithmetic (the hardware
// prefetcher alone leaves the one-row kernel waiting on memory: a step's 121 one-row products took
// 1.4-1.55x longer without it on a loaded AVX2 Zen 3). Prefetches change no arithmetic and never
// fault.
constexpr int64_t PREFETCH_ROWS = 16;

// The one-row tile widens blocks SCALE_CHUNK at a time: first each output's d (and m) of the
// chunk's blocks in float32 (`block_scales`, into a stack array), then the chunk's blocks from them
// (`widen_scaled`). The same float32 values as `widen`'s, so the same bits.
constexpr int64_t SCALE_CHUNK = 16;

// The cache lines of `span` bytes from p, the ones before `end` (the weights' end) only.
inline void prefetch_span(const uint8_t* p, int64_t span, const uint8_t* end) {
    for (int64_t k = 0; k < span; k += 64)
        if (p + k < end) __builtin_prefetch(p + k);
}

// A tile's RT x NT accumulators, zeroed.
template <int NT, int RT>
inline void zero_tile(Vec (&acc)[RT][NT]) {
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NT; ++n) acc[r][n] = zero();
}

#if defined(__AVX512F__)
// The lane sums of several accumulators at once, each by exactly `finish`'s additions: every
// level adds the same pairs of lanes as `finish` does (s[i] + s[i + 8], then + s[i + 4], + s[i + 2],
// s[0] + s[1]), for 2, 4, 8 and then 16 accumulators in one instruction, the operands brought together
// by shuffles. 16 accumulators take 30 shuffles and 15 additions instead of 16 `finish`es.

// Level 1 for a pair: [a lanes 0..7 | b lanes 0..7] + [a lanes 8..15 | b lanes 8..15] -> the
// 8-lane partial sums of a (128-bit lanes 0, 1) and b (lanes 2, 3).
inline __m512 halve_pair(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Level 2 for two level-1 results (p: a, b; q: c, d) -> the 4-lane partial sums of a, b, c, d,
// one per 128-bit lane.
inline __m512 quarter_pair(__m512 p, __m512 q) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Levels 3 and 4 for four level-2 results c0..c3 (accumulator 4k + L in 128-bit lane L of c_k):
// element 4L + k of the result is the lane sum of accumulator 4k + L.
inline __m512 last_levels(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_ps(c0, c1, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(c0, c1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_ps(c2, c3, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(c2, c3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline __m512 quarters(const __m512* a) {  // level 2 of a[0..3]
    return quarter_pair(halve_pair(a[0], a[1]), halve_pair(a[2], a[3]));
}
// Element 4L + k = finish(a[4k + L]) for 16 accumulators a.
inline __m512 finish16(const __m512 (&a)[16]) {
    return last_levels(quarters(a), quarters(a + 4), quarters(a + 8), quarters(a + 12));
}
// Elements 4L and 4L + 1 = finish(a[L]) and finish(a[4 + L]) for 8 accumulators a (L < 4).
inline __m512 finish8(const __m512 (&a)[8]) {
    const __m512 c0 = quarters(a), c1 = quarters(a + 4);
    return last_levels(c0, c1, c0, c1);
}
// Elements 4L and 4L + 1 of `sums` (L < 4) in order: [L = 0..3 at k = 0, L = 0..3 at k = 1].
inline __m256 gather_pairs(__m512 sums) {
    return _mm512_castps512_ps256(
        _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), sums));
}
#endif

// A tile's results: each accumulator's lane sum (`finish`), plus its output's bias, stored at
// y[row][output] for rows r0 .. r0 + RT and outputs n0 .. n0 + NT.
template <int NT, int RT>
inline void store_tile_each(Vec (&acc)[RT][NT], int64_t r0, int64_t n0, const float* bias, float* y, int64_t out) {
    for (int r = 0; r < RT; ++r)
        for (int n = 0; n < NT; ++n) {
            const float s = finish(acc[r][n]);
            y[(r0 + r) * out + n0 + n] = bias ? s + bias[n0 + n] : s;
        }
}

// The same results, where the tile's shape allows by the shared lane-sum tree (the same bits):
// the strip tiles (4 x 4, 4 x 2) and the one-row tile (8 outputs) on AVX-512. A step's products
// took 1.07-1.08x less time at 8, 16 and 64 rows and 1.02x at one row on a Zen 4, one thread
// (`bench/q4_kernel_versions.py`); the few-row `direct_tile` keeps `store_tile_each` (with the
// tree, 4 rows took 1.2-1.3x longer).
template <int NT, int RT>
inline void store_tile(Vec (&acc)[RT][NT], int64_t r0, int64_t n0, const float* bias, float* y, int64_t out) {
#if defined(__AVX512F__)
    if constexpr (NT == 4 && RT == 4) {
        // a[4n + r] = acc[r][n]: element 4r + n of the sums is row r's output n, so each 128-bit
        // lane is one row's four outputs
        const __m512 a[16] = {acc[0][0], acc[1][0], acc[2][0], acc[3][0], acc[0][1], acc[1][1], acc[2][1], acc[3][1],
                              acc[0][2], acc[1][2], acc[2][2], acc[3][2], acc[0][3], acc[1][3], acc[2][3], acc[3][3]};
        __m512 sums = finish16(a);
        if (bias) sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(bias + n0)));
        _mm_storeu_ps(y + (r0 + 0) * out + n0, _mm512_extractf32x4_ps(sums, 0));
        _mm_storeu_ps(y + (r0 + 1) * out + n0, _mm512_extractf32x4_ps(sums, 1));
        _mm_storeu_ps(y + (r0 + 2) * out + n0, _mm512_extractf32x4_ps(sums, 2));
        _mm_storeu_ps(y + (r0 + 3) * out + n0, _mm512_extractf32x4_ps(sums, 3));
        return;
    }
    if constexpr (NT == 8 && RT == 1) {  // one row's 8 outputs, in order
        const __m512 a[8] = {acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[0][4], acc[0][5], acc[0][6], acc[0][7]};
        __m256 row = gather_pairs(finish8(a));
        if (bias) row = _mm256_add_ps(row, _mm256_loadu_ps(bias + n0));
        _mm256_storeu_ps(y + r0 * out + n0, row);
        return;
    }
    if constexpr (NT == 4 && RT == 2) {  // a[4r + n] = acc[r][n]: row 0's 4 outputs, then row 1's
        const __m512 a[8] = {acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[1][0], acc[1][1], acc[1][2], acc[1][3]};
        __m256 rows = gather_pairs(finish8(a));
        if (bias) rows = _mm256_add_ps(rows, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(bias + n0)));
        _mm_storeu_ps(y + r0 * out + n0, _mm256_castps256_ps128(rows));
        _mm_storeu_ps(y + (r0 + 1) * out + n0, _mm256_extractf128_ps(rows, 1));
        return;
    }
#endif
    store_tile_each<NT, RT>(acc, r0, n0, bias, y, out);
}

// NT outputs (n0 ..) by RT rows (r0 ..): each weight block widened once for the RT rows.
template <Format F, int NT, int RT>
inline void tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                 int64_t n0, int64_t r0, const float* bias, float* y, int64_t out) {
    constexpr int64_t bb = block_bytes(F);
    const int64_t nb = in / QK;
    // the NT outputs' rows are contiguous: block b of the tile PREFETCH_ROWS on is NT * bb bytes in
    const uint8_t* ahead = w + (n0 + PREFETCH_ROWS) * row_bytes;
    const uint8_t* end = w + out * row_bytes;
    Vec acc[RT][NT];
    zero_tile<NT, RT>(acc);
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_span(ahead + b * NT * bb, NT * bb, end);
        Vec wlo[NT], whi[NT];
        for (int n = 0; n < NT; ++n) widen(F, w + (n0 + n) * row_bytes + b * bb, wlo[n], whi[n]);
        for (int r = 0; r < RT; ++r) {
            const float* xr = x + (r0 + r) * in + b * QK;
            const Vec xlo = load(xr), xhi = load(xr + 16);
            for (int n = 0; n < NT; ++n) acc[r][n] = fma(xhi, whi[n], fma(xlo, wlo[n], acc[r][n]));
        }
    }
    store_tile<NT, RT>(acc, r0, n0, bias, y, out);
}

// Whether this process runs on an Intel CPU (asked once); the kernel choices below go by it.
inline bool intel_cpu() {
    static const bool intel = [] {
        __builtin_cpu_init();
        return __builtin_cpu_is("intel") != 0;
    }();
    return intel;
}

// Whether one-row products take `one_row_tile`: on Intel CPUs with AVX-512. On a Zen 4, one-row
// products widened from scales converted ahead of each tile ran at 0.89x the speed of `tile`'s
// (docs/results/q4_kernel.md); on the AVX2 path `widen_scaled` is `widen`. Both give the same
// bits; -DDSPARK_ONE_ROW_SCALES_FIRST=0 or 1 fixes the choice at build time (the tests do).
inline bool one_row_scales_first() {
#if defined(DSPARK_ONE_ROW_SCALES_FIRST)
    return DSPARK_ONE_ROW_SCALES_FIRST;
#elif defined(__AVX512F__)
    return intel_cpu();
#else
    return false;
#endif
}

// Whether a strip chunk of more than 4 rows (STRIP_ROWS) widens its strip inside its first row tile
// (`widening_tile`) instead of in a pass of its own (`widen_strip`): on Intel CPUs with AVX-512.
// On a 2-core Xeon (amx_bf16), one thread, a step's products took 1.22x, 1.15x, 1.14x, 1.07x and
// 1.04x less time at 5, 6, 8, 16 and 64 rows (`bench/q4_kernel_versions.py`,
// docs/results/q4_kernel.md). Not measured on a Zen 4, where widening the next tile's strip
// inside the first pass ran at 0.95x; both give the same bits, and
// -DDSPARK_WIDEN_IN_FIRST_PASS=0 or 1 fixes the choice at build time (the tests do).
inline bool widen_in_first_pass() {
#if defined(DSPARK_WIDEN_IN_FIRST_PASS)
    return DSPARK_WIDEN_IN_FIRST_PASS;
#elif defined(__AVX512F__)
    return intel_cpu();
#else
    return false;
#endif
}

// One row by NT outputs, as `tile<F, NT, 1>`, with each chunk's scales converted first
// (`block_scales`, `widen_scaled`): the same values, so the same bits.
template <Format F, int NT>
inline void one_row_tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                         int64_t n0, const float* bias, float* y, int64_t out) {
    constexpr int64_t bb = block_bytes(F);
    const int64_t nb = in / QK;
    const uint8_t* ahead = w + (n0 + PREFETCH_ROWS) * row_bytes;
    const uint8_t* end = w + out * row_bytes;
    Vec acc[1][NT];
    zero_tile<NT, 1>(acc);
    float dm[NT][2 * SCALE_CHUNK];
    for (int64_t c0 = 0; c0 < nb; c0 += SCALE_CHUNK) {
        const int64_t c1 = std::min(nb, c0 + SCALE_CHUNK);
        for (int n = 0; n < NT; ++n) block_scales(w + (n0 + n) * row_bytes + c0 * bb, bb, c1 - c0, dm[n]);
        for (int64_t b = c0; b < c1; ++b) {
            prefetch_span(ahead + b * NT * bb, NT * bb, end);
            const Vec xlo = load(x + b * QK), xhi = load(x + b * QK + 16);
            for (int n = 0; n < NT; ++n) {
                Vec wlo, whi;
                widen_scaled(F, w + (n0 + n) * row_bytes + b * bb, dm[n] + 2 * (b - c0), wlo, whi);
                acc[0][n] = fma(xhi, whi, fma(xlo, wlo, acc[0][n]));
            }
        }
    }
    store_tile<NT, 1>(acc, 0, n0, bias, y, out);
}

// A few rows without the strip: NT outputs by RT rows, each output's block widened in registers and
// used at once for all RT rows (only one output's widened weights live at a time, beside the RT
// rows' inputs of the block, pinned, and the RT x NT accumulators). The same fused multiply-adds in
// the same order as `tile`: only the instruction schedule differs. With STORE, every widened block
// also goes into `strip` ([NT][in], as `widen_strip` writes it) for later rows to read.
template <Format F, int NT, int RT, bool STORE>
inline void direct_blocks(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                          int64_t n0, int64_t r0, int64_t out, Vec (&acc)[RT][NT], float* strip) {
    constexpr int64_t bb = block_bytes(F);
    const int64_t nb = in / QK;
    const uint8_t* ahead = w + (n0 + PREFETCH_ROWS) * row_bytes;
    const uint8_t* end = w + out * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_span(ahead + b * NT * bb, NT * bb, end);
        Vec xlo[RT], xhi[RT];
        for (int r = 0; r < RT; ++r) {
            const float* xr = x + (r0 + r) * in + b * QK;
            xlo[r] = load(xr);
            xhi[r] = load(xr + 16);
            pin(xlo[r]);
            pin(xhi[r]);
        }
        for (int n = 0; n < NT; ++n) {
            Vec wlo, whi;
            widen(F, w + (n0 + n) * row_bytes + b * bb, wlo, whi);
            if constexpr (STORE) {
                store(strip + n * in + b * QK, wlo);
                store(strip + n * in + b * QK + 16, whi);
            }
            for (int r = 0; r < RT; ++r) acc[r][n] = fma(xhi[r], whi, fma(xlo[r], wlo, acc[r][n]));
        }
    }
}

template <Format F, int NT, int RT>
inline void direct_tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                        int64_t n0, int64_t r0, const float* bias, float* y, int64_t out) {
    Vec acc[RT][NT];
    zero_tile<NT, RT>(acc);
    direct_blocks<F, NT, RT, false>(x, in, w, row_bytes, n0, r0, out, acc, nullptr);
    store_tile_each<NT, RT>(acc, r0, n0, bias, y, out);
}

#if defined(__AVX512F__)
// The first RT rows of a strip chunk as `direct_tile`, the strip widened as they go (`widen_in_first_pass`):
// the widening runs beside these rows' multiply-adds instead of in a pass of its own before them,
// and the later rows' strip tiles read it. The same widened values and multiply-adds in the same
// order: the same bits. Its lane sums by the shared tree (with `store_tile_each` a step's products
// took 1.07-1.11x longer at 8 and 16 rows on a Xeon).
template <Format F, int NT, int RT>
inline void widening_tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                          int64_t n0, int64_t r0, const float* bias, float* y, int64_t out, float* strip) {
    Vec acc[RT][NT];
    zero_tile<NT, RT>(acc);
    direct_blocks<F, NT, RT, true>(x, in, w, row_bytes, n0, r0, out, acc, strip);
    store_tile<NT, RT>(acc, r0, n0, bias, y, out);
}
#endif

// Outputs per tile (the strip: OUT_TILE x in float32, 24 KB at in = 1536, inside a 32 KB L1),
// and for several rows the register tile of STRIP_ROWS rows by STRIP_OUTS outputs (AVX-512: 16
// accumulators + 8 weights + 2 inputs of the 32 zmm; AVX2: 8 accumulators + 4 weights + 2 inputs
// of the 16 ymm, one half of the lanes at a time); remainder rows run as tiles of 2, then 1. N1
// outputs widened together for one row (AVX2: 2, whose 4 accumulators and widening temporaries fit the 16 ymm; at 4 GCC spills
// the accumulators to the stack every block, and a layer's one-row product took ~5% longer).
// Up to DIRECT_ROWS rows skip the strip (its stores and reloads cost more than a few rows' FMAs
// save): DIRECT_OUTS outputs' blocks are widened in registers and used for every row. AVX2: the
// one-row tile's N1 = 2 outputs over 2-4 rows (2 and 3 rows took 1.28x and 1.65x longer through
// the strip; 4 rows 1.06-1.29x, median 1.13x, on a Zen 3, though its 16 accumulators spill; 4 rows
// as two 2-row passes took 1.2x longer than that, and 5-8 rows as passes of up to 4 gained at most
// 1.06x, 0.96x at 8). AVX-512: `direct_tile`, 4 outputs one at a time over 2-4 rows (16 accumulators, 8
// inputs, 2 widened weights and the widening's temporaries in the 32 zmm); the products of a step
// took 1.37x, 1.55x and 1.2x longer through the strip at 2, 3 and 4 rows on a Zen 4, and 5-8 rows
// (two passes of `direct_tile`) were no faster than the strip.
#if defined(__AVX512F__)
constexpr int OUT_TILE = 4, STRIP_ROWS = 4, STRIP_OUTS = 4, N1 = 8, DIRECT_ROWS = 4, DIRECT_OUTS = 4;
#else
constexpr int OUT_TILE = 4, STRIP_ROWS = 4, STRIP_OUTS = 2, N1 = 2, DIRECT_ROWS = 4, DIRECT_OUTS = N1;
#endif

// AVX2: rows longer than SPAN_BLOCKS blocks run their strip passes a span of at most SPAN_BLOCKS
// blocks at a time (`strip_rows`), every (row, output) accumulator carried in memory between
// spans, so a span's inputs and weights stay in L1 across both halves of the lanes and the tile's
// row tiles. Over a whole 1536-input row a 4-row x 2-output pass reads 36 KB (inputs and strip),
// more than a 32 KB L1, once for each half of the lanes, and the down projection's 16-row product
// ran at 0.7 of the other products' rate on a Zen 3; a span's pass reads 18 KB. Rows of up to
// SPAN_BLOCKS blocks (576 inputs: 18) keep one pass with the accumulators in registers: with every
// product on spans a step's products ran at 0.88-1.03x the rate without, no gain for the carrying.
// AVX-512 and portable: no spans (SPAN_BLOCKS 0). The AVX-512 4 x 4 pass over 1536 inputs reads
// 48 KB, but with spans of 24 blocks a step's products ran at 0.89-1.0x and 0.97-1.03x the rate
// without, at 5-64 rows, in two runs on a Zen 4 (`bench/q4_kernel_versions.py`; one pass per tile
// there, no second half to re-read the row from L2).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t SPAN_BLOCKS = 24;
#else
constexpr int64_t SPAN_BLOCKS = 0;
#endif

// Several rows: the tile's weights widened once into `strip` ([outputs][in] float32, the same
// values `widen` gives), then NT outputs by RT rows read them from there: the same fused
// multiply-adds in the same order as `tile`, the widening paid once per ROW_CHUNK rows. Per block
// the NT outputs' weights and each row's inputs are loaded once into registers and `pin`ned
// there, so a 4 x 4 tile makes 16 loads for its 32 FMAs (GCC otherwise re-loads an operand for
// every FMA: 64 loads, and the tile runs at the load ports' rate, not the FMA units').
template <Format F>
inline void widen_strip(const uint8_t* w, int64_t row_bytes, int64_t out, int64_t n0, int nt, int64_t in, float* strip) {
    constexpr int64_t bb = block_bytes(F);
    const int64_t nb = in / QK;
    const uint8_t* ahead = w + (n0 + PREFETCH_ROWS) * row_bytes;
    const uint8_t* end = w + out * row_bytes;
    for (int n = 0; n < nt; ++n)
        for (int64_t b = 0; b < nb; ++b) {
            prefetch_span(ahead + (n * nb + b) * bb, bb, end);
            Vec lo, hi;
            widen(F, w + (n0 + n) * row_bytes + b * bb, lo, hi);
            store(strip + n * in + b * QK, lo);
            store(strip + n * in + b * QK + 16, hi);
        }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: a Vec is two ymm (lanes 0..7 and 8..15) and a 16-ymm file holds no tile of whole Vecs, so
// the tile runs the two halves one after the other: lanes 0..7 of every (row, output) pair over
// the blocks, then lanes 8..15. The halves never meet before `finish`, so each lane gets the same
// multiply-adds in the same order as `tile` (same bits); per half a 4-row x 2-output tile is 8
// accumulators, 4 weights and 2 inputs held in registers (`pin_half`): 12 loads per 16 FMAs.
inline void pin_half(__m256& v) { asm volatile("" : "+x"(v)); }

// Blocks b0 .. b1 of lanes 8g .. 8g + 7 of an RT-row x NT-output tile into its accumulators `a`.
template <int NT, int RT>
inline void strip_half(const float* x, int64_t in, const float* strip, int n_off, int64_t r0, int64_t b0, int64_t b1,
                       int g, __m256 (&a)[RT][NT]) {
    for (int64_t b = b0; b < b1; ++b) {
        __m256 wlo[NT], whi[NT];
        for (int n = 0; n < NT; ++n) {
            const float* wn = strip + (n_off + n) * in + b * QK + 8 * g;
            wlo[n] = _mm256_loadu_ps(wn);
            whi[n] = _mm256_loadu_ps(wn + 16);
            pin_half(wlo[n]);
            pin_half(whi[n]);
        }
        for (int r = 0; r < RT; ++r) {
            const float* xr = x + (r0 + r) * in + b * QK + 8 * g;
            __m256 xlo = _mm256_loadu_ps(xr), xhi = _mm256_loadu_ps(xr + 16);
            pin_half(xlo);
            pin_half(xhi);
            for (int n = 0; n < NT; ++n)
                a[r][n] = _mm256_fmadd_ps(xhi, whi[n], _mm256_fmadd_ps(xlo, wlo[n], a[r][n]));
        }
    }
}

// Blocks b0 .. b1 of an RT-row x NT-output strip tile (outputs n_off .. of the strip, rows r0 ..)
// into its accumulators: one half of the lanes after the other.
template <int NT, int RT>
inline void strip_blocks(const float* x, int64_t in, const float* strip, int n_off, int64_t r0, int64_t b0, int64_t b1,
                         Vec (&acc)[RT][NT]) {
    for (int g = 0; g < 2; ++g) {
        __m256 a[RT][NT];
        for (int r = 0; r < RT; ++r)
            for (int n = 0; n < NT; ++n) a[r][n] = g == 0 ? acc[r][n].a : acc[r][n].b;
        strip_half<NT, RT>(x, in, strip, n_off, r0, b0, b1, g, a);
        for (int r = 0; r < RT; ++r)
            for (int n = 0; n < NT; ++n) (g == 0 ? acc[r][n].a : acc[r][n].b) = a[r][n];
    }
}
#else
// Blocks b0 .. b1 of an RT-row x NT-output strip tile (outputs n_off .. of the strip, rows r0 ..)
// into its accumulators: per block the NT outputs' weights held in registers across the RT rows.
template <int NT, int RT>
inline void strip_blocks(const float* x, int64_t in, const float* strip, int n_off, int64_t r0, int64_t b0, int64_t b1,
                         Vec (&acc)[RT][NT]) {
    for (int64_t b = b0; b < b1; ++b) {
        Vec wlo[NT], whi[NT];
        for (int n = 0; n < NT; ++n) {
            const float* wn = strip + (n_off + n) * in + b * QK;
            wlo[n] = load(wn);
            whi[n] = load(wn + 16);
            pin(wlo[n]);
            pin(whi[n]);
        }
        for (int r = 0; r < RT; ++r) {
            const float* xr = x + (r0 + r) * in + b * QK;
            Vec xlo = load(xr), xhi = load(xr + 16);
            pin(xlo);
            pin(xhi);
            for (int n = 0; n < NT; ++n) acc[r][n] = fma(xhi, whi[n], fma(xlo, wlo[n], acc[r][n]));
        }
    }
}
#endif

// The whole tile over all blocks, accumulators in registers, results stored.
template <int NT, int RT>
inline void strip_tile(const float* x, int64_t in, const float* strip, int64_t n0, int n_off, int64_t r0,
                       const float* bias, float* y, int64_t out) {
    Vec acc[RT][NT];
    zero_tile<NT, RT>(acc);
    strip_blocks<NT, RT>(x, in, strip, n_off, r0, 0, in / QK, acc);
    store_tile<NT, RT>(acc, r0, n0 + n_off, bias, y, out);
}

template <int V>
using Const = std::integral_constant<int, V>;

// Rows rc .. rend of one output tile as register tiles: STRIP_ROWS rows x STRIP_OUTS outputs,
// then 2 rows, then one row by all OUT_TILE outputs; `tile_at(Const<NT>, Const<RT>, n_off, r0)`
// runs each.
template <class TileAt>
inline void row_tiles(int64_t rc, int64_t rend, TileAt&& tile_at) {
    int64_t r = rc;
    for (; r + STRIP_ROWS <= rend; r += STRIP_ROWS)
        for (int n = 0; n < OUT_TILE; n += STRIP_OUTS) tile_at(Const<STRIP_OUTS>{}, Const<STRIP_ROWS>{}, n, r);
    for (; r + 2 <= rend; r += 2)
        for (int n = 0; n < OUT_TILE; n += STRIP_OUTS) tile_at(Const<STRIP_OUTS>{}, Const<2>{}, n, r);
    for (; r < rend; ++r) tile_at(Const<OUT_TILE>{}, Const<1>{}, 0, r);
}

// The strip tiles of rows rc .. rend for one output tile (outputs n0 .. n0 + OUT_TILE, widened in
// `strip`): over all blocks at once, or (AVX2, long rows) SPAN_BLOCKS blocks at a time with each
// (row, output) pair's accumulator kept in `carried` between spans.
inline void strip_rows(const float* x, int64_t in, const float* strip, int64_t n0, int64_t rc, int64_t rend,
                       const float* bias, float* y, int64_t out) {
    const int64_t nb = in / QK;
    const int64_t spans = SPAN_BLOCKS > 0 ? (nb + SPAN_BLOCKS - 1) / SPAN_BLOCKS : 1;
    if (spans == 1) {
        row_tiles(rc, rend, [&](auto nt, auto rt, int n_off, int64_t r) {
            constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
            strip_tile<NT, RT>(x, in, strip, n0, n_off, r, bias, y, out);
        });
        return;
    }
    Vec carried[ROW_CHUNK * OUT_TILE];  // [row - rc][output - n0]
    auto carried_at = [&](int64_t r, int n) -> Vec& { return carried[(r - rc) * OUT_TILE + n]; };
    for (int64_t i = 0; i < (rend - rc) * OUT_TILE; ++i) carried[i] = zero();
    for (int64_t s = 0; s < spans; ++s) {
        const int64_t b0 = nb * s / spans, b1 = nb * (s + 1) / spans;
        row_tiles(rc, rend, [&](auto nt, auto rt, int n_off, int64_t r) {
            constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
            Vec acc[RT][NT];
            for (int i = 0; i < RT; ++i)
                for (int n = 0; n < NT; ++n) acc[i][n] = carried_at(r + i, n_off + n);
            strip_blocks<NT, RT>(x, in, strip, n_off, r, b0, b1, acc);
            for (int i = 0; i < RT; ++i)
                for (int n = 0; n < NT; ++n) carried_at(r + i, n_off + n) = acc[i][n];
        });
    }
    row_tiles(rc, rend, [&](auto nt, auto rt, int n_off, int64_t r) {
        constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
        Vec acc[RT][NT];
        for (int i = 0; i < RT; ++i)
            for (int n = 0; n < NT; ++n) acc[i][n] = carried_at(r + i, n_off + n);
        store_tile<NT, RT>(acc, r, n0 + n_off, bias, y, out);
    });
}


// RT rows (2 .. DIRECT_ROWS) by DIRECT_OUTS outputs from n0, weights widened in registers.
template <Format F, int RT>
inline void few_rows(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes, int64_t n0,
                     const float* bias, float* y, int64_t out) {
#if defined(__AVX512F__)
    direct_tile<F, DIRECT_OUTS, RT>(x, in, w, row_bytes, n0, 0, bias, y, out);
#else
    tile<F, DIRECT_OUTS, RT>(x, in, w, row_bytes, n0, 0, bias, y, out);
#endif
}

// y[rows, out] (+ bias) for one block format: the thread's output tiles, each row's outputs in
// the fixed order above.
template <Format F>
void products(const float* xp, int64_t rows, int64_t in, const uint8_t* wp, int64_t row_bytes, int64_t out,
              const float* bp, float* yp) {
    if (rows == 1) {  // one row: N1 outputs' blocks widened in registers, nothing stored
        const int64_t tiles = (out + N1 - 1) / N1;
        const bool scales_first = one_row_scales_first();
        at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t n0 = t * N1;
                if (n0 + N1 > out) {
                    for (int64_t n = n0; n < out; ++n) tile<F, 1, 1>(xp, in, wp, row_bytes, n, 0, bp, yp, out);
                } else if (scales_first) {
                    one_row_tile<F, N1>(xp, in, wp, row_bytes, n0, bp, yp, out);
                } else {
                    tile<F, N1, 1>(xp, in, wp, row_bytes, n0, 0, bp, yp, out);
                }
            }
        });
        return;
    }
    if (rows <= DIRECT_ROWS) {  // 2 .. DIRECT_ROWS rows: blocks widened in registers for all rows
        const int64_t tiles = (out + DIRECT_OUTS - 1) / DIRECT_OUTS;
        at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t n0 = t * DIRECT_OUTS;
                if (n0 + DIRECT_OUTS > out) {
                    for (int64_t n = n0; n < out; ++n)
                        for (int64_t r = 0; r < rows; ++r) tile<F, 1, 1>(xp, in, wp, row_bytes, n, r, bp, yp, out);
                } else if (rows == 2) {
                    few_rows<F, 2>(xp, in, wp, row_bytes, n0, bp, yp, out);
                } else if (rows == 3) {
                    few_rows<F, 3>(xp, in, wp, row_bytes, n0, bp, yp, out);
                } else {
                    few_rows<F, DIRECT_ROWS>(xp, in, wp, row_bytes, n0, bp, yp, out);
                }
            }
        });
        return;
    }
    const int64_t tiles = (out + OUT_TILE - 1) / OUT_TILE;
    [[maybe_unused]] const bool widen_first = widen_in_first_pass();
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> strip_buf(OUT_TILE * in);
        float* strip = strip_buf.data();
        for (int64_t rc = 0; rc < rows; rc += ROW_CHUNK) {
            const int64_t rend = std::min(rows, rc + ROW_CHUNK);
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t n0 = t * OUT_TILE;
                if (n0 + OUT_TILE > out) {  // a partial tile: one output at a time
                    for (int64_t n = n0; n < out; ++n)
                        for (int64_t r = rc; r < rend; ++r) tile<F, 1, 1>(xp, in, wp, row_bytes, n, r, bp, yp, out);
                    continue;
                }
#if defined(__AVX512F__)
                if (widen_first && rend - rc > STRIP_ROWS) {  // widened beside rows rc .. rc + 3
                    widening_tile<F, OUT_TILE, STRIP_ROWS>(xp, in, wp, row_bytes, n0, rc, bp, yp, out, strip);
                    strip_rows(xp, in, strip, n0, rc + STRIP_ROWS, rend, bp, yp, out);
                    continue;
                }
#endif
                widen_strip<F>(wp, row_bytes, out, n0, OUT_TILE, in, strip);
                strip_rows(xp, in, strip, n0, rc, rend, bp, yp, out);
            }
        }
    });
}

torch::Tensor block_linear(Format f, const torch::Tensor& x_in, const torch::Tensor& blocks,
                           const c10::optional<torch::Tensor>& bias_in) {
    TORCH_CHECK(x_in.device().is_cpu() && blocks.device().is_cpu(), "block_linear: CPU tensors only");
    TORCH_CHECK(x_in.scalar_type() == torch::kFloat32, "block_linear: x must be float32");
    TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2, "block_linear: blocks [out, bytes] uint8");
    TORCH_CHECK(x_in.dim() == 2, "block_linear: x [rows, in]");
    const torch::Tensor x = x_in.contiguous();
    const torch::Tensor w = blocks.contiguous();
    const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
    TORCH_CHECK(in % QK == 0, "block_linear: in_features must be a multiple of 32");
    const int64_t row_bytes = in / QK * block_bytes(f);
    TORCH_CHECK(w.size(1) == row_bytes, "block_linear: blocks have ", w.size(1), " bytes per output, expected ", row_bytes);
    torch::Tensor bias;
    if (bias_in.has_value() && bias_in->defined()) {
        bias = bias_in->contiguous();
        TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.numel() == out, "block_linear: bias [out] float32");
    }
    torch::Tensor y = torch::empty({rows, out}, x.options());
    if (rows == 0 || out == 0) return y;
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    if (f == Format::Q4_1) {
        products<Format::Q4_1>(xp, rows, in, wp, row_bytes, out, bp, yp);
    } else {
        products<Format::Q8_0>(xp, rows, in, wp, row_bytes, out, bp, yp);
    }
    return y;
}

torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& blocks, const c10::optional<torch::Tensor>& bias) {
    return block_linear(Format::Q4_1, x, blocks, bias);
}

torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& blocks, const c10::optional<torch::Tensor>& bias) {
    return block_linear(Format::Q8_0, x, blocks, bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("q4_1_linear", &q4_1_linear, "x[rows, in] @ W^T (+ b), W as GGUF Q4_1 blocks [out, in/32*20] uint8",
          py::arg("x"), py::arg("blocks"), py::arg("bias") = py::none());
    m.def("q8_0_linear", &q8_0_linear, "x[rows, in] @ W^T (+ b), W as GGUF Q8_0 blocks [out, in/32*34] uint8",
          py::arg("x"), py::arg("blocks"), py::arg("bias") = py::none());
    m.def("isa", &isa_name, "which path this build runs: avx512, avx2 or portable");
}
