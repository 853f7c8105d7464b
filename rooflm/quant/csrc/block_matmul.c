/* y = x @ W.T for GGUF block-quantized W, with x quantized to int8 per block of 32 (as
 * llama.cpp's Q8 activations, plus a second int8 level for the remainder): integer dot
 * products of 32 codes at a time (AVX2 maddubs), one float scale per block pair. Built at
 * first use by rooflm/quant/native.py, together with decode_layer.c (the whole-layer decoder),
 * which calls the same functions through block_matmul.h.
 *
 * Layouts (rooflm/quant/native.py packs them):
 *   4-bit W: codes [N, K/32, 16] bytes, byte j = element j (low nibble) | element j+16 (high);
 *            scale, offset [N, K/32] fp16 (the file's own): value = scale * code + offset
 *            (Q4_0: offset = -8 scale)
 *   8-bit W: codes [N, K] int8, scale [N, K/32] fp16 (Q8_0)
 * The bytes per weight are the file's: 20/32 for Q4_0/Q4_1, 34/32 for Q8_0.
 *   x: [M, K] float32, contiguous; y: [M, N] float32.
 * Activations: two int8 levels a block (quantize_block below).
 *
 * Work: 2 M N K integer multiply-adds (two levels); bytes: the weight once, whatever M. Each
 * thread takes whole rows of W; a row (K = 576: 18 blocks, 288 + 72 bytes) stays in L1 while
 * it meets every token. For M >= 4 tokens go 4 at a time (a prefill chunk): each weight block
 * is loaded and unpacked once for 4 tokens. Each output is still one row's dot product with
 * one token in the same order of operations as for M = 1, so the result of a token does not
 * depend on the batch it is in.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "block_matmul.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Per block of 32, x ~ d1 q1 + d2 q2: q1 = round(x / d1) with d1 = max|x| / 127, and q2 the
 * remainder x - d1 q1 in steps of d2 = d1 / 256 (|remainder| <= d1 / 2, so |q2| <= 128, clamped
 * to 127): about 15 bits a value. One level alone (llama.cpp's Q8 activations) flipped
 * SmolLM2-135M's greedy answer to "What is the capital of France?"; two keep it. Why d2 exactly
 * d1 / 256: a block's two integer dot products then add as 256 p1 + p2 in int32 (exact: < 2^24,
 * so exact in float too) and take one conversion and one scale, not two: the per-token work of a
 * block, which is what a batched decode step pays B times for one weight read.
 * sum_q_d = d1 sum(q1) + d2 sum(q2), for the offsets of Q4_1. */
static void quantize_block(const float *x, int8_t *q1, int8_t *q2, float *d1, float *d2, float *sum_q_d) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f, inv1 = amax > 0.0f ? 127.0f / amax : 0.0f, inv2 = inv1 * 256.0f;
    int s1 = 0, s2 = 0;
    for (int j = 0; j < QK; j++) {
        int v = (int)nearbyintf(x[j] * inv1);
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q1[j] = (int8_t)v;
        s1 += v;
        int r = (int)nearbyintf((x[j] - d * (float)v) * inv2);
        r = r > 127 ? 127 : (r < -127 ? -127 : r);
        q2[j] = (int8_t)r;
        s2 += r;
    }
    *d1 = d;
    *d2 = d * (1.0f / 256.0f);
    *sum_q_d = d * (float)s1 + *d2 * (float)s2;
}

void rl_free_activations(Activations *a) {
    free(a->q1); free(a->q2); free(a->d1); free(a->d2); free(a->sum_q_d);
    a->q1 = a->q2 = NULL;
    a->d1 = a->d2 = a->sum_q_d = NULL;
}

int rl_alloc_activations(Activations *a, int64_t M, int64_t K) {
    int64_t blocks = M * (K / QK);
    a->q1 = (int8_t *)malloc((size_t)(M * K));
    a->q2 = (int8_t *)malloc((size_t)(M * K));
    a->d1 = (float *)malloc(sizeof(float) * (size_t)blocks);
    a->d2 = (float *)malloc(sizeof(float) * (size_t)blocks);
    a->sum_q_d = (float *)malloc(sizeof(float) * (size_t)blocks);
    if (!a->q1 || !a->q2 || !a->d1 || !a->d2 || !a->sum_q_d) {
        rl_free_activations(a);
        return -1;
    }
    return 0;
}

void rl_quantize_activations(const float *x, int64_t M, int64_t K, Activations *a, int threads) {
    int64_t blocks = M * (K / QK);
    /* One token's blocks are too few to be worth waking a second thread. */
    #pragma omp parallel for num_threads(threads) schedule(static) if (M > 1 && threads > 1)
    for (int64_t i = 0; i < blocks; i++)
        quantize_block(x + i * QK, a->q1 + i * QK, a->q2 + i * QK, &a->d1[i], &a->d2[i], &a->sum_q_d[i]);
}

/* 256 (w . x1) + (w . x2) of 32 unsigned 4-bit codes (or |w| of signed codes) with a block's two
 * int8 levels, as 8 int32 lanes (each < 2^24: exact as floats). */
