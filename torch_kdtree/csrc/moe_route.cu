// kdtree::moe_route: noaux_tc expert selection from router logits (semantics and the reference:
// torch_kdtree/ops/moe_route.py).
//
// One block per token, one thread per expert (E <= 1024), everything in shared memory, one launch
// (the three to four fused kernels inductor makes of the same torch code cost ~4 us a layer in the
// decode step):
//   1. thread e: score = sigmoid(logit) (fp32, expf), choice = score + bias[e] (NaN -> -inf);
//   2. with n_group > 1: thread g sums its group's two largest choices, ranks the groups (ties:
//      lower group first) and the experts of groups outside the best topk_group get -inf;
//   3. thread e counts the experts that beat it (larger choice, or equal and lower index): a rank
//      that is unique per token, so ranks 0 .. k-1 name the top-k, largest first;
//   4. thread 0: w_j = score[id_j] (/ Σ_j w_j + 1e-20 when renormalising) · scaling.
// Deterministic, no host synchronisation, shapes from static sizes only (CUDA-graph safe).  The
// same code runs on sm_90 and sm_120.
#include "check.h"
#include "pdl.cuh"
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

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopk = 32;
constexpr int kMaxGroups = 64;

// Entries of v[0 .. n) that beat v[i]: larger, or equal at a lower index (a total order, so ranks
// are distinct).
__device__ __forceinline__ int rank_of(const float* v, int n, int i) {
  const float mine = v[i];
  int rank = 0;
  for (int j = 0; j < n; ++j) rank += (v[j] > mine) || (v[j] == mine && j < i);
  return rank;
}

__global__ void __launch_bounds__(kMaxExperts)
moe_route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k, int n_group,
                 int topk_group, bool renormalize, float scaling, int32_t* __restrict__ ids,
                 float* __restrict__ weights) {
  __shared__ float score[kMaxExperts];
  __shared__ float choice[kMaxExperts];
  __shared__ float group_score[kMaxGroups];
  __shared__ bool keep[kMaxGroups];
  __shared__ int sel_id[kMaxTopk];
  pdl_wait();  // programmatic dependent launch (pdl.cuh): the logits come from the previous kernel
  pdl_launch_dependents();
  const int t = blockIdx.x, e = threadIdx.x;
  if (e < E) {
    const float s = 1.f / (1.f + expf(-logits[int64_t(t) * E + e]));
    const float c = s + bias[e];
    score[e] = s;
    choice[e] = isnan(c) ? -INFINITY : c;
  }
  __syncthreads();
  if (n_group > 1) {
    const int gsize = E / n_group;
    if (e < n_group) {
      float a = -INFINITY, b = -INFINITY;  // the two largest of the group, a >= b
      for (int j = e * gsize; j < (e + 1) * gsize; ++j) {
        const float v = choice[j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[e] = a + b;
    }
    __syncthreads();
    if (e < n_group) keep[e] = rank_of(group_score, n_group, e) < topk_group;
    __syncthreads();
    if (e < E && !keep[e / gsize]) choice[e] = -INFINITY;
    __syncthreads();
  }
  if (e < E) {
    const int rank = rank_of(choice, E, e);
    if (rank < k) sel_id[rank] = e;
  }
  __syncthreads();
  if (e == 0) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += score[sel_id[j]];
    for (int j = 0; j < k; ++j) {
      const int id = sel_id[j];
      ids[int64_t(t) * k + j] = id;
      weights[int64_t(t) * k + j] = (renormalize ? score[id] / (sum + 1e-20f) : score[id]) * scaling;
    }
  }
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
  KD_CHECK(E >= 1 && E <= kMaxExperts, op, ": E must be in [1, ", kMaxExperts, "], got ", E);
  KD_CHECK(top_k >= 1 && top_k <= kMaxTopk && top_k <= E, op, ": top_k must be in [1, min(", kMaxTopk, ", E)], got ",
           top_k);
  KD_CHECK(n_group >= 1 && n_group <= kMaxGroups && E % n_group == 0, op, ": n_group must divide E and be in [1, ",
           kMaxGroups, "], got ", n_group);
  KD_CHECK(n_group == 1 || (E / n_group >= 2 && topk_group >= 1 && topk_group <= n_group &&
                            topk_group * (E / n_group) >= top_k),
           op, ": with n_group > 1, groups need >= 2 experts and topk_group in [1, n_group] keeping >= top_k "
           "experts, got n_group = ", n_group, ", topk_group = ", topk_group);
  KD_CHECK(T <= 2147483647, op, ": too many tokens");
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kInt));
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  if (T == 0) return {ids, weights};
  const c10::cuda::CUDAGuard guard(logits.device());
  const int threads = int((std::max<int64_t>(E, n_group) + 31) / 32 * 32);
  launch_kernel(moe_route_kernel, dim3(unsigned(T)), dim3(unsigned(threads)), 0, at::cuda::getCurrentCUDAStream(),
                pdl_enabled("moe_route"), logits.data_ptr<float>(), bias.data_ptr<float>(), int(E), int(top_k), int(n_group),
                int(topk_group), renormalize, float(scaling), ids.data_ptr<int32_t>(), weights.data_ptr<float>());
  return {ids, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("moe_route", &moe_route_cuda); }

}  // namespace kdtree
