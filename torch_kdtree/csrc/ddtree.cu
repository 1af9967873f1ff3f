// DDTree step kernels: tree_accept, kv_commit (ddtree_build: ddtree_build.cu).
// Semantics: shared/docs/ddtree.md, restated in torch_kdtree/ops/ddtree.py, whose pure-torch
// references these must equal bit for bit.
//
// tree_accept: one block per request; every node tests itself against its parent's target
// token in parallel (children of one node carry distinct tokens, ties go to the lower index),
// then one thread follows the matched links from the root (at most depth + 1 steps).
//
// kv_commit: one thread per (layer, request, 16-byte column chunk) copies the accepted rows in
// path order.  Reading a batch of rows before writing it is safe because a path's indices are
// increasing, so row j's source (>= j) is never a row an earlier j' < j writes.  Pure bandwidth.
#include "check.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace kdtree {
namespace {

constexpr int kMaxBudget = 1024;
constexpr int kMaxNodes = kMaxBudget + 1;

__global__ void tree_accept_kernel(const int64_t* __restrict__ tokens, const int32_t* __restrict__ parents,
                                   const int64_t* __restrict__ target, int N, int32_t* __restrict__ indices,
                                   int32_t* __restrict__ lengths, int64_t* __restrict__ next_tokens) {
  __shared__ int next_child[kMaxNodes];
  __shared__ int path[kMaxNodes];
  __shared__ int path_len;
  const int r = blockIdx.x;
  const int64_t base = int64_t(r) * N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) next_child[i] = 0x7fffffff;
  __syncthreads();
  for (int i = 1 + threadIdx.x; i < N; i += blockDim.x) {
    const int p = parents[base + i];
    if (p >= 0 && p < i && tokens[base + i] == target[base + p]) atomicMin(&next_child[p], i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int cur = 0, len = 0;
    path[len++] = 0;
    // Matched links strictly increase the index, so the walk ends within N steps.
    while (next_child[cur] != 0x7fffffff) {
      cur = next_child[cur];
      path[len++] = cur;
    }
    path_len = len;
    lengths[r] = len;
    next_tokens[r] = target[base + cur];
  }
  __syncthreads();
  const int len = path_len;
  for (int i = threadIdx.x; i < N; i += blockDim.x) indices[base + i] = i < len ? path[i] : -1;
}

template <typename V>
__global__ void kv_commit_kernel(V* __restrict__ cache, const int32_t* __restrict__ block_table,
                                 const int32_t* __restrict__ cache_lens, const int32_t* __restrict__ indices,
                                 const int32_t* __restrict__ lengths, int64_t num_pages, int page_size,
                                 int row_vecs, int max_pages, int N) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  const int layer = blockIdx.z;
  if (col >= row_vecs) return;
  const int len = min(lengths[r], N);
  const int base = cache_lens[r];
  const int32_t* bt = block_table + int64_t(r) * max_pages;
  const int32_t* idx = indices + int64_t(r) * N;
  V* layer_cache = cache + int64_t(layer) * num_pages * page_size * row_vecs;
  // Returns the element offset of a logical position, or -1 when it is not backed by a page.
  auto offset = [&](int pos) -> int64_t {
    if (pos < 0) return -1;
    const int pi = pos / page_size;
    if (pi >= max_pages) return -1;
    const int page = bt[pi];
    if (page < 0 || page >= num_pages) return -1;
    return (int64_t(page) * page_size + pos % page_size) * row_vecs + col;
  };
  constexpr int kBatch = 8;
  for (int j0 = 0; j0 < len; j0 += kBatch) {
    V v[kBatch];
    int64_t dst[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = j0 + u;
      dst[u] = -1;
      if (j < len) {
        const int src_idx = idx[j];
        if (src_idx == j) continue;  // already in place
        const int64_t so = offset(base + src_idx);
        const int64_t d = offset(base + j);
        if (so >= 0 && d >= 0) {
          v[u] = layer_cache[so];
          dst[u] = d;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (dst[u] >= 0) layer_cache[dst[u]] = v[u];
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_accept_cuda(const at::Tensor& tokens, const at::Tensor& parents,
                                                                const at::Tensor& target_tokens) {
  const char* op = "kdtree::tree_accept";
  check_cuda_tensor(tokens, op, "tokens", at::kLong, 2);
  check_cuda_tensor(parents, op, "parents", at::kInt, 2);
  check_cuda_tensor(target_tokens, op, "target_tokens", at::kLong, 2);
  KD_CHECK(parents.sizes() == tokens.sizes() && target_tokens.sizes() == tokens.sizes(), op,
              ": tokens, parents and target_tokens must share one [R, N] shape, got ", tokens.sizes(), ", ",
              parents.sizes(), ", ", target_tokens.sizes());
  const int64_t R = tokens.size(0), N = tokens.size(1);
  KD_CHECK(N >= 1 && N <= kMaxNodes, op, ": N must be in [1, ", kMaxNodes, "], got ", N);
  KD_CHECK(parents.device() == tokens.device() && target_tokens.device() == tokens.device(), op,
              ": all inputs must be on one device");
  const c10::cuda::CUDAGuard guard(tokens.device());
  at::Tensor indices = at::empty({R, N}, tokens.options().dtype(at::kInt));
  at::Tensor lengths = at::empty({R}, tokens.options().dtype(at::kInt));
  at::Tensor next_tokens = at::empty({R}, tokens.options());
  if (R > 0) {
    tree_accept_kernel<<<R, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(), target_tokens.data_ptr<int64_t>(), int(N),
        indices.data_ptr<int32_t>(), lengths.data_ptr<int32_t>(), next_tokens.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {indices, lengths, next_tokens};
}

template <typename V>
void launch_commit(at::Tensor& kv, const at::Tensor& bt, const at::Tensor& lens, const at::Tensor& idx,
                   const at::Tensor& lengths, int row_bytes) {
  const int64_t layers = kv.size(0), pages = kv.size(1), R = bt.size(0);
  const int row_vecs = row_bytes / int(sizeof(V));
  const int threads = std::min(128, ((row_vecs + 31) / 32) * 32);
  const dim3 grid((row_vecs + threads - 1) / threads, unsigned(R), unsigned(layers));
  kv_commit_kernel<V><<<grid, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<V*>(kv.data_ptr()), bt.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), idx.data_ptr<int32_t>(),
      lengths.data_ptr<int32_t>(), pages, int(kv.size(2)), row_vecs, int(bt.size(1)), int(idx.size(1)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_commit_cuda(at::Tensor kv_cache, const at::Tensor& block_table, const at::Tensor& cache_lens,
                    const at::Tensor& indices, const at::Tensor& lengths) {
  const char* op = "kdtree::kv_commit";
  KD_CHECK(kv_cache.is_cuda(), op, ": kv_cache must be a CUDA tensor");
  KD_CHECK(kv_cache.dim() == 4, op, ": kv_cache must be [num_layers, num_pages, page_size, D], got ",
              kv_cache.sizes());
  KD_CHECK(kv_cache.scalar_type() == at::kBFloat16 || kv_cache.scalar_type() == at::kFloat ||
                  kv_cache.scalar_type() == at::kHalf,
              op, ": kv_cache must be bfloat16, float16 or float32, got ", kv_cache.scalar_type());
  KD_CHECK(kv_cache.is_contiguous(), op, ": kv_cache must be contiguous");
  check_cuda_tensor(block_table, op, "block_table", at::kInt, 2);
  check_cuda_tensor(cache_lens, op, "cache_lens", at::kInt, 1);
  check_cuda_tensor(indices, op, "indices", at::kInt, 2);
  check_cuda_tensor(lengths, op, "lengths", at::kInt, 1);
  const int64_t R = block_table.size(0);
  KD_CHECK(cache_lens.size(0) == R && indices.size(0) == R && lengths.size(0) == R, op,
              ": block_table, cache_lens, indices and lengths must agree on R = ", R);
  for (const at::Tensor* t : {&block_table, &cache_lens, &indices, &lengths})
    KD_CHECK(t->device() == kv_cache.device(), op, ": all inputs must be on one device");
  if (R == 0 || kv_cache.numel() == 0 || indices.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int row_bytes = int(kv_cache.size(3) * kv_cache.element_size());
  const auto addr = reinterpret_cast<uintptr_t>(kv_cache.data_ptr());
  if (row_bytes % 16 == 0 && addr % 16 == 0)
    launch_commit<uint4>(kv_cache, block_table, cache_lens, indices, lengths, row_bytes);
  else if (row_bytes % 4 == 0 && addr % 4 == 0)
    launch_commit<uint32_t>(kv_cache, block_table, cache_lens, indices, lengths, row_bytes);
  else
    launch_commit<uint16_t>(kv_cache, block_table, cache_lens, indices, lengths, row_bytes);
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("tree_accept", &tree_accept_cuda);
  m.impl("kv_commit", &kv_commit_cuda);
}

}  // namespace kdtree