static inline __m256 dot_levels(__m256i w, __m256i x1, __m256i x2, __m256i k256, __m256i ones) {
    __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x1), k256);
    __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x2), ones);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p1, p2));
}

#define TILE 4

/* One row of a 4-bit W against tokens [t0, t0 + count), count <= TILE, weight blocks unpacked once. */
static inline __attribute__((always_inline)) void q4_row(const Activations *a, int64_t K, const uint8_t *wn, const uint16_t *dn,
                          const uint16_t *mn, int64_t t0, int count, int64_t N, int64_t n, float *y) {
    const int64_t nb = K / QK;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    __m256 acc[TILE];
    float offsets[TILE];
    for (int i = 0; i < count; i++) {
        acc[i] = _mm256_setzero_ps();
        offsets[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        __m128i packed = _mm_loadu_si128((const __m128i *)(wn + b * 16));
        __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
        float db = _cvtsh_ss(dn[b]), mb = _cvtsh_ss(mn[b]);
        for (int i = 0; i < count; i++) {
            int64_t t = t0 + i;
            const int8_t *q1 = a->q1 + t * K + b * QK, *q2 = a->q2 + t * K + b * QK;
            __m256 p = dot_levels(w, _mm256_loadu_si256((const __m256i *)q1), _mm256_loadu_si256((const __m256i *)q2),
                                  k256, ones);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(db * a->d2[t * nb + b]), p, acc[i]);
            offsets[i] += mb * a->sum_q_d[t * nb + b];
        }
    }
    for (int i = 0; i < count; i++) y[(t0 + i) * N + n] = hsum(acc[i]) + offsets[i];
}

static inline __attribute__((always_inline)) void q8_row(const Activations *a, int64_t K, const int8_t *wn, const uint16_t *dn,
                          int64_t t0, int count, int64_t N, int64_t n, float *y) {
    const int64_t nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1), k256 = _mm256_set1_epi16(256);
    __m256 acc[TILE];
    for (int i = 0; i < count; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(wn + b * QK));
        /* maddubs takes unsigned x signed: |w| times x with w's sign moved onto x. */
        __m256i aw = _mm256_sign_epi8(w, w);
        float db = _cvtsh_ss(dn[b]);
        for (int i = 0; i < count; i++) {
            int64_t t = t0 + i;
            const int8_t *q1 = a->q1 + t * K + b * QK, *q2 = a->q2 + t * K + b * QK;
            __m256 p = dot_levels(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q1), w),
                                  _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q2), w), k256, ones);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(db * a->d2[t * nb + b]), p, acc[i]);
        }
    }
    for (int i = 0; i < count; i++) y[(t0 + i) * N + n] = hsum(acc[i]);
}

/* Row n of W against all M tokens. The tile width is a constant in each call, so the
 * accumulators stay in registers. */
static inline void matmul_row(const Activations *a, int64_t M, const BlockWeight *w, int64_t n, float *y) {
    const int64_t N = w->n, K = w->k, nb = K / QK;
    const uint16_t *dn = w->scale + n * nb;
    int64_t t = 0;
    if (w->offset != NULL) {
        const uint8_t *wn = (const uint8_t *)w->codes + n * nb * 16;
        const uint16_t *mn = w->offset + n * nb;
        for (; t + TILE <= M; t += TILE) q4_row(a, K, wn, dn, mn, t, TILE, N, n, y);
        for (; t < M; t++) q4_row(a, K, wn, dn, mn, t, 1, N, n, y);
    } else {
        const int8_t *wn = (const int8_t *)w->codes + n * K;
        for (; t + TILE <= M; t += TILE) q8_row(a, K, wn, dn, t, TILE, N, n, y);
        for (; t < M; t++) q8_row(a, K, wn, dn, t, 1, N, n, y);
    }
}

void rl_block_matmul(const Activations *a, int64_t M, const BlockWeight *w, float *y, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < w->n; n++) matmul_row(a, M, w, n, y);
}

void rl_block_matmul_rows(const Activations *a, int64_t M, const BlockWeight *w, int64_t n0, int64_t n1, float *y) {
    for (int64_t n = n0; n < n1; n++) matmul_row(a, M, w, n, y);
}

/* The single-matmul entry points (rooflm/quant/linear_method.py's NativeBlockLinear). */
int rl_q4_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const uint16_t *scale,
                 const uint16_t *offset, int64_t N, float *y, int threads) {
    Activations a;
    if (rl_alloc_activations(&a, M, K)) return -1;
    rl_quantize_activations(x, M, K, &a, threads);
    BlockWeight w = {codes, scale, offset, N, K};
    rl_block_matmul(&a, M, &w, y, threads);
    rl_free_activations(&a);
    return 0;
}

int rl_q8_linear(const float *x, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scale,
                 int64_t N, float *y, int threads) {
    Activations a;
    if (rl_alloc_activations(&a, M, K)) return -1;
    rl_quantize_activations(x, M, K, &a, threads);
    BlockWeight w = {codes, scale, NULL, N, K};
    rl_block_matmul(&a, M, &w, y, threads);
    rl_free_activations(&a);
    return 0;
}
