// kdtree::mla_prepare and kdtree::mla_output: the absorbed-MLA steps before and after
// mla_tree_attention in a decode / tree-verify pass (semantics and the references:
// torch_kdtree/ops/mla_absorb.py).
//
// mla_prepare -- grid: h · (dc / 256) absorption blocks, then ceil(M / 8) latent blocks; 256 threads.
//   - Absorption block (head h, 256 output columns): lane l owns columns 8 l .. 8 l + 7 (16 bytes of
//     each W_UK row, so a warp reads 512 contiguous bytes of a row), warp w the rows d = w, w + 8, ...
//     Before its programmatic-launch wait (pdl.cuh) it loads its first 16 rows (all of K2's dn 128)
//     into registers (weights are never written by any kernel of the step), so the loads overlap
//     the query projection.  Tokens go in chunks of four: their q_nope rows in shared
//     memory as fp32, fp32 products summed per warp, the warps' sums added in warp order, rounded
//     to bf16.  The block of the first 256 columns also writes q_rope for head h.
//   - Latent block: one warp per token; the RMS of c (dc values) by a warp sum, y = bf16(w ·
//     bf16(c · rsqrt(mean + eps))), then rope(k_pe), written to the token's cache slot (a slot
//     outside the cache is skipped: the wrapper's eager check raises on it).
// mla_output -- grid: h · ceil(dv / 32) blocks of 8 warps; warp w of block (h, b) owns the W_UV rows
//   32 b + 4 w .. + 3 of head h, loaded into registers before the wait (lane l: columns 8 l + 256 j);
//   per token, each lane's partial dot products over its columns of o_lat, a warp sum, bf16 out
//   (mla_wuv.cuh, shared with mla_tree_attention_output's merge kernel).
// Deterministic, no host synchronisation, shapes from static sizes only (CUDA-graph safe).  The
// same code runs on sm_90 and sm_120.
#include "bf16_vec.cuh"
#include "check.h"
#include "mla_wuv.cuh"
#include "pdl.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

