// INT4 (w4a16) routed-expert MoE: int4_repack, int4_moe_out, int4_moe.  Semantics, the
// weight layout and the workspace layout are documented in torch_kdtree/ops/moe.py.
//
// Layout: weights are the A operand of mma.m16n8k16 (channels on the m side, "swap AB"), so
// one int32 of the repacked weights is exactly one lane's A fragment for a 16x16 tile and a
// 16-byte load is four k16 steps; tokens are the n side (8 per n8 tile, block_size per CTA).
// Dequantisation: lop3 puts a nibble pair into the mantissas of bf16 128.0, one bf16x2
// subtraction of 136.0 gives q - 8 exactly, one bf16x2 multiply applies the scale.
//
// Pipeline per MoE call (all launch shapes depend on shapes only; CUDA-graph safe):
//   1. align (one CTA): histogram of local expert ids, block prefix sum, scatter of the
//      (token, k) entries into fixed-size blocks of block_size rows per expert; zeroes the
//      split-K tile counters.
//   2. gate/up GEMM: CTA = (expert block, 128 w13 channels = 64 gate + 64 up, K split).
//      4 warps x (gate tile, up tile) x all tokens of the block; weights, scales and the
//      gathered activation rows stream through a 4-stage cp.async ring; the activations in
//      shared memory feed all four warps.  With k_splits > 1 each CTA writes fp32 partials in
//      register order and the last CTA of a tile (atomic ticket) sums them in split order
//      (deterministic), then SiLU(gate) * up -> act (bf16).
//   3. down GEMM: CTA = (expert block, 128 output channels); epilogue multiplies by the router
//      weight and writes one bf16 row per (token, k) entry.
//   4. combine: out[t] = sum_j y[t, j] in fixed order j = 0..k-1 (fp32), skipping entries
//      whose expert is not on this rank.  No float atomics anywhere.
// Decode-sized calls (int4_decode_applies: T·k <= 32) skip all four for two GEMV launches
// (moe_decode.cu) with the same numerics up to fp32 summation order.
// Launches after the first use programmatic dependent launch (pdl.cuh).
// Bounds: decode sizes stream the touched experts' weights (0.5 byte per weight + 1/16 for the
// scales) once; every weight byte feeds block_size tokens, so large T becomes mma-bound.
// No wgmma, no TMA, no L2 cache hints: the same code runs on sm_90 and sm_120 (smem <= 51 KB here;
// the decode path's gate/up takes up to 69 KB and thread-block clusters, both on sm_90 and sm_120).
#include "bf16_vec.cuh"
#include "check.h"
#include "int4_mma.cuh"
#include "moe_decode.h"
#include "pdl.cuh"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace kdtree {
namespace {

using bf16 = __nv_bfloat16;
using bf162 = __nv_bfloat162;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMW = 2;                     // m16 weight tiles per warp
constexpr int kCtaN = kWarps * kMW * 16;   // 128 channels per CTA
constexpr int kTileK = 64;                 // k per weight tile / pipeline stage
constexpr int kStages = 4;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopk = 16;
constexpr int kMaxSplits = 16;
constexpr int kAlignThreads = 1024;
constexpr int kCombineThreads = 64;  // small blocks: a decode call's H / 8 threads still spread over SMs
constexpr int kCombineBatch = 4;     // top-k entries loaded together
constexpr int64_t kRegionAlign = 256;

// ------------------------------------------------------------------------------------------
// PTX helpers
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// ------------------------------------------------------------------------------------------
// int4_repack
// ------------------------------------------------------------------------------------------

// out[e][m][c][lane*4 + s], slot j: channel 16m + g + 8(j&1), k = 64c + 16s + 2t + 8((j>>1)&1) + (j>>2).
__global__ void repack_qweight_kernel(const uint32_t* __restrict__ packed, uint32_t* __restrict__ out, int64_t total,
                                      int N, int K8, int MT, int KC) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t q = idx;
    const int entry = int(q % 128);
    q /= 128;
    const int c = int(q % KC);
    q /= KC;
    const int m = int(q % MT);
    const int64_t e = q / MT;
    const int lane = entry >> 2, s = entry & 3, g = lane >> 2, t = lane & 3;
    uint32_t v = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = 16 * m + g + 8 * (j & 1);
      const int k = 64 * c + 16 * s + 2 * t + 8 * ((j >> 1) & 1) + (j >> 2);
      const uint32_t w = packed[(e * N + n) * K8 + (k >> 3)];
      v |= ((w >> (4 * (k & 7))) & 0xFu) << (4 * j);
    }
    out[idx] = v;
  }
}

// out[e][m][grp][2g + h] = scale[e][16m + g + 8h][grp]
__global__ void repack_scales_kernel(const bf16* __restrict__ scale, bf16* __restrict__ out, int64_t total, int N,
                                     int G, int MT) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t q = idx;
    const int i = int(q % 16);
    q /= 16;
    const int grp = int(q % G);
    q /= G;
    const int m = int(q % MT);
    const int64_t e = q / MT;
    const int n = 16 * m + (i >> 1) + 8 * (i & 1);
    out[idx] = scale[(e * N + n) * G + grp];
  }
}

