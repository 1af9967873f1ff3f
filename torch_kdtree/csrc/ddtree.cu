// DDTree step kernels: ddtree_build, tree_accept, kv_commit (semantics: shared/docs/ddtree.md,
// restated in torch_kdtree/ops/ddtree.py, whose pure-torch references these must equal bit for bit).
//
// ddtree_build: one block per request.  Warp 0 runs the best-first loop; the other warps clear
// the [N, N] visibility matrix meanwhile.  The loop is latency-bound (each pop depends on the
// last), so it is written around its dependency chain:
//  - `cur`, the next key to pop, is held by every lane (no broadcast on the chain).  A pop
//    decodes it, loads the parent's score and two log-probs from shared memory (every row of
//    lp is cached there when it fits, up to 80 KB of dynamic shared memory), and forms the
//    sibling key a and the first-child key b.  The next `cur` is min(a, b, list head, pool
//    best); the list head is kept uniform too (computed from the old list's lanes 0 and 1).
//  - The rest of the frontier lives in a sorted list of up to 32 keys, one per lane: per pop it
//    loses its head if that was chosen and gains the (one or two) new keys not chosen, with two
//    ballots and a few shuffles.  Peaked drafts mostly pop a or b (a chain), which costs one
//    insert.  This update is off the `cur` chain: the next pop needs only the new head.
//  - Keys pushed past lane 31 go to an unsorted overflow pool in shared memory whose best key
//    is tracked; only a pop from the pool rescans it (warp-parallel, 32-bit redux).
// What bounds it: the per-pop chain (decode, one shared-memory load, two float adds, key
// compares: ~100-150 cycles) plus the list update issued by the same warp; a pop from the pool
// adds a rescan of pool/32 loads per lane.  Fixed costs: the launch, one global round trip for
// lp (and, when L*K <= 2048, the token ids, so the outputs need no second round trip), the
// output stores and the ancestor walk of every visibility row (depth <= L steps).
// A key is 64 bits, smaller = popped first: high word = ~orderable(score), low word starts with
// parent, then rank, which is exactly the reference's order (score desc, parent asc, rank asc).
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
constexpr int kMaxDepth = 32;
constexpr int kMaxK = 1024;
constexpr int kBuildThreads = 256;
constexpr int kLpCacheMaxFloats = 20480;  // 80 KB of dynamic shared memory for lp rows
constexpr int kIdsCacheMax = 2048;        // token ids cached too when L*K <= this (16 KB)
constexpr uint64_t kEmpty = ~0ull;

