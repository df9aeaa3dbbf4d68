/* Products of a few fp32 rows with bf16 or int8 weights, fp32 accumulation: y[r, n] = s[n] * sum_k x[r, k] * w[n, k].
 *
 * moectl.kernels.bf16_rows loads this file, compiled for the machine it runs on (-march=native),
 * and calls it for decoding on CPUs without AVX512-BF16, where PyTorch's bf16 products of a few
 * rows read the weights at a fraction of the memory bandwidth (see that module's docstring);
 * moectl.kernels.int8_rows calls its int8 twins (per-row scales s[n]), where PyTorch's
 * _weight_int8pack_mm read int8 weights slower than this reads bf16 ones (see that module).
 *
 * Each weight row is converted to fp32 in registers (a bf16 is the top half of an fp32, an int8 is
 * widened) and multiplied with every input row while it is in cache, so rows cost compute, not
 * bandwidth. A row's sum is accumulated in the same order whatever the number of rows, so a
 * request's result does not depend on the batch it runs in. Threads: OpenMP, which resolves to
 * PyTorch's own libgomp when PyTorch is loaded (one thread pool, no two runtimes spinning on the
 * same cores).
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#else
#define LANES 1
#endif

#define NB 4 /* weight rows per inner block */
#ifndef NB1
#if LANES == 16
#define NB1 8 /* weight rows per inner block for one input row: more loads in flight (2 threads, weights from
                 memory: 1-row [2048, 2048] 29.5-30.1 -> 31.8-32.1 GB/s, 8 experts 24.6 -> 25.8-26.2, the 50304-row
                 LM head 27.6-28.4 -> 29.5-30.9; 6 rows gained less, 12 and 16 no more) */
#else
#define NB1 NB /* AVX2's 16 registers hold no more accumulators */
#endif
#endif
#define NB_MAX (NB1 > NB ? NB1 : NB)
#if LANES == 16
#define RB 8 /* input rows per inner block: with AVX-512, 8 beat 4 at 5-48 rows (+12-18%), equal below */
#else
#define RB 4 /* AVX2's 16 registers: 8 rows lost to 4 (16.2 against 19.8 GB/s at 4 rows, measured) */
#endif
#define BLOCK 32 /* weight rows per work item */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 512 /* weights prefetched this far ahead in each row: +10-13% GB/s for bf16, one thread or two (measured) */
#endif

#ifndef SHORT_ROWS_AHEAD
#define SHORT_ROWS_AHEAD 1 /* 0: AHEAD_BYTES along the row whatever its length (before; benchmarks/row_prefetch.py) */
#endif
#ifndef FAR_TILES
#define FAR_TILES 4 /* short rows: tiles prefetched ahead into L2, beside the next tile into L1 (1 thread, weights
                       from memory, 1-row [8192, 256] 6.4 -> 19.9 GB/s, [256, 256] 5.7 -> 13.8; 2 threads 12.6 -> 32.2
                       and 9.7 -> 15.8; AMD EPYC Zen 4: without it the tile's 8 short streams kept few loads in flight) */
#endif

#define BF16 2 /* kind: the weights' bytes per element */
#define INT8 1

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

/* element k of a weight row, as fp32 */
static inline __attribute__((always_inline)) float weight(const void *w, int64_t k, int kind) {
    return kind == BF16 ? bf16_to_f32(((const uint16_t *)w)[k]) : (float)((const int8_t *)w)[k];
}

#if LANES == 16
static inline __attribute__((always_inline)) __m512 load(const void *w, int64_t k, int kind) {
    if (kind == BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + k))));
}
#elif LANES == 8
static inline __attribute__((always_inline)) __m256 load(const void *w, int64_t k, int kind) {
    if (kind == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)w + k))));
}
#endif

