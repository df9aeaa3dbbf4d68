/* Quantized weights dequantised to bf16, for products of many rows: int4 (PyTorch's CPU packing) and int8.
 *
 * moectl.kernels.unpack loads this file (compiled for the machine it runs on, -march=native): past a
 * few rows a weight dequantised once goes through PyTorch's bf16 product (AMX or AVX-512), whose time
 * barely grows with the rows, where the quantized kernels unpack the codes again for every row. Both
 * loops compute in fp32 and round to bf16 to nearest even (one helper, scalar and AVX-512), so their
 * values are the tensor code's bit for bit (int4_groups.dequantize, int8.dequantize_rows).
 *
 * moectl_int4_unpack, for moectl.quant.int4_groups: the packing (aten._convert_weight_to_int4pack_for_cpu,
 * AVX-512 layout) holds each block of 64 output rows as K x 32 bytes, byte (k, j) with row j's code
 * in its low nibble and row 32 + j's in its high one; a scale s and a zero z per group of g inputs
 * and output row (bf16, [K/g, N, 2]); w = (q - 8) s + z, computed as q s plus (z - 8 s). Writing w
 * transposed, out[k, n], keeps both sides sequential: for each k, a block's 64 codes give 64
 * consecutive outputs. Threads: OpenMP over blocks of 64 output rows.
 *
 * moectl_int8_unpack, for moectl.offload.int8: out[n, k] = bf16(q[n, k] * s[n]), a float32 scale per
 * output row. Threads: OpenMP over output rows.
 *
 * moectl_int4_row (moectl.kernels.int4_row), one row times an int4 weight in the same packing, the
 * decoding step's product: a group's share of an output is s * sum_k x_k q_k + (z - 8 s) * sum_k x_k,
 * so the codes are widened to fp32 and multiplied with the broadcast x_k, 64 outputs at a time, each
 * code read once, the blocks' bytes in order (prefetched ahead, the next group's scales too), the
 * scales applied once per group. Sums in fp32 in a fixed order (k within a group, then groups), rounded
 * once to bf16 where the row is bf16. Threads: OpenMP over blocks of 64 output rows. A bf16 row, on a
 * CPU with AVX512-BF16 and VBMI, takes bf16 dot products instead (row_block_dp: the codes as the bf16
 * numbers 128 + q, vdpbf16ps against the row's bf16 pairs), 1.3-1.5x the fp32 widening's speed on an
 * AMD EPYC (benchmarks/int4_dp.py); -DNO_DP_BF16 builds the widening alone.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define BLOCK 64

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (no NaNs here) */
    union { uint32_t u; float f; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
static inline __m256i round_bf16(__m512 v) { /* 16 fp32 -> 16 bf16, nearest even */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
#endif

/* out [K, N] bf16 (row stride ldo) = the weight of packed [N, K/2] (N a multiple of 64) and sz */
void moectl_int4_unpack(const uint8_t *packed, const uint16_t *sz, int64_t N, int64_t K, int64_t g, uint16_t *out,
                        int64_t ldo, int threads) {
    int64_t blocks = N / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = packed + b * BLOCK * (K / 2);
        int64_t n0 = b * BLOCK;
        for (int64_t gi = 0; gi < K / g; gi++) {
            float s[BLOCK], c[BLOCK];
            for (int n = 0; n < BLOCK; n++) {
                const uint16_t *e = sz + (gi * N + n0 + n) * 2;
                s[n] = bf16_to_f32(e[0]);
                c[n] = bf16_to_f32(e[1]) - 8.0f * s[n];
            }
#if defined(__AVX512F__)
            __m512 sv[4], cv[4];
            for (int i = 0; i < 4; i++) {
                sv[i] = _mm512_loadu_ps(s + 16 * i);
                cv[i] = _mm512_loadu_ps(c + 16 * i);
            }
            const __m256i low = _mm256_set1_epi8(15);
            for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + k * 32));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                    _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
                uint16_t *o = out + k * ldo + n0;
                for (int i = 0; i < 4; i++) {
                    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[i]));
                    _mm256_storeu_si256((__m256i *)(o + 16 * i), round_bf16(_mm512_add_ps(_mm512_mul_ps(q, sv[i]), cv[i])));
                }
            }
