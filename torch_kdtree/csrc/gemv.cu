// kdtree::gemv: decode-sized linear layers with a fused prologue and epilogue (semantics, rounding
// points and the reference: torch_kdtree/ops/gemv.py).
//
// A few rows x [M, K] against up to four weights W_i [N_i, K] that share the input: bound by
// reading the weights once, so the work is a GEMV per output row.  One launch, persistent:
//   grid (min(ceil(N / 8), the blocks resident on the device), ceil(M / rows_per_block)), 8 warps
//   per block; output rows 0 .. N-1 run over the concatenated weights, warp w of the grid's W
//   warps takes rows w, w + W, ... for the block's rows m of x.
//   0. Launched with programmatic dependent launch (pdl.cuh): before waiting for the previous
//      kernel, each warp prefetches its first weight row into L2 and loads its first two items
//      (kB 16-byte chunks per lane each; a whole row of K <= 2048) into registers -- coherent
//      loads, which ptxas keeps before the wait (bf16_vec.cuh's ld_stream_early).  With an RMSNorm
//      prologue, the thread's chunks of the norm weight are loaded before the wait too, ahead of
//      the weights.
//   1. So weight bytes are in flight during the prologue (and, with PDL, during the predecessor).
//   2. Prologue, per block: the block's rows of the GEMV input into shared memory as bf16 --
//      x itself; RMSNorm(x) · norm_weight (sum of squares in fp32, a block reduction, then
//      bf16(norm_weight · bf16(x · rsqrt(mean + eps)))); or bf16(silu(x) · up) (SwiGLU, x the
//      gate projection).
//   3. Main loop over (row, batch) items: the next item's loads are issued before this item's
//      FMAs, so every warp keeps two items in flight from start to end (no tail between waves of
//      blocks); fp32 accumulation per m, one xor-shuffle sum per (row, m) when a row is done.
//   4. Epilogue per row: y = bf16(acc); with a residual (one weight only) out = bf16(residual + y).
// Two weight streams, the same items in the same order (so the same bits):
//   - the ring kernel (wherever its shared memory fits): lane 0 of each warp copies items into
//     a ring of shared-memory stages with bulk copies (bulk_copy.cuh), all stages before the wait;
//     the warp reads each stage once it has landed and refills it.  It beat the register kernel on
//     the large-K layers (K2's q_a + kv_a 16.9 -> 13.2 us, dense MLP 31.3 -> 25.9 us) and at M = 4
//     (RESULTS.md runs 61-62); about even on 2p2b's small layers;
//   - the register kernel (steps 0-4 above, two items in flight per warp), where fewer than two
//     ring stages fit beside the prologue's rows (sm_120's 99 KB per block with large K · rows).
//   Tried for the ring and removed (RESULTS.md runs 108, 110): copying only some stages before the
//   wait (the rest after the prologue), or prefetching them into L2 instead: even to 7 % slower.
//   The decode shape (one row of x per block, 3 stages: every M = 1 layer of the decode step) gets
//   its own instantiation, gemv_ring_kernel<kRingB, 1, 3>: the same code with the row count and the
//   stage count fixed at compile time, 34 KB of sm_90 code instead of 66 KB (4 KB before the wait
//   instead of 7.5).  A block reaches each kernel's code cold (the step streams ~90 MB of weights
//   per layer between two launches of it), so it pays for the code it runs through: 2p2b's decode
//   step 0.6022 -> 0.5610 ms, k2_slice 0.3412 -> 0.3241 ms, the same tokens (RESULTS.md run 124).
// Shapes come from static sizes only (CUDA-graph safe); no atomics and a fixed summation order
// (deterministic).  No tensor cores (a GEMV has nothing to reuse): the same code runs on sm_90
// and sm_120.
#include "bf16_vec.cuh"
#include "bulk_copy.cuh"
#include "check.h"
#include "pdl.cuh"
#include "trace.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace kdtree {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxWeights = 4;
constexpr int kMaxRows = 4;                 // rows of x per block (accumulators per lane)
constexpr int kNormPrefetch = 4;            // norm-weight chunks per thread loaded before the wait (K <= 8192)
constexpr int kSmemLimit = 96 * 1024;       // the prologue's rows, within sm_120's 99 KB per block
constexpr int kDefaultSmem = 48 * 1024;
constexpr int kDefaultStages = 3;           // ring kernel: items in flight per warp, at most (H200,
                                            // RESULTS.md run 62: 2-3 beat 6 and two blocks per SM;
                                            // fewer stages leave room for the next kernel's blocks
                                            // to start their loads early)