// ------------------------------------------------------------------------------------------
// align: (token, k) entries -> expert blocks of TB rows (one CTA, 1024 threads)
// ------------------------------------------------------------------------------------------

template <typename IdT>
__global__ void __launch_bounds__(kAlignThreads)
moe_align_kernel(const IdT* __restrict__ topk_ids, const int32_t* __restrict__ emap, int num_global, int M, int E,
                 int TB, int max_blocks, int num_counters, int32_t* __restrict__ meta,
                 int32_t* __restrict__ sorted_ids, int32_t* __restrict__ block_expert, int32_t* __restrict__ counters) {
  __shared__ int s_count[kMaxExperts];
  __shared__ int s_start[kMaxExperts + 1];
  __shared__ int s_cursor[kMaxExperts];
  __shared__ int s_warp[32];
  __shared__ int s_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  pdl_launch_dependents();  // gate/up's CTAs may get resident now; they wait for this grid
  for (int e = tid; e < E; e += blockDim.x) {
    s_count[e] = 0;
    s_cursor[e] = 0;
  }
  for (int i = tid; i < num_counters; i += blockDim.x) counters[i] = 0;
  __syncthreads();
  for (int i = tid; i < M; i += blockDim.x) {
    const int e = local_expert(topk_ids, i, emap, num_global, E);
    if (e >= 0) atomicAdd(&s_count[e], 1);
  }
  __syncthreads();
  // Exclusive prefix sum of blocks per expert (blockDim == 1024 >= E: one expert per thread).
  const int v = tid < E ? (s_count[tid] + TB - 1) / TB : 0;
  int incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += n;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int wv = s_warp[lane];
    int wi = wv;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, wi, off);
      if (lane >= off) wi += n;
    }
    s_warp[lane] = wi - wv;
    if (lane == 31) s_total = wi;
  }
  __syncthreads();
  if (tid < E) s_start[tid] = s_warp[warp] + incl - v;
  if (tid == 0) s_start[E] = s_total;
  __syncthreads();
  const int total = s_total;  // <= max_blocks by construction of the bound
  if (tid == 0) meta[0] = total;
  for (int b = tid; b < max_blocks; b += blockDim.x) {
    int e = -1;
    if (b < total) {  // largest e with s_start[e] <= b (empty experts share their successor's start)
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_start[mid] <= b) lo = mid; else hi = mid - 1;
      }
      e = lo;
    }
    block_expert[b] = e;
  }
  for (int p = tid; p < max_blocks * TB; p += blockDim.x) sorted_ids[p] = M;  // padding sentinel
  __syncthreads();
  for (int i = tid; i < M; i += blockDim.x) {
    const int e = local_expert(topk_ids, i, emap, num_global, E);
    if (e >= 0) sorted_ids[s_start[e] * TB + atomicAdd(&s_cursor[e], 1)] = i;
  }
}

// ------------------------------------------------------------------------------------------
// the two GEMMs
// ------------------------------------------------------------------------------------------

struct GemmArgs {
  const int4* qweight;        // [E][N/16][K/64][32] (16-byte units)
  const bf16* scales;         // [E][N/16][K/GS][16]
  const bf16* a;              // gate/up: x [T][K]; down: act [R][K]
  int K, N, M, topk;          // M = T * topk, the padding sentinel
  const int32_t* meta;        // meta[0] = number of expert blocks
  const int32_t* sorted_ids;  // [R] entries t * topk + j, or M
  const int32_t* block_expert;
  int k_splits, max_blocks;
  int32_t* counters;          // gate/up split-K tickets [max_blocks][N / 128]
  float* partials;            // [k_splits][max_blocks][N / 128][128 * TB] in register order
  bf16* act;                  // [R][N / 2] (gate/up output, down input)
  const float* topk_weights;  // [M]
  bf16* y;                    // [M][N] (down output)
};

template <int TB, int GS>
struct GemmSmem {
  static constexpr int kScaleChunks = GS == 32 ? 4 : 2;  // 16-byte pieces of one tile's scales per stage
  static constexpr int kScaleBytes = kScaleChunks * 16;
  static constexpr int kWBytes = kWarps * kMW * 512;
  static constexpr int kSBytes = kWarps * kMW * kScaleBytes;
  static constexpr int kABytes = TB * 128;               // TB rows x 64 bf16, 16-byte chunks XOR-swizzled
  static constexpr int kStageBytes = kWBytes + kSBytes + kABytes;
  static constexpr int kBytes = kStages * kStageBytes;
  static constexpr int kGatePitch = 64 + 8;    // epilogue staging rows (bf16), 16-byte multiple
  static constexpr int kDownPitch = 128 + 8;
  static_assert(TB * kGatePitch * 2 <= kBytes && TB * kDownPitch * 2 <= kBytes, "epilogue staging must fit");
};