#else
            for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
                const uint8_t *v = p + k * 32;
                uint16_t *o = out + k * ldo + n0;
                for (int j = 0; j < 32; j++) {
                    o[j] = f32_to_bf16((float)(v[j] & 15) * s[j] + c[j]);
                    o[32 + j] = f32_to_bf16((float)(v[j] >> 4) * s[32 + j] + c[32 + j]);
                }
            }
#endif
        }
    }
}

/* out [N, K] bf16 (row stride ldo) = q [N, K] int8 (row stride ldq) times scale [N] per row */
void moectl_int8_unpack(const int8_t *q, int64_t ldq, const float *scale, int64_t N, int64_t K, uint16_t *out,
                        int64_t ldo, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = q + n * ldq;
        uint16_t *o = out + n * ldo;
        float s = scale[n];
        int64_t k = 0;
#if defined(__AVX512F__)
        __m512 sv = _mm512_set1_ps(s);
        for (; k + 16 <= K; k += 16) {
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k)))), sv);
            _mm256_storeu_si256((__m256i *)(o + k), round_bf16(v));
        }
#endif
        for (; k < K; k++) o[k] = f32_to_bf16((float)row[k] * s);
    }
}

#ifndef ROW_AHEAD_BYTES
#define ROW_AHEAD_BYTES 2048 /* codes prefetched this far ahead: from memory, 2 threads, 512 B read 14.7 GB/s, 1 KB 16.7,
                            2 KB 17.6-17.8, 3-8 KB 17.9 (PyTorch's kernel 15.5) */
#endif

/* One block of 64 outputs: y[n0 .. n0 + 64) = x [K] (fp32) times the block's codes p (K x 32 bytes)
 * and the scales sz [K/g, N, 2]; y bf16 where bf16 is set, else fp32. */
static inline void row_block(const float *x, const uint8_t *p, const uint16_t *sz, int64_t N, int64_t K, int64_t g,
                             int64_t n0, void *yv, int bf16) {
    int64_t groups = K / g;
#if defined(__AVX512F__)
    __m512 out[4];
    for (int i = 0; i < 4; i++) out[i] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t gi = 0; gi < groups; gi++) {
        if (gi + 1 < groups) /* the next group's 64 (s, z) pairs, N * 4 bytes away: fetched while this one runs */
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(sz + ((gi + 1) * N + n0 + 16 * i) * 2), _MM_HINT_T0);
        __m512 acc[4];
        for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
        float xsum = 0.0f;
        for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
            _mm_prefetch((const char *)(p + k * 32) + ROW_AHEAD_BYTES, _MM_HINT_T0); /* never faults */
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + k * 32));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            __m512 xk = _mm512_set1_ps(x[k]);
            xsum += x[k];
            acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))), xk, acc[0]);
            acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))), xk, acc[1]);
            acc[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))), xk, acc[2]);
            acc[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))), xk, acc[3]);
        }
        const __m512 xs = _mm512_set1_ps(xsum), eight = _mm512_set1_ps(8.0f);
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int i = 0; i < 4; i++) { /* rows n0 + 16 i .. + 16: 16 (s, z) bf16 pairs, 64 bytes */
            __m512i pairs = _mm512_loadu_si512((const void *)(sz + (gi * N + n0 + 16 * i) * 2));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
            __m512 c = _mm512_fnmadd_ps(eight, s, z); /* z - 8 s */
            out[i] = _mm512_fmadd_ps(s, acc[i], out[i]);
            out[i] = _mm512_fmadd_ps(c, xs, out[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        if (bf16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)yv + n0 + 16 * i), round_bf16(out[i]));
        } else {
            _mm512_storeu_ps((float *)yv + n0 + 16 * i, out[i]);
        }
    }
