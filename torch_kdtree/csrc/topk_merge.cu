// kdtree::draft_topk_merge: semantics and the pure-torch reference in torch_kdtree/ops/topk.py.
//
// On [P, rows, k_in] candidates (the vocabulary shards' draft_topk_partial results): one block
// of 1024 threads per row runs a block-wide radix select (11-bit digits, shared-memory
// histograms) and a bitonic sort over the P*k_in keys = orderable(value) << 32 | ~id (re-read
// from global/L2 on every digit), and logsumexp over the P parts' lse.  Bound: latency of
// the select's digits and the sort's stages (P*k_in*12 bytes per row are read per digit).
// No host sync, no allocation beyond the outputs: CUDA-graph safe.
#include "check.h"
#include "topk_select.cuh"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>

namespace kdtree {
namespace {

__global__ void __launch_bounds__(kRowThreads, 1)
topk_merge_kernel(const float* __restrict__ values, const int64_t* __restrict__ ids, const float* __restrict__ lse,
                  int P, int64_t rows, int kin, int k, float* __restrict__ out_lp, int64_t* __restrict__ out_id) {
  __shared__ SelectShared sh;
  __shared__ uint64_t sorted[kRowThreads];
  __shared__ float row_lse;
  const int64_t row = blockIdx.x;
  const int n = P * kin;
  const int n2 = next_pow2(k);
  sorted[threadIdx.x] = 0;
  if (threadIdx.x < 32) {  // logsumexp over the parts, as torch.logsumexp (an infinite max counts as 0)
    const int lane = threadIdx.x;
    float m = -INFINITY;
    for (int p = lane; p < P; p += 32) m = fmaxf(m, lse[p * rows + row]);
    m = warp_max(m);
    const float mu = isinf(m) ? 0.0f : m;
    float s = 0.0f;
    for (int p = lane; p < P; p += 32) s += expf(lse[p * rows + row] - mu);
    s = warp_sum(s);
    if (lane == 0) row_lse = logf(s) + mu;
  }
  auto key_at = [&](int j, uint64_t& key) -> bool {
    const int i = j * kRowThreads + int(threadIdx.x);
    if (i >= n) {
      key = 0;
      return false;
    }
    const int p = i / kin, q = i - p * kin;
    const int64_t o = (int64_t(p) * rows + row) * kin + q;
    key = (uint64_t(F32::orderable(__float_as_uint(values[o]))) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(ids[o]));
    return true;
  };
  const int iters = (n + kRowThreads - 1) / kRowThreads;
  uint64_t prefix;
  int shift;
  radix_select<kRowThreads, 0>(sh, key_at, iters, 64, uint32_t(k), false, prefix, shift);
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int j = 0; j < iters; ++j) {
    uint64_t key;
    const bool take = key_at(j, key) && shr(key, shift) >= prefix;
    const int pos = warp_claim(take, &sh.count);
    if (take && pos < k) sorted[pos] = key;
  }
  __syncthreads();
  const uint64_t key = bitonic_sort_desc_1024(sorted[threadIdx.x], sorted, n2);
  const float lse_all = row_lse;
  if (int(threadIdx.x) < k) {
    const int i = threadIdx.x;
    const int64_t o = row * k + i;
    out_lp[o] = __uint_as_float(F32::from_orderable(uint32_t(key >> 32))) - lse_all;
    out_id[o] = int64_t(0xFFFFFFFFu - uint32_t(key));
  }
}

std::tuple<at::Tensor, at::Tensor> draft_topk_merge_cuda(const at::Tensor& values, const at::Tensor& token_ids,
                                                        const at::Tensor& lse, int64_t k) {
  const char* op = "kdtree::draft_topk_merge";
  KD_CHECK(values.is_cuda() && token_ids.is_cuda() && lse.is_cuda(), op, ": inputs must be CUDA tensors");
  KD_CHECK(values.device() == token_ids.device() && values.device() == lse.device(), op,
              ": all inputs must be on one device");
  KD_CHECK(values.scalar_type() == at::kFloat, op, ": values must be float32, got ", values.scalar_type());
  KD_CHECK(token_ids.scalar_type() == at::kLong, op, ": token_ids must be int64, got ", token_ids.scalar_type());
  KD_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32, got ", lse.scalar_type());
  KD_CHECK(values.dim() == 4, op, ": values must have 4 dimensions [P, R, L, k_in], got shape ", values.sizes());
  KD_CHECK(token_ids.sizes() == values.sizes(), op, ": token_ids shape ", token_ids.sizes(), " != values shape ",
              values.sizes());
  KD_CHECK(lse.dim() == 3 && lse.size(0) == values.size(0) && lse.size(1) == values.size(1) &&
                  lse.size(2) == values.size(2),
              op, ": lse must have shape [P, R, L], got ", lse.sizes());
  KD_CHECK(values.is_contiguous() && token_ids.is_contiguous() && lse.is_contiguous(), op,
              ": values, token_ids and lse must be contiguous");
  const int64_t P = values.size(0), R = values.size(1), L = values.size(2), kin = values.size(3);
  KD_CHECK(P >= 1 && kin >= 1, op, ": need at least one part with at least one entry");
  KD_CHECK(k >= 1 && k <= kMaxK, op, ": k must be in [1, ", kMaxK, "], got ", k);
  KD_CHECK(k <= P * kin, op, ": k = ", k, " exceeds the ", P, " x ", kin, " candidates");
  KD_CHECK(P * kin <= (int64_t(1) << 30), op, ": too many candidates per row (P * k_in = ", P * kin, ")");
  const c10::cuda::CUDAGuard guard(values.device());
  auto opts = values.options();
  at::Tensor logprobs = at::empty({R, L, k}, opts);
  at::Tensor ids = at::empty({R, L, k}, opts.dtype(at::kLong));
  const int64_t rows = R * L;
  KD_CHECK(rows <= INT32_MAX, op, ": R * L = ", rows, " rows is too many for one launch");
  if (rows > 0) {
    topk_merge_kernel<<<unsigned(rows), kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        values.data_ptr<float>(), token_ids.data_ptr<int64_t>(), lse.data_ptr<float>(), int(P), rows, int(kin),
        int(k), logprobs.data_ptr<float>(), ids.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {logprobs, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("draft_topk_merge", &draft_topk_merge_cuda); }

}  // namespace kdtree