namespace kdtree {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 256;       // output columns per absorption block (32 lanes x 8)
constexpr int kChunk = 4;        // tokens per pass over W_UK
constexpr int kRegRows = 16;     // W_UK rows per warp held in registers (all of them for dn <= 128)
constexpr int kMaxDn = 256;
constexpr int kMaxDc = 1024;
constexpr int kMaxDr = 256;

struct Params {
  const bf16* q;       // [M, h, dn + dr]
  const bf16* ckv;     // [M, dc + dr]
  const float* cos;    // [M, dr / 2]
  const float* sin;
  const bf16* norm_w;  // [dc]
  const bf16* w;       // [h * (dn + dv), dc]
  bf16* kv;            // this layer's [num_pages * page_size, dc + dr]
  const int64_t* slots;
  bf16* out;           // [M, h, dc + dr]
  int64_t capacity;    // num_pages * page_size
  int M, heads, dn, dv, dc, dr;
  float eps;
  bool interleave;
};

// Rotated pair j of a dr-wide vector x: (x1 c - x2 s, x2 c + x1 s), stored at j and j + dr / 2.
__device__ __forceinline__ void rope_pair(const bf16* x, bf16* dst, float c, float s, int j, int dr, bool interleave) {
  const int half = dr / 2;
  const float x1 = __bfloat162float(x[interleave ? 2 * j : j]);
  const float x2 = __bfloat162float(x[interleave ? 2 * j + 1 : j + half]);
  dst[j] = __float2bfloat16(x1 * c - x2 * s);
  dst[j + half] = __float2bfloat16(x2 * c + x1 * s);
}

__global__ void __launch_bounds__(kThreads) mla_prepare_kernel(Params p) {
  __shared__ float qn[kChunk][kMaxDn];
  __shared__ __align__(16) float red[kWarps][kChunk][kCols];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int halves = p.dc / kCols, nq = p.heads * halves, D = p.dc + p.dr, qd = p.dn + p.dr;
  if (int(blockIdx.x) < nq) {
    const int h = blockIdx.x / halves, col0 = (blockIdx.x % halves) * kCols;
    const bf16* w = p.w + int64_t(h) * (p.dn + p.dv) * p.dc + col0 + 8 * lane;
    // The warp's first kRegRows rows of W_UK into registers before the wait: every load in flight
    // at once, landing while the predecessor (the query projection) still runs.
    uint4 wr[kRegRows];
#pragma unroll
    for (int i = 0; i < kRegRows; ++i) {
      const int d = warp + kWarps * i;
      wr[i] = d < p.dn ? ld_stream_early(reinterpret_cast<const uint4*>(w + int64_t(d) * p.dc))
                       : make_uint4(0, 0, 0, 0);
    }
    pdl_wait();  // q comes from the previous kernel
    pdl_launch_dependents();
    for (int m0 = 0; m0 < p.M; m0 += kChunk) {
      const int mc = min(kChunk, p.M - m0);
      for (int i = threadIdx.x; i < kChunk * p.dn; i += kThreads) {
        const int mm = i / p.dn, d = i - mm * p.dn;
        qn[mm][d] = mm < mc ? __bfloat162float(p.q[(int64_t(m0 + mm) * p.heads + h) * qd + d]) : 0.f;
      }
      __syncthreads();
      float acc[kChunk][8];
#pragma unroll
      for (int mm = 0; mm < kChunk; ++mm)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[mm][j] = 0.f;
      auto row = [&](const uint4& raw, int d) {
        float wf[8];
        unpack8(raw, wf);
#pragma unroll
        for (int mm = 0; mm < kChunk; ++mm) {
          const float qv = qn[mm][d];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[mm][j] = fmaf(qv, wf[j], acc[mm][j]);
        }
      };
#pragma unroll
      for (int i = 0; i < kRegRows; ++i)
        if (warp + kWarps * i < p.dn) row(wr[i], warp + kWarps * i);
#pragma unroll 4
      for (int d = warp + kWarps * kRegRows; d < p.dn; d += kWarps)  // dn > 128: the rest from memory
        row(__ldg(reinterpret_cast<const uint4*>(w + int64_t(d) * p.dc)), d);
#pragma unroll
      for (int mm = 0; mm < kChunk; ++mm) {
        float4* r = reinterpret_cast<float4*>(&red[warp][mm][8 * lane]);
        r[0] = make_float4(acc[mm][0], acc[mm][1], acc[mm][2], acc[mm][3]);
        r[1] = make_float4(acc[mm][4], acc[mm][5], acc[mm][6], acc[mm][7]);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < mc * kCols; i += kThreads) {
        const int mm = i / kCols, c = i - mm * kCols;
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) s += red[v][mm][c];
        p.out[(int64_t(m0 + mm) * p.heads + h) * D + col0 + c] = __float2bfloat16(s);
      }
      __syncthreads();  // qn and red are rewritten by the next chunk
    }
    if (col0 == 0) {
      const int half = p.dr / 2;
      for (int i = threadIdx.x; i < p.M * half; i += kThreads) {
        const int m = i / half, j = i - m * half;
        const int64_t row = int64_t(m) * p.heads + h;
        rope_pair(p.q + row * qd + p.dn, p.out + row * D + p.dc, p.cos[int64_t(m) * half + j],
                  p.sin[int64_t(m) * half + j], j, p.dr, p.interleave);
      }
    }
    return;
  }
  pdl_wait();  // ckv comes from an earlier kernel
  pdl_launch_dependents();
  const int m = (blockIdx.x - nq) * kWarps + warp;
  if (m >= p.M) return;
  const int64_t slot = p.slots[m];
  if (slot < 0 || slot >= p.capacity) return;
  const bf16* c = p.ckv + int64_t(m) * D;
  float v[kMaxDc / kCols][8];  // lane's groups g = lane, lane + 32, ... of 8 values
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxDc / kCols; ++i) {
    const int g = lane + 32 * i;
    if (8 * g < p.dc) {
      const uint4 raw = *reinterpret_cast<const uint4*>(c + 8 * g);
      float f[8];
      unpack8(raw, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[i][j] = f[j];
        ss = fmaf(f[j], f[j], ss);
      }
    }
  }
  const float r = rsqrtf(warp_sum(ss) / float(p.dc) + p.eps);
  bf16* dst = p.kv + slot * D;