enum Prologue : int { kPlain = 0, kRmsNorm = 1, kSwiGlu = 2 };

struct Segment {
  const __nv_bfloat16* w;  // [n, K]
  void* out;               // [M, n]: bf16, or fp32 (the unrounded sums) when fp32
  int n;
  int row_begin;           // first row of this weight in the concatenation
  int fp32;
};

struct Params {
  const __nv_bfloat16* x;         // [M, K]
  const __nv_bfloat16* aux;       // norm weight [K] (kRmsNorm) or up [M, K] (kSwiGlu)
  const __nv_bfloat16* residual;  // [M, seg[0].n] or nullptr
  __nv_bfloat16* x_out;           // [M, K]: the prologue's output, or nullptr
  float eps;
  int M, K, rows_per_block, prologue, nseg, rows_total;
  int stages;                     // ring kernel: stages per warp (2 .. kDefaultStages)
  Segment seg[kMaxWeights];
  KD_TRACE_FIELD
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float sumsq8(uint4 v, float acc) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(bf16_lo(w[i]), bf16_lo(w[i]), acc);
    acc = fmaf(bf16_hi(w[i]), bf16_hi(w[i]), acc);
  }
  return acc;
}

// bf16(g · bf16(x · r)) for the 8 values (RMSNorm's rounding points).
__device__ __forceinline__ uint32_t norm2(uint32_t x, uint32_t g, float r) {
  return pack_bf16(bf16_lo(g) * round_bf16(bf16_lo(x) * r), bf16_hi(g) * round_bf16(bf16_hi(x) * r));
}
__device__ __forceinline__ uint4 norm8(uint4 x, uint4 g, float r) {
  return make_uint4(norm2(x.x, g.x, r), norm2(x.y, g.y, r), norm2(x.z, g.z, r), norm2(x.w, g.w, r));
}

// bf16(silu(g) · u) for the 8 values, in fp32.
__device__ __forceinline__ uint32_t swiglu2(uint32_t g, uint32_t u) {
  return pack_bf16(silu_mul(bf16_lo(g), bf16_lo(u)), silu_mul(bf16_hi(g), bf16_hi(u)));
}
__device__ __forceinline__ uint4 swiglu8(uint4 g, uint4 u) {
  return make_uint4(swiglu2(g.x, u.x), swiglu2(g.y, u.y), swiglu2(g.z, u.z), swiglu2(g.w, u.w));
}

// The block's rows of the GEMV input (bf16) into shared memory: x, RMSNorm(x) · norm_weight or
// silu(x) · up.  Every block computes it (a few KB from L2).
// The thread's first kNormPrefetch chunks of the norm weight (kRmsNorm).  A model weight, so the
// kernels load them before pdl_wait, ahead of their weight stream: issued after the wait, they were
// HBM misses queued behind every block's pre-issued weight copies (the norm weight of a layer is
// long evicted from L2 by the next step; RESULTS.md run 107: -0.7 % k2_slice, -0.8 % 2p2b steps).
__device__ __forceinline__ void load_norm(const Params& p, int chunks, uint4 (&gpre)[kNormPrefetch]) {
  if (p.prologue != kRmsNorm) return;
  const uint4* g = reinterpret_cast<const uint4*>(p.aux);
#pragma unroll
  for (int i = 0; i < kNormPrefetch; ++i) {
    const int c = threadIdx.x + kThreads * i;
    if (c < chunks) gpre[i] = ld_stream_early(g + c);
  }
}