template <int TB, int GS, bool kGateUp>
__global__ void __launch_bounds__(kThreads)
moe_gemm_kernel(const GemmArgs p) {
  using S = GemmSmem<TB, GS>;
  constexpr int NT = TB / 8;
  constexpr int NSC = GS == 32 ? 2 : 1;  // scale groups per k64 stage
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_rows[TB];
  __shared__ float s_tw[TB];
  __shared__ int s_last;

  // gate/up reads align's output straight away.  down may read align's output (two grids back:
  // complete before gate/up passed its wait and let down launch) and the weights before its
  // wait; only act, gate/up's output, needs the wait.  L2 loads (ldcg): align rewrote these
  // words while earlier CTAs of this SM may hold them in L1.
  if constexpr (kGateUp) pdl_wait();
  const int blk = blockIdx.y;
  if (blk >= __ldcg(p.meta)) return;  // beyond the blocks this routing produced
  const int e = __ldcg(p.block_expert + blk);
  const int n_tiles = p.N / kCtaN;
  const int ntile = blockIdx.x % n_tiles;
  const int split = blockIdx.x / n_tiles;
  const int kc_total = p.K / kTileK;
  const int c_begin = split * kc_total / p.k_splits;
  const int nchunks = (split + 1) * kc_total / p.k_splits - c_begin;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  if (tid < TB) {
    const int entry = __ldcg(p.sorted_ids + blk * TB + tid);
    s_rows[tid] = entry;
    if (!kGateUp) s_tw[tid] = entry < p.M ? p.topk_weights[entry] : 0.f;
  }
  __syncthreads();

  const int MT = p.N / 16;
  const int G = p.K / GS;
  const int mt_cta = ntile * (kWarps * kMW);
  // This lane's 16 bytes of its warp's first tile at chunk 0; tile + 1 is kc_total * 32 further.
  const int4* wsrc = p.qweight + (int64_t(e) * MT + mt_cta + warp * kMW) * kc_total * 32 + lane;

  auto load_weights = [&](int st, int c) {
    uint8_t* base = smem + st * S::kStageBytes;
    int4* sw = reinterpret_cast<int4*>(base);
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw)
      cp_async16(sw + (warp * kMW + mw) * 32 + lane, wsrc + (int64_t(mw) * kc_total + c) * 32);
    if (tid < kWarps * kMW * S::kScaleChunks) {
      const int tl = tid / S::kScaleChunks, q = tid % S::kScaleChunks;
      const bf16* src = p.scales + ((int64_t(e) * MT + mt_cta + tl) * G + (c * kTileK) / GS) * 16 + q * 8;
      cp_async16(base + S::kWBytes + tl * S::kScaleBytes + q * 16, src);
    }
  };
  auto load_acts = [&](int st, int c) {
    uint8_t* sa = smem + st * S::kStageBytes + S::kWBytes + S::kSBytes;
    for (int i = tid; i < TB * 8; i += kThreads) {
      const int r = i >> 3, ch = i & 7;
      const int entry = s_rows[r];
      const bool valid = entry < p.M;
      const bf16* src = kGateUp ? p.a + int64_t(valid ? entry / p.topk : 0) * p.K + c * kTileK + ch * 8
                                : p.a + (int64_t(blk) * TB + r) * p.K + c * kTileK + ch * 8;
      cp_async16(sa + r * 128 + ((ch ^ (r & 7)) << 4), src, valid);
    }
  };

  float acc[kMW][NT][4];
#pragma unroll
  for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mw][nt][r] = 0.f;

  auto compute_stage = [&](int st) {
    const uint8_t* base = smem + st * S::kStageBytes;
    const int4* sw = reinterpret_cast<const int4*>(base);
    int4 wq[kMW];
    uint32_t sc[kMW][NSC];
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw) {
      wq[mw] = sw[(warp * kMW + mw) * 32 + lane];
      const uint8_t* sb = base + S::kWBytes + (warp * kMW + mw) * S::kScaleBytes;
#pragma unroll
      for (int h = 0; h < NSC; ++h) sc[mw][h] = *reinterpret_cast<const uint32_t*>(sb + h * 32 + g * 4);
    }
    const uint32_t sa = smem_u32(base + S::kWBytes + S::kSBytes);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t b[NT][2];
      if constexpr (NT == 1) {
        // matrices: chunk 2s (k 0..7 of the step) and 2s + 1 (k 8..15); lanes 16..31 mirror 0..15
        const int i = (lane >> 3) & 1, r = lane & 7;
        ldmatrix_x2(b[0], sa + r * 128 + (((2 * s + i) ^ r) << 4));
      } else {
        const int i = lane >> 3, r = lane & 7;
#pragma unroll
        for (int np = 0; np < NT; np += 2) {
          // matrices: (tile np, chunk 2s), (np, 2s + 1), (np + 1, 2s), (np + 1, 2s + 1)
          const int row = (np + (i >> 1)) * 8 + r;
          uint32_t v[4];
          ldmatrix_x4(v, sa + row * 128 + (((2 * s + (i & 1)) ^ r) << 4));
          b[np][0] = v[0];
          b[np][1] = v[1];
          b[np + 1][0] = v[2];
          b[np + 1][1] = v[3];
        }
      }
