// kdtree::moe_router: the MoE block's input RMSNorm, the router GEMV (fp32 or bf16 weights, fp32
// sums) and the noaux_tc choice in one launch (semantics and the reference:
// torch_kdtree/ops/moe_router.py).
//
// In the decode step these were three dependent launches (the norm's variance, the router product,
// moe_route) of a few microseconds each for ~0.5-11 MB of router weight.  Grid (blocks, chunks of
// up to kRows tokens), 1024 threads:
//   1. Before the predecessor is done (PDL, pdl.cuh): the warp's first router segment into L2.
//   2. Every block: its chunk's rows of x normalised into shared memory as bf16 with the model's
//      rounding points, bf16(w · bf16(x · rsqrt(mean(x²) + eps))) (a fixed-order block reduction);
//      block 0 also writes them out (x_norm, the experts' input).
//   3. Items (expert e, segment s of RS equal segments of H) over the grid's warps: the fp32 dot
//      of the segment of router row e with each normalised row (16-byte weight loads: 4 fp32 or
//      8 bf16 values), a xor-shuffle sum, the partial to a workspace.  RS keeps the grid in one
//      wave of blocks (segments()).
//   4. The last block of the chunk to finish (a ticket per chunk in device memory, taken after a
//      __threadfence and reset by that block) sums each logit's RS partials in order, writes the
//      logits and runs route_select (route_select.cuh) per row.
// Deterministic (fixed summation orders; the ticket only picks which block does the last step),
// shapes from static sizes only (CUDA-graph safe).  Tickets are one per chunk per device and
// return to zero at the end of every launch, so calls on one device must be stream-ordered (not
// concurrent on two streams).
#include "bf16_vec.cuh"
#include "check.h"
#include "pdl.cuh"
#include "route_select.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace kdtree {
namespace {

constexpr int kThreads = kRouteMaxExperts;  // route_select: one thread per expert
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 4;                    // tokens per chunk
constexpr int kMaxChunks = 16384;
constexpr int kMaxSegments = 16;
constexpr int kSmemLimit = 88 * 1024;       // the normalised rows (+ 9 KB static), within sm_120's 99 KB

__device__ unsigned int g_router_tickets[kMaxChunks];  // zero between launches

struct RouterParams {
  const __nv_bfloat16* x;     // [T, H]
  const __nv_bfloat16* norm;  // [H]
  const void* w;              // [E, H], fp32 or bf16 (the kernel's WT)
  const float* bias;          // [E]
  float eps, scaling;
  int T, H, E, k, n_group, topk_group, rs, rows_per_chunk;
  bool renormalize;
  float* partial;             // [chunks, RS, rows_per_chunk, E]
  __nv_bfloat16* x_norm;      // [T, H]
  float* logits;              // [T, E]
  int32_t* ids;               // [T, k]
  float* weights;             // [T, k]
};

// The fp32 dot of one router-row segment (WT: float or bf16) with a normalised row in shared
// memory: 16-byte weight loads (4 fp32 or 8 bf16 values), lane-strided, then the caller's warp sum.
template <typename WT>
__device__ __forceinline__ void segment_dots(const WT* wr, int seg, int h0, const __nv_bfloat16* xs, int H, int rows,
                                             int lane, float (&acc)[kRows]) {
  constexpr int kVec = 16 / sizeof(WT);
  for (int c = lane; c < seg / kVec; c += 32) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(wr) + c);
    float wv[kVec];
    if constexpr (kVec == 4) {
      wv[0] = __uint_as_float(raw.x), wv[1] = __uint_as_float(raw.y);
      wv[2] = __uint_as_float(raw.z), wv[3] = __uint_as_float(raw.w);
    } else {
      unpack8(raw, wv);
    }
    const int h = h0 + kVec * c;
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < rows) {
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(xs + m * H + h);
#pragma unroll
        for (int j = 0; j < kVec / 2; ++j) {
          const float2 a = __bfloat1622float2(xp[j]);
          acc[m] = fmaf(wv[2 * j], a.x, fmaf(wv[2 * j + 1], a.y, acc[m]));
        }
      }
  }
}