#else
    float out[BLOCK] = {0};
    for (int64_t gi = 0; gi < groups; gi++) {
        float acc[BLOCK] = {0}, xsum = 0.0f;
        for (int64_t k = gi * g; k < (gi + 1) * g; k++) {
            const uint8_t *v = p + k * 32;
            xsum += x[k];
            for (int j = 0; j < 32; j++) {
                acc[j] += (float)(v[j] & 15) * x[k];
                acc[32 + j] += (float)(v[j] >> 4) * x[k];
            }
        }
        for (int n = 0; n < BLOCK; n++) {
            const uint16_t *e = sz + (gi * N + n0 + n) * 2;
            float s = bf16_to_f32(e[0]), z = bf16_to_f32(e[1]);
            out[n] += s * acc[n] + (z - 8.0f * s) * xsum;
        }
    }
    for (int n = 0; n < BLOCK; n++) {
        if (bf16) ((uint16_t *)yv)[n0 + n] = f32_to_bf16(out[n]);
        else ((float *)yv)[n0 + n] = out[n];
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && !defined(NO_DP_BF16)
#define DP_BF16 1
/* Byte indices for _mm512_permutex2var_epi8 over (codes, 0x43 bytes): 32-bit lane m of the result is
 * [q(k, m), 0x43, q(k + 1, m), 0x43] for outputs m (IDX_LOW) or 16 + m (IDX_HIGH) of a half-block,
 * i.e. the bf16 pair (128 + q(k), 128 + q(k + 1)): 0x4300 | q is bf16's exact 128 + q for q < 16. */
static const uint8_t IDX_LOW[64] = {
#define L(m) m, 0x40, 32 + m, 0x40
    L(0), L(1), L(2), L(3), L(4), L(5), L(6), L(7), L(8), L(9), L(10), L(11), L(12), L(13), L(14), L(15)};
static const uint8_t IDX_HIGH[64] = {
    L(16), L(17), L(18), L(19), L(20), L(21), L(22), L(23), L(24), L(25), L(26), L(27), L(28), L(29), L(30), L(31)};
#undef L

/* row_block for a bf16 row by AVX512-BF16 dot products: each pair of inputs (k, k + 1) is one 64-byte
 * load of both inputs' codes, the codes turned into bf16 (128 + q) pairs by byte permutes and summed
 * with the bf16 pair (x_k, x_k+1) by vdpbf16ps (products exact in fp32, sums in fp32): a group's
 * sum of x (128 + q) is sum x q + 128 sum x, so its share is s * acc + (z - 136 s) * sum x.
 * xsum: each group's sum of x (fp32). ~12 instructions per 64 bytes of codes, where row_block's
 * widening to fp32 takes ~34: the loop is bound by arithmetic there on CPUs that split 512-bit work. */
static inline void row_block_dp(const uint16_t *xb, const float *xsum, const uint8_t *p, const uint16_t *sz,
                                int64_t N, int64_t K, int64_t g, int64_t n0, uint16_t *y) {
    int64_t groups = K / g;
    __m512 out[4];
    for (int i = 0; i < 4; i++) out[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15), c43 = _mm512_set1_epi8(0x43);
    const __m512i idx_low = _mm512_loadu_si512((const void *)IDX_LOW), idx_high = _mm512_loadu_si512((const void *)IDX_HIGH);
    for (int64_t gi = 0; gi < groups; gi++) {
        if (gi + 1 < groups)
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(sz + ((gi + 1) * N + n0 + 16 * i) * 2), _MM_HINT_T0);
        __m512 acc[4];
        for (int i = 0; i < 4; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = gi * g; k < (gi + 1) * g; k += 2) {
            _mm_prefetch((const char *)(p + k * 32) + ROW_AHEAD_BYTES, _MM_HINT_T0); /* never faults */
            __m512i v = _mm512_loadu_si512((const void *)(p + k * 32)); /* inputs k and k + 1 */
            __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            uint32_t pair;
            __builtin_memcpy(&pair, xb + k, 4);
            __m512bh xk = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_permutex2var_epi8(lo, idx_low, c43), xk);
            acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_permutex2var_epi8(lo, idx_high, c43), xk);
            acc[2] = _mm512_dpbf16_ps(acc[2], (__m512bh)_mm512_permutex2var_epi8(hi, idx_low, c43), xk);
            acc[3] = _mm512_dpbf16_ps(acc[3], (__m512bh)_mm512_permutex2var_epi8(hi, idx_high, c43), xk);
        }
        const __m512 xs = _mm512_set1_ps(xsum[gi]), offset = _mm512_set1_ps(136.0f);
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
        for (int i = 0; i < 4; i++) {
            __m512i pairs = _mm512_loadu_si512((const void *)(sz + (gi * N + n0 + 16 * i) * 2));
            __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
            out[i] = _mm512_fmadd_ps(s, acc[i], out[i]);
            out[i] = _mm512_fmadd_ps(_mm512_fnmadd_ps(offset, s, z), xs, out[i]); /* (z - 136 s) sum x */
        }
    }
    for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(y + n0 + 16 * i), round_bf16(out[i]));
}