#pragma unroll
      for (int mw = 0; mw < kMW; ++mw) {
        uint32_t a[4];
        dequant_a(reinterpret_cast<const uint32_t*>(&wq[mw])[s], sc[mw][NSC == 2 ? (s >> 1) : 0], a);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_bf16(acc[mw][nt], a, b[nt]);
      }
    }
  };

  // Prologue: weights of the first stages first (they never depend on the previous kernel),
  // then the activations; group 0 holds all prologue weights, so group i done => stage i full.
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st)
    if (st < nchunks) load_weights(st, c_begin + st);
  if constexpr (!kGateUp) pdl_wait();
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < nchunks) load_acts(st, c_begin + st);
    cp_async_commit();
  }
  for (int i = 0; i < nchunks; ++i) {
    cp_async_wait<kStages - 2>();  // chunk i has landed (this thread's copies)
    __syncthreads();               // ... everyone's; and chunk i - 1's stage is free again
    const int nxt = i + kStages - 1;
    if (nxt < nchunks) {
      load_weights(nxt % kStages, c_begin + nxt);
      load_acts(nxt % kStages, c_begin + nxt);
    }
    cp_async_commit();
    compute_stage(i % kStages);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is reused for the epilogue staging below
  pdl_launch_dependents();  // the next kernel waits for this grid's completion before reading its output

  if constexpr (kGateUp) {
    if (p.k_splits > 1) {
      constexpr int R4 = kMW * NT;  // float4s per thread
      const int64_t tiles = int64_t(p.max_blocks) * n_tiles;
      const int64_t tile_id = int64_t(blk) * n_tiles + ntile;
      float4* part = reinterpret_cast<float4*>(p.partials);
      float4* mine = part + (int64_t(split) * tiles + tile_id) * R4 * kThreads;
#pragma unroll
      for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mine[(mw * NT + nt) * kThreads + tid] =
              make_float4(acc[mw][nt][0], acc[mw][nt][1], acc[mw][nt][2], acc[mw][nt][3]);
      __threadfence();
      __syncthreads();
      if (tid == 0) s_last = atomicAdd(p.counters + tile_id, 1) == p.k_splits - 1;
      __syncthreads();
      if (!s_last) return;
      __threadfence();
      // The last CTA of the tile sums every split's partials in split order (deterministic).
#pragma unroll
      for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[mw][nt][r] = 0.f;
      for (int sp = 0; sp < p.k_splits; ++sp) {
        const float4* src = part + (int64_t(sp) * tiles + tile_id) * R4 * kThreads;
#pragma unroll
        for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const float4 v = __ldcg(src + (mw * NT + nt) * kThreads + tid);
            acc[mw][nt][0] += v.x;
            acc[mw][nt][1] += v.y;
            acc[mw][nt][2] += v.z;
            acc[mw][nt][3] += v.w;
          }
      }
    }
    // acc[0] = gate, acc[1] = up of intermediate channels 64 ntile + 16 warp + (g, g + 8).
    bf16* so = reinterpret_cast<bf16*>(smem);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int col = nt * 8 + 2 * t + (r & 1);
        const int ch = warp * 16 + g + 8 * (r >> 1);
        const float gv = acc[0][nt][r], uv = acc[1][nt][r];
        so[col * S::kGatePitch + ch] = __float2bfloat16(silu_mul(gv, uv));
      }
    __syncthreads();
    const int I = p.N / 2;
    for (int i = tid; i < TB * 8; i += kThreads) {
      const int r = i >> 3, q = i & 7;
      *reinterpret_cast<int4*>(p.act + (int64_t(blk) * TB + r) * I + ntile * 64 + q * 8) =
          *reinterpret_cast<const int4*>(so + r * S::kGatePitch + q * 8);
    }
  } else {
    bf16* so = reinterpret_cast<bf16*>(smem);
#pragma unroll
    for (int mw = 0; mw < kMW; ++mw)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int col = nt * 8 + 2 * t + (r & 1);
          const int ch = warp * 32 + mw * 16 + g + 8 * (r >> 1);
          so[col * S::kDownPitch + ch] = __float2bfloat16(acc[mw][nt][r] * s_tw[col]);
        }
    __syncthreads();
    for (int i = tid; i < TB * 16; i += kThreads) {
      const int r = i >> 4, q = i & 15;
      const int entry = s_rows[r];
      if (entry < p.M)
        *reinterpret_cast<int4*>(p.y + int64_t(entry) * p.N + ntile * kCtaN + q * 8) =
            *reinterpret_cast<const int4*>(so + r * S::kDownPitch + q * 8);
    }
  }
}

// out[t][8c .. 8c + 8) = sum over j = 0..topk-1 (in order) of y[t * topk + j][...] for local experts.
template <typename IdT>
__global__ void moe_combine_kernel(const bf16* __restrict__ y, const IdT* __restrict__ topk_ids,
                                   const int32_t* __restrict__ emap, int num_global, int E, int64_t T, int topk, int H,
                                   bf16* __restrict__ out) {
  pdl_wait();  // y comes from the down GEMM
  const int chunks = H / 8;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < T * chunks;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t tok = idx / chunks;
    const int c = int(idx % chunks);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int j0 = 0; j0 < topk; j0 += kCombineBatch) {  // a batch's loads in flight together
      int4 v[kCombineBatch];
      bool ok[kCombineBatch];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        const int64_t entry = tok * topk + j0 + u;
        ok[u] = j0 + u < topk && local_expert(topk_ids, entry, emap, num_global, E) >= 0;
        if (ok[u]) v[u] = __ldcg(reinterpret_cast<const int4*>(y + entry * H) + c);
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        if (!ok[u]) continue;
        const bf162* h = reinterpret_cast<const bf162*>(&v[u]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(h[i]);
          acc[2 * i] += f.x;
          acc[2 * i + 1] += f.y;
        }
      }
    }
    int4 o;
    bf162* oh = reinterpret_cast<bf162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    reinterpret_cast<int4*>(out + tok * H)[c] = o;
  }
}