#pragma unroll
  for (int i = 0; i < kMaxDc / kCols; ++i) {
    const int g = lane + 32 * i;
    if (8 * g < p.dc) {
      const uint4 nw = __ldg(reinterpret_cast<const uint4*>(p.norm_w + 8 * g));
      float wn[8];
      unpack8(nw, wn);
      uint32_t y[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 two = __floats2bfloat162_rn(wn[2 * j] * round_bf16(v[i][2 * j] * r),
                                                         wn[2 * j + 1] * round_bf16(v[i][2 * j + 1] * r));
        y[j] = (uint32_t(__bfloat16_as_ushort(two.y)) << 16) | __bfloat16_as_ushort(two.x);
      }
      *reinterpret_cast<uint4*>(dst + 8 * g) = make_uint4(y[0], y[1], y[2], y[3]);
    }
  }
  const int half = p.dr / 2;
  for (int j = lane; j < half; j += 32)
    rope_pair(c + p.dc, dst + p.dc, p.cos[int64_t(m) * half + j], p.sin[int64_t(m) * half + j], j, p.dr,
              p.interleave);
}

constexpr int kOutRows = kWarps * kWuvRowsPerWarp;  // W_UV rows per block

__global__ void __launch_bounds__(kThreads)
mla_output_kernel(const bf16* __restrict__ o_lat, const bf16* __restrict__ w_kv_b, bf16* __restrict__ out, int M,
                  int heads, int dn, int dv, int dc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int blocks_per_head = (dv + kOutRows - 1) / kOutRows;
  const int h = blockIdx.x / blocks_per_head, d0 = (blockIdx.x % blocks_per_head) * kOutRows + warp * kWuvRowsPerWarp;
  const int groups = dc / kCols;  // 16-byte pieces per lane per row
  uint4 wr[kWuvRowsPerWarp][kMaxDc / kCols];
  wuv_load_rows(w_kv_b + (int64_t(h) * (dn + dv) + dn) * dc + 8 * lane, d0, dv, dc, groups, wr);
  pdl_wait();  // o_lat comes from the attention's combine (or the attention itself)
  pdl_launch_dependents();
  for (int m = 0; m < M; ++m)
    wuv_rows_times(o_lat + (int64_t(m) * heads + h) * dc + 8 * lane, groups, wr, lane, d0, dv, out,
                   (int64_t(m) * heads + h) * dv);
}

at::Tensor mla_prepare_cuda(const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& norm_weight, double eps, const at::Tensor& w_kv_b,
                            at::Tensor& kv_cache, int64_t layer, const at::Tensor& slots, bool interleave) {
  constexpr const char* op = "kdtree::mla_prepare";
  check_cuda_tensor(q, op, "q", at::kBFloat16, 3);
  check_cuda_tensor(ckv, op, "ckv", at::kBFloat16, 2);
  check_cuda_tensor(cos, op, "cos", at::kFloat, 2);
  check_cuda_tensor(sin, op, "sin", at::kFloat, 2);
  check_cuda_tensor(norm_weight, op, "norm_weight", at::kBFloat16, 1);
  check_cuda_tensor(w_kv_b, op, "w_kv_b", at::kBFloat16, 2);
  check_cuda_tensor(kv_cache, op, "kv_cache", at::kBFloat16, 4);
  check_cuda_tensor(slots, op, "slots", at::kLong, 1);
  const at::Tensor* others[] = {&ckv, &cos, &sin, &norm_weight, &w_kv_b, &kv_cache, &slots};
  for (const at::Tensor* t : others)
    KD_CHECK(t->device() == q.device(), op, ": every tensor must be on ", q.device(), ", got ", t->device());
  const int64_t M = q.size(0), heads = q.size(1), dc = norm_weight.size(0), D = kv_cache.size(3), dr = D - dc,
                dn = q.size(2) - dr;
  KD_CHECK(dc % kCols == 0 && dc <= kMaxDc, op, ": the CUDA kernel needs dc (norm_weight's size) a multiple of ",
           kCols, " up to ", kMaxDc, ", got ", dc);
  KD_CHECK(dr >= 8 && dr % 8 == 0 && dr <= kMaxDr, op, ": the CUDA kernel needs the rope dim (cache row - dc) a "
           "multiple of 8 up to ", kMaxDr, " (16-byte rows), got ", dr);
  KD_CHECK(dn >= 1 && dn <= kMaxDn, op, ": dn (q's last dim - dr) must be in [1, ", kMaxDn, "], got ", dn);
  KD_CHECK(ckv.size(0) == M && ckv.size(1) == D, op, ": ckv must be [M, dc + dr] = [", M, ", ", D, "], got ",
           ckv.sizes());
  KD_CHECK(cos.size(0) == M && cos.size(1) == dr / 2 && sin.sizes() == cos.sizes(), op,
           ": cos and sin must be [M, dr / 2] = [", M, ", ", dr / 2, "], got ", cos.sizes(), " and ", sin.sizes());
  KD_CHECK(slots.size(0) == M, op, ": slots must be [M = ", M, "], got ", slots.sizes());
  KD_CHECK(heads >= 1 && w_kv_b.size(1) == dc && w_kv_b.size(0) % heads == 0 && w_kv_b.size(0) / heads > dn, op,
           ": w_kv_b must be [h * (dn + dv), dc] with h = ", heads, ", dn = ", dn, ", dc = ", dc, ", got ",
           w_kv_b.sizes());
  KD_CHECK(layer >= 0 && layer < kv_cache.size(0), op, ": layer must be in [0, ", kv_cache.size(0), "), got ", layer);
  KD_CHECK(M <= (int64_t(1) << 24), op, ": too many tokens (", M, ")");
  at::Tensor out = at::empty({M, heads, D}, q.options());
  if (M == 0) return out;
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t capacity = kv_cache.size(1) * kv_cache.size(2);
  Params p{reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(ckv.data_ptr()),
           cos.data_ptr<float>(), sin.data_ptr<float>(), reinterpret_cast<const bf16*>(norm_weight.data_ptr()),
           reinterpret_cast<const bf16*>(w_kv_b.data_ptr()),
           reinterpret_cast<bf16*>(kv_cache.data_ptr()) + layer * capacity * D, slots.data_ptr<int64_t>(),
           reinterpret_cast<bf16*>(out.data_ptr()), capacity, int(M), int(heads), int(dn),
           int(w_kv_b.size(0) / heads - dn), int(dc), int(dr), float(eps), interleave};
  const int blocks = int(heads * (dc / kCols) + (M + kWarps - 1) / kWarps);
  launch_kernel(mla_prepare_kernel, dim3(unsigned(blocks)), dim3(kThreads), 0, at::cuda::getCurrentCUDAStream(),
                pdl_enabled("mla"), p);
  return out;
}

