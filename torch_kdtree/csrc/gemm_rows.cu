// kdtree::gemm_rows: y_i = bf16(x @ W_i.T) for a few rows x [M <= 32, K] against up to three weights
// W_i [N_i, K] that read the same x (q_a and kv_a; gate and up) -- the linear layers of a tree-verify
// pass (T = B + 1 = 5 ... 33 tokens), where the weight bytes bound the time (semantics and the
// reference: torch_kdtree/ops/gemm_rows.py).
//
// Why: at 5-17 rows cuBLAS picks split-K GEMMs that read the weight at 0.3-0.5 of the read
// bandwidth (run 178, k2_slice B = 4: ~460 us of projections whose weights an M = 1 GEMV streams
// in ~205 us), and kdtree::gemv (FMA, 4 rows a block) re-reads the weight for every 4 rows.  Here
// the rows ride in one or two m16 tiles of tensor-core products, so the weight is read once
// whatever M (up to 32), with enough bytes in flight to stream it:
//   - grid (sum of ceil(N_i / 64), splits): block (n, s) owns 64 rows of the weight whose tiles
//     hold n and the s-th range of K (a multiple of 64; split-K so that ~3 blocks per SM are
//     resident for the weights' tiles together), 4 warps each owning 16 weight rows (two n8
//     tiles) for every x row;
//   - a 4-stage cp.async ring of [64 rows x 64 k] weight tiles and [16 MT rows x 64 k] x tiles
//     (128-byte rows, 16-byte chunks XOR-swizzled by row & 7 so ldmatrix's 8 rows hit 8 banks);
//     the first three weight tiles are issued before pdl_wait (weights are never written by a
//     kernel of the step: pdl.cuh's rules), the x tiles after it;
//   - per 16-wide k step: ldmatrix.x4 of each x m16 tile (A, row-major) and one ldmatrix.x4 of
//     the warp's 16 weight rows (B, "col" = W's own row-major layout: two n8 tiles), then
//     mma.sync.m16n8k16 bf16 -> fp32;
//   - one split: bf16 stores.  Several: fp32 partials [splits, M, sum N_i] (weight i's columns at
//     its offset), then a reduce kernel sums them in split order (deterministic, no atomics),
//     rounds once and stores each column into its weight's output.
// Rows m >= M and columns k >= K are zero-filled by the copies (cp.async's src_bytes = 0), rows
// n >= N too; nothing outside [M, N] is stored.  Shapes come from static sizes only (CUDA-graph
// safe).  mma.sync and cp.async exist on sm_80+: the same code runs on sm_90 and sm_120.
#include "check.h"
#include "cp_async.cuh"
#include "mma_sync.cuh"
#include "pdl.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kdtree {
namespace {

constexpr int kRowsMax = 32;             // x rows: two m16 tiles
constexpr int kBN = 64;                  // weight rows per block
constexpr int kBK = 64;                  // k per stage: 8 chunks of 16 bytes per row
constexpr int kStages = 4;
constexpr int kWarpsG = 4;
constexpr int kThreadsG = kWarpsG * 32;
constexpr int kRowBytesG = kBK * 2;      // 128
constexpr int kWTileBytes = kBN * kRowBytesG;             // 8 KB
constexpr int kBlocksPerSm = 3;          // resident blocks the split choice aims for
constexpr int kReduceThreads = 256;
constexpr int kMaxWeights = 3;

template <int MT>
struct GemmRowsTile {
  static constexpr int kXRows = MT * 16;
  static constexpr int kXTileBytes = kXRows * kRowBytesG;
  static constexpr int kStageBytes = kWTileBytes + kXTileBytes;
  static constexpr int kSmem = kStages * kStageBytes;     // 40 KB (MT 1) / 48 KB (MT 2)
  static_assert(kSmem <= 48 * 1024, "within the default dynamic shared memory");
};

struct GemmRowsParams {
  const __nv_bfloat16* x;               // [M, K]
  const __nv_bfloat16* w[kMaxWeights];  // [N_i, K]
  __nv_bfloat16* y[kMaxWeights];        // [M, N_i]
  int N[kMaxWeights];
  int tile_end[kMaxWeights];            // cumulative n tiles: weight i owns tiles [tile_end[i-1], tile_end[i])
  int col0[kMaxWeights + 1];            // weight i's first column in the partials; col0[kMaxWeights] = sum N_i
  int nw;
  float* part;                          // [splits, M, col0[nw]] (splits > 1)
  int M, K;
  int steps_per_split;                  // k tiles of kBK per split
  int k_tiles;                          // ceil(K / kBK)
};

// Weight wi's entries, selected with constant indices (a dynamic index into the parameter arrays
// would copy them to local memory).
struct WeightView {
  const __nv_bfloat16* w;
  __nv_bfloat16* y;
  int N, col0, tile0;
};
__device__ __forceinline__ WeightView weight_view(const GemmRowsParams& p, int wi) {
  WeightView v{p.w[0], p.y[0], p.N[0], p.col0[0], 0};
#pragma unroll
  for (int i = 1; i < kMaxWeights; ++i)
    if (wi == i) v = WeightView{p.w[i], p.y[i], p.N[i], p.col0[i], p.tile_end[i - 1]};
  return v;
}
// The weight whose n tiles hold grid column `tile` (at most three, compared in order).
__device__ __forceinline__ int weight_of_tile(const GemmRowsParams& p, int tile) {
  int wi = 0;
#pragma unroll
  for (int i = 0; i < kMaxWeights - 1; ++i) wi += (i < p.nw - 1 && tile >= p.tile_end[i]) ? 1 : 0;
  return wi;
}
// The weight whose columns of the partials hold column c.
__device__ __forceinline__ int weight_of_col(const GemmRowsParams& p, int c) {
  int wi = 0;
#pragma unroll
  for (int i = 1; i < kMaxWeights; ++i) wi += (i < p.nw && c >= p.col0[i]) ? 1 : 0;
  return wi;
}

// Byte offset of 16-byte chunk c (0..7) of row `row` in a tile of 128-byte rows.
__device__ __forceinline__ uint32_t tile_off(int row, int c) { return uint32_t(row * kRowBytesG + ((c ^ (row & 7)) << 4)); }

// The weight tile of k tile `kt` into stage buffer `dst`: rows n0.. of w [N, K], 64 rows x 8 chunks,
// 4 chunks a thread.
__device__ __forceinline__ void load_w_tile(const GemmRowsParams& p, const __nv_bfloat16* w, int N, uint32_t dst,
                                            int n0, int kt) {
#pragma unroll
  for (int i = 0; i < kBN * 8 / kThreadsG; ++i) {
    const int idx = threadIdx.x + i * kThreadsG;
    const int row = idx >> 3, c = idx & 7;
    const int n = n0 + row, k = kt * kBK + c * 8;
    const bool in = n < N && k < p.K;
    const __nv_bfloat16* src = in ? w + int64_t(n) * p.K + k : w;
    cp_async16(dst + tile_off(row, c), src, in ? 16 : 0);
  }
}

// The x tile of k tile `kt`: 16 MT rows x 8 chunks, MT chunks a thread.
template <int MT>
__device__ __forceinline__ void load_x_tile(const GemmRowsParams& p, uint32_t dst, int kt) {
#pragma unroll
  for (int i = 0; i < MT * 16 * 8 / kThreadsG; ++i) {
    const int idx = threadIdx.x + i * kThreadsG;
    const int row = idx >> 3, c = idx & 7;
    const int k = kt * kBK + c * 8;
    const bool in = row < p.M && k < p.K;
    const __nv_bfloat16* src = in ? p.x + int64_t(row) * p.K + k : p.x;
    cp_async16(dst + tile_off(row, c), src, in ? 16 : 0);
  }
}

template <int MT>
__global__ void __launch_bounds__(kThreadsG) gemm_rows_kernel(const GemmRowsParams p) {
  using T = GemmRowsTile<MT>;
  extern __shared__ __align__(128) unsigned char smem_g[];
  const uint32_t base = smem_u32(smem_g);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const WeightView wv = weight_view(p, weight_of_tile(p, int(blockIdx.x)));
  const __nv_bfloat16* w = wv.w;
  const int N = wv.N;
  const int n0 = (int(blockIdx.x) - wv.tile0) * kBN;
  const int kt0 = blockIdx.y * p.steps_per_split;
  const int steps = max(0, min(p.steps_per_split, p.k_tiles - kt0));
  auto w_stage = [&](int s) { return base + uint32_t(s * T::kStageBytes); };
  auto x_stage = [&](int s) { return base + uint32_t(s * T::kStageBytes + kWTileBytes); };

  // Prologue: the first kStages - 1 weight tiles before the wait (weights only), their x tiles after;
  // one commit group for all of them, then empty groups so that group i holds stage i's data or less.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < steps) load_w_tile(p, w, N, w_stage(s), n0, kt0 + s);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < steps) load_x_tile<MT>(p, x_stage(s), kt0 + s);
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < kStages - 1; ++s) cp_async_commit();
  pdl_launch_dependents();

