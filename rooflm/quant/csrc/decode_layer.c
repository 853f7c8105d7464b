/* The decoder on the CPU, every layer in one C call for a whole step: decode rows of several
 * sequences, prefill chunks, or both mixed, with no per-op Python or torch dispatch. The Llama layer, and the parts
 * other families add to it (model/spec.py): post-norms, q/k norms per head, GELU-tanh, a residual
 * scale, and per layer a rotary table (a base of its own, a partial width, or none) and a window.
 *
 * Why: SmolLM2-135M's decode step on 2 cores spent ~14-18 ms of ~24 ms outside the matmuls,
 * in ~20 torch ops a layer over 30 layers (norms, rotary, casts, the cache write, SDPA) each
 * costing microseconds of dispatch for nanoseconds of arithmetic. Here a step is one call.
 *
 * Per layer, for the T tokens of the step (rooflm/model/decoder.py's math, in fp32):
 *   xn   = RMSNorm(h) * ln1                                    (fp32, HF's order: norm, then weight;
 *                                                               a (1 + w) norm passes 1 + w)
 *   qkv  = xn @ Wqkv.T                                         (block matmul, block_matmul.c)
 *   q, k = per-head RMSNorm (q_norm, k_norm, where given), then neox rotary of the first rot_dim
 *          elements at each token's position (no rotary without a table); k, v -> the paged
 *          cache at each token's slot (the layer's KV cache group's slots)
 *   a    = softmax(q k^T * scale) v over the token's own sequence's cached positions pos - window + 1..pos
 *          (causal; window 0: from 0; GQA: query head h reads KV head h / (H / H_kv)), K/V found
 *          through the group's block table
 *   h   += post1(a @ Wo.T) * residual_scale                    (post1: RMSNorm where given)
 *   xn   = RMSNorm(h) * ln2;  g, u = xn @ Wgate_up.T;  h += post2(act(g) * u @ Wdown.T) * residual_scale
 *          (act: SiLU, or GELU-tanh)
 * and after the last layer, x = RMSNorm(h) * final_norm.
 *
 * Activations are quantized once per matmul input (four per layer: the fused q/k/v and
 * gate/up share theirs), into buffers allocated once per call. The cache is the engine's own
 * paged pool (layers/attention.py's layout: [num_blocks, block_size, H_kv, D] fp32 per layer),
 * so prefix caching, copy-on-write and preemption see exactly what the torch path would write.
 *
 * Several sequences in one call (a batched decode step: B rows, each its own sequence and KV
 * length): every matmul takes the B rows together, so each weight block is read from memory once
 * a step for all of them (block_matmul.c's tiles of 4 tokens; a weight row stays in L1 across
 * tiles) instead of once per sequence: B tokens per weight read, which is what makes B streams
 * faster than one on a memory-bound CPU. Attention stays per sequence, over its own KV.
 *
 * Attention work: 4 T L D flops per query head for a context of L; bytes: 2 L H_kv D 4 (the
 * K/V read once per query head group). Threads: one OpenMP parallel region for the whole call
 * (see forward below): rows of every weight split between threads, (sequence, KV-head group)
 * units in attention.
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
    const float *post1, *post2;  /* [hidden] post-attention / post-MLP norms, or NULL */
    const float *q_norm, *k_norm;  /* [head_dim] per-head q/k norms, or NULL */
    const float *cos_sin;  /* [max_positions, rot_dim]: cos of the half, then sin; NULL: no rotary */
    int64_t rot_dim;  /* elements of a head rotated (head_dim, fewer for a partial rotary) */
    int64_t window;  /* keys pos - window + 1 .. pos (sliding window), or 0: every earlier key */
    int64_t group;  /* KV cache group: which of the step's slot mappings and block tables */
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, num_layers;
    float eps, scale;
    const float *final_norm;
    int64_t gelu_tanh;  /* the MLP's act: 0 SiLU, 1 GELU-tanh (Gemma's gelu_pytorch_tanh) */
    float residual_scale;  /* each sublayer's output times this before its add (Granite); 1 */
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

/* Neox rotary of the first d elements of one head vector in place:
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
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

/* One query head of one token against positions first..pos of the sequence (first: 0, or the
 * window's edge). scores: pos + 1 floats. */