template <int R>
__device__ __forceinline__ void prologue(const Params& p, uint4* xs, int m0, int rows, int chunks,
                                         const uint4 (&gpre)[kNormPrefetch]) {
  __shared__ float partial[R][kWarps];
  __shared__ float rscale[R];
  const uint4* xg = reinterpret_cast<const uint4*>(p.x) + int64_t(m0) * chunks;
  if (p.prologue == kRmsNorm) {
    const uint4* g = reinterpret_cast<const uint4*>(p.aux);  // its first chunks: gpre, before the wait
    float ss[R];
#pragma unroll
    for (int m = 0; m < R; ++m) ss[m] = 0.f;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m < rows) {
          const uint4 v = __ldg(xg + m * chunks + c);
          xs[m * chunks + c] = v;
          ss[m] = sumsq8(v, ss[m]);
        }
      }
    }
    block_rms_scale(ss, partial, rscale, p.K, p.eps);
#pragma unroll
    for (int i = 0; i < kNormPrefetch; ++i) {
      const int c = threadIdx.x + kThreads * i;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < R; ++m)
          if (m < rows) xs[m * chunks + c] = norm8(xs[m * chunks + c], gpre[i], rscale[m]);
      }
    }
    for (int c = threadIdx.x + kThreads * kNormPrefetch; c < chunks; c += kThreads) {
      const uint4 gv = __ldg(g + c);
#pragma unroll
      for (int m = 0; m < R; ++m)
        if (m < rows) xs[m * chunks + c] = norm8(xs[m * chunks + c], gv, rscale[m]);
    }
  } else if (p.prologue == kSwiGlu) {
    const uint4* ug = reinterpret_cast<const uint4*>(p.aux) + int64_t(m0) * chunks;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
#pragma unroll
      for (int m = 0; m < R; ++m)
        if (m < rows) xs[m * chunks + c] = swiglu8(__ldg(xg + m * chunks + c), __ldg(ug + m * chunks + c));
    }
  } else {
    for (int i = threadIdx.x; i < rows * chunks; i += kThreads) xs[i] = __ldg(xg + i);
  }
  __syncthreads();
}

// The prologue's output rows to p.x_out (blocks of column 0 of the grid; after the prologue's barrier).
__device__ __forceinline__ void store_input(const Params& p, const uint4* xs, int m0, int rows, int chunks) {
  if (p.x_out == nullptr || blockIdx.x != 0) return;
  uint4* dst = reinterpret_cast<uint4*>(p.x_out) + int64_t(m0) * chunks;
  for (int i = threadIdx.x; i < rows * chunks; i += kThreads) dst[i] = xs[i];
}

// Output row rho of the concatenated weights: its segment (selects, no dynamic param indexing).
__device__ __forceinline__ Segment locate(const Params& p, int rho) {
  Segment seg = p.seg[0];
#pragma unroll
  for (int i = 1; i < kMaxWeights; ++i)
    if (i < p.nseg && rho >= p.seg[i].row_begin) seg = p.seg[i];
  return seg;
}

template <int kB, bool kEarly = false>
__device__ __forceinline__ void load_chunks(const Params& p, int rho, int base, int chunks, int lane, uint4 (&buf)[kB]) {
  const Segment seg = locate(p, rho);
  const uint4* w = reinterpret_cast<const uint4*>(seg.w) + int64_t(rho - seg.row_begin) * chunks;
#pragma unroll
  for (int u = 0; u < kB; ++u) {
    const int c = base + lane + 32 * u;
    if (c < chunks) buf[u] = kEarly ? ld_stream_early(w + c) : ld_stream(w + c);
  }
}

// A finished row: the warp's sums (one per row m of x), reduced over the lanes; lane 0 stores
// y = bf16(sum) [+ residual, rounded again], or the fp32 sum for an fp32 segment.
template <int R>
__device__ __forceinline__ void store_row(const Params& p, int rho, int m0, int rows, int lane,
                                          float (&acc)[R]) {
  const Segment seg = locate(p, rho);
  const int n = rho - seg.row_begin;
#pragma unroll
  for (int m = 0; m < R; ++m) {
    const float t = warp_sum(acc[m]);
    acc[m] = 0.f;
    if (lane == 0 && m < rows) {
      const int64_t at = int64_t(m0 + m) * seg.n + n;
      if (seg.fp32) {
        static_cast<float*>(seg.out)[at] = t;
      } else {
        float y = round_bf16(t);
        if (p.residual != nullptr) y += __bfloat162float(p.residual[at]);
        static_cast<__nv_bfloat16*>(seg.out)[at] = __float2bfloat16(y);
      }
    }
  }
}

