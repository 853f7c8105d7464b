/* The Llama-family decoder on the CPU for one sequence, every layer in one C call: batch-1
 * decode steps and single prefill chunks, with no per-op Python or torch dispatch.
 *
 * Why: SmolLM2-135M's decode step on 2 cores spent ~14-18 ms of ~24 ms outside the matmuls,
 * in ~20 torch ops a layer over 30 layers (norms, rotary, casts, the cache write, SDPA) each
 * costing microseconds of dispatch for nanoseconds of arithmetic. Here a step is one call.
 *
 * Per layer, for the T tokens of the step (rooflm/model/llama.py's math, in fp32):
 *   xn   = RMSNorm(h) * ln1                                    (fp32, HF's order: norm, then weight)
 *   qkv  = xn @ Wqkv.T                                         (block matmul, block_matmul.c)
 *   q, k = neox rotary at each token's position; k, v -> the paged cache at each token's slot
 *   a    = softmax(q k^T * scale) v over the sequence's cached positions 0..pos (causal; GQA:
 *          query head h reads KV head h / (H / H_kv)), K/V found through the block table
 *   h   += a @ Wo.T
 *   xn   = RMSNorm(h) * ln2;  g, u = xn @ Wgate_up.T;  h += (silu(g) * u) @ Wdown.T
 * and after the last layer, x = RMSNorm(h) * final_norm.
 *
 * Activations are quantized once per matmul input (four per layer: the fused q/k/v and
 * gate/up share theirs), into buffers allocated once per call. The cache is the engine's own
 * paged pool (layers/attention.py's layout: [num_blocks, block_size, H_kv, D] fp32 per layer),
 * so prefix caching, copy-on-write and preemption see exactly what the torch path would write.
 *
 * Attention work: 4 T L D flops per query head for a context of L; bytes: 2 L H_kv D 4 (the
 * K/V read once per query head group). Threads: one OpenMP parallel region for the whole call
 * (see forward below): rows of every weight split between threads, KV-head groups in attention.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "block_matmul.h"

/* One decoder layer's weights and cache (rooflm/quant/native_decode.py fills these). */
typedef struct {
    const float *ln1, *ln2;  /* [hidden] */
    BlockWeight qkv, o, gate_up, down;
    float *k_cache, *v_cache;  /* [num_blocks * block_size, kv_heads, head_dim] */
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, num_layers;
    float eps, scale;
    const float *cos_sin;  /* [max_positions, head_dim]: cos of the half, then sin */
    const float *final_norm;
} DecoderShape;

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    /* Sum in double: the mean is then the correctly rounded one, as close as torch's as any. */
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* Neox rotary of one head vector in place: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
static inline void rotate(float *x, const float *cs, int64_t d) {
    int64_t half = d / 2;
    const float *c = cs, *s = cs + half;
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static inline int64_t slot_of(const int32_t *block_table, int64_t pos, int64_t block_size) {
    return (int64_t)block_table[pos / block_size] * block_size + pos % block_size;
}

/* One query head of one token against positions 0..pos of the sequence. scores: pos + 1 floats. */
static void attend_one(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
                       int64_t pos, int64_t kv_head, const DecoderShape *s, float *scores, float *out) {
    const int64_t d = s->head_dim, row = s->kv_heads * d;
    float m = -INFINITY;
    for (int64_t j = 0; j <= pos; j++) {
        int64_t slot = slot_of(block_table, j, s->block_size);
        float v = dot(q, k_cache + slot * row + kv_head * d, d) * s->scale;
        scores[j] = v;
        m = v > m ? v : m;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j <= pos; j++) {
        scores[j] = expf(scores[j] - m);
        sum += scores[j];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j <= pos; j++) {
        int64_t slot = slot_of(block_table, j, s->block_size);
        const float *v = v_cache + slot * row + kv_head * d;
        float p = scores[j] * inv;
        int64_t i = 0;
        __m256 pv = _mm256_set1_ps(p);
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
        for (; i < d; i++) out[i] += p * v[i];
    }
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline int64_t split(int64_t n, int part, int parts) { return n * part / parts; }

/* A barrier that spins briefly and then yields the core. Why not `omp barrier`: libgomp's
 * waiter spins for a long time (GOMP_SPINCOUNT, read once when torch loads the library), and
 * when other jobs share the cores, the thread it waits for may be queued behind it on the same
 * core: the spin then lasts the scheduler's whole time slice (~4 ms measured per barrier at a
 * load average of ~5 on 2 cores). After SPIN_PAUSES pauses (tens of microseconds: longer than
 * a barrier's wait on a quiet machine) the waiter calls sched_yield, which lets that thread run.
 * Sense-reversing: the last thread to arrive resets the count and flips the sense. */
#define SPIN_PAUSES 2000

typedef struct {
    int count;
    int sense;
} Barrier;

static void barrier_wait(Barrier *b, int threads, int *local_sense) {
    if (threads == 1) return;
    *local_sense = !*local_sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, *local_sense, __ATOMIC_RELEASE);
        return;
    }
    int spins = 0;
    while (__atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != *local_sense) {
        if (spins < SPIN_PAUSES) {
            _mm_pause();
            spins++;
        } else {
            sched_yield();
        }
    }
}

