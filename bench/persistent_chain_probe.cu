// A diagnostic for the decode step's design (bench/persistent_chain_probe.py builds and runs it with
// torch.utils.cpp_extension.load; not part of the library): a chain of dependent bf16 GEMVs
// y_p = W_p · y_{p-1} (M = 1) in ONE persistent launch, one block of W warps per SM, a grid barrier
// between phases, and a weight stream that runs on across the barriers.  It answers: how much of a
// chain of per-phase kernels' cost (launch, ramp, prologue, tail: bench/RESULTS.md runs 71, 80-82)
// a persistent design removes.  bench/RESULTS.md runs 111-116 have its numbers.
//
//   - Work: a phase's weight is a flat list of items (row, k-slice of 1024 elements = 2 KB).  Warp g
//     of G takes items [T g / G, T (g + 1) / G) (blocked) or g, g + G, ... (strided: the grid sweeps
//     the weight in address order); either way balanced to one item.
//   - Stream: lane 0 of each warp keeps S bulk copies (bulk_copy.cuh) in flight into its ring of S
//     2 KB stages; its cursor walks phase p + 1's items as soon as phase p's are issued, so the ring
//     fills during the barrier (the weights depend on no data).
//   - Arithmetic: each item's fp32 dot product is warp-summed and stored as a partial P_p[slice][row];
//     phase p + 1's x[c] = bf16(sum over slices of P_p[.][c]) in slice order (deterministic, not
//     gemv.cu's order: the last output agrees with kdtree::gemv's chain to bf16 rounding).
//   - Grid barrier: __syncthreads; thread 0 fences, increments the phase's counter and spins until it
//     reaches gridDim.x (acquire); __syncthreads.  Counters are zeroed by the launch's memset; every
//     block must be resident at once (the host checks the occupancy).
//   - Switches for the diagnosis: barrier = 0 drops the barriers, xload = 0 reuses phase 0's x (both
//     give wrong results: the stream's own speed without the dependency's costs).
#include "bf16_vec.cuh"
#include "bulk_copy.cuh"
#include "warp_reduce.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace probe {

using kdtree::bulk_load;
using kdtree::fence_mbar_init;
using kdtree::fence_proxy_async;
using kdtree::mbar_init;
using kdtree::mbar_wait;
using kdtree::warp_sum;

constexpr int kB = 4;           // 16-byte chunks per lane per item
constexpr int kItem = 32 * kB;  // chunks per item (2 KB, 1024 bf16)
constexpr int kMaxPhases = 32;
constexpr int kMaxStages = 16;
constexpr int kMaxK = 8192;

struct Params {
  const __nv_bfloat16* w[kMaxPhases];  // [n_p, k_p]
  float* part[kMaxPhases];             // [nb_p, n_p]
  int n[kMaxPhases];
  int k[kMaxPhases];
  int nb[kMaxPhases];  // items per row
  const __nv_bfloat16* x0;
  unsigned* counters;
  int phases;
  int stages;
  int barrier;  // 0: no grid barriers (wrong results)
  int xload;    // 0: phases > 0 reuse phase 0's x (wrong results)
  int strided;  // 1: warp g takes items g, g + G, ...; 0: a contiguous range of items
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void grid_barrier(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (ld_acquire(counter) < gridDim.x) {
    }
    __threadfence();
  }
  __syncthreads();
}

using kdtree::dot8;

template <int W>
__global__ void __launch_bounds__(W * 32, 1) chain_kernel(const Params p) {
  extern __shared__ uint4 smem[];  // x: kMaxK / 8 chunks | rings [W][S][kItem]
  __shared__ alignas(8) uint64_t bars[W][kMaxStages];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = p.stages;
  uint4* xs = smem;
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(smem);
  uint4* ring = smem + kMaxK / 8 + warp * S * kItem;
  uint64_t* bar = bars[warp];
  const long G = long(gridDim.x) * W, g = long(blockIdx.x) * W + warp;

  // producer cursor (lane 0): phase pp, item t of [t, te)
  int pp = 0, ps = 0;
  long t = 0, te = 0;
  auto range = [&](int ph, long& a, long& b) {
    const long T = long(p.n[ph]) * p.nb[ph];
    a = p.strided ? g : T * g / G;
    b = p.strided ? T : T * (g + 1) / G;
  };
  const long step = p.strided ? G : 1;
  range(0, t, te);
  auto produce = [&]() {
    while (t >= te) {
      if (++pp >= p.phases) return;
      range(pp, t, te);
    }
    const int nb = p.nb[pp], chunks = p.k[pp] / 8;
    const int row = int(t) / nb, b = int(t) % nb;
    const int c0 = b * kItem, n = min(kItem, chunks - c0);
    const uint4* src = reinterpret_cast<const uint4*>(p.w[pp]) + long(row) * chunks + c0;
    bulk_load(ring + ps * kItem, src, uint32_t(n) * 16u, bar + ps);
    if (++ps == S) ps = 0;
    t += step;
  };
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bar + s, 1);
    fence_mbar_init();
    for (int s = 0; s < S; ++s) produce();
  }
  __syncwarp();

  int cs = 0;
  uint32_t par = 0;
  for (int ph = 0; ph < p.phases; ++ph) {
    const int K = p.k[ph];
    if (ph > 0 && p.barrier) grid_barrier(p.counters + ph - 1);
    if (ph == 0) {
      const uint4* xg = reinterpret_cast<const uint4*>(p.x0);
      for (int i = threadIdx.x; i < K / 8; i += W * 32) xs[i] = xg[i];
    } else if (p.xload) {  // else phase 0's x stays
      const float* prev = p.part[ph - 1];
      const int nbp = p.nb[ph - 1];
      for (int q = threadIdx.x; q < K / 4; q += W * 32) {  // partials [nb][n]: float4 per slice
        float4 v[8];
#pragma unroll
        for (int s = 0; s < 8; ++s)
          if (s < nbp) v[s] = __ldcg(reinterpret_cast<const float4*>(prev + long(s) * K) + q);
        float4 a = v[0];
#pragma unroll
        for (int s = 1; s < 8; ++s)
          if (s < nbp) a.x += v[s].x, a.y += v[s].y, a.z += v[s].z, a.w += v[s].w;
        xh[4 * q] = __float2bfloat16(a.x);
        xh[4 * q + 1] = __float2bfloat16(a.y);
        xh[4 * q + 2] = __float2bfloat16(a.z);
        xh[4 * q + 3] = __float2bfloat16(a.w);
      }
    }
    __syncthreads();
    const int nb = p.nb[ph], chunks = K / 8;
    long a, e;
    range(ph, a, e);  // the producer's items of this phase, in its order
    int row = int(a / nb), b = int(a % nb);
    for (long it = a; it < e; it += step) {
      if (p.strided) row = int(it) / nb, b = int(it) % nb;
      mbar_wait(bar + cs, par);
      const uint4* st = ring + cs * kItem;
      float acc[kB];
#pragma unroll
      for (int u = 0; u < kB; ++u) {
        const int c = b * kItem + lane + 32 * u;
        acc[u] = (c < chunks) ? dot8(st[lane + 32 * u], xs[c], 0.f) : 0.f;
      }
      __syncwarp();
      if (lane == 0) {
        fence_proxy_async();
        produce();
      }
      if (++cs == S) {
        cs = 0;
        par ^= 1u;
      }
      float v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      v = warp_sum(v);
      if (lane == 0) __stcg(p.part[ph] + long(b) * p.n[ph] + row, v);
      if (!p.strided && ++b == nb) {
        b = 0;
        ++row;
      }
    }
    __syncthreads();  // xs is rewritten after the next barrier
  }
}