  float acc[MT][2][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.f;

  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `step` landed for every thread; stage step - 1 is free again
    const int next = step + kStages - 1;
    if (next < steps) {
      load_w_tile(p, w, N, w_stage(next % kStages), n0, kt0 + next);
      load_x_tile<MT>(p, x_stage(next % kStages), kt0 + next);
    }
    cp_async_commit();
    const uint32_t sw = w_stage(step % kStages), sx = x_stage(step % kStages);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) ldsm_x4(a[mi], sx + tile_off(mi * 16 + (lane & 15), 2 * ks + (lane >> 4)));
      // the warp's 16 weight rows: matrices (rows 0-7, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 0-7),
      // (rows 8-15, k 8-15) -> b[0], b[1] of n8 tile 0 and b[2], b[3] of n8 tile 1
      uint32_t b[4];
      ldsm_x4(b, sw + tile_off(warp * 16 + (lane >> 4) * 8 + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        mma_bf16(acc[mi][0], a[mi], b[0], b[1]);
        mma_bf16(acc[mi][1], a[mi], b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();

  // Accumulator (mi, ni, j): x row mi * 16 + lane / 4 + 8 (j >= 2), weight row n0 + warp * 16 +
  // ni * 8 + 2 (lane % 4) + (j & 1).
  const bool split = gridDim.y > 1;
  const int cols = p.col0[kMaxWeights], col0 = wv.col0;
  __nv_bfloat16* y = wv.y;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = mi * 16 + (lane >> 2) + (j >= 2 ? 8 : 0);
        const int n = n0 + warp * 16 + ni * 8 + 2 * (lane & 3) + (j & 1);
        if (m >= p.M || n >= N) continue;
        if (split)
          p.part[(int64_t(blockIdx.y) * p.M + m) * cols + col0 + n] = acc[mi][ni][j];
        else
          y[int64_t(m) * N + n] = __float2bfloat16_rn(acc[mi][ni][j]);
      }
}

// y_i[m, n] = bf16(sum over s in order of part[s, m, col0[i] + n]).  The loads of kReduceBatch splits are issued
// together before their in-order adds: a loop of dependent load-add pairs waited one L2 round trip
// per split (~0.3 us each; run 183's timeline had each reduce end 2-5 us after its GEMM at 8-17
// splits).  The adds, and so the bits, are those of the one-at-a-time loop.
constexpr int kReduceBatch = 8;
__global__ void __launch_bounds__(kReduceThreads) gemm_rows_reduce_kernel(const GemmRowsParams p, int splits) {
  pdl_wait();
  pdl_launch_dependents();
  const float* __restrict__ part = p.part;
  const int cols = p.col0[kMaxWeights];
  const int64_t MN = int64_t(p.M) * cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < MN; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int j0 = 0; j0 < splits; j0 += kReduceBatch) {
      float v[kReduceBatch];
#pragma unroll
      for (int u = 0; u < kReduceBatch; ++u) v[u] = part[int64_t(min(j0 + u, splits - 1)) * MN + i];  // in bounds, unpredicated
#pragma unroll
      for (int u = 0; u < kReduceBatch; ++u)
        if (j0 + u < splits) s += v[u];
    }
    const int m = int(i / cols), c = int(i - int64_t(m) * cols);
    const WeightView wv = weight_view(p, weight_of_col(p, c));
    wv.y[int64_t(m) * wv.N + (c - wv.col0)] = __float2bfloat16_rn(s);
  }
}

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int v = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    cached[device] = v;
  }
  return cached[device];
}