/* rb (<= RB) input rows x (stride ldx) against nb (<= NB) weight rows w (stride ldw elements, of
 * kind BF16 or INT8), length K, each output scaled by scale[n] (none: NULL). Inlined with constant
 * rb, nb and kind where it can be, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, int rb, const void *w, int64_t ldw, int nb, int64_t K,
                 float *y, int64_t ldy, const float *scale, int kind, int64_t ahead, int64_t far) {
    int64_t k = 0;
    float sums[RB][NB_MAX] = {{0}};
#if LANES == 16
    __m512 acc[RB][NB_MAX];
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) acc[r][n] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NB_MAX];
        for (int n = 0; n < nb; n++) {
            _mm_prefetch((const char *)w + (n * ldw + k) * kind + ahead, _MM_HINT_T0); /* never faults */
            if (far > ahead) _mm_prefetch((const char *)w + (n * ldw + k) * kind + far, _MM_HINT_T1); /* short rows */
            wv[n] = load((const char *)w + n * ldw * kind, k, kind);
        }
        for (int r = 0; r < rb; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
            for (int n = 0; n < nb; n++) acc[r][n] = _mm512_fmadd_ps(xv, wv[n], acc[r][n]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) sums[r][n] = _mm512_reduce_add_ps(acc[r][n]);
#elif LANES == 8
    __m256 acc[RB][NB_MAX];
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) acc[r][n] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NB_MAX];
        for (int n = 0; n < nb; n++) {
            _mm_prefetch((const char *)w + (n * ldw + k) * kind + ahead, _MM_HINT_T0);
            if (far > ahead) _mm_prefetch((const char *)w + (n * ldw + k) * kind + far, _MM_HINT_T1); /* short rows */
            wv[n] = load((const char *)w + n * ldw * kind, k, kind);
        }
        for (int r = 0; r < rb; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int n = 0; n < nb; n++) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][n]);
            float s = 0.0f;
            for (int i = 0; i < 8; i++) s += lanes[i];
            sums[r][n] = s;
        }
#endif
    for (; k < K; k++)
        for (int r = 0; r < rb; r++)
            for (int n = 0; n < nb; n++) sums[r][n] += x[r * ldx + k] * weight((const char *)w + n * ldw * kind, k, kind);
    for (int r = 0; r < rb; r++)
        for (int n = 0; n < nb; n++) y[r * ldy + n] = scale ? sums[r][n] * scale[n] : sums[r][n];
}

/* How far ahead of each load a tile prefetches, into L1 (ahead) and L2 (far): AHEAD_BYTES along the row
 * where rows are long (both), else the next tile's same place and FAR_TILES tiles on (a tile of short
 * rows is a few contiguous lines, which a prefetch AHEAD_BYTES along would find loaded by the tile itself) */
static inline int64_t ahead_bytes(int64_t row_bytes, int64_t tile_bytes, int far) {
    if (row_bytes >= 2 * AHEAD_BYTES || !SHORT_ROWS_AHEAD) return AHEAD_BYTES;
    return far ? FAR_TILES * tile_bytes : tile_bytes;
}

/* rows [r0, r1) of x against weight rows [n0, n1) of w (scale: per weight row, or NULL) */
static inline __attribute__((always_inline)) void block(const float *x, int64_t ldx, int64_t r0, int64_t r1, const void *w,
                  int64_t ldw, int64_t n0, int64_t n1, int64_t K, float *y, int64_t ldy, const float *scale, int kind) {
    int64_t ahead = ahead_bytes(K * kind, NB1 * ldw * kind, 0), far = ahead_bytes(K * kind, NB1 * ldw * kind, 1);
    if (r1 - r0 == 1) { /* one input row: NB1 weight rows at a time (same sums, in the same order) */
        for (int64_t n = n0; n < n1; n += NB1) {
            int nb = (int)(n1 - n < NB1 ? n1 - n : NB1);
            const void *wn = (const char *)w + n * ldw * kind;
            const float *sn = scale ? scale + n : 0;
            if (nb == NB1) tile(x + r0 * ldx, ldx, 1, wn, ldw, NB1, K, y + r0 * ldy + n, ldy, sn, kind, ahead, far);
            else tile(x + r0 * ldx, ldx, 1, wn, ldw, nb, K, y + r0 * ldy + n, ldy, sn, kind, ahead, far);
        }
        return;
    }
    ahead = ahead_bytes(K * kind, NB * ldw * kind, 0), far = ahead_bytes(K * kind, NB * ldw * kind, 1);
    for (int64_t n = n0; n < n1; n += NB) {
        int nb = (int)(n1 - n < NB ? n1 - n : NB);
        for (int64_t r = r0; r < r1; r += RB) {
            int rb = (int)(r1 - r < RB ? r1 - r : RB);
            const float *xr = x + r * ldx;
            const void *wn = (const char *)w + n * ldw * kind;
            const float *sn = scale ? scale + n : 0;
            float *yr = y + r * ldy + n;
            if (nb != NB) tile(xr, ldx, rb, wn, ldw, nb, K, yr, ldy, sn, kind, ahead, far);
            else if (rb == RB) tile(xr, ldx, RB, wn, ldw, NB, K, yr, ldy, sn, kind, ahead, far);
            else if (rb == 1) tile(xr, ldx, 1, wn, ldw, NB, K, yr, ldy, sn, kind, ahead, far);
            else if (rb == 2) tile(xr, ldx, 2, wn, ldw, NB, K, yr, ldy, sn, kind, ahead, far);
            else if (rb == 4) tile(xr, ldx, 4, wn, ldw, NB, K, yr, ldy, sn, kind, ahead, far);
            else tile(xr, ldx, rb, wn, ldw, NB, K, yr, ldy, sn, kind, ahead, far);
        }
    }
}

