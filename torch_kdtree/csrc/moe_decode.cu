// int4_moe's decode path: for a handful of (token, expert) slots (T·k <= 32) the grouped
// GEMMs of moe.cu (align, gate/up, down, combine: four launches with a sort and a padded expert
// block each) have nothing to share between tokens, so two GEMV launches read every touched
// expert's weights once instead.  Same inputs, layout (ops/moe.py), workspace (its act region)
// and numerics as the reference within fp32 summation order (bf16 dequantisation q · scale as in
// dequant_a, fp32 tensor-core accumulation, bf16 activations).
//
// Both kernels stream weight tiles through a per-warp ring of cp.async stages in shared memory
// (kStages tiles in flight per warp, no registers held by loads in flight); each lane reads back
// the 16 bytes it copied (its A fragments of four mma.m16n8k16 steps), the B operand (x or the
// activations, staged in shared memory) fills all eight columns, and lanes t == 0 hold the dot
// products of rows g (c[0]) and g + 8 (c[2]).
//   1. gate/up: grid (I / 16, T·k, S) with clusters of (1, 1, S), 8 warps.  Block = one slot, one
//      16-channel tile pair (gate tile 2i and up tile 2i + 1 of w13) and split s of H's k64 tiles
//      (S <= 8 splits, only when a call has fewer units than half the SMs); warp w takes the
//      split's tiles w, w + 8, ...  The eight warps' sums are added in warp order, the splits' sums in rank order through the
//      cluster's shared memory (rank 0), then act[slot, 16 i + r] = bf16(silu(g) · u).
//      With a shared expert (bf16 gate / up [Is, H]; the <IdT, true> instantiations): T · ns more
//      rows of blocks, each kShRows rows of gate and of up for one token, one warp per row (16-byte
//      loads along the split's k range, kShBatch per lane in flight; before the wait -- these
//      weights depend on no routing -- the first batch copied into shared memory and the rest
//      into L2), then act_s[t, r] = bf16(silu(g) · u) through the same cluster reduction.
//      Both kinds of block copy their slice of x into shared memory right after the wait (cp.async),
//      the routed ones before they read the routing and issue their weight copies, so that x is
//      not queued behind them.  Tried and removed (bench/RESULTS.md runs 149, 151): with the router's
//      logits as a hint (moe_gemv's route_logits), the shared-expert blocks running whole before the
//      wait, first or last in the grid -- 2.5 % and 0.4 % slower k2_slice steps.
//   2. down: grid (H / 16, T), 8 warps.  Block = one 16-channel tile of out for one token; its
//      k · I / 64 (slot j, k64 tile c) items, warp w taking items w, w + 8, ...; each item's
//      fp32 partial times the router weight is added to the warp's sum, the warps' sums in warp
//      order.  With a shared expert, warp w also takes rows 2 w and 2 w + 1 of the block's tile of
//      shared_down [H, Is] against act_s (the first chunk per lane loaded before the wait): a row's
//      sum is the warps' routed sums in warp order plus the shared row.  With a residual:
//      out = bf16(residual + bf16(sum)).  Before its programmatic-launch wait (pdl.cuh) it reads the
//      routing (two kernels back) and starts its first weight copies (weights are never written by
//      a predecessor).
#include "moe_decode.h"

#include "bf16_vec.cuh"
#include "int4_mma.cuh"
#include "pdl.cuh"
#include "trace.cuh"
#include "warp_reduce.cuh"
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>

#include <algorithm>