/* each group's sum of the bf16 row x [K], in fp32, in order */
static inline void group_sums(const uint16_t *x, int64_t K, int64_t g, float *sums) {
    for (int64_t gi = 0; gi < K / g; gi++) {
        float t = 0.0f;
        for (int64_t k = gi * g; k < (gi + 1) * g; k++) t += bf16_to_f32(x[k]);
        sums[gi] = t;
    }
}
#endif

/* x [K] in fp32 (bf16 or fp32 input) into buf */
static inline void widen_row(const void *xv, int64_t K, int bf16, float *buf) {
    for (int64_t k = 0; k < K; k++) buf[k] = bf16 ? bf16_to_f32(((const uint16_t *)xv)[k]) : ((const float *)xv)[k];
}

/* y [N] = x [K] times the weight of packed [N, K/2] (N a multiple of 64) and sz; x and y bf16 where
 * bf16 is set (the sums still in fp32, rounded once to nearest even), else fp32. */
void moectl_int4_row(const void *xv, const uint8_t *packed, const uint16_t *sz, int64_t N, int64_t K, int64_t g,
                     void *yv, int bf16, int threads) {
#ifdef DP_BF16
    if (bf16) { /* bf16 pairs straight from the row, each group's sum of x once */
        float sums[K / g];
        group_sums((const uint16_t *)xv, K, g, sums);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t b = 0; b < N / BLOCK; b++)
            row_block_dp((const uint16_t *)xv, sums, packed + b * BLOCK * (K / 2), sz, N, K, g, b * BLOCK, (uint16_t *)yv);
        return;
    }
#endif
    float x[K]; /* x in fp32, once (K is a few thousand: on the stack) */
    widen_row(xv, K, bf16, x);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < N / BLOCK; b++) row_block(x, packed + b * BLOCK * (K / 2), sz, N, K, g, b * BLOCK, yv, bf16);
}

/* Rows of x [S, K] (row stride ldx) sorted by expert, ends[e] each expert's end row, times expert e's
 * weight (packed + e * stride_p bytes, sz + e * stride_s elements, [N, K] each): y [S, N] (row stride
 * ldy), each row as moectl_int4_row computes it (a decoding step's experts: a row or two each, one
 * call for all of them). xf: the caller's scratch of S * K floats. */
void moectl_int4_grouped_rows(const void *xv, int64_t ldx, const int64_t *ends, int64_t E, const uint8_t *packed,
                              int64_t stride_p, const uint16_t *sz, int64_t stride_s, int64_t N, int64_t K, int64_t g,
                              void *yv, int64_t ldy, int bf16, float *xf, int threads) {
    int64_t S = E ? ends[E - 1] : 0, blocks = N / BLOCK, es = bf16 ? 2 : 4;
#ifdef DP_BF16
    if (bf16) { /* as moectl_int4_row's bf16 path: xf holds each row's group sums */
        for (int64_t r = 0; r < S; r++) group_sums((const uint16_t *)xv + r * ldx, K, g, xf + r * (K / g));
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t i = 0; i < S * blocks; i++) {
            int64_t r = i / blocks, b = i % blocks, e = 0;
            while (ends[e] <= r) e++;
            row_block_dp((const uint16_t *)xv + r * ldx, xf + r * (K / g), packed + e * stride_p + b * BLOCK * (K / 2),
                         sz + e * stride_s, N, K, g, b * BLOCK, (uint16_t *)yv + r * ldy);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < S; r++) widen_row((const char *)xv + r * ldx * es, K, bf16, xf + r * K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < S * blocks; i++) {
        int64_t r = i / blocks, b = i % blocks, e = 0;
        while (ends[e] <= r) e++; /* the expert of row r (E is small) */
        row_block(xf + r * K, packed + e * stride_p + b * BLOCK * (K / 2), sz + e * stride_s, N, K, g, b * BLOCK,
                  (char *)yv + r * ldy * es, bf16);
    }
}