__device__ __forceinline__ float from_orderable(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// Low word: parent (11 bits) | rank (10 bits) | depth (6 bits).  Depth is a function of the
// parent, so it never decides an order; it rides along to save a shared-memory load.  The low
// word is also what a node keeps (node_info) once popped.
// The high word is ~orderable(score), orderable = the float's bits mapped so that unsigned order
// is float order.  The score must not be -0 (which would sort apart from +0): the loop's scores
// are float sums whose left operand is never -0, so they never are; the first one is +0-fixed.
__device__ __forceinline__ uint64_t make_key(float score, int parent, int rank, int depth) {
  const uint32_t u = __float_as_uint(score);
  const uint32_t ord = u ^ (uint32_t(int32_t(u) >> 31) | 0x80000000u);
  return (uint64_t(~ord) << 32) | (uint32_t(parent) << 16) | (uint32_t(rank) << 6) | uint32_t(depth);
}
__device__ __forceinline__ uint64_t shfl64(uint64_t v, int src) {
  return __shfl_sync(0xffffffffu, v, src);
}
__device__ __forceinline__ uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t max64(uint64_t a, uint64_t b) { return a < b ? b : a; }

struct BuildShared {
  float node_score[kMaxNodes];
  uint32_t node_info[kMaxNodes];  // the popped key's low word: parent | rank | depth
  uint64_t pool[kMaxNodes + 1];
  int num_nodes;
};

// Dynamic shared memory: lp[L][kc] floats (rows cut to their first kc ranks when L*K does not
// fit), then, when cache_ids, ids[L][K] int64 at a 16-byte aligned offset.
__host__ __device__ inline int lp_cache_bytes(int L, int kc) { return (L * kc * 4 + 15) & ~15; }

__global__ void __launch_bounds__(kBuildThreads)
ddtree_build_kernel(const float* __restrict__ logprobs, const int64_t* __restrict__ token_ids,
                    const int64_t* __restrict__ root_tokens, int L, int K, int kc, int cache_ids, int budget,
                    int64_t* __restrict__ tokens, int32_t* __restrict__ parents,
                    int32_t* __restrict__ depths, bool* __restrict__ visible) {
  __shared__ BuildShared sh;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  float* lp_s = reinterpret_cast<float*>(dyn_smem);
  int64_t* ids_s = reinterpret_cast<int64_t*>(dyn_smem + lp_cache_bytes(L, kc));
  const int r = blockIdx.x;
  const int N = budget + 1;
  const float* lp_g = logprobs + int64_t(r) * L * K;
  const int64_t* ids_g = token_ids + int64_t(r) * L * K;
  bool* vis = visible + int64_t(r) * N * N;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;

  // One global round trip for everything the loop (and, when small, the output) reads.
  const int64_t root_token = threadIdx.x == 0 ? root_tokens[r] : 0;
  if (kc == K) {
    for (int i = threadIdx.x; i < L * K; i += blockDim.x) lp_s[i] = lp_g[i];
  } else {
    for (int i = threadIdx.x; i < L * kc; i += blockDim.x) lp_s[i] = lp_g[(i / kc) * K + i % kc];
  }
  if (cache_ids)
    for (int i = threadIdx.x; i < L * K; i += blockDim.x) ids_s[i] = ids_g[i];
  __syncthreads();

  if (warp == 0) {
    constexpr unsigned kFull = 0xffffffffu;
    // Every lane computes the same uniform values and stores the same value to the same shared
    // address, and later reads back only what it wrote itself: no __syncwarp is needed.
    sh.node_score[0] = 0.0f;
    sh.node_info[0] = 0u;
    // `cur`: the next key to pop (uniform).  lp[0][0] + 0 turns a -0 into +0; every later score
    // is a float sum with a non-(-0) left operand, which is never -0 (see make_key).
    uint64_t cur = make_key(__fadd_rn(lp_s[0], 0.0f), 0, 0, 1);
    uint64_t key = kEmpty;        // sorted list, one key per lane
    uint64_t head = kEmpty;       // the list's lane-0 key (uniform)
    uint64_t pool_best = kEmpty;  // the pool's best key (uniform)
    uint64_t rest = kEmpty;       // min(head, pool_best)
    bool rest_in_list = false;    // head < pool_best
    int len = 0;                  // keys in the list (uniform)
    int pool_size = 0;
    int pool_best_idx = -1;
    auto push_pool = [&](uint64_t x) {
      if (x == kEmpty) return;
      sh.pool[pool_size] = x;
      if (x < pool_best) {
        pool_best = x;
        pool_best_idx = pool_size;
      }
      ++pool_size;
    };
    int n = 1;
    for (; n < N; ++n) {
      if (cur == kEmpty) break;  // no candidates left: fewer than B nodes exist
      const uint64_t second = shfl64(key, 1);  // depends only on `key`: off the pop chain

      const uint32_t lo = uint32_t(cur);
      const float s = from_orderable(~uint32_t(cur >> 32));
      const int p = int(lo >> 16);
      const int rank = int((lo >> 6) & 0x3ffu);
      const int d = int(lo & 0x3fu);
      const float sp = sh.node_score[p];
      const int sib = min(rank + 1, K - 1);
      float lp_sib;
      if (sib < kc)
        lp_sib = lp_s[(d - 1) * kc + sib];
      else
        lp_sib = __ldg(lp_g + (d - 1) * K + sib);
      const float lp_child = lp_s[min(d, L - 1) * kc];
      sh.node_score[n] = s;
      sh.node_info[n] = lo;
      const uint64_t a = rank + 1 < K ? make_key(__fadd_rn(sp, lp_sib), p, rank + 1, d) : kEmpty;
      const uint64_t b = d < L ? make_key(__fadd_rn(s, lp_child), n, 0, d + 1) : kEmpty;
      const uint64_t x = min64(a, b), y = max64(a, b);
      // Next pop: the best of x and the rest (keys are unique, so x != rest unless both are
      // empty).  The list loses its head when that is popped and gains the new keys not popped.
      const bool chain = x < rest;
      const int drop = (!chain && rest_in_list) ? 1 : 0;
      const bool from_pool = !chain && !rest_in_list && rest != kEmpty;
      const uint64_t next = chain ? x : rest;
      const uint64_t ins1 = chain ? y : x;  // ins1 < ins2 unless both are empty
      const uint64_t ins2 = chain ? kEmpty : y;
      // Merge: M = (list minus its head if dropped) + {ins1, ins2}, sorted; the list keeps
      // M[0..31] and M[32..] goes to the pool.  ins1 sits at pa, ins2 at pb + 1, and every
      // other M[i] is the old key at i + drop - (i > pa) - (i > pb + 1).
      const int pa = __popc(__ballot_sync(kFull, key < ins1)) - drop;
      const int pb1 = __popc(__ballot_sync(kFull, key < ins2)) - drop + 1;
      const int src = lane + drop - (lane > pa) - (lane > pb1);
      const uint64_t moved = shfl64(key, src & 31);
      const uint64_t merged = lane == pa ? ins1 : lane == pb1 ? ins2 : src > 31 ? kEmpty : moved;
      const int len_new = len - drop + (ins1 != kEmpty) + (ins2 != kEmpty);
      uint64_t ov0 = kEmpty, ov1 = kEmpty;
      if (len_new > 32) {  // uniform: M[32] (and M[33] after a pop from the pool) spill
        const int src32 = 32 + drop - (32 > pa) - (32 > pb1);
        const uint64_t moved32 = shfl64(key, min(src32, 31));
        ov0 = pa == 32 ? ins1 : pb1 == 32 ? ins2 : src32 > 31 ? kEmpty : moved32;
        if (len_new > 33) ov1 = pb1 == 33 ? ins2 : shfl64(key, 31);  // only when drop == 0
      }
      head = min64(drop ? second : head, ins1);  // = M[0]
      key = merged;
      len = min(len_new, 32);
      if (from_pool) {
        sh.pool[pool_best_idx] = sh.pool[pool_size - 1];
        --pool_size;
        // Rescan the pool for its best key: lane-local min, then 32-bit warp reductions.
        uint64_t best = kEmpty;
        int best_i = 0x7fffffff;
        for (int i = lane; i < pool_size; i += 32) {
          const uint64_t v = sh.pool[i];
          if (v < best) {
            best = v;
            best_i = i;
          }
        }
        const uint32_t hi_min = __reduce_min_sync(kFull, uint32_t(best >> 32));
        const uint32_t lo_min = __reduce_min_sync(kFull, uint32_t(best >> 32) == hi_min ? uint32_t(best) : ~0u);
        pool_best = (uint64_t(hi_min) << 32) | lo_min;
        pool_best_idx = int(__reduce_min_sync(kFull, best == pool_best ? uint32_t(best_i) : ~0u));
      }
      push_pool(ov0);
      push_pool(ov1);
      rest_in_list = head < pool_best;
      rest = rest_in_list ? head : pool_best;
      cur = next;
    }
    if (lane == 0) sh.num_nodes = n;
  } else {
    // Clear the visibility matrix while warp 0 builds (16-byte stores where aligned).
    const int64_t total = int64_t(N) * N;
    const int t = threadIdx.x - 32, nt = blockDim.x - 32;
    const int64_t misalign = int64_t((16 - (reinterpret_cast<uintptr_t>(vis) & 15)) & 15);
    const int64_t head = misalign < total ? misalign : total;
    for (int64_t i = t; i < head; i += nt) vis[i] = false;
    uint4* v4 = reinterpret_cast<uint4*>(vis + head);
    const int64_t n4 = (total - head) / 16;
    for (int64_t i = t; i < n4; i += nt) v4[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = head + n4 * 16 + t; i < total; i += nt) vis[i] = false;
  }
  __syncthreads();

  const int built = sh.num_nodes;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    const int64_t o = int64_t(r) * N + i;
    if (i == 0) {
      tokens[o] = root_token;  // thread 0 loaded it
      parents[o] = -1;
      depths[o] = 0;
    } else if (i < built) {
      const uint32_t info = sh.node_info[i];
      const int d = int(info & 0x3fu);
      const int at = (d - 1) * K + int((info >> 6) & 0x3ffu);
      tokens[o] = cache_ids ? ids_s[at] : ids_g[at];
      parents[o] = int(info >> 16);
      depths[o] = d;
    } else {
      tokens[o] = -1;
      parents[o] = -1;
      depths[o] = -1;
    }
    bool* row = vis + int64_t(i) * N;
    if (i < built) {
      row[i] = true;
      for (int a = i; a > 0;) {
        a = int(sh.node_info[a] >> 16);
        row[a] = true;
      }
    } else {
      row[i] = true;
    }
  }
}

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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ddtree_build_cuda(
    const at::Tensor& logprobs, const at::Tensor& token_ids, const at::Tensor& root_tokens, int64_t budget) {
  const char* op = "kdtree::ddtree_build";
  check_cuda_tensor(logprobs, op, "logprobs", at::kFloat, 3);
  check_cuda_tensor(token_ids, op, "token_ids", at::kLong, 3);
  check_cuda_tensor(root_tokens, op, "root_tokens", at::kLong, 1);
  KD_CHECK(token_ids.sizes() == logprobs.sizes(), op, ": token_ids shape ", token_ids.sizes(),
              " != logprobs shape ", logprobs.sizes());
  const int64_t R = logprobs.size(0), L = logprobs.size(1), K = logprobs.size(2);
  KD_CHECK(root_tokens.size(0) == R, op, ": root_tokens must have R = ", R, " entries, got ", root_tokens.size(0));
  KD_CHECK(L >= 1 && L <= kMaxDepth, op, ": depth L must be in [1, ", kMaxDepth, "], got ", L);
  KD_CHECK(K >= 1 && K <= kMaxK, op, ": K must be in [1, ", kMaxK, "], got ", K);
  KD_CHECK(budget >= 1 && budget <= kMaxBudget, op, ": budget must be in [1, ", kMaxBudget, "], got ", budget);
  KD_CHECK(logprobs.device() == token_ids.device() && logprobs.device() == root_tokens.device(),
              op, ": all inputs must be on one device");
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t N = budget + 1;
  auto opts = logprobs.options();
  at::Tensor tokens = at::empty({R, N}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({R, N}, opts.dtype(at::kInt));
  at::Tensor depths = at::empty({R, N}, opts.dtype(at::kInt));
  at::Tensor visible = at::empty({R, N, N}, opts.dtype(at::kBool));
  if (R > 0) {
    const int kc = int(std::min<int64_t>(K, kLpCacheMaxFloats / L));
    const int cache_ids = L * K <= kIdsCacheMax ? 1 : 0;
    const int smem = lp_cache_bytes(int(L), kc) + (cache_ids ? int(L * K) * 8 : 0);
    if (smem > 48 * 1024)
      C10_CUDA_CHECK(cudaFuncSetAttribute(ddtree_build_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    ddtree_build_kernel<<<R, kBuildThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        logprobs.data_ptr<float>(), token_ids.data_ptr<int64_t>(), root_tokens.data_ptr<int64_t>(), int(L),
        int(K), kc, cache_ids, int(budget), tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
        depths.data_ptr<int32_t>(), visible.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {tokens, parents, depths, visible};
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
  m.impl("ddtree_build", &ddtree_build_cuda);
  m.impl("tree_accept", &tree_accept_cuda);
  m.impl("kv_commit", &kv_commit_cuda);
}

}  // namespace kdtree
