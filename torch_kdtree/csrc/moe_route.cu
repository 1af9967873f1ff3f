// kdtree::moe_route: noaux_tc expert selection from router logits (semantics and the reference:
// torch_kdtree/ops/moe_route.py).
//
// One block per token, one thread per expert (E <= 1024), everything in shared memory, one launch
// (the three to four fused kernels inductor makes of the same torch code cost ~4 us a layer in the
// decode step); the selection itself is route_select (route_select.cuh).  Tried and removed: L2
// prefetches of the chosen experts' weights issued from here, from one block or spread over a block
// per SM (bench/RESULTS.md runs 103-104: 5-150 % slower decode steps).
// Deterministic, no host synchronisation, shapes from static sizes only (CUDA-graph safe).  The
// same code runs on sm_90 and sm_120.
#include "check.h"
#include "pdl.cuh"
#include "route_select.cuh"
#include "trace.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace kdtree {
namespace {


__global__ void __launch_bounds__(kRouteMaxExperts)
moe_route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k,
                 int n_group, int topk_group, bool renormalize, float scaling, int32_t* __restrict__ ids,
                 float* __restrict__ weights KD_TRACE_PARAM) {
  __shared__ RouteSmem sm;
  KD_TRACE(trace, 0);
  const int t = blockIdx.x, e = threadIdx.x;
  // the correction bias is a model weight: loaded before the wait (after it, an HBM miss -- the bias
  // is evicted from L2 between steps -- on the path from the logits to the experts)
  const float b = e < E ? ld_early_f32(bias + e) : 0.f;
  pdl_wait();  // programmatic dependent launch (pdl.cuh): the logits come from the previous kernel
  KD_TRACE(trace, 2);
  // Only after the wait: everything before this launch is then complete when the next kernel starts,
  // which the route_logits hint of kdtree::moe_gemv relies on (its shared expert's blocks read x
  // without waiting).
  pdl_launch_dependents();
  route_select(e < E ? logits[int64_t(t) * E + e] : 0.f, b, E, k, n_group, topk_group, renormalize, scaling,
               ids + int64_t(t) * k, weights + int64_t(t) * k, sm);
  KD_TRACE(trace, 4);
}

std::tuple<at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& logits, const at::Tensor& bias, int64_t top_k,
                                                  int64_t n_group, int64_t topk_group, bool renormalize,
                                                  double scaling) {
  constexpr const char* op = "kdtree::moe_route";
  check_cuda_tensor(logits, op, "logits", at::kFloat, 2);
  check_cuda_tensor(bias, op, "bias", at::kFloat, 1);
  KD_CHECK(bias.device() == logits.device(), op, ": logits and bias must be on one device");
  const int64_t T = logits.size(0), E = logits.size(1);
  KD_CHECK(bias.size(0) == E, op, ": bias must be [E = ", E, "], got ", bias.sizes());
  check_route_args(op, E, top_k, n_group, topk_group);
  KD_CHECK(T <= 2147483647, op, ": too many tokens");
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kInt));
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  if (T == 0) return {ids, weights};
  const c10::cuda::CUDAGuard guard(logits.device());
  const int threads = int((std::max<int64_t>(E, n_group) + 31) / 32 * 32);
  launch_kernel(moe_route_kernel, dim3(unsigned(T)), dim3(unsigned(threads)), 0, at::cuda::getCurrentCUDAStream(),
                launch_pdl(), logits.data_ptr<float>(), bias.data_ptr<float>(), int(E), int(top_k), int(n_group),
                int(topk_group), renormalize, float(scaling), ids.data_ptr<int32_t>(), weights.data_ptr<float>()
                KD_TRACE_ARG(kTraceMoeRoute, dim3(unsigned(T))));
  return {ids, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("moe_route", &moe_route_cuda); }

}  // namespace kdtree