namespace kdtree {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;       // down: k64 weight tiles in flight per warp
constexpr int kMaxSplits = 8;    // gate/up's K splits: a portable cluster
constexpr int kMaxTopk = 16;
constexpr int kTileBytes = 512;  // one 16 x 64 INT4 tile: 16 bytes per lane
constexpr int kScaleBytes = 64;  // a tile's scales over its 64 k: at most two groups of 16 bf16
constexpr int kShRows = 4;       // gate/up: shared-expert rows of gate (and of up) per block
constexpr int kShBatch = 4;      // 16-byte chunks per lane of a shared-expert row in flight together

// Per target (neither sm_120 setting has been timed):
// - blocks per SM the kernels are built for.  sm_90: 5 (48 registers, no spills): gate/up and down
//   blocks resident together.  sm_120: 4 (64 registers): at 5, ptxas spills 48 bytes of down's
//   shared-expert instantiation there, the pre-wait loads of shared_down among them (an early load
//   stored to the stack stalls on its data); gate/up no longer holds pre-wait loads in registers.
// - gate/up's k64 tile pairs in flight per warp (the host reads the count a kernel was built with
//   from its PTX version, up_stages()).  sm_120 has 100 KB of shared memory per SM: at 4 stages a
//   block at K2's H (36 KB of ring + 14 KB of x) fits once per SM, so the K2 TP-8 rank's 192 blocks
//   (128 routed, 64 shared-expert) would take two waves on the RTX PRO 6000's 188 SMs; at 3 (42 KB
//   of ring and x) two fit.  The 3-stage code is tested on sm_90 by building it with
//   kUpStagesSm90 = 3 (bench/RESULTS.md run 109).
constexpr int kUpStagesSm90 = 4;
constexpr int kUpStagesSm120 = 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define KD_INT4_DECODE_MIN_BLOCKS 4
constexpr int kUpStages = kUpStagesSm120;
#else
#define KD_INT4_DECODE_MIN_BLOCKS 5
constexpr int kUpStages = kUpStagesSm90;
#endif

template <typename IdT>
__device__ __forceinline__ int local_expert_l2(const IdT* ids, int64_t i, const int32_t* emap, int num_global, int E) {
  const int64_t id = static_cast<int64_t>(__ldcg(ids + i));
  if (id < 0 || id >= num_global) return -1;
  const int e = emap != nullptr ? __ldcg(emap + id) : static_cast<int>(id);
  return (e >= 0 && e < E) ? e : -1;
}

// Four k16 steps of one 16x64 weight tile (q: this lane's 16 bytes of it) against B, the tile's
// 64 activations (bf16 pairs load_b(w) = word w of the tile), into acc.  sp0 / sp1: this lane's
// scale pairs of the tile's k 0..31 and k 32..63 (the same word for groups of 64 and 128).
template <typename LoadB>
__device__ __forceinline__ void tile_mma(const uint4& q, uint32_t sp0, uint32_t sp1, LoadB load_b, float (&acc)[4]) {
  const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[4];
    dequant_a(qs[s], s < 2 ? sp0 : sp1, a);
    const uint32_t b[2] = {load_b(8 * s), load_b(8 * s + 4)};
    mma_bf16(acc, a, b);
  }
}

// Copy k64 tile c of one 16-row weight tile (tile: its 16-byte units, 32 per k64 tile; scales:
// its [groups, 16] bf16) into dst (kTileBytes of weights, then kScaleBytes of scales): every lane
// 16 bytes of weights, lanes 0..3 (group 32: two groups) or 0..1 (one group) 16 bytes of scales.
__device__ __forceinline__ void copy_tile(char* dst, const uint4* tile, const bf16* scales, int c, int gs_shift,
                                          int lane) {
  cp_async16(dst + 16 * lane, tile + 32 * c + lane);
  const int pieces = gs_shift == 5 ? 4 : 2;
  if (lane < pieces) cp_async16(dst + kTileBytes + 16 * lane, scales + ((64 * c) >> gs_shift) * 16 + 8 * lane);
}

// This lane's A data and scale pairs of a tile copied by copy_tile (after the copies landed).
struct TileRegs {
  uint4 q;
  uint32_t sp0, sp1;
};
__device__ __forceinline__ TileRegs read_tile(const char* src, int gs_shift, int lane) {
  const uint32_t* sc = reinterpret_cast<const uint32_t*>(src + kTileBytes) + (lane >> 2);
  return TileRegs{*reinterpret_cast<const uint4*>(src + 16 * lane), sc[0], sc[gs_shift == 5 ? 8 : 0]};
}

// Lanes t == 0 hold rows g and g + 8 of a warp's tile sums; red[warp][16 * which + row].
__device__ __forceinline__ void stash_rows(float* red_w, const float (&acc)[4], int lane) {
  if ((lane & 3) == 0) {
    red_w[lane >> 2] = acc[0];
    red_w[(lane >> 2) + 8] = acc[2];
  }
}