std::vector<at::Tensor> gemm_rows_cuda(const at::Tensor& x, at::TensorList weights) {
  constexpr const char* op = "kdtree::gemm_rows";
  check_cuda_tensor(x, op, "x", at::kBFloat16, 2);
  const int nw = int(weights.size());
  KD_CHECK(nw >= 1 && nw <= kMaxWeights, op, ": 1 to ", kMaxWeights, " weights sharing x, got ", nw);
  const int64_t M = x.size(0), K = x.size(1);
  KD_CHECK(M <= kRowsMax, op, ": at most ", kRowsMax, " rows of x, got ", M);
  KD_CHECK(K >= 8 && K % 8 == 0 && K <= INT32_MAX / 2, op, ": K must be a positive multiple of 8, got ", K);
  KD_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, ": x must be 16-byte aligned");
  GemmRowsParams p{};
  int64_t cols = 0, tiles = 0;
  for (int i = 0; i < nw; ++i) {
    const at::Tensor& w = weights[i];
    check_cuda_tensor(w, op, "weight", at::kBFloat16, 2);
    KD_CHECK(w.device() == x.device(), op, ": x and the weights must be on one device, got ", x.device(), " and ",
             w.device());
    const int64_t N = w.size(0);
    KD_CHECK(w.size(1) == K, op, ": weight ", i, " must be [N, K = ", K, "], got ", w.sizes());
    KD_CHECK(N >= 1 && N * std::max<int64_t>(K, M) <= INT32_MAX, op, ": weight [", N, ", ", K, "] is too large");
    KD_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0, op, ": the weights must be 16-byte aligned");
    p.w[i] = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
    p.N[i] = int(N);
    p.col0[i] = int(cols);
    cols += N;
    tiles += (N + kBN - 1) / kBN;
    p.tile_end[i] = int(tiles);
  }
  KD_CHECK(cols * M <= INT32_MAX, op, ": the outputs are too large");
  for (int i = nw; i <= kMaxWeights; ++i) p.col0[i] = int(cols);  // unused weights: empty column ranges
  for (int i = nw; i < kMaxWeights; ++i) p.tile_end[i] = int(tiles);
  p.nw = nw;
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> ys;
  for (int i = 0; i < nw; ++i) {
    ys.push_back(at::empty({M, weights[i].size(0)}, x.options()));
    p.y[i] = reinterpret_cast<__nv_bfloat16*>(ys.back().data_ptr());
  }
  if (M == 0) return ys;
  const int n_tiles = int(tiles);
  const int k_tiles = int((K + kBK - 1) / kBK);
  const int target = kBlocksPerSm * sm_count(x.device().index());
  int splits = std::min(k_tiles, std::max(1, (target + n_tiles - 1) / n_tiles));
  const int steps = (k_tiles + splits - 1) / splits;
  splits = (k_tiles + steps - 1) / steps;  // no empty split
  at::Tensor part;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.M = int(M);
  p.K = int(K);
  p.steps_per_split = steps;
  p.k_tiles = k_tiles;
  if (splits > 1) {
    part = at::empty({splits, M, cols}, x.options().dtype(at::kFloat));
    p.part = part.data_ptr<float>();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid{unsigned(n_tiles), unsigned(splits), 1u};
  if (M <= 16)
    launch_kernel(gemm_rows_kernel<1>, grid, dim3(kThreadsG), size_t(GemmRowsTile<1>::kSmem), stream, launch_pdl(), p);
  else
    launch_kernel(gemm_rows_kernel<2>, grid, dim3(kThreadsG), size_t(GemmRowsTile<2>::kSmem), stream, launch_pdl(), p);
  if (splits > 1) {
    const int64_t MN = M * cols;
    const int blocks = int(std::min<int64_t>((MN + kReduceThreads - 1) / kReduceThreads, 4 * sm_count(x.device().index())));
    launch_kernel(gemm_rows_reduce_kernel, dim3(unsigned(blocks)), dim3(kReduceThreads), 0, stream, launch_pdl(), p,
                  splits);
  }
  return ys;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("gemm_rows", &gemm_rows_cuda); }

}  // namespace kdtree
