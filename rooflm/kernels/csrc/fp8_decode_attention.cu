// Paged decode attention over an FP8 (E4M3) KV cache with static per-head scales, on mma.sync.
// rooflm/kernels/fp8_decode_mma.py says why, gives the shapes and the reference, and compiles this
// file with NVRTC at run time:
//   -DWARPS=w   warps a block; a block owns one (sequence, KV head, split), its warps take the
//               split's 16-key chunks in turn and combine their softmax states at the end
//   -DDEPTH=d   chunks of K and V each warp keeps in flight in registers (16-byte loads past L1)
//   -DSTAGES=s  0: that register ring; s >= 2: cp.async into s chunk buffers of shared memory a warp
//               instead (s - 1 chunks in flight, no registers held for them; DEPTH unused)
//   -DGROUP=g   query heads a KV head (<= 8: the MMA's N)
//   -DFP16=0|1  q and out in bf16 or fp16 (the dots run in fp16 either way: E4M3 widens to fp16 in
//               one instruction per pair)
//   -DPDL=0|1   launched as a programmatic dependent: wait for q and the K/V writes first
//   -DMINB=b    __launch_bounds__' blocks an SM
//   -DHEADS_FAST=0|1  grid (sequences, KV heads, splits) or (KV heads, sequences, splits)
// head_dim is 128.
//
// Layout of the MMAs (m16n8k16, fp16 in, fp32 accumulate; lane = 4 g + c):
// * S^T = K q^T per chunk of 16 keys: A = K (16 keys x 16 dims a k-step), B = q^T (16 dims x 8
//   heads; heads >= GROUP are zero). The k order inside an MMA is free as long as A and B agree, so
//   k-step j's slots 2c, 2c+1, 2c+8, 2c+9 of lane c are the dims 64 (j / 4) + 16 c + 4 (j % 4) + 0..3:
//   a lane's K bytes for a key are two 16-byte runs, one load each, and each 4-byte word widens
//   (two cvt.f16x2.e4m3x2) straight into A's registers. q's B fragment follows the same order.
// * O^T += V^T P^T: A = V^T (16 dims x 16 keys), B = P^T (16 keys x 8 heads). The rows (dims) are
//   free too: tile t's rows g, g+8 are dims 16 g + 2 t, 16 g + 2 t + 1, so lane (g, c) reads the 16
//   bytes [16 g, 16 g + 16) of the keys 2c, 2c+1, 2c+8, 2c+9 (its k slots) and one prmt per pair of
//   keys and dims turns 4 keys x 4 dims of bytes into the (key, key) pairs A wants.
// * S^T's accumulator has keys on g and heads on c; P^T's B fragment wants heads on g and keys on c:
//   four shuffles a chunk move P (packed to fp16 pairs by head) to where B wants it.
// Softmax state per lane: m and l of heads 2c, 2c+1 (l partial over the lane's keys until the end).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define D 128
#define CHUNK 16                  // keys an MMA covers (m16)
#define MASKED (-1.0e30f)
#ifndef MINB
#define MINB 1
#endif

// E4M3 pair (low byte -> low half) to an fp16 pair.
__device__ __forceinline__ u32 e4m3x2(u32 v) {
  u32 r;
  asm("{.reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t;}" : "=r"(r) : "r"(v));
  return r;
}
#define LO16(w) e4m3x2((w) & 0xFFFFu)
#define HI16(w) e4m3x2((w) >> 16)

// 16-bit pair of q's dtype -> fp16 pair.
__device__ __forceinline__ u32 to_f16x2(u32 v) {
#if FP16
  return v;
#else
  const float lo = __uint_as_float(v << 16), hi = __uint_as_float(v & 0xFFFF0000u);
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// ex2.approx, as Triton's exp2: exact enough for a softmax, and 0 for MASKED.
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u16 to_out(float f) {
  u16 v;
#if FP16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
#endif
  return v;
}

// K/V are read once: past L1, through the non-coherent path.
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

struct Chunk {                    // one lane's bytes of a 16-key chunk
  uint4 k[2][2];                  // keys g, g+8 x dims [16 c, +16), [64 + 16 c, +16)
  uint4 v[4];                     // keys 2c, 2c+1, 2c+8, 2c+9 x dims [16 g, +16)
};

// Keys past end (only in a sequence's last chunk) read the last key instead: finite bytes in the same
// cache block (a chunk never crosses one: blocks hold >= 16 keys and chunks start at multiples of 16),
// masked out of the softmax, so their p is 0.
__device__ __forceinline__ void load_chunk(Chunk& ch, const u8* k_head, const u8* v_head, const int* table,
                                           int kb, int end, int bs_log2, long long stride_cb, int stride_ct,
                                           int g, int c) {
  const long long page = (long long)table[kb >> bs_log2] * stride_cb;
  const int slot0 = kb & ((1 << bs_log2) - 1), last = end - 1 - kb;
  const u8* kp = k_head + page;
  const u8* vp = v_head + page;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = min(g + 8 * h, last);
    const u8* row = kp + (long long)(slot0 + r) * stride_ct + 16 * c;
    ch.k[h][0] = ld_stream(row);
    ch.k[h][1] = ld_stream(row + 64);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = min(2 * c + (i & 1) + 8 * (i >> 1), last);
    ch.v[i] = ld_stream(vp + (long long)(slot0 + r) * stride_ct + 16 * g);
  }
}