// Persistent: warp gw of gridDim.x · 8 takes output rows gw, gw + 8·gridDim.x, ... and walks
// (row, batch of kB chunks per lane) items with the next item's loads issued before this one's
// FMAs, so every warp keeps two items of weight bytes in flight from start to end (no waves).
template <int kB, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) gemv_kernel(const Params p) {
  extern __shared__ uint4 xs[];  // [rows_per_block][K / 8]: the prologue's output
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m0 = int(blockIdx.y) * p.rows_per_block;
  const int rows = min(p.rows_per_block, p.M - m0);
  const int chunks = p.K >> 3;
  const int nb = (chunks + 32 * kB - 1) / (32 * kB);  // batches per row
  const int stride = int(gridDim.x) * kWarps;
  int rho = int(blockIdx.x) * kWarps + warp, b = 0;
  KD_TRACE(p.trace, 0);

  // the item after (r, bb): the next batch of the row, or the warp's next row
  auto successor = [&](int r, int bb, int& r2, int& b2) {
    r2 = r;
    b2 = bb + 1;
    if (b2 == nb) {
      b2 = 0;
      r2 += stride;
    }
  };
  // Before the predecessor is done (PDL): this warp's first row into L2 and its first two items
  // into registers (weights only: no kernel writes them).  Only the first item made no difference
  // on k2_slice (RESULTS.md run 54).
  uint4 cur[kB], nxt[kB], gpre[kNormPrefetch];
  load_norm(p, chunks, gpre);
  if (rho < p.rows_total) {
    const Segment seg = locate(p, rho);
    l2_prefetch_range(seg.w + int64_t(rho - seg.row_begin) * p.K, int64_t(p.K) * 2, lane);
    load_chunks<kB, true>(p, rho, 0, chunks, lane, cur);
    int rho2, b2;
    successor(rho, 0, rho2, b2);
    if (rho2 < p.rows_total) load_chunks<kB, true>(p, rho2, b2 * 32 * kB, chunks, lane, nxt);
  }
  KD_TRACE(p.trace, 1);
  pdl_wait();
  KD_TRACE(p.trace, 2);
  pdl_launch_dependents();

  prologue<kMaxRows>(p, xs, m0, rows, chunks, gpre);
  KD_TRACE(p.trace, 3);
  store_input(p, xs, m0, rows, chunks);

  float acc[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) acc[m] = 0.f;
  bool loaded = true;  // nxt already holds the first successor
  while (rho < p.rows_total) {
    int rho2, b2;
    successor(rho, b, rho2, b2);
    if (rho2 < p.rows_total && !loaded) load_chunks<kB>(p, rho2, b2 * 32 * kB, chunks, lane, nxt);
    loaded = false;
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int c = b * 32 * kB + lane + 32 * u;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < kMaxRows; ++m)
          if (m < rows) acc[m] = dot8(cur[u], xs[m * chunks + c], acc[m]);
      }
    }
    if (b == nb - 1) store_row(p, rho, m0, rows, lane, acc);  // row done
#pragma unroll
    for (int u = 0; u < kB; ++u) cur[u] = nxt[u];
    rho = rho2;
    b = b2;
  }
  KD_TRACE(p.trace, 4);
}