template <typename WT>
__global__ void __launch_bounds__(kThreads) moe_router_kernel(const RouterParams p) {
  extern __shared__ __align__(16) __nv_bfloat16 xs[];  // [rows][H] normalised
  __shared__ float red[kRows][kWarps];
  __shared__ float rscale[kRows];
  __shared__ RouteSmem sm;
  __shared__ bool s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunk = blockIdx.y, m0 = chunk * p.rows_per_chunk;
  const int rows = min(p.rows_per_chunk, p.T - m0);
  const int seg = p.H / p.rs, items = p.E * p.rs;
  const int stride = int(gridDim.x) * kWarps;
  int item = int(blockIdx.x) * kWarps + warp;

  const WT* w = static_cast<const WT*>(p.w);
  if (item < items) {  // static weights: safe to prefetch before the wait
    const int e = item / p.rs, s = item - e * p.rs;
    l2_prefetch_range(w + int64_t(e) * p.H + int64_t(s) * seg, int64_t(seg) * int64_t(sizeof(WT)), lane);
  }
  pdl_wait();
  pdl_launch_dependents();

  // 2. RMSNorm of the chunk's rows into shared memory
  float ss[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) ss[m] = 0.f;
  const __nv_bfloat16* xg = p.x + int64_t(m0) * p.H;
  for (int i = threadIdx.x; i < p.H; i += kThreads) {
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < rows) {
        const float v = __bfloat162float(xg[int64_t(m) * p.H + i]);
        ss[m] = fmaf(v, v, ss[m]);
      }
  }
  block_rms_scale(ss, red, rscale, p.H, p.eps);
  for (int i = threadIdx.x; i < p.H; i += kThreads) {
    const float g = __bfloat162float(p.norm[i]);
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < rows) {
        const __nv_bfloat16 v = __float2bfloat16(g * round_bf16(__bfloat162float(xg[int64_t(m) * p.H + i]) * rscale[m]));
        xs[m * p.H + i] = v;
        if (blockIdx.x == 0) p.x_norm[int64_t(m0 + m) * p.H + i] = v;
      }
  }
  __syncthreads();

  // 3. partial logits: item = (expert e, segment s)
  for (; item < items; item += stride) {
    const int e = item / p.rs, s = item - e * p.rs;
    float acc[kRows];
#pragma unroll
    for (int m = 0; m < kRows; ++m) acc[m] = 0.f;
    segment_dots<WT>(w + int64_t(e) * p.H + int64_t(s) * seg, seg, s * seg, xs, p.H, rows, lane, acc);
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      const float t = warp_sum(acc[m]);
      if (lane == 0 && m < rows)
        p.partial[((int64_t(chunk) * p.rs + s) * p.rows_per_chunk + m) * p.E + e] = t;
    }
  }

  // 4. the chunk's last block: logits and the choice
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&g_router_tickets[chunk], 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int e = threadIdx.x;
  for (int m = 0; m < rows; ++m) {
    float logit = 0.f;
    if (e < p.E) {
      for (int s = 0; s < p.rs; ++s)
        logit += __ldcg(p.partial + ((int64_t(chunk) * p.rs + s) * p.rows_per_chunk + m) * p.E + e);
      p.logits[int64_t(m0 + m) * p.E + e] = logit;
    }
    route_select(logit, e < p.E ? p.bias[e] : 0.f, p.E, p.k, p.n_group, p.topk_group, p.renormalize, p.scaling,
                 p.ids + int64_t(m0 + m) * p.k, p.weights + int64_t(m0 + m) * p.k, sm);
    __syncthreads();
  }
  if (threadIdx.x == 0) g_router_tickets[chunk] = 0;
}