static inline __attribute__((always_inline)) void linear(const float *x, int64_t ldx, int64_t M, const void *w, int64_t ldw,
                                                        const float *scale, int64_t N, int64_t K, float *y, int64_t ldy,
                                                        int threads, int kind) {
    int64_t items = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        int64_t n0 = i * BLOCK, n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
        block(x, ldx, 0, M, w, ldw, n0, n1, K, y, ldy, scale, kind);
    }
}

/* Grouped: rows ends[e-1]..ends[e] of x (sorted by group) against w + e * stride_e elements ([N, K]
 * each; int8: scaled by scale + e * stride_s); y [rows, N]. Groups without rows cost nothing. group:
 * the caller's scratch of E entries (the groups that have rows), so nothing here allocates. */
static inline __attribute__((always_inline)) void grouped(const float *x, int64_t ldx, const int64_t *ends, int64_t E,
                                                         const void *w, int64_t stride_e, int64_t ldw, const float *scale,
                                                         int64_t stride_s, int64_t N, int64_t K, float *y, int64_t ldy,
                                                         int64_t *group, int threads, int kind) {
    int64_t per = (N + BLOCK - 1) / BLOCK, used = 0;
    for (int64_t e = 0; e < E; e++)
        if (ends[e] > (e ? ends[e - 1] : 0)) group[used++] = e;
    int64_t items = used * per;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        int64_t e = group[i / per], n0 = (i % per) * BLOCK, n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
        int64_t r0 = e ? ends[e - 1] : 0;
        block(x, ldx, r0, ends[e], (const char *)w + e * stride_e * kind, ldw, n0, n1, K, y, ldy,
              scale ? scale + e * stride_s : 0, kind);
    }
}

/* y [M, N] = x [M, K] (fp32, row stride ldx) times w [N, K]^T (bf16 bits, row stride ldw) */
void moectl_bf16_linear(const float *x, int64_t ldx, int64_t M, const uint16_t *w, int64_t ldw, int64_t N,
                        int64_t K, float *y, int64_t ldy, int threads) {
    linear(x, ldx, M, w, ldw, 0, N, K, y, ldy, threads, BF16);
}

void moectl_bf16_grouped(const float *x, int64_t ldx, const int64_t *ends, int64_t E, const uint16_t *w,
                         int64_t stride_e, int64_t ldw, int64_t N, int64_t K, float *y, int64_t ldy,
                         int64_t *group, int threads) {
    grouped(x, ldx, ends, E, w, stride_e, ldw, 0, 0, N, K, y, ldy, group, threads, BF16);
}

/* y [M, N] = x [M, K] times (w [N, K] int8 * scale [N])^T */
void moectl_int8_linear(const float *x, int64_t ldx, int64_t M, const int8_t *w, int64_t ldw, const float *scale,
                        int64_t N, int64_t K, float *y, int64_t ldy, int threads) {
    linear(x, ldx, M, w, ldw, scale, N, K, y, ldy, threads, INT8);
}

void moectl_int8_grouped(const float *x, int64_t ldx, const int64_t *ends, int64_t E, const int8_t *w,
                         int64_t stride_e, int64_t ldw, const float *scale, int64_t stride_s, int64_t N, int64_t K,
                         float *y, int64_t ldy, int64_t *group, int threads) {
    grouped(x, ldx, ends, E, w, stride_e, ldw, scale, stride_s, N, K, y, ldy, group, threads, INT8);
}
