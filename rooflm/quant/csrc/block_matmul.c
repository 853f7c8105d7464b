/* y = x @ W.T for GGUF block-quantized W, with x quantized to int8 per block of 32 (as
 * llama.cpp's Q8 activations, plus a second int8 level for the remainder): integer dot
 * products of 32 codes at a time (AVX2 maddubs), one float scale per block pair. Built at first use by rooflm/quant/native.py.
 *
 * Layouts (rooflm/quant/native.py packs them):
 *   4-bit W: codes [N, K/32, 16] bytes, byte j = element j (low nibble) | element j+16 (high);
 *            scale, offset [N, K/32] fp16 (the file's own): value = scale * code + offset
 *            (Q4_0: offset = -8 scale)
 *   8-bit W: codes [N, K] int8, scale [N, K/32] fp16 (Q8_0)
 * The bytes per weight are the file's: 20/32 for Q4_0/Q4_1, 34/32 for Q8_0.
 *   x: [M, K] float32, contiguous; y: [M, N] float32.
 * Activations: two int8 levels a block (quantize_x below).
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

/* Per block of 32, x ~ d1 q1 + d2 q2: q1 = round(x / d1) with d1 = max|x| / 127, and q2 the
 * same for the remainder x - d1 q1 (|remainder| <= d1 / 2, so d2 ~ d1 / 254): about 15 bits a
 * value. One level alone (llama.cpp's Q8 activations) flipped SmolLM2-135M's greedy answer to
 * "What is the capital of France?"; two keep it, for one more integer dot product a block.
 * sum_q_d = d1 sum(q1) + d2 sum(q2), for the offsets of Q4_1. */
static void quantize_level(const float *x, int8_t *q, float *d, int *sum) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d = amax / 127.0f;
    *sum = 0;
    for (int j = 0; j < QK; j++) {
        int v = (int)nearbyintf(x[j] * inv);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[j] = (int8_t)v;
        *sum += v;
    }
}

typedef struct {
    int8_t *q1, *q2;  /* [M, K] */
    float *d1, *d2, *sum_q_d;  /* [M, K / 32] */
} Activations;

static void free_activations(Activations *a) {
    free(a->q1); free(a->q2); free(a->d1); free(a->d2); free(a->sum_q_d);
}

static int quantize_x(const float *x, int64_t M, int64_t K, Activations *a) {
    int64_t blocks = M * (K / QK);
    a->q1 = (int8_t *)malloc((size_t)(M * K));
    a->q2 = (int8_t *)malloc((size_t)(M * K));
    a->d1 = (float *)malloc(sizeof(float) * (size_t)blocks);
    a->d2 = (float *)malloc(sizeof(float) * (size_t)blocks);
    a->sum_q_d = (float *)malloc(sizeof(float) * (size_t)blocks);
    if (!a->q1 || !a->q2 || !a->d1 || !a->d2 || !a->sum_q_d) {
        free_activations(a);
        return -1;
    }
    for (int64_t i = 0; i < blocks; i++) {
        float rest[QK];
        int s1, s2;
        quantize_level(x + i * QK, a->q1 + i * QK, &a->d1[i], &s1);
        for (int j = 0; j < QK; j++) rest[j] = x[i * QK + j] - a->d1[i] * (float)a->q1[i * QK + j];
        quantize_level(rest, a->q2 + i * QK, &a->d2[i], &s2);
        a->sum_q_d[i] = a->d1[i] * (float)s1 + a->d2[i] * (float)s2;
    }
    return 0;
}

/* Integer dot of 32 unsigned 4-bit codes (or |w| of signed codes) with 32 int8 values, as 8 floats. */
static inline __m256 dot_u8(__m256i w, __m256i x, __m256i ones) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}

int rl_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
                 const uint16_t *offset, int64_t N, float *y, int threads) {
    Activations a;
    if (quantize_x(x, M, K, &a)) return -1;
    const int64_t nb = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = codes + n * nb * 16;
        const uint16_t *dn = scale + n * nb, *mn = offset + n * nb;
        for (int64_t t = 0; t < M; t++) {
            const int8_t *q1 = a.q1 + t * K, *q2 = a.q2 + t * K;
            const float *d1 = a.d1 + t * nb, *d2 = a.d2 + t * nb, *sq = a.sum_q_d + t * nb;
            __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
            float offsets = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                __m128i packed = _mm_loadu_si128((const __m128i *)(wn + b * 16));
                __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
                __m256 p1 = dot_u8(w, _mm256_loadu_si256((const __m256i *)(q1 + b * QK)), ones);
                __m256 p2 = dot_u8(w, _mm256_loadu_si256((const __m256i *)(q2 + b * QK)), ones);
                float db = _cvtsh_ss(dn[b]);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(db * d1[b]), p1, acc1);
                acc2 = _mm256_fmadd_ps(_mm256_set1_ps(db * d2[b]), p2, acc2);
                offsets += _cvtsh_ss(mn[b]) * sq[b];
            }
            y[t * N + n] = hsum(_mm256_add_ps(acc1, acc2)) + offsets;
        }
    }
    free_activations(&a);
    return 0;
}

int rl_q8_linear(const float *x, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scale,
                 int64_t N, float *y, int threads) {
    Activations a;
    if (quantize_x(x, M, K, &a)) return -1;
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = codes + n * K;
        const uint16_t *dn = scale + n * nb;
        for (int64_t t = 0; t < M; t++) {
            const int8_t *q1 = a.q1 + t * K, *q2 = a.q2 + t * K;
            const float *d1 = a.d1 + t * nb, *d2 = a.d2 + t * nb;
            __m256 acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(wn + b * QK));
                /* maddubs takes unsigned x signed: |w| times x with w's sign moved onto x. */
                __m256i aw = _mm256_sign_epi8(w, w);
                __m256 p1 = dot_u8(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q1 + b * QK)), w), ones);
                __m256 p2 = dot_u8(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q2 + b * QK)), w), ones);
                float db = _cvtsh_ss(dn[b]);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(db * d1[b]), p1, acc1);
                acc2 = _mm256_fmadd_ps(_mm256_set1_ps(db * d2[b]), p2, acc2);
            }
            y[t * N + n] = hsum(_mm256_add_ps(acc1, acc2));
        }
    }
    free_activations(&a);
    return 0;
}