// gate/up's last step (part: this block's gate sums in [0, 16) and up sums in [16, 32), written by
// warp 0): the splits' sums added in rank order through the cluster's shared memory (rank 0), then
// dst[r] = bf16(silu(g) · u) for rows r < rows.  Every block of a cluster calls it.
__device__ __forceinline__ void up_finish(const float* part, int rows, bf16* __restrict__ dst) {
  const int splits = gridDim.z;
  if (splits == 1) {
    __syncwarp();
    if (int(threadIdx.x) < rows) dst[threadIdx.x] = __float2bfloat16(silu_mul(part[threadIdx.x], part[threadIdx.x + 16]));
    return;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's sums are in its shared memory
  if (cluster.block_rank() == 0 && int(threadIdx.x) < rows) {
    float g = 0.f, u = 0.f;
    for (int r = 0; r < splits; ++r) {
      const float* p = cluster.map_shared_rank(part, r);
      g += p[threadIdx.x];
      u += p[threadIdx.x + 16];
    }
    dst[threadIdx.x] = __float2bfloat16(silu_mul(g, u));
  }
  cluster.sync();  // no block exits while rank 0 may still read its shared memory
}

// This block's slice of token t's x (k64 tiles [c0, c1), 128 bytes each) into s_x with cp.async, as
// one copy group (the caller waits for it).
__device__ __forceinline__ void copy_x(const bf16* x, int64_t t, int H, int c0, int c1, uint32_t* s_x) {
  const uint4* xg = reinterpret_cast<const uint4*>(x + t * H + 64 * c0);
  for (int i = threadIdx.x; i < (c1 - c0) * 8; i += kThreads) cp_async16(reinterpret_cast<uint4*>(s_x) + i, xg + i);
  cp_async_commit();
}

// A shared-expert block of gate/up (token t, rows r0 .. r0 + kShRows - 1 of gate and of up): warp w
// takes row r0 + w % kShRows of gate (w < kShRows) or up over the split's k range [64 c0, 64 c1):
// lane l its 16-byte chunks l, l + 32, ..., kShBatch of them in flight at a time; the first batch
// was copied before the wait into the warp's shared-memory slots (first: chunk c at first[c]).
// Returns the warp's row sum in every lane.
__device__ __forceinline__ float shared_row_sum(const uint4* row, const uint32_t* s_x, int c0, int c1,
                                                const uint4* first, int lane) {
  const int n = 8 * (c1 - c0);  // chunks of the split
  const uint4* xs = reinterpret_cast<const uint4*>(s_x);
  float acc = 0.f;
#pragma unroll
  for (int b = 0; b < kShBatch; ++b)
    if (lane + 32 * b < n) acc = dot8(first[lane + 32 * b], xs[lane + 32 * b], acc);
  for (int c = lane + 32 * kShBatch; c < n; c += 32 * kShBatch) {
    uint4 w[kShBatch];
#pragma unroll
    for (int b = 0; b < kShBatch; ++b)
      if (c + 32 * b < n) w[b] = ld_stream(row + c + 32 * b);
#pragma unroll
    for (int b = 0; b < kShBatch; ++b)
      if (c + 32 * b < n) acc = dot8(w[b], xs[c + 32 * b], acc);
  }
  return warp_sum(acc);
}

// kShared: the launch has shared-expert blocks (a separate instantiation, so that calls without
// one run the same code as before it existed).
template <typename IdT, bool kShared>
__global__ void __launch_bounds__(kThreads, KD_INT4_DECODE_MIN_BLOCKS)
int4_decode_up_kernel(const bf16* __restrict__ x, const uint4* __restrict__ w13q, const bf16* __restrict__ w13s,
                      const IdT* __restrict__ ids, const int32_t* __restrict__ emap, int num_global, int E, int H,
                      int I, int gs_shift, int topk, int chunks_per_split, bf16* __restrict__ act,
                      const bf16* __restrict__ shared_gate, const bf16* __restrict__ shared_up, int Is, int ns,
                      bf16* __restrict__ act_s KD_TRACE_PARAM) {
  extern __shared__ __align__(16) char smem[];  // [kWarps][kUpStages][2 tiles] | x of this split
  __shared__ float red[kWarps][32];             // per warp: 16 gate sums, 16 up sums
  __shared__ float part[32];                    // this block's sums (read by cluster rank 0)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int tp = blockIdx.x, slot = blockIdx.y, split = blockIdx.z;
#ifdef KDTREE_TRACE
  uint64_t* tr = split == 0 ? trace : nullptr;  // stamps by (x, y) only: the first split's blocks
#endif
  KD_TRACE(tr, 0);
  const int KC = H / 64, MT = 2 * I / 16, G = H >> gs_shift;
  const int c0 = split * chunks_per_split, c1 = min(KC, c0 + chunks_per_split);
  constexpr int kPair = 2 * (kTileBytes + kScaleBytes);
  uint32_t* s_x = reinterpret_cast<uint32_t*>(smem + kWarps * kUpStages * kPair);
  const int routed = kShared ? int(gridDim.y) - int(gridDim.y) / (topk + ns) * ns : int(gridDim.y);  // T · k
  if (kShared && slot >= routed) {  // a shared-expert block
    const int tok = (slot - routed) / ns, r0 = kShRows * ((slot - routed) % ns * int(gridDim.x) + tp);
    const int r = r0 + warp % kShRows;
    const bool mine = r < Is;  // warp-uniform
    const uint4* row = reinterpret_cast<const uint4*>((warp < kShRows ? shared_gate : shared_up) + int64_t(r) * H) +
                       8 * c0;
    // Before the wait (the weights depend on no routing): the row's first kShBatch chunks per lane
    // copied into the warp's slots of the (here unused) ring -- no registers held across the wait,
    // where 4 uint4 of them made ptxas spill in-flight loads at the 48-register cap -- the rest
    // into L2.  After it, x's copies (one round trip for all of them).
    uint4* first = reinterpret_cast<uint4*>(smem) + warp * 32 * kShBatch;
    static_assert(kWarps * 32 * kShBatch * 16 <= kWarps * kUpStages * 2 * (kTileBytes + kScaleBytes),
                  "the first batches fit in the ring");
#pragma unroll
    for (int b = 0; b < kShBatch; ++b)
      if (mine && lane + 32 * b < 8 * (c1 - c0)) cp_async16(first + lane + 32 * b, row + lane + 32 * b);
    if (mine) l2_prefetch_range(row + 32 * kShBatch, (int64_t(8) * (c1 - c0) - 32 * kShBatch) * 16, lane);
    KD_TRACE(tr, 1);
    pdl_wait();  // x comes from an earlier kernel
    KD_TRACE(tr, 2);
    pdl_launch_dependents();
    copy_x(x, tok, H, c0, c1, s_x);
    cp_async_wait<0>();
    __syncthreads();
    KD_TRACE(tr, 3);
    const float v = mine ? shared_row_sum(row, s_x, c0, c1, first, lane) : 0.f;
    KD_TRACE(tr, 4);
    if (lane == 0 && warp < 2 * kShRows) part[(warp < kShRows ? 0 : 16) + warp % kShRows] = v;
    __syncthreads();
    up_finish(part, min(kShRows, Is - r0), act_s + int64_t(tok) * Is + r0);
    KD_TRACE(tr, 5);
    return;
  }
  KD_TRACE(tr, 1);
  pdl_wait();  // the routing and x come from earlier kernels
  KD_TRACE(tr, 2);
  pdl_launch_dependents();
  // x's copies first (copy group 0), ahead of the routing's load and of the weight copies in the
  // memory queues: x does not depend on the expert, and every tile needs it.
  copy_x(x, slot / topk, H, c0, c1, s_x);
  const int n = c1 - c0 > warp ? (c1 - c0 - warp + kWarps - 1) / kWarps : 0;  // this warp's tiles
  const int e = local_expert_l2(ids, slot, emap, num_global, E);
  char* ring = smem + warp * kUpStages * kPair;
  float cg_[4] = {0.f, 0.f, 0.f, 0.f}, cu[4] = {0.f, 0.f, 0.f, 0.f};
  if (e >= 0) {  // block-uniform
    const uint4* wg = w13q + (int64_t(e) * MT + 2 * tp) * KC * 32;  // tile (e, 2 tp); up = 2 tp + 1
    const uint4* wu = wg + int64_t(KC) * 32;
    const bf16* sg = w13s + (int64_t(e) * MT + 2 * tp) * G * 16;
    const bf16* su = sg + int64_t(G) * 16;
    auto issue = [&](int i) {  // the warp's i-th tile pair into stage i % kUpStages
      if (i < n) {
        const int c = c0 + warp + kWarps * i;
        char* d = ring + (i % kUpStages) * kPair;
        copy_tile(d, wg, sg, c, gs_shift, lane);
        copy_tile(d + kTileBytes + kScaleBytes, wu, su, c, gs_shift, lane);
      }
      cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < kUpStages - 1; ++i) issue(i);
    cp_async_wait<kUpStages - 1>();  // x's group has landed (the stages' may not have)
    __syncthreads();
    KD_TRACE(tr, 3);
    // Group accounting: x's group, then one per issue, so "at most kUpStages - 1 pending" after
    // issue(i + kUpStages - 1) means tile pair i (and x's copies) have landed.
    for (int i = 0; i < n; ++i) {
      issue(i + kUpStages - 1);
      cp_async_wait<kUpStages - 1>();  // the warp's tile pair i has landed (every lane's copies, after the sync)
      __syncwarp();
      const char* d = ring + (i % kUpStages) * kPair;
      const TileRegs rg = read_tile(d, gs_shift, lane), ru = read_tile(d + kTileBytes + kScaleBytes, gs_shift, lane);
      const uint32_t* xc = s_x + 32 * (warp + kWarps * i) + t;
      auto load_b = [&](int w) { return xc[w]; };
      tile_mma(rg.q, rg.sp0, rg.sp1, load_b, cg_);
      tile_mma(ru.q, ru.sp0, ru.sp1, load_b, cu);
      __syncwarp();  // every lane has read the stage before the next issue overwrites it
    }
  } else {
    cp_async_wait<0>();  // no copy into shared memory outlives the block
  }
  KD_TRACE(tr, 4);
  stash_rows(red[warp], cg_, lane);
  stash_rows(red[warp] + 16, cu, lane);
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][threadIdx.x];
    part[threadIdx.x] = v;
  }
  up_finish(part, 16, act + int64_t(slot) * I + 16 * tp);
  KD_TRACE(tr, 5);
}