#ifndef STAGES
#define STAGES 0
#endif
#define STAGE_BYTES (2 * CHUNK * D)   // a chunk's K then V rows, 128 bytes each

#include "cp_async.cuh"

// Bank-conflict-free 16-byte pieces of a stage (8 a 128-byte row): the readers of one LDS.128 phase
// (8 lanes) take K rows g, g+1 at pieces c (0..3), and V rows 2c + r0 (c = 0..3) at pieces g, g+1.
__device__ __forceinline__ int k_piece(int row, int piece) { return row * 8 + (piece ^ ((row & 1) << 2)); }
__device__ __forceinline__ int v_piece(int row, int piece) { return row * 8 + (piece ^ (((row >> 1) & 3) << 1)); }

// cp.async of the chunk at kb into a stage: 256 pieces, 8 a lane. Keys past end read the last key, as
// load_chunk's. The group is committed by the caller (also when there is no chunk: uniform counting).
__device__ __forceinline__ void issue_chunk(u8* stage, const u8* k_head, const u8* v_head, const int* table,
                                            int kb, int end, int bs_log2, long long stride_cb, int stride_ct,
                                            int lane) {
  const long long page = (long long)table[kb >> bs_log2] * stride_cb;
  const int slot0 = kb & ((1 << bs_log2) - 1), last = end - 1 - kb;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int row = (lane >> 3) + 4 * p, piece = lane & 7;
    const long long src = page + (long long)(slot0 + min(row, last)) * stride_ct + 16 * piece;
    cp_async16(stage + 16 * k_piece(row, piece), k_head + src);
    cp_async16(stage + CHUNK * D + 16 * v_piece(row, piece), v_head + src);
  }
}

__device__ __forceinline__ void read_chunk(Chunk& ch, const u8* stage, int g, int c) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int x = 0; x < 2; ++x) ch.k[h][x] = *(const uint4*)(stage + 16 * k_piece(g + 8 * h, c + 4 * x));
#pragma unroll
  for (int i = 0; i < 4; ++i)
    ch.v[i] = *(const uint4*)(stage + CHUNK * D + 16 * v_piece(2 * c + (i & 1) + 8 * (i >> 1), g));
}

struct State {
  float o[8][4];                  // O^T tile t: (dim 16g+2t, heads 2c, 2c+1), (dim 16g+2t+1, same heads)
  float m[2], l[2];               // heads 2c, 2c+1
};

