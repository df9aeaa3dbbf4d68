/* int8 weights with a float32 scale per output row, dequantised to bf16: out[n, k] = bf16(q[n, k] * s[n]).
 *
 * moectl.kernels.unpack loads this file (compiled for the machine it runs on, -march=native) to
 * multiply many rows with an int8 weight of moectl.offload.int8: dequantised once, the weight goes
 * through PyTorch's bf16 product (AMX or AVX-512), whose time barely grows with the rows. The
 * product q s is taken in fp32 and rounded to bf16 to nearest even: int8.dequantize_rows's values.
 * Threads: OpenMP over output rows.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (no NaNs here) */
    union { uint32_t u; float f; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
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
            __m512i u = _mm512_castps_si512(v);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            _mm256_storeu_si256((__m256i *)(o + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
        }
#endif
        for (; k < K; k++) o[k] = f32_to_bf16((float)row[k] * s);
    }
}