// The ring kernel: gemv_kernel's items, order and arithmetic (so the same bits), with the weight
// bytes streamed by bulk copies (bulk_copy.cuh) into a per-warp ring of p.stages shared-memory
// stages of one item (32 · kB chunks) each instead of registers.  Lane 0 of each warp is its
// producer: before the programmatic-launch wait it fills every stage (weights only), then refills
// a stage as soon as the warp has read it, so a warp has p.stages items in flight where the
// register kernel has two, for the cost of one instruction per item.
// R: rows of x a block holds (1: decode's M = 1, so no code for more); kS: stages per warp when
// known at compile time (0: p.stages).
template <int kB, int R = kMaxRows, int kS = 0>
__global__ void __launch_bounds__(kThreads) gemv_ring_kernel(const Params p) {
  constexpr int kItem = 32 * kB;  // chunks per item (stage)
  extern __shared__ uint4 smem[];  // [rows_per_block][K / 8] prologue output, then the rings
  __shared__ alignas(8) uint64_t bars[kWarps][kDefaultStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m0 = int(blockIdx.y) * p.rows_per_block;
  const int rows = min(p.rows_per_block, p.M - m0);
  const int chunks = p.K >> 3;
  const int nb = (chunks + kItem - 1) / kItem;
  const int stride = int(gridDim.x) * kWarps;
  const int S = kS > 0 ? kS : p.stages;
  uint4* xs = smem;
  uint4* ring = smem + p.rows_per_block * chunks + warp * S * kItem;
  uint64_t* bar = bars[warp];
  KD_TRACE(p.trace, 0);

  auto advance = [&](int& r, int& bb) {
    if (++bb == nb) {
      bb = 0;
      r += stride;
    }
  };
  // the producer's cursor: the next item to copy, into stage `fill` % S
  int rp = int(blockIdx.x) * kWarps + warp, bp = 0, fill = 0;
  auto produce = [&]() {  // lane 0 only
    const Segment seg = locate(p, rp);
    const int c0 = bp * kItem;
    const int n = min(kItem, chunks - c0);
    const uint4* src = reinterpret_cast<const uint4*>(seg.w) + int64_t(rp - seg.row_begin) * chunks + c0;
    const int s = fill % S;
    bulk_load(ring + s * kItem, src, uint32_t(n) * 16u, bar + s);
    ++fill;
    advance(rp, bp);
  };
  uint4 gpre[kNormPrefetch];
  load_norm(p, chunks, gpre);  // issued before the ring's copies
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar + s, 1);
    fence_mbar_init();
    for (int s = 0; s < S && rp < p.rows_total; ++s) produce();
  }
  __syncwarp();
  KD_TRACE(p.trace, 1);
  pdl_wait();
  KD_TRACE(p.trace, 2);
  pdl_launch_dependents();
  prologue<R>(p, xs, m0, rows, chunks, gpre);
  KD_TRACE(p.trace, 3);
  store_input(p, xs, m0, rows, chunks);

  float acc[R];
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.f;
  int rho = int(blockIdx.x) * kWarps + warp, b = 0;
  for (int j = 0; rho < p.rows_total; ++j) {
    const int s = j % S;
    mbar_wait(bar + s, uint32_t(j / S) & 1u);
    if (j == 0) KD_TRACE(p.trace, 5);
    if (j == 1) KD_TRACE(p.trace, 8);  // items 0-2 are the ones copied before the wait (3 stages)
    if (j == 2) KD_TRACE(p.trace, 9);
    const uint4* st = ring + s * kItem;
#pragma unroll
    for (int u = 0; u < kB; ++u) {
      const int c = b * kItem + lane + 32 * u;
      if (c < chunks) {
        const uint4 w = st[lane + 32 * u];
#pragma unroll
        for (int m = 0; m < R; ++m)
          if (m < rows) acc[m] = dot8(w, xs[m * chunks + c], acc[m]);
      }
    }
    __syncwarp();
    if (lane == 0 && rp < p.rows_total) {
      fence_proxy_async();  // the warp's reads of stage s before the copy that refills it
      produce();
    }
    if (b == nb - 1) {
      if (j == nb - 1) KD_TRACE(p.trace, 6);
      store_row(p, rho, m0, rows, lane, acc);  // row done
      if (j == nb - 1) KD_TRACE(p.trace, 7);
    }
    advance(rho, b);
  }
  KD_TRACE(p.trace, 4);
}

// The register kernel: 4 chunks per lane per item (3 blocks / SM) and one grid of resident blocks,
// the fastest of the four settings bench_gemv timed on most of its layers (H200, RESULTS.md run 35).
using GemvKernel = void (*)(const Params);
constexpr GemvKernel kRegisterKernel = gemv_kernel<4, 3>;

// The ring kernel's configuration: kB = 4 (2 KB items, the register kernel's default item), a
// stage of all 8 warps' rings per kRingStageBytes.
constexpr int kRingB = 4;
constexpr int kRingStageBytes = kWarps * 32 * kRingB * 16;