__device__ __forceinline__ void attend_chunk(State& st, const Chunk& ch, const u32 (*qb)[2], float qk_scale,
                                             int kb, int end, int lane, int g, int c) {
  // S^T (keys g, g+8 x heads 2c, 2c+1), two accumulators to halve the MMA chain.
  float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const u32 wg = word(ch.k[0][j >> 2], j & 3), w8 = word(ch.k[1][j >> 2], j & 3);
    mma((j & 1) ? s2 : s, LO16(wg), LO16(w8), HI16(wg), HI16(w8), qb[j][0], qb[j][1]);
  }
  const bool ok_g = kb + g < end, ok_g8 = kb + g + 8 < end;
  float x[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[e] = (s[e] + s2[e]) * qk_scale;
    x[e] = ((e < 2) ? ok_g : ok_g8) ? x[e] : MASKED;
  }
  // Online softmax per head: the chunk's max over the 8 lanes sharing c (lane bits 2..4).
  float mx[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
  }
  float alpha[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(st.m[h], mx[h]);
    alpha[h] = exp2_approx(st.m[h] - m_new);
    st.m[h] = m_new;
  }
  const float p0 = exp2_approx(x[0] - st.m[0]), p1 = exp2_approx(x[1] - st.m[1]);
  const float p2 = exp2_approx(x[2] - st.m[0]), p3 = exp2_approx(x[3] - st.m[1]);
  st.l[0] = st.l[0] * alpha[0] + (p0 + p2);
  st.l[1] = st.l[1] * alpha[1] + (p1 + p3);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    st.o[t][0] *= alpha[0]; st.o[t][1] *= alpha[1];
    st.o[t][2] *= alpha[0]; st.o[t][3] *= alpha[1];
  }
  // P^T's B fragment: lane (g, c) wants head g, keys 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1). Key 2c and
  // 2c+8 of head g sit in lane 4 (2c) + g / 2 (its rows g', g'+8 = 2c, 2c+8; its head pair g / 2),
  // keys 2c+1, 2c+9 in lane 4 (2c+1) + g / 2.
  const u32 pk0 = pack_f16x2(p0, p2), pk1 = pack_f16x2(p1, p3);  // by head: (key g, key g+8)
  const int src_a = 4 * (2 * c) + (g >> 1), src_b = src_a + 4;
  const u32 a0 = __shfl_sync(0xffffffffu, pk0, src_a), a1 = __shfl_sync(0xffffffffu, pk1, src_a);
  const u32 b0 = __shfl_sync(0xffffffffu, pk0, src_b), b1 = __shfl_sync(0xffffffffu, pk1, src_b);
  const u32 pa = (g & 1) ? a1 : a0, pb = (g & 1) ? b1 : b0;
  const u32 pfrag0 = __byte_perm(pa, pb, 0x5410), pfrag1 = __byte_perm(pa, pb, 0x7632);
  (void)lane;
  // O^T += V^T P^T, tile t: dims 16g + 2t (row g) and + 1 (row g + 8).
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int wi = t >> 1;
    const u32 sel = (t & 1) ? 0x7362u : 0x5140u;  // bytes 2, 3 or 0, 1 of each key's word, interleaved
    const u32 x01 = __byte_perm(word(ch.v[0], wi), word(ch.v[1], wi), sel);  // keys 2c, 2c+1
    const u32 x89 = __byte_perm(word(ch.v[2], wi), word(ch.v[3], wi), sel);  // keys 2c+8, 2c+9
    mma(st.o[t], LO16(x01), HI16(x01), LO16(x89), HI16(x89), pfrag0, pfrag1);
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
fp8_decode_attention(u16* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_lse,
                     const u16* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
                     const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                     const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                     const int* __restrict__ query_start_loc, float qk_scale, int num_splits, int num_heads,
                     int stride_qt, int stride_qh, int stride_ot, int stride_oh, int stride_cb, int stride_ct,
                     int stride_ch, int stride_bt, int bs_log2) {
#if PDL
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // HEADS_FAST: the grid is (KV heads, sequences, splits), so a sequence's KV heads run side by side
  // and read each key's H_kv x 128 bytes (one cache row) together, not 128 bytes at a time far apart.
#if HEADS_FAST
  const int seq = blockIdx.y, kv_head = blockIdx.x, split = blockIdx.z;
#else
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
#endif
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int seq_len = seq_lens[seq];
  const long long tok = query_start_loc[seq];
  // This split's keys [start, end), whole chunks each (the reduce kernel combines the splits).
  const int per_split = ((seq_len + num_splits - 1) / num_splits + CHUNK - 1) / CHUNK * CHUNK;
  const int start = split * per_split, end = min(start + per_split, seq_len);
  const int* table = block_tables + (long long)seq * stride_bt;
  const u8* k_head = k_cache + (long long)kv_head * stride_ch;
  const u8* v_head = v_cache + (long long)kv_head * stride_ch;
  qk_scale *= k_scale[kv_head];

  // q^T's B fragments in the dims order above; heads >= GROUP are zero.
  u32 qb[8][2];
  {
    uint4 run[2][2] = {{make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}, {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)}};
    if (g < GROUP) {
      const u16* qh = q + tok * stride_qt + (long long)(kv_head * GROUP + g) * stride_qh;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // dims 64 h + 16 c .. + 16: two 16-byte loads
        run[h][0] = *(const uint4*)(qh + 64 * h + 16 * c);
        run[h][1] = *(const uint4*)(qh + 64 * h + 16 * c + 8);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // dims 64 (j/4) + 16 c + 4 (j%4) + 0..3: words 2 (j%4), +1 of the run
      const int jj = j & 3;
      qb[j][0] = to_f16x2(word(run[j >> 2][jj >> 1], (2 * jj) & 3));
      qb[j][1] = to_f16x2(word(run[j >> 2][jj >> 1], (2 * jj + 1) & 3));
    }
  }

  State st;