// Segments per router row: about 512 values per warp item, each a whole number of 16-byte loads
// (vec values), and few enough items that the grid's 1024-thread blocks fit on the SMs at once
// (one wave: every block waits for the slowest before the last one picks).
int segments(int64_t H, int64_t E, int vec, int sms) {
  int rs = int(std::clamp<int64_t>(H / 512, 1, kMaxSegments));
  while (rs > 1 && (H % (int64_t(vec) * rs) != 0 || (E * rs + kWarps - 1) / kWarps > sms)) --rs;
  return rs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_router_cuda(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& router_weight,
    const at::Tensor& bias, int64_t top_k, int64_t n_group, int64_t topk_group, bool renormalize, double scaling) {
  constexpr const char* op = "kdtree::moe_router";
  check_cuda_tensor(x, op, "x", at::kBFloat16, 2);
  check_cuda_tensor(norm_weight, op, "norm_weight", at::kBFloat16, 1);
  KD_CHECK(router_weight.scalar_type() == at::kFloat || router_weight.scalar_type() == at::kBFloat16, op,
           ": router_weight must be Float or BFloat16, got ", router_weight.scalar_type());
  check_cuda_tensor(router_weight, op, "router_weight", router_weight.scalar_type(), 2);
  check_cuda_tensor(bias, op, "bias", at::kFloat, 1);
  for (const at::Tensor* t : {&norm_weight, &router_weight, &bias})
    KD_CHECK(t->device() == x.device(), op, ": all inputs must be on one device");
  const int64_t T = x.size(0), H = x.size(1), E = router_weight.size(0);
  KD_CHECK(H >= 8 && H % 8 == 0 && norm_weight.size(0) == H && router_weight.size(1) == H, op,
           ": x [T, H], norm_weight [H] and router_weight [E, H] must agree with H a positive multiple of 8, got ",
           x.sizes(), ", ", norm_weight.sizes(), ", ", router_weight.sizes());
  KD_CHECK(bias.size(0) == E, op, ": bias must be [E = ", E, "], got ", bias.sizes());
  check_route_args(op, E, top_k, n_group, topk_group);
  const int64_t rows_per_chunk = std::min<int64_t>(kRows, int64_t(kSmemLimit) / (2 * H));
  KD_CHECK(rows_per_chunk >= 1, op, ": H = ", H, " is too large (at most ", kSmemLimit / 2, ")");
  const int64_t chunks = (T + rows_per_chunk - 1) / rows_per_chunk;
  KD_CHECK(chunks <= kMaxChunks, op, ": at most ", kMaxChunks * rows_per_chunk, " tokens per call, got ", T);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor x_norm = at::empty({T, H}, x.options());
  at::Tensor logits = at::empty({T, E}, f32);
  at::Tensor ids = at::empty({T, top_k}, x.options().dtype(at::kInt));
  at::Tensor weights = at::empty({T, top_k}, f32);
  if (T == 0) return {x_norm, logits, ids, weights};
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), nc = norm_weight.contiguous(), wc = router_weight.contiguous(),
                   bc = bias.contiguous();
  KD_CHECK(reinterpret_cast<uintptr_t>(wc.data_ptr()) % 16 == 0, op, ": router_weight must be 16-byte aligned");
  const bool bf16_w = router_weight.scalar_type() == at::kBFloat16;
  const int rs = segments(H, E, bf16_w ? 8 : 4, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  at::Tensor partial = at::empty({chunks * rs * rows_per_chunk * E}, f32);
  RouterParams p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(xc.data_ptr());
  p.norm = reinterpret_cast<const __nv_bfloat16*>(nc.data_ptr());
  p.w = wc.data_ptr();
  p.bias = bc.data_ptr<float>();
  p.eps = float(eps);
  p.scaling = float(scaling);
  p.T = int(T);
  p.H = int(H);
  p.E = int(E);
  p.k = int(top_k);
  p.n_group = int(n_group);
  p.topk_group = int(topk_group);
  p.rs = rs;
  p.rows_per_chunk = int(rows_per_chunk);
  p.renormalize = renormalize;
  p.partial = partial.data_ptr<float>();
  p.x_norm = reinterpret_cast<__nv_bfloat16*>(x_norm.data_ptr());
  p.logits = logits.data_ptr<float>();
  p.ids = ids.data_ptr<int32_t>();
  p.weights = weights.data_ptr<float>();
  const int smem = int(rows_per_chunk * H * 2);
  const auto kernel = bf16_w ? moe_router_kernel<__nv_bfloat16> : moe_router_kernel<float>;
  if (smem + int(sizeof(RouteSmem)) + 512 > 48 * 1024)
    raise_dynamic_smem(kernel, smem);
  const int blocks = int((E * rs + kWarps - 1) / kWarps);
  launch_kernel(kernel, dim3(unsigned(blocks), unsigned(chunks)), dim3(kThreads), size_t(smem),
                at::cuda::getCurrentCUDAStream(), launch_pdl(), p);
  return {x_norm, logits, ids, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("moe_router", &moe_router_cuda); }

}  // namespace kdtree