template <typename IdT, bool kShared>
__global__ void __launch_bounds__(kThreads, KD_INT4_DECODE_MIN_BLOCKS)
int4_decode_down_kernel(const bf16* __restrict__ act, const uint4* __restrict__ w2q, const bf16* __restrict__ w2s,
                        const IdT* __restrict__ ids, const float* __restrict__ topk_weights,
                        const int32_t* __restrict__ emap, int num_global, int E, int H, int I, int gs_shift, int topk,
                        bf16* __restrict__ out, const bf16* __restrict__ shared_down, int Is,
                        const bf16* __restrict__ act_s, const bf16* __restrict__ residual KD_TRACE_PARAM) {
  extern __shared__ __align__(16) char smem[];  // [kWarps][kStages][tile] | [topk][I / 2] activation pairs
  __shared__ int s_e[kMaxTopk];
  __shared__ float s_w[kMaxTopk];
  __shared__ float red[kWarps][16];
  __shared__ float s_sh[16];  // the shared expert's 16 rows
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int tok = blockIdx.y, m = blockIdx.x;
  KD_TRACE(trace, 0);
  // The shared expert's rows 16 m + 2 w, 2 w + 1 (warp w): the first kShFirst chunks per lane of
  // each before the wait (weights), the rest after it.
  constexpr int kShFirst = 1;
  const int sch = Is / 8;
  const uint4* sdr =
      kShared ? reinterpret_cast<const uint4*>(shared_down + int64_t(16 * m + 2 * warp) * Is) : nullptr;
  uint4 sw[2][kShFirst];
  if (kShared) {
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int b = 0; b < kShFirst; ++b)
        if (lane + 32 * b < sch) sw[q][b] = ld_stream_early(sdr + int64_t(q) * sch + lane + 32 * b);
  }
  const int MT = H / 16, KC = I / 64, G = I >> gs_shift;
  constexpr int kStage = kTileBytes + kScaleBytes;
  char* ring = smem + warp * kStages * kStage;
  uint32_t* s_act = reinterpret_cast<uint32_t*>(smem + kWarps * kStages * kStage);
  // Before gate/up is done: the routing (two kernels back, complete once gate/up let this grid
  // launch; read through L2) and the first weight copies.
  if (threadIdx.x < topk) {
    const int e = local_expert_l2(ids, int64_t(tok) * topk + threadIdx.x, emap, num_global, E);
    s_e[threadIdx.x] = e;
    s_w[threadIdx.x] = e >= 0 ? __ldcg(topk_weights + int64_t(tok) * topk + threadIdx.x) : 0.f;
  }
  __syncthreads();
  const int items = topk * KC;  // (slot j, k64 tile c) = item j · KC + c
  const int n = items > warp ? (items - warp + kWarps - 1) / kWarps : 0;
  auto issue = [&](int i) {
    if (i < n) {
      const int item = warp + kWarps * i, j = item / KC, e = s_e[j];
      if (e >= 0)
        copy_tile(ring + (i % kStages) * kStage, w2q + (int64_t(e) * MT + m) * KC * 32,
                  w2s + (int64_t(e) * MT + m) * G * 16, item - j * KC, gs_shift, lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  KD_TRACE(trace, 1);
  pdl_wait();
  KD_TRACE(trace, 2);
  pdl_launch_dependents();
  const uint4* ag = reinterpret_cast<const uint4*>(act + int64_t(tok) * topk * I);
  for (int i = threadIdx.x; i < topk * I / 8; i += kThreads) reinterpret_cast<uint4*>(s_act)[i] = __ldcg(ag + i);
  __syncthreads();
  KD_TRACE(trace, 3);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int i = 0; i < n; ++i) {
    issue(i + kStages - 1);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const int item = warp + kWarps * i, j = item / KC;
    if (s_e[j] >= 0) {
      const TileRegs r = read_tile(ring + (i % kStages) * kStage, gs_shift, lane);
      const uint32_t* ac = s_act + j * (I / 2) + 32 * (item - j * KC) + t;
      float p[4] = {0.f, 0.f, 0.f, 0.f};
      tile_mma(r.q, r.sp0, r.sp1, [&](int w) { return ac[w]; }, p);
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] = fmaf(s_w[j], p[q], acc[q]);
    }
    __syncwarp();
  }
  KD_TRACE(trace, 4);
  stash_rows(red[warp], acc, lane);
  if (kShared) {
    const uint4* ar = reinterpret_cast<const uint4*>(act_s + int64_t(tok) * Is);
    float d[2] = {0.f, 0.f};
#pragma unroll
    for (int b = 0; b < kShFirst; ++b)
      if (lane + 32 * b < sch) {
        const uint4 a = __ldcg(ar + lane + 32 * b);
        d[0] = dot8(sw[0][b], a, d[0]);
        d[1] = dot8(sw[1][b], a, d[1]);
      }
    for (int c = lane + 32 * kShFirst; c < sch; c += 32) {
      const uint4 w0 = ld_stream(sdr + c), w1 = ld_stream(sdr + sch + c), a = __ldcg(ar + c);
      d[0] = dot8(w0, a, d[0]);
      d[1] = dot8(w1, a, d[1]);
    }
    d[0] = warp_sum(d[0]);
    d[1] = warp_sum(d[1]);
    if (lane == 0) {
      s_sh[2 * warp] = d[0];
      s_sh[2 * warp + 1] = d[1];
    }
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][threadIdx.x];
    if (kShared) v += s_sh[threadIdx.x];
    const int64_t at = int64_t(tok) * H + 16 * m + threadIdx.x;
    if (residual != nullptr) v = round_bf16(v) + __bfloat162float(residual[at]);
    out[at] = __float2bfloat16(v);
  }
  KD_TRACE(trace, 5);
}

