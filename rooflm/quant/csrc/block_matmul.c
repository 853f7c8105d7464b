/* y = x @ W.T for GGUF block-quantized W, with x quantized to int8 per block of 32 (as
 * llama.cpp's Q8 activations): integer dot products of 32 codes at a time (AVX2 maddubs),
 * one float scale per block pair. Built at first use by rooflm/quant/native.py.
 *
 * Layouts (rooflm/quant/native.py packs them):
 *   4-bit W: codes [N, K/32, 16] bytes, byte j = element j (low nibble) | element j+16 (high);
 *            scale, offset [N, K/32] float: value = scale * code + offset (Q4_0: offset = -8 scale)
 *   8-bit W: codes [N, K] int8, scale [N, K/32] float (Q8_0)
 *   x: [M, K] float32, contiguous; y: [M, N] float32.
 * Each output is one row's dot product with one token, in the same order for any M: the
 * result of a token does not depend on the batch it is in.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Per block of 32: d = max|x| / 127, q = round(x / d); sum_q_d = d * sum(q) (for offsets). */
static void quantize_rows(const float *x, int64_t blocks, int8_t *q, float *d, float *sum_q_d) {
    for (int64_t i = 0; i < blocks; i++) {
        const float *xb = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        float di = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * inv);
            q[i * QK + j] = (int8_t)v;
            sum += v;
        }
        d[i] = di;
        sum_q_d[i] = di * (float)sum;
    }
}

static int quantize_x(const float *x, int64_t M, int64_t K, int8_t **q, float **d, float **s) {
    int64_t blocks = M * (K / QK);
    *q = (int8_t *)malloc((size_t)(M * K));
    *d = (float *)malloc(sizeof(float) * (size_t)blocks);
    *s = (float *)malloc(sizeof(float) * (size_t)blocks);
    if (!*q || !*d || !*s) {
        free(*q); free(*d); free(*s);
        return -1;
    }
    quantize_rows(x, blocks, *q, *d, *s);
    return 0;
}

int rl_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                 const float *offset, int64_t N, float *y, int threads) {
    int8_t *q; float *dx, *sx;
    if (quantize_x(x, M, K, &q, &dx, &sx)) return -1;
    const int64_t nb = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = codes + n * nb * 16;
        const float *dn = scale + n * nb, *mn = offset + n * nb;
        for (int64_t t = 0; t < M; t++) {
            const int8_t *qt = q + t * K;
            const float *dxt = dx + t * nb, *sxt = sx + t * nb;
            /* Two blocks an iteration, two accumulators: the FMA chains overlap. */
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float off0 = 0.0f, off1 = 0.0f;
            int64_t b = 0;
            for (; b + 1 < nb; b += 2) {
                __m256i p01 = _mm256_loadu_si256((const __m256i *)(wn + b * 16));
                __m256i lo = _mm256_and_si256(p01, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p01, 4), low);
                /* block b: lo[0:16] | hi[0:16]; block b + 1: lo[16:32] | hi[16:32] */
                __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(qt + b * QK));
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(qt + (b + 1) * QK));
                __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones);
                __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dn[b] * dxt[b]), _mm256_cvtepi32_ps(d0), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dn[b + 1] * dxt[b + 1]), _mm256_cvtepi32_ps(d1), acc1);
                off0 += mn[b] * sxt[b];
                off1 += mn[b + 1] * sxt[b + 1];
            }
            for (; b < nb; b++) {
                __m128i packed = _mm_loadu_si128((const __m128i *)(wn + b * 16));
                __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                __m256i xq = _mm256_loadu_si256((const __m256i *)(qt + b * QK));
                __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dn[b] * dxt[b]), _mm256_cvtepi32_ps(dot), acc0);
                off0 += mn[b] * sxt[b];
            }
            __m256 acc = _mm256_add_ps(acc0, acc1);
            float offsets = off0 + off1;
            y[t * N + n] = hsum(acc) + offsets;
        }
    }
    free(q); free(dx); free(sx);
    return 0;
}

int rl_q8_linear(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scale,
                 int64_t N, float *y, int threads) {
    int8_t *q; float *dx, *sx;
    if (quantize_x(x, M, K, &q, &dx, &sx)) return -1;
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = codes + n * K;
        const float *dn = scale + n * nb;
        for (int64_t t = 0; t < M; t++) {
            const int8_t *qt = q + t * K;
            const float *dxt = dx + t * nb;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wn + b * QK));
                __m256i xq = _mm256_loadu_si256((const __m256i *)(qt + b * QK));
                /* maddubs takes unsigned x signed: |w| times x with w's sign moved onto x. */
                __m256i dot = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w)), ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dn[b] * dxt[b]), _mm256_cvtepi32_ps(dot), acc);
            }
            y[t * N + n] = hsum(acc);
        }
    }
    free(q); free(dx); free(sx);
    return 0;
}
