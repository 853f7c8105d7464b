// W4A16 at M <= 8 on mma.sync: the weight is the MMA's A operand, unpacked from 4-bit codes to
// 16-bit floats by bits alone, x the B operand's first M columns. rooflm/kernels/w4a16_mma.py says
// why, gives the layout and the torch reference, and compiles this file with NVRTC at run time:
//   -DWARPS=w   warps a block; one block owns 16 TILES rows of W, its warps split K by whole groups
//   -DTILES=t   16-row tiles each warp multiplies (x's loads and B fragments serve all of them)
//   -DGROUP=g   the quantization group (a multiple of 64 codes)
//   -DDEPTH=d   groups of codes a warp keeps in flight ahead of the one it multiplies, in registers
//   -DSTAGES=s  0: that register ring; s >= 2: cp.async through shared memory instead, s - 1 groups
//               (codes, scales and zeros) in flight a warp and no registers held for them
//               (Marlin's pipeline); needs N % (16 TILES) == 0 (the wrapper checks)
//   -DFP16=0|1  the activation dtype: bf16 or fp16
//   -DPDL=0|1   launched as a programmatic dependent (sm_90): codes and scales load before the wait
//   -DGATED=0|1 W is the gated MLP's gate_up [2I, K] (gate rows, then up rows) and y is
//               silu(gate) * up [M, I] (silu_mul.py's casts): a block's 16 TILES rows are 8 TILES gate
//               rows and the same 8 TILES up rows, so a thread's two rows of a tile are a gate and its
//               up, and the SiLU-mul is the block's epilogue. N is 2I.
//   -DRELEASE=0|1|2  where each block lets the next kernel launch (griddepcontrol.launch_dependents):
//               0 at its end, 1 at its start (after the first loads), 2 after its main loop
//   -DNORM=0|1  (with -DNORM_K=K) x is the residual stream h (M = 1) and the kernel multiplies
//               rmsnorm(h) (HF's casts:
//               h * rstd rounded to the dtype, times the norm weight, rounded again): each block
//               reduces sum(h^2) over K itself (from L2) and keeps the normalized row in shared
//               memory, so the norm is not a launch of its own (the batch-1 layer, gemv.py's NORM)
//   -DRESIDUAL=0|1  y = residual + W x, the product rounded to the dtype first (torch's x + r)
//
// The runtime layout (rooflm/quant/formats.py pack_int4): qweight uint8 [N, S], S = K / 2; byte j
// of a row holds code k = j in its low nibble and k = S + j in its high one. scales and zeros
// [K / g, N] in x's dtype; w[n, k] = (code - zero) * scale.
//
// One 32-bit word of a row (bytes j..j+3) holds 8 codes as nibbles n0..n7 = k: j, S+j, j+1, S+j+1,
// j+2, S+j+2, j+3, S+j+3. A shift and one lop3 put the pair (n0, n4) at the top four mantissa bits
// of two 16-bit 1.0s: (1 + code / 16) for k = (j, j+2), exact, no float op. (n2, n6) gives
// (j+1, j+3); (n1, n5) and (n3, n7) the same for the high half. The MMA's k order is free as long as
// x's B fragment follows it: prmt builds (x[j], x[j+2]) and (x[j+1], x[j+3]) from x[j..j+3].
// Per group and row: sum((code - z) s x) = 16 s sum(w' x) - s (16 + z) sum(x), sum(x) from an MMA
// with an A of ones, so it lands in the accumulator's layout. Low and high halves are separate
// groups, so they accumulate in separate fragments.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#if FP16
#define MMA_TYPES "f32.f16.f16.f32"
#define ONE2 0x3C003C00u            // 1.0 in both fp16 halves
#define CODE2 0x03C003C0u           // the top four mantissa bits of each fp16 half
#define SH0 <<6                     // nibble 0 (bits 0..3) to bits 6..9
#define SH1 <<2                     // nibble 1 (4..7)
#define SH2 >>2                     // nibble 2 (8..11)
#define SH3 >>6                     // nibble 3 (12..15)
__device__ __forceinline__ float to_f32(u16 v) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f; }
__device__ __forceinline__ u16 from_f32(float f) { u16 v; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f)); return v; }
#else
#define MMA_TYPES "f32.bf16.bf16.f32"
#define ONE2 0x3F803F80u            // 1.0 in both bf16 halves
#define CODE2 0x00780078u           // the top four mantissa bits of each bf16 half
#define SH0 <<3
#define SH1 >>1
#define SH2 >>5
#define SH3 >>9
__device__ __forceinline__ float to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ u16 from_f32(float f) { u16 v; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f)); return v; }
#endif