// ------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Mirrors ops/moe.py int4_moe_workspace_bytes (same regions, same order).
struct Workspace {
  int64_t M, B, R, N1;
  int64_t meta, sorted_ids, block_expert, counters, act, partials, y, total;
};

Workspace workspace_layout(int64_t T, int64_t topk, int64_t E, int64_t H, int64_t I, int64_t TB, int64_t S) {
  Workspace w{};
  w.M = T * topk;
  w.B = (w.M + TB - 1) / TB + std::min(E, w.M);
  w.R = w.B * TB;
  w.N1 = 2 * I / kCtaN;
  const bool split = S > 1;
  const int64_t sizes[7] = {16, 4 * w.R, 4 * w.B, split ? 4 * w.B * w.N1 : 0, 2 * w.R * I,
                            split ? 4 * S * w.B * w.N1 * kCtaN * TB : 0, 2 * w.M * H};
  int64_t* offs[7] = {&w.meta, &w.sorted_ids, &w.block_expert, &w.counters, &w.act, &w.partials, &w.y};
  int64_t at = 0;
  for (int i = 0; i < 7; ++i) {
    *offs[i] = at;
    at += round_up(sizes[i], kRegionAlign);
  }
  w.total = at;
  return w;
}

void check_moe_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int dim) {
  check_cuda_tensor(t, op, name, dtype, dim);
  KD_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 || t.numel() == 0, op, ": ", name,
              " must be 16-byte aligned");
}

std::tuple<at::Tensor, at::Tensor> int4_repack_cuda(const at::Tensor& packed, const at::Tensor& scale,
                                                    int64_t group_size) {
  const char* op = "kdtree::int4_repack";
  KD_CHECK(packed.is_cuda() && scale.is_cuda() && packed.device() == scale.device(), op,
              ": packed and scale must be on one CUDA device");
  KD_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.is_contiguous(), op,
              ": packed must be a contiguous int32 [E, N, K/8] tensor");
  KD_CHECK(scale.scalar_type() == at::kBFloat16 && scale.dim() == 3 && scale.is_contiguous(), op,
              ": scale must be a contiguous bfloat16 [E, N, K/group] tensor");
  KD_CHECK(group_size == 32 || group_size == 64 || group_size == 128, op, ": group_size must be 32, 64 or 128, got ",
              group_size);
  const int64_t E = packed.size(0), N = packed.size(1), K = packed.size(2) * 8;
  KD_CHECK(N % 16 == 0, op, ": N = ", N, " output channels must be a multiple of 16");
  KD_CHECK(K % kTileK == 0 && K % group_size == 0, op, ": K = ", K,
              " input channels must be a multiple of 64 and of the group size ", group_size);
  KD_CHECK(scale.size(0) == E && scale.size(1) == N && scale.size(2) == K / group_size, op,
              ": scale must be [E, N, K/group] = [", E, ", ", N, ", ", K / group_size, "], got ", scale.sizes());
  KD_CHECK(N * K < (int64_t(1) << 40), op, ": tensor too large");
  const c10::cuda::CUDAGuard guard(packed.device());
  const int64_t MT = N / 16, KC = K / kTileK, G = K / group_size;
  at::Tensor qweight = at::empty({E, MT, KC, 128}, packed.options());
  at::Tensor scales = at::empty({E, MT, G, 16}, scale.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t nq = qweight.numel(), ns = scales.numel();
  if (nq > 0) {
    const int blocks = int(std::min<int64_t>((nq + 255) / 256, 65536));
    repack_qweight_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                                                      reinterpret_cast<uint32_t*>(qweight.data_ptr<int32_t>()), nq,
                                                      int(N), int(K / 8), int(MT), int(KC));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (ns > 0) {
    const int blocks = int(std::min<int64_t>((ns + 255) / 256, 65536));
    repack_scales_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const bf16*>(scale.data_ptr()),
                                                     reinterpret_cast<bf16*>(scales.data_ptr()), ns, int(N), int(G),
                                                     int(MT));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {qweight, scales};
}