static void attend_one(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
                       int64_t pos, int64_t first, int64_t kv_head, const DecoderShape *s, float *scores,
                       float *out) {
    const int64_t d = s->head_dim, row = s->kv_heads * d;
    float m = -INFINITY;
    for (int64_t j = first; j <= pos; j++) {
        int64_t slot = slot_of(block_table, j, s->block_size);
        float v = dot(q, k_cache + slot * row + kv_head * d, d) * s->scale;
        scores[j] = v;
        m = v > m ? v : m;
    }
    float sum = 0.0f;
    for (int64_t j = first; j <= pos; j++) {
        scores[j] = expf(scores[j] - m);
        sum += scores[j];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = first; j <= pos; j++) {
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

/* HF's gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* A per-head norm in place (q/k norms): RMSNorm of d elements times w. */
static inline void head_norm(float *x, const float *w, int64_t d, float eps) { rms_norm(x, w, d, eps, x); }

/* out[n0:n1] = base[n0:n1] + post(y)[n0:n1] * scale for one row: the post-norm needs the whole row
 * of y for its mean of squares (every thread sums it; it is hidden floats), then its own slice. */
static void post_add(const float *y, const float *w, const float *base, int64_t H, int64_t n0, int64_t n1,
                     float eps, float scale, float *out) {
    float r = 1.0f;
    if (w) {
        double ss = 0.0;
        for (int64_t i = 0; i < H; i++) ss += (double)y[i] * y[i];
        r = 1.0f / sqrtf((float)(ss / (double)H) + eps);
    }
    for (int64_t n = n0; n < n1; n++) {
        float v = w ? w[n] * (y[n] * r) : y[n];
        out[n] = base[n] + v * scale;
    }
}

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

/* All layers in one parallel region, five barriers (barrier_wait) a layer (seven with post-norms),
 * whatever the number of sequences in the step. Each thread
 * normalizes and quantizes a matmul's input itself, into its own buffers, instead of one thread
 * doing it while the others wait at a barrier (for a 512-token chunk that repeats ~4% of the
 * matmul's work); each takes a contiguous slice of every weight's rows (and the residual add on
 * its own slice of the output), and whole (sequence, KV-head group) units in attention (it
 * rotates, caches and attends them alone, so the cache write needs no barrier before the
 * attention that reads it; with fewer units than threads, some threads idle there). Why: every
 * fork/join or barrier is a point where a thread descheduled by another job holds up the rest; a
 * parallel loop per step had ten such points a layer, this has five. */
static int forward(const DecoderShape *s, const DecoderLayer *layers, float *x, int64_t T,
                   const int64_t *positions, const int64_t *const *slot_groups,
                   const int32_t *const *table_groups, const int64_t *table_widths, int64_t S,
                   const int64_t *seq_starts, const int64_t *seq_rows, int threads) {
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
    float *proj = (float *)malloc(sizeof(float) * (size_t)(T * H));  /* o / down output before a post-norm */
    int failed = !mid || !qkv || !attn || !gu || !act || !proj;

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
                const int64_t *slots = slot_groups[L->group];
                const int32_t *tables = table_groups[L->group];
                const int64_t width = table_widths[L->group];
                const int64_t R = L->rot_dim;
                /* q, k, v: this thread's rows of the fused weight. */
                for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, L->ln1, H, s->eps, xn + t * H);
                rl_quantize_activations(xn, T, H, &acts, 1);
                rl_block_matmul_rows(&acts, T, &L->qkv, split(qkv_n, tid, nt), split(qkv_n, tid + 1, nt), qkv);
                barrier_wait(&bar, nt, &sense);
                /* Attention: this thread's (sequence, KV-head group) units, written to the cache, then
                 * read (a sequence's tokens attend to its own earlier tokens only). */
                for (int64_t u = tid; u < S * s->kv_heads; u += nt) {
                    const int64_t g = u % s->kv_heads, seq = u / s->kv_heads;
                    const int64_t t0 = seq_starts[seq], t1 = seq_starts[seq + 1];
                    const int32_t *block_table = tables + seq_rows[seq] * width;
                    for (int64_t t = t0; t < t1; t++) {
                        float *row = qkv + t * qkv_n;
                        float *k = row + q_size + g * D, *v = row + q_size + kv_size + g * D;
                        if (L->k_norm) {
                            head_norm(k, L->k_norm, D, s->eps);
                            for (int64_t h = g * group; h < (g + 1) * group; h++)
                                head_norm(row + h * D, L->q_norm, D, s->eps);
                        }
                        if (L->cos_sin) {
                            const float *cs = L->cos_sin + positions[t] * R;
                            rotate(k, cs, R);
                            for (int64_t h = g * group; h < (g + 1) * group; h++) rotate(row + h * D, cs, R);
                        }
                        memcpy(L->k_cache + slots[t] * kv_size + g * D, k, sizeof(float) * (size_t)D);
                        memcpy(L->v_cache + slots[t] * kv_size + g * D, v, sizeof(float) * (size_t)D);
                    }
                    for (int64_t t = t0; t < t1; t++) {
                        int64_t first = L->window > 0 && positions[t] >= L->window ? positions[t] - L->window + 1 : 0;
                        for (int64_t h = g * group; h < (g + 1) * group; h++)
                            attend_one(qkv + t * qkv_n + h * D, L->k_cache, L->v_cache, block_table, positions[t],
                                       first, g, s, scores, attn + t * q_size + h * D);
                    }
                }
                barrier_wait(&bar, nt, &sense);
                /* mid = x + post1(attn @ Wo.T), this thread's columns of it; a post-norm reads whole
                 * rows of the projection, so every thread's columns are written first. */
                rl_quantize_activations(attn, T, q_size, &acts, 1);
                int64_t n0 = split(H, tid, nt), n1 = split(H, tid + 1, nt);
                const float rs = s->residual_scale;
                if (L->post1) {
                    rl_block_matmul_rows(&acts, T, &L->o, n0, n1, proj);
                    barrier_wait(&bar, nt, &sense);
                    for (int64_t t = 0; t < T; t++)
                        post_add(proj + t * H, L->post1, x + t * H, H, n0, n1, s->eps, rs, mid + t * H);
                } else {
                    rl_block_matmul_rows(&acts, T, &L->o, n0, n1, mid);
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t n = n0; n < n1; n++) mid[t * H + n] = x[t * H + n] + mid[t * H + n] * rs;
                }
                barrier_wait(&bar, nt, &sense);
                /* silu(gate) * up for this thread's slice of the intermediate features. */
                for (int64_t t = 0; t < T; t++) rms_norm(mid + t * H, L->ln2, H, s->eps, xn + t * H);
                rl_quantize_activations(xn, T, H, &acts, 1);
                int64_t i0 = split(I, tid, nt), i1 = split(I, tid + 1, nt);
                rl_block_matmul_rows(&acts, T, &L->gate_up, i0, i1, gu);
                rl_block_matmul_rows(&acts, T, &L->gate_up, I + i0, I + i1, gu);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t i = i0; i < i1; i++) {
                        float g = gu[t * 2 * I + i];
                        act[t * I + i] = (s->gelu_tanh ? gelu_tanh(g) : silu(g)) * gu[t * 2 * I + I + i];
                    }
                barrier_wait(&bar, nt, &sense);
                /* x = mid + post2(act @ Wdown.T) (nobody reads x's old value after the last barrier). */
                rl_quantize_activations(act, T, I, &acts, 1);
                if (L->post2) {
                    rl_block_matmul_rows(&acts, T, &L->down, n0, n1, proj);
                    barrier_wait(&bar, nt, &sense);
                    for (int64_t t = 0; t < T; t++)
                        post_add(proj + t * H, L->post2, mid + t * H, H, n0, n1, s->eps, rs, x + t * H);
                } else {
                    rl_block_matmul_rows(&acts, T, &L->down, n0, n1, x);
                    for (int64_t t = 0; t < T; t++)
                        for (int64_t n = n0; n < n1; n++) x[t * H + n] = mid[t * H + n] + x[t * H + n] * rs;
                }
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
    free(mid); free(qkv); free(attn); free(gu); free(act); free(proj);
    return failed ? -1 : 0;
}

/* x [T, hidden]: the step's embeddings in, the final normed hidden states out. The T tokens are
 * S sequences' runs of consecutive positions: sequence i's are tokens seq_starts[i] ..
 * seq_starts[i + 1] - 1 (seq_starts [S + 1], 0 .. T), and its block table is row seq_rows[i] of
 * each group's table (a decode is a run of one token; a prefill chunk a longer one).
 * positions [T] int64; slot_groups[g] [T] int64 (>= 0) the tokens' slots in KV cache group g, and
 * table_groups[g] that group's block tables, int32 rows of table_widths[g] entries (one group: one
 * of each).
 * Returns 0, or -1 when a buffer could not be allocated (x is then undefined). */
int rl_decoder_forward(const DecoderShape *s, const DecoderLayer *layers, float *x, int64_t T,
                       const int64_t *positions, const int64_t *const *slot_groups,
                       const int32_t *const *table_groups, const int64_t *table_widths, int64_t S,
                       const int64_t *seq_starts, const int64_t *seq_rows, int threads) {
    return forward(s, layers, x, T, positions, slot_groups, table_groups, table_widths, S, seq_starts, seq_rows,
                   threads);
}