// Stages per warp for the ring kernel with `x_smem` bytes of prologue output per block: as many as
// fit (up to kDefaultStages) with two blocks per SM, else with one; 0 (use the register kernel)
// when fewer than two fit.
int ring_stages(const cudaDeviceProp& prop, int x_smem) {
  constexpr int cap = kDefaultStages;
  static const int static_smem = [] {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemv_ring_kernel<kRingB>));
    return int(attr.sharedSizeBytes);
  }();
  const int reserved = int(prop.reservedSharedMemPerBlock);
  auto fit = [&](int budget) { return std::min(cap, (budget - reserved - static_smem - x_smem) / kRingStageBytes); };
  const int two = fit(int(prop.sharedMemPerMultiprocessor / 2));
  if (two >= std::min(cap, 4)) return two;
  const int one = std::min(fit(int(prop.sharedMemPerMultiprocessor)),
                           (int(prop.sharedMemPerBlockOptin) - static_smem - x_smem) / kRingStageBytes);
  return std::min(cap, one) >= 2 ? std::min(cap, one) : 0;
}

void check_aligned(const at::Tensor& t, const char* op, const char* name) {
  KD_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name, " must be 16-byte aligned");
}

std::vector<at::Tensor> gemv_cuda(const at::Tensor& x, at::TensorList weights,
                                  const std::optional<at::Tensor>& norm_weight, double eps,
                                  const std::optional<at::Tensor>& up, const std::optional<at::Tensor>& residual,
                                  int64_t fp32_outputs, bool return_input) {
  constexpr const char* op = "kdtree::gemv";
  check_cuda_tensor(x, op, "x", at::kBFloat16, 2);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t nw = int64_t(weights.size());
  KD_CHECK(nw >= 1 && nw <= kMaxWeights, op, ": takes 1 to ", kMaxWeights, " weights, got ", nw);
  KD_CHECK(fp32_outputs >= 0 && fp32_outputs <= nw, op, ": fp32_outputs must be in [0, ", nw, "], got ", fp32_outputs);
  KD_CHECK(K >= 8 && K % 8 == 0, op, ": K must be a positive multiple of 8, got ", K);
  const int64_t rows_per_block = std::min<int64_t>({int64_t(kMaxRows), std::max<int64_t>(M, 1),
                                                    int64_t(kSmemLimit) / (K * 2)});
  KD_CHECK(rows_per_block >= 1, op, ": K = ", K, " is too large (at most ", kSmemLimit / 2, ")");
  KD_CHECK(!(norm_weight.has_value() && up.has_value()), op, ": norm_weight and up are exclusive prologues");
  check_aligned(x, op, "x");
  Params p{};
  p.prologue = kPlain;
  if (norm_weight.has_value()) {
    check_cuda_tensor(*norm_weight, op, "norm_weight", at::kBFloat16, 1);
    KD_CHECK(norm_weight->size(0) == K && norm_weight->device() == x.device(), op, ": norm_weight must be [K = ", K,
             "] on x's device, got ", norm_weight->sizes());
    check_aligned(*norm_weight, op, "norm_weight");
    p.prologue = kRmsNorm;
    p.aux = reinterpret_cast<const __nv_bfloat16*>(norm_weight->data_ptr());
  }
  if (up.has_value()) {
    check_cuda_tensor(*up, op, "up", at::kBFloat16, 2);
    KD_CHECK(up->sizes() == x.sizes() && up->device() == x.device(), op, ": up must be x's shape ", x.sizes(),
             " on x's device, got ", up->sizes());
    check_aligned(*up, op, "up");
    p.prologue = kSwiGlu;
    p.aux = reinterpret_cast<const __nv_bfloat16*>(up->data_ptr());
  }
  std::vector<at::Tensor> outs;
  int64_t rows_total = 0;
  for (int64_t i = 0; i < nw; ++i) {
    const at::Tensor& w = weights[i];
    check_cuda_tensor(w, op, "weights[i]", at::kBFloat16, 2);
    KD_CHECK(w.size(1) == K && w.device() == x.device(), op, ": weights[", i, "] must be [N, K = ", K,
             "] on x's device, got ", w.sizes());
    KD_CHECK(w.size(0) < (int64_t(1) << 30), op, ": weights[", i, "] has too many rows");
    check_aligned(w, op, "weights[i]");
    const bool fp32 = i < fp32_outputs;
    outs.push_back(at::empty({M, w.size(0)}, x.options().dtype(fp32 ? at::kFloat : at::kBFloat16)));
    p.seg[i] = Segment{reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()), outs.back().data_ptr(), int(w.size(0)),
                       int(rows_total), int(fp32)};
    rows_total += w.size(0);
  }
  if (return_input) {
    outs.push_back(at::empty({M, K}, x.options()));
    p.x_out = reinterpret_cast<__nv_bfloat16*>(outs.back().data_ptr());
  }
  if (residual.has_value()) {
    KD_CHECK(nw == 1, op, ": a residual needs exactly one weight, got ", nw);
    KD_CHECK(fp32_outputs == 0, op, ": a residual is added to a bf16 output (fp32_outputs must be 0)");
    check_cuda_tensor(*residual, op, "residual", at::kBFloat16, 2);
    KD_CHECK(residual->size(0) == M && residual->size(1) == weights[0].size(0) && residual->device() == x.device(),
             op, ": residual must be [M, N] = [", M, ", ", weights[0].size(0), "] on x's device, got ",
             residual->sizes());
    p.residual = reinterpret_cast<const __nv_bfloat16*>(residual->data_ptr());
  }
  const int64_t grid_y = (M + rows_per_block - 1) / rows_per_block;
  KD_CHECK(grid_y <= 65535 && rows_total < (int64_t(1) << 30), op, ": too many rows (M = ", M, ", N = ", rows_total,
           ")");
  if (M == 0 || (rows_total == 0 && !return_input)) return outs;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.eps = float(eps);
  p.M = int(M);
  p.K = int(K);
  p.rows_per_block = int(rows_per_block);
  p.nseg = int(nw);
  p.rows_total = int(rows_total);
  const c10::cuda::CUDAGuard guard(x.device());
  const int smem = int(rows_per_block * K * 2);
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int sms = prop->multiProcessorCount;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool pdl = launch_pdl();
  if (const int stages = ring_stages(*prop, smem); stages >= 2) {
    p.stages = stages;
    const int ring_smem = smem + stages * kRingStageBytes;
    // decode (one row of x per block, the default stages): the kernel compiled for exactly that,
    // whose path runs through less code
    const bool decode = rows_per_block == 1 && stages == kDefaultStages;
    const GemvKernel ring_kernel =
        decode ? gemv_ring_kernel<kRingB, 1, kDefaultStages> : gemv_ring_kernel<kRingB>;
    raise_dynamic_smem(ring_kernel, ring_smem);
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ring_kernel, kThreads, ring_smem));
    const int64_t blocks = std::max<int64_t>(
        1, std::min<int64_t>((rows_total + kWarps - 1) / kWarps, int64_t(std::max(per_sm, 1)) * sms));
    KD_TRACE_SET(p, kTraceGemv, dim3(unsigned(blocks), unsigned(grid_y)));
    launch_kernel(ring_kernel, dim3(unsigned(blocks), unsigned(grid_y)), dim3(kThreads),
                  size_t(ring_smem), stream, pdl, p);
    return outs;
  }
  const GemvKernel kernel = kRegisterKernel;
  if (smem + int(sizeof(float)) * (kMaxRows * kWarps + kMaxRows) > kDefaultSmem)  // dynamic + static > 48 KB
    raise_dynamic_smem(kernel, smem);
  // persistent grid: the blocks that fit on the device at once, or fewer when there are fewer rows
  // than warps
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t resident = std::max<int64_t>(1, int64_t(std::max(per_sm, 1)) * sms);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((rows_total + kWarps - 1) / kWarps, resident));
  KD_TRACE_SET(p, kTraceGemv, dim3(unsigned(blocks), unsigned(grid_y)));
  launch_kernel(kernel, dim3(unsigned(blocks), unsigned(grid_y)), dim3(kThreads), size_t(smem), stream, pdl, p);
  return outs;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("gemv", &gemv_cuda); }

}  // namespace kdtree