/* All layers in one parallel region, four barriers (barrier_wait) a layer. Each thread
 * normalizes and quantizes a matmul's input itself, into its own buffers, instead of one thread
 * doing it while the others wait at a barrier (for a 512-token chunk that repeats ~4% of the
 * matmul's work); each takes a contiguous slice of every weight's rows (and the residual add on
 * its own slice of the output), and whole KV-head groups in attention (it rotates, caches and
 * attends them alone, so the cache write needs no barrier before the attention that reads it;
 * with fewer groups than threads, some threads idle there). Why: every fork/join or barrier is
 * a point where a thread descheduled by another job holds up the rest; a parallel loop per
 * step had ten such points a layer, this has four. */
static int forward(const DecoderShape *s, const DecoderLayer *layers, float *x, int64_t T,
                   const int64_t *positions, const int64_t *slots, const int32_t *block_table,
                   int threads) {
    const int64_t H = s->hidden, D = s->head_dim, q_size = s->heads * D, kv_size = s->kv_heads * D;
    const int64_t qkv_n = q_size + 2 * kv_size, I = s->intermediate;
    const int64_t group = s->heads / s->kv_heads;
    int64_t max_k = H > q_size ? H : q_size;
    max_k = max_k > I ? max_k : I;
    int64_t max_pos = 0;
    for (int64_t t = 0; t < T; t++) max_pos = positions[t] > max_pos ? positions[t] : max_pos;

    float *mid = (float *)malloc(sizeof(float) * (size_t)(T * H));  /* h after attention */
    float *qkv = (float *)malloc(sizeof(float) * (size_t)(T * qkv_n));
    float *attn = (float *)malloc(sizeof(float) * (size_t)(T * q_size));
    float *gu = (float *)malloc(sizeof(float) * (size_t)(T * 2 * I));
    float *act = (float *)malloc(sizeof(float) * (size_t)(T * I));
    int failed = !mid || !qkv || !attn || !gu || !act;

    Barrier bar = {0, 0};
    #pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int sense = 0;
        float *xn = (float *)malloc(sizeof(float) * (size_t)(T * H));
        float *scores = (float *)malloc(sizeof(float) * (size_t)(max_pos + 1));
        Activations acts;
        int mine = rl_alloc_activations(&acts, T, max_k) || !xn || !scores;
        if (mine) {
            #pragma omp atomic write
            failed = 1;
        }
        barrier_wait(&bar, nt, &sense);
        if (!__atomic_load_n(&failed, __ATOMIC_ACQUIRE)) {
            for (int64_t l = 0; l < s->num_layers; l++) {
                const DecoderLayer *L = &layers[l];
                /* q, k, v: this thread's rows of the fused weight. */
                for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, L->ln1, H, s->eps, xn + t * H);
                rl_quantize_activations(xn, T, H, &acts, 1);
                rl_block_matmul_rows(&acts, T, &L->qkv, split(qkv_n, tid, nt), split(qkv_n, tid + 1, nt), qkv);
                barrier_wait(&bar, nt, &sense);
                /* Attention: this thread's KV-head groups, written to the cache, then read. */
                for (int64_t g = tid; g < s->kv_heads; g += nt) {
                    for (int64_t t = 0; t < T; t++) {
                        float *row = qkv + t * qkv_n;
                        const float *cs = s->cos_sin + positions[t] * D;
                        float *k = row + q_size + g * D, *v = row + q_size + kv_size + g * D;
                        rotate(k, cs, D);
                        for (int64_t h = g * group; h < (g + 1) * group; h++) rotate(row + h * D, cs, D);
                        memcpy(L->k_cache + slots[t] * kv_size + g * D, k, sizeof(float) * (size_t)D);
                        memcpy(L->v_cache + slots[t] * kv_size + g * D, v, sizeof(float) * (size_t)D);
                    }
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t h = g * group; h < (g + 1) * group; h++)
                            attend_one(qkv + t * qkv_n + h * D, L->k_cache, L->v_cache, block_table, positions[t],
                                       g, s, scores, attn + t * q_size + h * D);
                }
                barrier_wait(&bar, nt, &sense);
                /* mid = x + attn @ Wo.T, this thread's columns of it. */
                rl_quantize_activations(attn, T, q_size, &acts, 1);
                int64_t n0 = split(H, tid, nt), n1 = split(H, tid + 1, nt);
                rl_block_matmul_rows(&acts, T, &L->o, n0, n1, mid);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t n = n0; n < n1; n++) mid[t * H + n] += x[t * H + n];
                barrier_wait(&bar, nt, &sense);
                /* silu(gate) * up for this thread's slice of the intermediate features. */
                for (int64_t t = 0; t < T; t++) rms_norm(mid + t * H, L->ln2, H, s->eps, xn + t * H);
                rl_quantize_activations(xn, T, H, &acts, 1);
                int64_t i0 = split(I, tid, nt), i1 = split(I, tid + 1, nt);
                rl_block_matmul_rows(&acts, T, &L->gate_up, i0, i1, gu);
                rl_block_matmul_rows(&acts, T, &L->gate_up, I + i0, I + i1, gu);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t i = i0; i < i1; i++) act[t * I + i] = silu(gu[t * 2 * I + i]) * gu[t * 2 * I + I + i];
                barrier_wait(&bar, nt, &sense);
                /* x = mid + act @ Wdown.T (nobody reads x's old value after the last barrier). */
                rl_quantize_activations(act, T, I, &acts, 1);
                rl_block_matmul_rows(&acts, T, &L->down, n0, n1, x);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t n = n0; n < n1; n++) x[t * H + n] += mid[t * H + n];
                barrier_wait(&bar, nt, &sense);
            }
            for (int64_t t = tid; t < T; t += nt) {
                rms_norm(x + t * H, s->final_norm, H, s->eps, xn + t * H);
                memcpy(x + t * H, xn + t * H, sizeof(float) * (size_t)H);
            }
        }
        free(xn);
        free(scores);
        rl_free_activations(&acts);
    }
    free(mid); free(qkv); free(attn); free(gu); free(act);
    return failed ? -1 : 0;
}

/* x [T, hidden]: the step's embeddings in, the final normed hidden states out.
 * positions, slots [T] int64 (slots >= 0); block_table: the sequence's, int32.
 * Returns 0, or -1 when a buffer could not be allocated (x is then undefined). */
int rl_decoder_forward(const DecoderShape *s, const DecoderLayer *layers, float *x, int64_t T,
                       const int64_t *positions, const int64_t *slots, const int32_t *block_table,
                       int threads) {
    return forward(s, layers, x, T, positions, slots, block_table, threads);
}