// gate/up's K splits (a unit = a slot's 32 w13 channels): none while there are at least half as
// many units as SMs (run 44, K2 TP-8 rank: 15.5 us at T 1 unsplit, 17.6 in 4 splits, 21.4 in 2;
// unsplit as fast or faster at T 2 and 4; k2_slice's decode step with 2, 3 or 4 splits within
// 0.6 % of unsplit, run 172), else about one block per SM; at most a portable cluster, at least one
// k64 tile per warp.
int up_splits(const Int4DecodeArgs& a, int sms) {
  const int64_t units = a.I / 16 * a.T * a.topk;
  const int64_t want = 2 * units >= sms ? 1 : (sms + units - 1) / units;
  return int(std::max<int64_t>(1, std::min<int64_t>({kMaxSplits, want, a.H / 64 / kWarps})));
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) raise_dynamic_smem(kernel, int(bytes));
}

// The gate/up stages of the code the device runs: the target it was built for (its PTX version,
// which is also __CUDA_ARCH__ / 10 of a JIT-compiled kernel), as kUpStages was chosen there.
template <typename Kernel>
int up_stages(Kernel kernel) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.ptxVersion >= 120 ? kUpStagesSm120 : kUpStagesSm90;
}

template <typename IdT>
void launch_decode(const Int4DecodeArgs& a, cudaStream_t stream, bool pdl) {
  const IdT* ids = static_cast<const IdT*>(a.topk_ids);
  const int T = int(a.T), k = int(a.topk), H = int(a.H), I = int(a.I), E = int(a.E), ng = int(a.num_global),
            gs_shift = a.group_size == 32 ? 5 : a.group_size == 64 ? 6 : 7;
  const int splits = up_splits(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const int KC = H / 64, per_split = (KC + splits - 1) / splits;
  // shared-expert blocks: ns rows of I / 16 blocks per token, kShRows gate and up rows each
  const int Is = int(a.extra.Is), sh_rows = kShRows * (I / 16), ns = (Is + sh_rows - 1) / sh_rows;
  const auto up = Is > 0 ? &int4_decode_up_kernel<IdT, true> : &int4_decode_up_kernel<IdT, false>;
  const size_t up_smem =
      size_t(kWarps) * up_stages(up) * 2 * (kTileBytes + kScaleBytes) + size_t(per_split) * 128;
  allow_smem(up, up_smem);
  launch_kernel_ex(up, dim3(unsigned(I / 16), unsigned(T * (k + ns)), unsigned(splits)), dim3(kThreads),
                   dim3(1, 1, unsigned(splits)), up_smem, stream, pdl, a.x, a.w13q, a.w13s, ids, a.emap, ng, E, H, I,
                   gs_shift, k, per_split, a.act, a.extra.shared_gate, a.extra.shared_up, Is, ns,
                   a.extra.act_s KD_TRACE_ARG(kTraceInt4Up, dim3(unsigned(I / 16), unsigned(T * (k + ns)))));
  const size_t down_smem = size_t(kWarps) * kStages * (kTileBytes + kScaleBytes) + size_t(k) * I * 2;
  const auto down = Is > 0 ? &int4_decode_down_kernel<IdT, true> : &int4_decode_down_kernel<IdT, false>;
  allow_smem(down, down_smem);
  launch_kernel(down, dim3(unsigned(H / 16), unsigned(T)), dim3(kThreads), down_smem, stream, pdl,
                static_cast<const bf16*>(a.act), a.w2q, a.w2s, ids, a.topk_weights, a.emap, ng, E, H, I, gs_shift, k,
                a.out, a.extra.shared_down, Is, static_cast<const bf16*>(a.extra.act_s),
                a.extra.residual KD_TRACE_ARG(kTraceInt4Down, dim3(unsigned(H / 16), unsigned(T))));
}

}  // namespace

bool int4_decode_applies(int64_t T, int64_t topk, int64_t H, int64_t I) {
  return T * topk <= kInt4DecodeMaxSlots && topk <= kMaxTopk && topk * I * 2 <= kInt4DecodeMaxBytes &&
         H * 2 <= kInt4DecodeMaxBytes;
}

void int4_moe_decode(const Int4DecodeArgs& a, bool ids_int64) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool pdl = launch_pdl();
  if (ids_int64)
    launch_decode<int64_t>(a, stream, pdl);
  else
    launch_decode<int32_t>(a, stream, pdl);
}

}  // namespace kdtree