at::Tensor mla_output_cuda(const at::Tensor& o_lat, const at::Tensor& w_kv_b, int64_t qk_nope_head_dim) {
  constexpr const char* op = "kdtree::mla_output";
  check_cuda_tensor(o_lat, op, "o_lat", at::kBFloat16, 3);
  check_cuda_tensor(w_kv_b, op, "w_kv_b", at::kBFloat16, 2);
  KD_CHECK(w_kv_b.device() == o_lat.device(), op, ": o_lat and w_kv_b must be on one device, got ", o_lat.device(),
           " and ", w_kv_b.device());
  const int64_t M = o_lat.size(0), heads = o_lat.size(1), dc = o_lat.size(2), dn = qk_nope_head_dim;
  KD_CHECK(dc % kCols == 0 && dc <= kMaxDc, op, ": the CUDA kernel needs dc (o_lat's last dim) a multiple of ", kCols,
           " up to ", kMaxDc, ", got ", dc);
  KD_CHECK(dn >= 0 && heads >= 1 && w_kv_b.size(1) == dc && w_kv_b.size(0) % heads == 0 && w_kv_b.size(0) / heads > dn,
           op, ": w_kv_b must be [h * (dn + dv), dc] with h = ", heads, ", dn = ", dn, ", dc = ", dc, ", got ",
           w_kv_b.sizes());
  const int64_t dv = w_kv_b.size(0) / heads - dn;
  KD_CHECK(M <= (int64_t(1) << 24) && heads * ((dv + kOutRows - 1) / kOutRows) <= INT32_MAX, op, ": too large");
  at::Tensor out = at::empty({M, heads, dv}, o_lat.options());
  if (M == 0) return out;
  const c10::cuda::CUDAGuard guard(o_lat.device());
  const int blocks = int(heads * ((dv + kOutRows - 1) / kOutRows));
  launch_kernel(mla_output_kernel, dim3(unsigned(blocks)), dim3(kThreads), 0, at::cuda::getCurrentCUDAStream(),
                pdl_enabled("mla"), reinterpret_cast<const bf16*>(o_lat.data_ptr()),
                reinterpret_cast<const bf16*>(w_kv_b.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()), int(M),
                int(heads), int(dn), int(dv), int(dc));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("mla_prepare", &mla_prepare_cuda);
  m.impl("mla_output", &mla_output_cuda);
}

}  // namespace kdtree