#define SPANS (GROUP / 64)          // 64-byte spans of a row a group covers (4 threads x 16 bytes)

// (1 + code / 16) for the two codes a shift brings to the mask's place: one shift, one lop3. The
// 1.0s come in a register: a SASS LOP3 takes one immediate, and with both constants immediate
// ptxas splits the and-or into two.
__device__ __forceinline__ u32 unit(u32 shifted, u32 one) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(shifted), "n"(CODE2), "r"(one));
  return d;
}
#define UNIT(q, SH) unit((q) SH, one)

// Codes are read once: past L1 (no_allocate), through the non-coherent path.
__device__ __forceinline__ uint4 ld_codes(const u8* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

#ifndef NORM
#define NORM 0
#endif
#ifndef RESIDUAL
#define RESIDUAL 0
#endif

// x is read by every block: keep it in L1. (NORM: the block's normalized row, in shared memory.)
__device__ __forceinline__ uint4 ld_x(const u16* p) {
#if NORM
  return *(const uint4*)p;
#else
  uint4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#endif
}

#include "cp_async.cuh"

// PDL: x is what the kernel before writes; codes and scales (weights) may load before this.
__device__ __forceinline__ void wait_for_x() {
#if PDL
#if RELEASE == 1
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// silu(g) * u with silu_mul.py's casts: silu in fp32, rounded to the dtype, the product rounded again.
__device__ __forceinline__ u16 silu_mul1(u16 g, u16 u) {
  const float gf = to_f32(g);
  return from_f32(to_f32(from_f32(gf / (1.f + __expf(-gf)))) * to_f32(u));
}

#if NORM
// rmsnorm(h) of the block's one row into shared memory xs [NORM_K], HF's casts. The norm weight is a
// weight: its loads go before the wait for h (load_norm_weight); h is read once (from L2) into
// registers, sum(h^2) reduced over the block (warp shuffles, then the warps' sums), then each element.
#define NORM_VECS ((NORM_K + 8 * WARPS * 32 - 1) / (8 * WARPS * 32))   // 8-value vectors a thread
__device__ __forceinline__ void load_norm_weight(uint4* wv, const u16* w) {
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = 8 * (threadIdx.x + i * WARPS * 32);
    wv[i] = k < NORM_K ? *(const uint4*)(w + k) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void normalize_row(u16* xs, const u16* h, const uint4* wv, float eps) {
  __shared__ float warp_sums[WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4 hv[NORM_VECS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = 8 * (threadIdx.x + i * WARPS * 32);
    hv[i] = k < NORM_K ? *(const uint4*)(h + k) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const u32 words[4] = {hv[i].x, hv[i].y, hv[i].z, hv[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float a = to_f32((u16)(words[j] & 0xFFFFu)), b = to_f32((u16)(words[j] >> 16));
      sq = fmaf(a, a, fmaf(b, b, sq));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
  if (lane == 0) warp_sums[warp] = sq;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) total += warp_sums[i];
  const float rstd = 1.f / sqrtf(total / NORM_K + eps);
#pragma unroll
  for (int i = 0; i < NORM_VECS; ++i) {
    const int k = 8 * (threadIdx.x + i * WARPS * 32);
    if (k < NORM_K) {
      const u32 hw[4] = {hv[i].x, hv[i].y, hv[i].z, hv[i].w}, ww[4] = {wv[i].x, wv[i].y, wv[i].z, wv[i].w};
      u32 o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u16 lo = from_f32(to_f32(from_f32(to_f32((u16)(hw[j] & 0xFFFFu)) * rstd)) * to_f32((u16)(ww[j] & 0xFFFFu)));
        const u16 hi = from_f32(to_f32(from_f32(to_f32((u16)(hw[j] >> 16)) * rstd)) * to_f32((u16)(ww[j] >> 16)));
        o[j] = (u32)lo | ((u32)hi << 16);
      }
      *(uint4*)(xs + k) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
}
#endif

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col." MMA_TYPES " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#ifndef MINB
#define MINB 1                      // __launch_bounds__' blocks an SM: caps the registers
#endif
#ifndef STAGES
#define STAGES 0
#endif
#ifndef RELEASE
#define RELEASE 0
#endif
#ifndef GATED
#define GATED 0
#endif
#define ROWS (2 * TILES)        // rows a thread holds, i < ROWS: block rows r + 8 i (GATED: see LOCAL)
#if GATED
// Block row of a thread's row i: gate rows (i even) first, their up rows (i odd) 8 TILES later.
#define LOCAL(i) (((i) & 1) * 8 * TILES + ((i) >> 1) * 8 + r)
#else
#define LOCAL(i) (r + 8 * (i))
#endif

// uint4s of dynamic shared memory the cp.async stages take (the NORM row follows them)
#if STAGES
#define STAGE_UINT4S (WARPS * STAGES * (ROWS * SPANS * 32 + 8 * TILES))
#else
#define STAGE_UINT4S 0
#endif

struct Group {                      // one group's codes of the thread's rows, their scales and zeros
  uint4 q[ROWS][SPANS];
  u16 s[2][ROWS], z[2][ROWS];       // [low / high half][row]
};

__device__ __forceinline__ void load_group(Group& G, const u8* const* qrow, const u16* sc, const u16* zr,
                                           int g, int half_groups, int N, const int* row) {
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int p = 0; p < SPANS; ++p) G.q[i][p] = ld_codes(qrow[i] + g * GROUP + p * 64);
  const size_t lo = (size_t)g * N, hi = (size_t)(g + half_groups) * N;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    G.s[0][i] = sc[lo + row[i]]; G.s[1][i] = sc[hi + row[i]];
    G.z[0][i] = zr[lo + row[i]]; G.z[1][i] = zr[hi + row[i]];
  }
}

// acc[tile] (rows r + 16 t, r + 16 t + 8; columns 2c, 2c + 1) += one group of both halves.
__device__ __forceinline__ void multiply_group(float (*acc)[4], const Group& G, const u16* xlo, const u16* xhi,
                                               bool has_x, int g) {
  const u32 one = ONE2;
  float cl[TILES][4], ch[TILES][4];
  float sl[4] = {0.f, 0.f, 0.f, 0.f}, sh[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) cl[t][e] = ch[t][e] = 0.f;
#pragma unroll
  for (int p = 0; p < SPANS; ++p) {
    const int off = g * GROUP + p * 64;   // this thread's 16 codes of each half: xlo/xhi hold + 16 c
    uint4 l0 = make_uint4(0, 0, 0, 0), l1 = l0, h0 = l0, h1 = l0;
    if (has_x) {
      l0 = ld_x(xlo + off); l1 = ld_x(xlo + off + 8);
      h0 = ld_x(xhi + off); h1 = ld_x(xhi + off + 8);
    }
    const u32 xl[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
    const u32 xh[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {         // word w: bytes off + 16 c + 4 w .. + 3
      const u32 bl0 = __byte_perm(xl[2 * w], xl[2 * w + 1], 0x5410);  // (x[j], x[j + 2])
      const u32 bl1 = __byte_perm(xl[2 * w], xl[2 * w + 1], 0x7632);  // (x[j + 1], x[j + 3])
      const u32 bh0 = __byte_perm(xh[2 * w], xh[2 * w + 1], 0x5410);
      const u32 bh1 = __byte_perm(xh[2 * w], xh[2 * w + 1], 0x7632);
#pragma unroll
      for (int t = 0; t < TILES; ++t) {
        const u32 qa = ((const u32*)&G.q[2 * t][p])[w], qb = ((const u32*)&G.q[2 * t + 1][p])[w];
        mma(cl[t], UNIT(qa, SH0), UNIT(qb, SH0), UNIT(qa, SH2), UNIT(qb, SH2), bl0, bl1);
        mma(ch[t], UNIT(qa, SH1), UNIT(qb, SH1), UNIT(qa, SH3), UNIT(qb, SH3), bh0, bh1);
      }
      mma(sl, one, one, one, one, bl0, bl1);  // sum(x): A of ones, the same for every row
      mma(sh, one, one, one, one, bh0, bh1);
    }
  }
  // 16 s sum(w' x) - s (16 + z) sum(x) per row (fragments 0, 1: row r + 16 t; 2, 3: + 8)
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 2 * t + (e >> 1);
      const float s_lo = to_f32(G.s[0][i]), z_lo = to_f32(G.z[0][i]);
      const float s_hi = to_f32(G.s[1][i]), z_hi = to_f32(G.z[1][i]);
      acc[t][e] = fmaf(16.f * s_lo, cl[t][e], fmaf(-s_lo * (16.f + z_lo), sl[e], acc[t][e]));
      acc[t][e] = fmaf(16.f * s_hi, ch[t][e], fmaf(-s_hi * (16.f + z_hi), sh[e], acc[t][e]));
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
w4a16_mma(u16* __restrict__ y, const u16* __restrict__ x, const u8* __restrict__ qw,
          const u16* __restrict__ scales, const u16* __restrict__ zeros,
          int M, int N, int S, int stride_xm, int stride_ym,
          const u16* __restrict__ norm_w, float eps, const u16* __restrict__ residual, int stride_rm) {
  __shared__ float red[WARPS][16 * TILES][8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, c = lane & 3;   // the MMA's groupID and thread-in-group
#if GATED
  const int n0 = blockIdx.x * 8 * TILES;   // this block's outputs (and gate rows); up rows at N / 2 + ..
#define BLOCK_ROW(L) ((L) < 8 * TILES ? n0 + (L) : N / 2 + n0 + (L) - 8 * TILES)
#else
  const int n0 = blockIdx.x * 16 * TILES;
#define BLOCK_ROW(L) (n0 + (L))
#endif
  int row[ROWS];
  const u8* qrow[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    row[i] = min(BLOCK_ROW(LOCAL(i)), N - 1);   // rows past N: read, not stored
    qrow[i] = qw + (size_t)row[i] * S + 16 * c;
  }
  const int half_groups = S / GROUP;
  const int g_begin = warp * half_groups / WARPS, g_end = (warp + 1) * half_groups / WARPS;
  const bool has_x = r < M;                // this thread holds x's row r in the B fragment
#if NORM
  // M == 1: the normalized row, after the stage buffers (wait_for_x below fills it)
  extern __shared__ uint4 dynamic_smem[];
  u16* xs = (u16*)(dynamic_smem + STAGE_UINT4S);
  const u16* xlo = xs + 16 * c;
#else
  const u16* xlo = x + (size_t)(has_x ? r : 0) * stride_xm + 16 * c;
#endif
  const u16* xhi = xlo + S;
  float acc[TILES][4];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

#if STAGES
  // Per warp and stage: each lane's ROWS x SPANS 16-byte code chunks ([chunk][lane]: a warp's
  // accesses are consecutive), then the block rows' scales and zeros of the group's two halves
  // (s_lo, z_lo, s_hi, z_hi: 16 TILES u16 each, copied by the first 8 TILES lanes).
  constexpr int CHUNKS = ROWS * SPANS * 32, STAGE = CHUNKS + 8 * TILES;  // uint4s a stage
  extern __shared__ uint4 stages[];
  uint4* mine = stages + warp * STAGES * STAGE;
  const int nb = g_end - g_begin;
  auto issue = [&](int j) {                 // group g_begin + j into stage j % STAGES
    if (j < nb) {
      uint4* st = mine + (j % STAGES) * STAGE;
      const int g = g_begin + j;
#pragma unroll
      for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int p = 0; p < SPANS; ++p) cp_async16(st + (i * SPANS + p) * 32 + lane, qrow[i] + g * GROUP + p * 64);
      if (lane < 8 * TILES) {
        const int which = lane / (2 * TILES), part = lane % (2 * TILES);   // which: s_lo z_lo s_hi z_hi
        const u16* src = ((which & 1) ? zeros : scales) + (size_t)(g + (which >> 1) * half_groups) * N + BLOCK_ROW(8 * part);
        cp_async16(st + CHUNKS + lane, src);
      }
    }
    cp_async_commit();                      // empty groups too: the wait below counts groups
  };
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) issue(j);
#if NORM
  uint4 norm_wv[NORM_VECS];
  load_norm_weight(norm_wv, norm_w);
#endif
  wait_for_x();
#if NORM
  normalize_row(xs, x, norm_wv, eps);
#endif
  for (int j = 0; j < nb; ++j) {
    cp_async_wait<STAGES - 2>();            // group j has landed (this lane's copies)
    __syncwarp();                           // ... and every lane's; stage (j - 1) % STAGES is free
    issue(j + STAGES - 1);
    const uint4* st = mine + (j % STAGES) * STAGE;
    Group cur;
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
      for (int p = 0; p < SPANS; ++p) cur.q[i][p] = st[(i * SPANS + p) * 32 + lane];
    const u16* sz = (const u16*)(st + CHUNKS);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      cur.s[0][i] = sz[LOCAL(i)]; cur.z[0][i] = sz[16 * TILES + LOCAL(i)];
      cur.s[1][i] = sz[32 * TILES + LOCAL(i)]; cur.z[1][i] = sz[48 * TILES + LOCAL(i)];
    }
    multiply_group(acc, cur, xlo, xhi, has_x, g_begin + j);
  }
#else
  Group ring[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (g_begin + d < g_end) load_group(ring[d], qrow, scales, zeros, g_begin + d, half_groups, N, row);
#if NORM
  uint4 norm_wv[NORM_VECS];
  load_norm_weight(norm_wv, norm_w);
#endif
  wait_for_x();
#if NORM
  normalize_row(xs, x, norm_wv, eps);
#endif
  for (int g = g_begin; g < g_end; g += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (g + d < g_end) {
        const Group cur = ring[d];
        if (g + d + DEPTH < g_end) load_group(ring[d], qrow, scales, zeros, g + d + DEPTH, half_groups, N, row);
        multiply_group(acc, cur, xlo, xhi, has_x, g + d);
      }
    }
  }
#endif
#if PDL && RELEASE == 2
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    red[warp][LOCAL(2 * t)][2 * c] = acc[t][0];
    red[warp][LOCAL(2 * t)][2 * c + 1] = acc[t][1];
    red[warp][LOCAL(2 * t + 1)][2 * c] = acc[t][2];
    red[warp][LOCAL(2 * t + 1)][2 * c + 1] = acc[t][3];
  }
  __syncthreads();
#if GATED
  for (int idx = threadIdx.x; idx < 8 * TILES * M; idx += WARPS * 32) {
    const int o = idx % (8 * TILES), col = idx / (8 * TILES);
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) { g += red[w][o][col]; u += red[w][8 * TILES + o][col]; }
    // gate and up rounded to the dtype first, as gate_up's output is before silu_mul reads it
    if (n0 + o < N / 2) y[(size_t)col * stride_ym + n0 + o] = silu_mul1(from_f32(g), from_f32(u));
  }
#else
  for (int idx = threadIdx.x; idx < 16 * TILES * M; idx += WARPS * 32) {
    const int rr = idx % (16 * TILES), col = idx / (16 * TILES);
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += red[w][rr][col];   // in order of warp: fixed bits
#if RESIDUAL
    if (n0 + rr < N) y[(size_t)col * stride_ym + n0 + rr] =
        from_f32(to_f32(from_f32(s)) + to_f32(residual[(size_t)col * stride_rm + n0 + rr]));
#else
    if (n0 + rr < N) y[(size_t)col * stride_ym + n0 + rr] = from_f32(s);
#endif
  }
#endif
#if PDL && RELEASE == 0
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