template <int TB, int GS>
void launch_gemms(GemmArgs up, GemmArgs down, int64_t n1, int64_t n2, int64_t max_blocks, int64_t k_splits,
                  cudaStream_t stream, bool pdl) {
  using S = GemmSmem<TB, GS>;
  auto* k_up = &moe_gemm_kernel<TB, GS, true>;
  auto* k_down = &moe_gemm_kernel<TB, GS, false>;
  if (S::kBytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(k_up, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
    C10_CUDA_CHECK(cudaFuncSetAttribute(k_down, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
  }
  launch_kernel(k_up, dim3(unsigned(n1 * k_splits), unsigned(max_blocks)), dim3(kThreads), S::kBytes, stream, pdl, up);
  launch_kernel(k_down, dim3(unsigned(n2), unsigned(max_blocks)), dim3(kThreads), S::kBytes, stream, pdl, down);
}

template <int TB>
void dispatch_group(int64_t gs, GemmArgs up, GemmArgs down, int64_t n1, int64_t n2, int64_t B, int64_t S,
                    cudaStream_t stream, bool pdl) {
  if (gs == 32) launch_gemms<TB, 32>(up, down, n1, n2, B, S, stream, pdl);
  else if (gs == 64) launch_gemms<TB, 64>(up, down, n1, n2, B, S, stream, pdl);
  else launch_gemms<TB, 128>(up, down, n1, n2, B, S, stream, pdl);
}

struct MoeDims {
  int64_t T, H, I, E, topk, num_global;
};

// Structural checks (never read tensor data); the Python wrapper checks values in eager mode.
MoeDims check_moe_inputs(const char* op, const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& w13_s,
                         const at::Tensor& w2_q, const at::Tensor& w2_s, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, const std::optional<at::Tensor>& expert_map,
                         int64_t group_size, int64_t block_size, int64_t k_splits) {
  check_moe_tensor(x, op, "x", at::kBFloat16, 2);
  check_moe_tensor(w13_q, op, "w13_qweight", at::kInt, 4);
  check_moe_tensor(w13_s, op, "w13_scales", at::kBFloat16, 4);
  check_moe_tensor(w2_q, op, "w2_qweight", at::kInt, 4);
  check_moe_tensor(w2_s, op, "w2_scales", at::kBFloat16, 4);
  KD_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  check_moe_tensor(topk_ids, op, "topk_ids", topk_ids.scalar_type(), 2);
  check_moe_tensor(topk_weights, op, "topk_weights", at::kFloat, 2);
  const at::Device dev = x.device();
  for (const at::Tensor* t : {&w13_q, &w13_s, &w2_q, &w2_s, &topk_ids, &topk_weights})
    KD_CHECK(t->device() == dev, op, ": all inputs must be on one device");
  MoeDims d{};
  d.T = x.size(0);
  d.H = x.size(1);
  d.I = w13_q.size(1) * 8;
  d.E = w13_q.size(0);
  d.topk = topk_ids.size(1);
  d.num_global = d.E;
  if (expert_map.has_value()) {
    check_moe_tensor(*expert_map, op, "expert_map", at::kInt, 1);
    KD_CHECK(expert_map->device() == dev, op, ": all inputs must be on one device");
    d.num_global = expert_map->size(0);
  }
  KD_CHECK(group_size == 32 || group_size == 64 || group_size == 128, op,
              ": group_size must be 32, 64 or 128, got ", group_size);
  KD_CHECK(block_size == 8 || block_size == 16 || block_size == 32 || block_size == 64, op,
              ": block_size must be 8, 16, 32 or 64, got ", block_size);
  KD_CHECK(d.E >= 1 && d.E <= kMaxExperts, op, ": the number of local experts must be in [1, ", kMaxExperts,
              "], got ", d.E);
  KD_CHECK(d.num_global <= (int64_t(1) << 30), op, ": expert_map too long");
  KD_CHECK(d.H % kCtaN == 0 && d.H % group_size == 0, op, ": hidden size H = ", d.H,
              " must be a multiple of 128 and of ", group_size);
  KD_CHECK(d.I > 0 && d.I % kTileK == 0 && d.I % group_size == 0, op, ": intermediate size I = ", d.I,
              " must be a positive multiple of 64 and of ", group_size);
  const int64_t E = d.E, H = d.H, I = d.I;
  KD_CHECK(w13_q.sizes().vec() == std::vector<int64_t>({E, 2 * I / 16, H / 64, 128}), op,
              ": w13_qweight must be [", E, ", ", 2 * I / 16, ", ", H / 64, ", 128], got ", w13_q.sizes());
  KD_CHECK(w13_s.sizes().vec() == std::vector<int64_t>({E, 2 * I / 16, H / group_size, 16}), op,
              ": w13_scales must be [", E, ", ", 2 * I / 16, ", ", H / group_size, ", 16], got ", w13_s.sizes());
  KD_CHECK(w2_q.sizes().vec() == std::vector<int64_t>({E, H / 16, I / 64, 128}), op, ": w2_qweight must be [", E,
              ", ", H / 16, ", ", I / 64, ", 128], got ", w2_q.sizes());
  KD_CHECK(w2_s.sizes().vec() == std::vector<int64_t>({E, H / 16, I / group_size, 16}), op,
              ": w2_scales must be [", E, ", ", H / 16, ", ", I / group_size, ", 16], got ", w2_s.sizes());
  KD_CHECK(topk_ids.size(0) == d.T && topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_ids and topk_weights must both be [T = ", d.T, ", k], got ", topk_ids.sizes(), " and ",
              topk_weights.sizes());
  KD_CHECK(d.topk >= 1 && d.topk <= kMaxTopk, op, ": top-k must be in [1, ", kMaxTopk, "], got ", d.topk);
  const int64_t max_splits = std::min<int64_t>(kMaxSplits, H / kTileK);
  KD_CHECK(k_splits >= 1 && k_splits <= max_splits, op, ": k_splits must be in [1, ", max_splits, "], got ",
              k_splits);
  KD_CHECK(d.T * d.topk < (int64_t(1) << 30), op, ": too many tokens");
  const Workspace w = workspace_layout(d.T, d.topk, E, H, I, block_size, k_splits);
  KD_CHECK(w.B <= 65535, op, ": too many expert blocks (", w.B, ") for block_size ", block_size);
  return d;
}

template <typename IdT>
void run_moe(const MoeDims& d, const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& w13_s,
             const at::Tensor& w2_q, const at::Tensor& w2_s, const at::Tensor& topk_ids,
             const at::Tensor& topk_weights, const int32_t* emap, int64_t group_size, int64_t block_size,
             int64_t k_splits, uint8_t* ws, at::Tensor& out, const Int4DecodeExtra* extra) {
  const Workspace w = workspace_layout(d.T, d.topk, d.E, d.H, d.I, block_size, k_splits);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const IdT* ids = topk_ids.data_ptr<IdT>();
  const int64_t n1 = 2 * d.I / kCtaN, n2 = d.H / kCtaN;
  const bool pdl = launch_pdl();
  if (int4_decode_applies(d.T, d.topk, d.H, d.I)) {  // a few slots: two GEMV launches (moe_decode.cu)
    Int4DecodeArgs a{};
    a.x = reinterpret_cast<const bf16*>(x.data_ptr());
    a.w13q = reinterpret_cast<const uint4*>(w13_q.data_ptr<int32_t>());
    a.w13s = reinterpret_cast<const bf16*>(w13_s.data_ptr());
    a.w2q = reinterpret_cast<const uint4*>(w2_q.data_ptr<int32_t>());
    a.w2s = reinterpret_cast<const bf16*>(w2_s.data_ptr());
    a.topk_ids = ids;
    a.topk_weights = topk_weights.data_ptr<float>();
    a.emap = emap;
    a.T = d.T;
    a.topk = d.topk;
    a.H = d.H;
    a.I = d.I;
    a.E = d.E;
    a.num_global = d.num_global;
    a.group_size = group_size;
    a.act = reinterpret_cast<bf16*>(ws + w.act);
    a.out = reinterpret_cast<bf16*>(out.data_ptr());
    if (extra != nullptr) a.extra = *extra;
    int4_moe_decode(a, std::is_same_v<IdT, int64_t>);
    return;
  }

  moe_align_kernel<IdT><<<1, kAlignThreads, 0, stream>>>(
      ids, emap, int(d.num_global), int(w.M), int(d.E), int(block_size), int(w.B),
      k_splits > 1 ? int(w.B * n1) : 0, reinterpret_cast<int32_t*>(ws + w.meta),
      reinterpret_cast<int32_t*>(ws + w.sorted_ids), reinterpret_cast<int32_t*>(ws + w.block_expert),
      reinterpret_cast<int32_t*>(ws + w.counters));
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  GemmArgs up{};
  up.qweight = reinterpret_cast<const int4*>(w13_q.data_ptr<int32_t>());
  up.scales = reinterpret_cast<const bf16*>(w13_s.data_ptr());
  up.a = reinterpret_cast<const bf16*>(x.data_ptr());
  up.K = int(d.H);
  up.N = int(2 * d.I);
  up.M = int(w.M);
  up.topk = int(d.topk);
  up.meta = reinterpret_cast<const int32_t*>(ws + w.meta);
  up.sorted_ids = reinterpret_cast<const int32_t*>(ws + w.sorted_ids);
  up.block_expert = reinterpret_cast<const int32_t*>(ws + w.block_expert);
  up.k_splits = int(k_splits);
  up.max_blocks = int(w.B);
  up.counters = reinterpret_cast<int32_t*>(ws + w.counters);
  up.partials = reinterpret_cast<float*>(ws + w.partials);
  up.act = reinterpret_cast<bf16*>(ws + w.act);
  up.topk_weights = topk_weights.data_ptr<float>();
  up.y = reinterpret_cast<bf16*>(ws + w.y);
  GemmArgs down = up;
  down.qweight = reinterpret_cast<const int4*>(w2_q.data_ptr<int32_t>());
  down.scales = reinterpret_cast<const bf16*>(w2_s.data_ptr());
  down.a = up.act;
  down.K = int(d.I);
  down.N = int(d.H);
  down.k_splits = 1;
  switch (block_size) {
    case 8: dispatch_group<8>(group_size, up, down, n1, n2, w.B, k_splits, stream, pdl); break;
    case 16: dispatch_group<16>(group_size, up, down, n1, n2, w.B, k_splits, stream, pdl); break;
    case 32: dispatch_group<32>(group_size, up, down, n1, n2, w.B, k_splits, stream, pdl); break;
    default: dispatch_group<64>(group_size, up, down, n1, n2, w.B, k_splits, stream, pdl); break;
  }

  const int64_t n = d.T * (d.H / 8);
  const int blocks = int(std::min<int64_t>((n + kCombineThreads - 1) / kCombineThreads, 65536));
  launch_kernel(&moe_combine_kernel<IdT>, dim3(blocks), dim3(kCombineThreads), 0, stream, pdl, reinterpret_cast<const bf16*>(ws + w.y),
         ids, emap, int(d.num_global), int(d.E), d.T, int(d.topk), int(d.H), reinterpret_cast<bf16*>(out.data_ptr()));
}

void moe_forward(const MoeDims& d, const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& w13_s,
                 const at::Tensor& w2_q, const at::Tensor& w2_s, const at::Tensor& topk_ids,
                 const at::Tensor& topk_weights, const std::optional<at::Tensor>& expert_map, int64_t group_size,
                 int64_t block_size, int64_t k_splits, at::Tensor& workspace, at::Tensor& out,
                 const Int4DecodeExtra* extra = nullptr) {
  if (d.T == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int32_t* emap = expert_map.has_value() ? expert_map->data_ptr<int32_t>() : nullptr;
  uint8_t* ws = workspace.data_ptr<uint8_t>();
  if (topk_ids.scalar_type() == at::kLong)
    run_moe<int64_t>(d, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, emap, group_size, block_size, k_splits,
                     ws, out, extra);
  else
    run_moe<int32_t>(d, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, emap, group_size, block_size, k_splits,
                     ws, out, extra);
}

void int4_moe_out_cuda(const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& w13_s, const at::Tensor& w2_q,
                       const at::Tensor& w2_s, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const std::optional<at::Tensor>& expert_map, int64_t group_size, int64_t block_size,
                       int64_t k_splits, at::Tensor workspace, at::Tensor out) {
  const char* op = "kdtree::int4_moe_out";
  const MoeDims d = check_moe_inputs(op, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size,
                                     block_size, k_splits);
  check_moe_tensor(out, op, "out", at::kBFloat16, 2);
  check_moe_tensor(workspace, op, "workspace", at::kByte, 1);
  KD_CHECK(out.device() == x.device() && workspace.device() == x.device(), op,
              ": all inputs must be on one device");
  KD_CHECK(out.sizes() == x.sizes(), op, ": out must be [T, H] = ", x.sizes(), ", got ", out.sizes());
  const int64_t need = workspace_layout(d.T, d.topk, d.E, d.H, d.I, block_size, k_splits).total;
  KD_CHECK(workspace.numel() >= need, op, ": workspace has ", workspace.numel(), " bytes, this shape needs ", need,
              " (int4_moe_plan(...).workspace_bytes)");
  moe_forward(d, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size, block_size, k_splits,
              workspace, out);
}

at::Tensor int4_moe_cuda(const at::Tensor& x, const at::Tensor& w13_q, const at::Tensor& w13_s, const at::Tensor& w2_q,
                         const at::Tensor& w2_s, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         const std::optional<at::Tensor>& expert_map, int64_t group_size, int64_t block_size,
                         int64_t k_splits, const std::optional<at::Tensor>& shared_gate,
                         const std::optional<at::Tensor>& shared_up, const std::optional<at::Tensor>& shared_down,
                         const std::optional<at::Tensor>& residual) {
  constexpr const char* op = "kdtree::int4_moe";
  const MoeDims d = check_moe_inputs(op, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size,
                                     block_size, k_splits);
  const int64_t Is = check_shared_expert(op, x, shared_gate, shared_up, shared_down, residual);
  const bool has_shared = Is > 0;
  const int64_t need = workspace_layout(d.T, d.topk, d.E, d.H, d.I, block_size, k_splits).total;
  at::Tensor workspace = at::empty({need}, x.options().dtype(at::kByte));
  at::Tensor out = at::empty_like(x);
  if (d.T == 0) return out;
  if ((has_shared || residual.has_value()) && int4_decode_applies(d.T, d.topk, d.H, d.I)) {
    // the decode path computes the shared expert and adds the residual in its two launches
    Int4DecodeExtra extra{};
    at::Tensor act_s;  // the shared expert's activations [T, Is]
    if (has_shared) {
      act_s = at::empty({d.T, Is}, x.options());
      extra.shared_gate = reinterpret_cast<const bf16*>(shared_gate->data_ptr());
      extra.shared_up = reinterpret_cast<const bf16*>(shared_up->data_ptr());
      extra.shared_down = reinterpret_cast<const bf16*>(shared_down->data_ptr());
      extra.Is = Is;
      extra.act_s = reinterpret_cast<bf16*>(act_s.data_ptr());
    }
    if (residual.has_value()) extra.residual = reinterpret_cast<const bf16*>(residual->data_ptr());
    moe_forward(d, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size, block_size, k_splits,
                workspace, out, &extra);
    return out;
  }
  moe_forward(d, x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights, expert_map, group_size, block_size, k_splits,
              workspace, out);
  if (!has_shared && !residual.has_value()) return out;
  // The grouped path: the shared expert and the residual with ATen ops (the routed sum already
  // rounded to bf16, then + the shared expert in fp32, rounded; then + the residual, rounded).
  at::Tensor y = out.to(at::kFloat);
  if (has_shared) {
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor g = at::linear(xf, shared_gate->to(at::kFloat)), u = at::linear(xf, shared_up->to(at::kFloat));
    const at::Tensor act_s = (at::silu(g) * u).to(at::kBFloat16).to(at::kFloat);
    y = y + at::linear(act_s, shared_down->to(at::kFloat));
  }
  if (residual.has_value()) y = y.to(at::kBFloat16).to(at::kFloat) + residual->to(at::kFloat);
  return y.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("int4_repack", &int4_repack_cuda);
  m.impl("int4_moe_out", &int4_moe_out_cuda);
  m.impl("int4_moe", &int4_moe_cuda);
}

}  // namespace kdtree