#pragma unroll
  for (int t = 0; t < 8; ++t) st.o[t][0] = st.o[t][1] = st.o[t][2] = st.o[t][3] = 0.f;
  st.m[0] = st.m[1] = MASKED;
  st.l[0] = st.l[1] = 0.f;

  const int step = CHUNK * WARPS;
#if STAGES
  // Each warp owns STAGES chunk buffers: STAGES - 1 chunks in flight, no registers held for them.
  extern __shared__ __align__(16) u8 smem[];
  u8* stages = smem + warp * (STAGES * STAGE_BYTES);
  const int first = start + CHUNK * warp;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (first + s * step < end)
      issue_chunk(stages + s * STAGE_BYTES, k_head, v_head, table, first + s * step, end, bs_log2, stride_cb,
                  stride_ct, lane);
    cp_async_commit();
  }
  int slot = 0;
  for (int at = first; at < end; at += step) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // every lane's copies landed, and every lane read the stage refilled below
    Chunk ch;
    read_chunk(ch, stages + slot * STAGE_BYTES, g, c);
    const int refill = slot == 0 ? STAGES - 1 : slot - 1;
    if (at + (STAGES - 1) * step < end)
      issue_chunk(stages + refill * STAGE_BYTES, k_head, v_head, table, at + (STAGES - 1) * step, end, bs_log2,
                  stride_cb, stride_ct, lane);
    cp_async_commit();
    attend_chunk(st, ch, qb, qk_scale, at, end, lane, g, c);
    slot = slot == STAGES - 1 ? 0 : slot + 1;
  }
  cp_async_wait<0>();
#else
  Chunk ring[DEPTH];
  int kb = start + CHUNK * warp;
#pragma unroll
  for (int s = 0; s < DEPTH; ++s)
    if (kb + s * step < end)
      load_chunk(ring[s], k_head, v_head, table, kb + s * step, end, bs_log2, stride_cb, stride_ct, g, c);
  for (; kb < end; kb += DEPTH * step) {
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) {
      const int at = kb + s * step;
      if (at < end) {
        attend_chunk(st, ring[s], qb, qk_scale, at, end, lane, g, c);
        if (at + DEPTH * step < end)
          load_chunk(ring[s], k_head, v_head, table, at + DEPTH * step, end, bs_log2, stride_cb, stride_ct, g, c);
      }
    }
  }
#endif

  // The warps' states: l summed over the lanes sharing c, then combined through shared memory.
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], off);
  // A warp's combine record: o [GROUP][D], then m [8] and l [8]. With STAGES it lives in the warp's
  // own stage buffers (its copies are done), so the blocks an SM are not cut by a second array.
#define RECORD (GROUP * D + 16)
#if STAGES
  float* records = (float*)smem;
#define REC(w) (records + (w) * (STAGES * STAGE_BYTES / 4))
#else
  __shared__ float records[WARPS * RECORD];
#define REC(w) (records + (w) * RECORD)
#endif
  float* mine = REC(warp);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * c + h;
    if (head < GROUP) {
      if (g == 0) { mine[GROUP * D + head] = st.m[h]; mine[GROUP * D + 8 + head] = st.l[h]; }
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        mine[head * D + 16 * g + 2 * t] = st.o[t][h];
        mine[head * D + 16 * g + 2 * t + 1] = st.o[t][2 + h];
      }
    }
  }
  __syncthreads();
  const float vs = v_scale[kv_head];
  for (int idx = threadIdx.x; idx < GROUP * D; idx += WARPS * 32) {
    const int head = idx / D, d = idx % D;
    float m_all = MASKED;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, REC(w)[GROUP * D + head]);
    float l_all = 0.f, o_all = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {  // a warp without keys has l = 0 and o = 0
      const float* rec = REC(w);
      const float wgt = exp2f(rec[GROUP * D + head] - m_all);
      l_all += wgt * rec[GROUP * D + 8 + head];
      o_all += wgt * rec[head * D + d];
    }
    const int qhead = kv_head * GROUP + head;
    if (num_splits == 1) {
      out[tok * stride_ot + (long long)qhead * stride_oh + d] = to_out(o_all * vs / l_all);
    } else {
      // An empty split (short sequence) writes lse = -inf and no output, which the reduce skips.
      const long long row = ((long long)seq * num_heads + qhead) * num_splits + split;
      const bool has_keys = l_all > 0.f;
      if (has_keys) part_out[row * D + d] = o_all * vs / l_all;
      if (d == 0) part_lse[row] = has_keys ? m_all + log2f(l_all) : -__int_as_float(0x7f800000);
    }
  }
}
