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
