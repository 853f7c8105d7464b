/* Shared declarations of rooflm's CPU block matmuls (block_matmul.c) for the whole-layer
 * decoder (decode_layer.c). Both files are compiled into one library by rooflm/quant/native.py.
 *
 * The split into "quantize the activations" and "multiply" lets a caller quantize one layer
 * input once and reuse the int8 codes, and own its buffers (no malloc per matmul).
 */
#ifndef ROOFLM_BLOCK_MATMUL_H
#define ROOFLM_BLOCK_MATMUL_H

#include <stdint.h>

#define QK 32

/* Activations of M tokens of K values, two int8 levels a block of 32 (see block_matmul.c). */
typedef struct {
    int8_t *q1, *q2;           /* [M, K] */
    float *d1, *d2, *sum_q_d;  /* [M, K / 32] */
} Activations;

/* One block-quantized weight [N, K] as rooflm/quant/native.py packs it.
 * 4-bit: codes [N, K/32, 16] bytes, fp16 scale and offset [N, K/32].
 * 8-bit (offset NULL): codes [N, K] int8, fp16 scale [N, K/32]. */
typedef struct {
    const void *codes;
    const uint16_t *scale;
    const uint16_t *offset;
    int64_t n, k;
} BlockWeight;

int rl_alloc_activations(Activations *a, int64_t M, int64_t K);
void rl_free_activations(Activations *a);
/* x [M, K] float32 -> a (buffers of at least M * K). */
void rl_quantize_activations(const float *x, int64_t M, int64_t K, Activations *a, int threads);
/* y [M, N] = x @ W.T from quantized activations; rows of W split over `threads` OpenMP threads. */
void rl_block_matmul(const Activations *a, int64_t M, const BlockWeight *w, float *y, int threads);
/* The same for rows [n0, n1) of W only, on the calling thread (inside a caller's parallel region). */
void rl_block_matmul_rows(const Activations *a, int64_t M, const BlockWeight *w, int64_t n0, int64_t n1, float *y);

#endif