// The chain x0 -> weights[0] -> weights[1] ...; returns every phase's partials ([nb_p, n_p] fp32, nb_p =
// ceil(k_p / 1024)): y_p = bf16(part_p.sum(0)).  counters: int32 [phases] (zeroed here, stream-ordered,
// so a CUDA graph captures the memset with the launch).  blocks: at most the resident blocks.
std::vector<at::Tensor> run_chain(const at::Tensor& x0, const std::vector<at::Tensor>& weights, at::Tensor counters,
                                  int64_t warps, int64_t stages, int64_t blocks, bool barrier, bool xload, bool strided) {
  TORCH_CHECK(x0.is_cuda() && x0.scalar_type() == at::kBFloat16 && x0.dim() == 1, "x0: bf16 CUDA vector");
  const int P = int(weights.size());
  TORCH_CHECK(P >= 1 && P <= kMaxPhases, "1 to ", kMaxPhases, " phases");
  TORCH_CHECK(stages >= 2 && stages <= kMaxStages, "stages in [2, ", kMaxStages, "]");
  TORCH_CHECK(warps == 8 || warps == 16, "warps: 8 or 16");
  TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.numel() >= P,
              "counters: int32 [phases] on CUDA");
  const c10::cuda::CUDAGuard guard(x0.device());
  Params p{};
  std::vector<at::Tensor> parts;
  int64_t k = x0.size(0);
  for (int i = 0; i < P; ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() &&
                    w.size(1) == k && k % 8 == 0 && k <= kMaxK,
                "weights[", i, "]: bf16 [n, ", k, "] contiguous on CUDA, k a multiple of 8 and at most ", kMaxK);
    const int nb = int((k / 8 + kItem - 1) / kItem);
    parts.push_back(at::empty({nb, w.size(0)}, x0.options().dtype(at::kFloat)));
    p.w[i] = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
    p.part[i] = parts.back().data_ptr<float>();
    p.n[i] = int(w.size(0));
    p.k[i] = int(k);
    p.nb[i] = nb;
    k = w.size(0);
  }
  p.x0 = reinterpret_cast<const __nv_bfloat16*>(x0.data_ptr());
  p.counters = reinterpret_cast<unsigned*>(counters.data_ptr());
  p.phases = P;
  p.stages = int(stages);
  p.barrier = barrier ? 1 : 0;
  p.xload = xload ? 1 : 0;
  p.strided = strided ? 1 : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(counters.data_ptr(), 0, size_t(P) * 4, stream));
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const size_t need = size_t(kMaxK / 8) * 16 + size_t(warps) * stages * kItem * 16;
  const size_t smem = std::min(std::max(need, prop->sharedMemPerMultiprocessor / 2 + 1024),
                               prop->sharedMemPerBlockOptin - 1024);
  TORCH_CHECK(smem >= need, "stages: ", stages, " do not fit in shared memory with ", warps, " warps");
  auto launch = [&](auto kern, int W) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, W * 32, smem));
    TORCH_CHECK(per_sm >= 1 && blocks >= 1 && blocks <= int64_t(per_sm) * prop->multiProcessorCount,
                "blocks must all be resident");
    kern<<<unsigned(blocks), W * 32, smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (warps == 8)
    launch(chain_kernel<8>, 8);
  else
    launch(chain_kernel<16>, 16);
  return parts;
}

}  // namespace probe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run_chain", &probe::run_chain); }
