// kdtree::mla_prepare and kdtree::mla_output: the absorbed-MLA steps before and after
// mla_tree_attention in a decode / tree-verify pass; kdtree::mla_decode: all three for one token per
// request in one launch (semantics and the references: torch_kdtree/ops/mla_absorb.py).
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
#include "bulk_copy.cuh"
#include "check.h"
#include "cp_async.cuh"
#include "mla_wuv.cuh"
#include "pdl.cuh"
#include "trace.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

namespace kdtree {
namespace {

using bf16 = __nv_bfloat16;
namespace cg = cooperative_groups;

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

// Eight values of the latent norm's output: bf16(w · bf16(v · r)) (KimiK2RMSNorm's roundings), packed.
__device__ __forceinline__ uint4 norm_row8(uint4 w_raw, const float (&v)[8], float r) {
  float wn[8];
  unpack8(w_raw, wn);
  uint32_t y[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 two = __floats2bfloat162_rn(wn[2 * j] * round_bf16(v[2 * j] * r),
                                                     wn[2 * j + 1] * round_bf16(v[2 * j + 1] * r));
    y[j] = (uint32_t(__bfloat16_as_ushort(two.y)) << 16) | __bfloat16_as_ushort(two.x);
  }
  return make_uint4(y[0], y[1], y[2], y[3]);
}

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
      *reinterpret_cast<uint4*>(dst + 8 * g) = norm_row8(nw, v[i], r);
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

// The dtype / rank / contiguity / device checks mla_prepare and mla_decode share.
void check_prepare_tensors(const char* op, const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& norm_weight, const at::Tensor& w_kv_b,
                           const at::Tensor& kv_cache, const at::Tensor& slots) {
  check_cuda_tensor(q, op, "q", at::kBFloat16, 3);
  check_cuda_tensor(ckv, op, "ckv", at::kBFloat16, 2);
  check_cuda_tensor(cos, op, "cos", at::kFloat, 2);
  check_cuda_tensor(sin, op, "sin", at::kFloat, 2);
  check_cuda_tensor(norm_weight, op, "norm_weight", at::kBFloat16, 1);
  check_cuda_tensor(w_kv_b, op, "w_kv_b", at::kBFloat16, 2);
  check_cuda_tensor(kv_cache, op, "kv_cache", at::kBFloat16, 4);
  check_cuda_tensor(slots, op, "slots", at::kLong, 1);
  for (const at::Tensor* t : {&ckv, &cos, &sin, &norm_weight, &w_kv_b, &kv_cache, &slots})
    KD_CHECK(t->device() == q.device(), op, ": every tensor must be on ", q.device(), ", got ", t->device());
}

at::Tensor mla_prepare_cuda(const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& norm_weight, double eps, const at::Tensor& w_kv_b,
                            at::Tensor& kv_cache, int64_t layer, const at::Tensor& slots, bool interleave) {
  constexpr const char* op = "kdtree::mla_prepare";
  check_prepare_tensors(op, q, ckv, cos, sin, norm_weight, w_kv_b, kv_cache, slots);
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
                launch_pdl(), p);
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
                launch_pdl(), reinterpret_cast<const bf16*>(o_lat.data_ptr()),
                reinterpret_cast<const bf16*>(w_kv_b.data_ptr()), reinterpret_cast<bf16*>(out.data_ptr()), int(M),
                int(heads), int(dn), int(dv), int(dc));
  return out;
}


// ------------------------------------------------------------------------------------------------
// mla_decode: mla_prepare, the attention and mla_output of one token per request in one launch
// ------------------------------------------------------------------------------------------------
// Grid (8 h, R), thread-block clusters of 8 = one head h of request r, 256 threads.  Cluster rank s:
//   before the wait: its 64 W_UK columns (cols 64 s ..) and its W_UV rows into registers, its share of
//     the committed keys (with prefix_ready) into a ring of 32-key shared-memory stages (cp.async);
//   1. q_abs columns 64 s .. + 63 (fp32 sums over dn, rounded to bf16) pushed into every cluster
//      block's query row (st.async onto that block's mbarrier); the rope half rotated locally; the
//      block whose keys end at the new token computes its cache row (kv_a_layernorm, rope) and, for
//      head 0, writes it to the cache;
//   2. once its mbarrier has all 8 blocks' columns: the split's keys [kb, ke) of the L + 1 (chunk =
//      ceil((L + 1) / 8) rounded up to 32), a 32-key tile at a time: scores by 8 threads per key,
//      warp 0 runs the tile's online softmax in fp32, the unnormalised latent sum held as two dims
//      per thread; the new key from shared memory;
//   3. the split's partial (latent sum, max, sum) pushed to every block the same way; once all 8 are
//      in, every block merges them (fixed order, so all 8 agree), rounds the latent row to bf16 and
//      multiplies its W_UV rows (mla_wuv.cuh).
//   The pushes replaced cluster barriers (stores into the other blocks' shared memory,
//   cluster.sync(), reads of theirs, and a last barrier that kept every block's shared memory alive
//   until all had read it; the same bits).  A cluster barrier with release semantics is a
//   MEMBAR.ALL.GPU on sm_90, three per block (RESULTS.md run 126).
// The committed length, the block table and the committed rows are read before the wait only with
// prefix_ready (pdl.cuh's rule); the query, ckv, cos / sin and the slots after it.
constexpr int kDecC = 8;                          // cluster size = key splits per head
constexpr int kDecDc = 512, kDecDr = 64, kDecD = kDecDc + kDecDr;
constexpr int kDecChunks = kDecD / 8;             // 16-byte pieces per cache row
constexpr int kDecRowBytes = kDecD * 2;
constexpr int kDecTile = 32;                      // keys per ring stage
constexpr int kDecStageBytes = kDecTile * kDecRowBytes;
constexpr int kDecCols = kDecDc / kDecC;          // q_abs columns per block
constexpr int kDecGroups = kDecCols / 8;          // 16-byte column groups per block
constexpr int kDecPhases = kThreads / kDecGroups; // W_UK rows walked in parallel
constexpr int kDecRegRows = 4;                    // W_UK rows per thread in registers (dn <= 128)
constexpr int kDecMaxDn = 256, kDecMaxDv = kDecC * kWarps * kWuvRowsPerWarp;
constexpr int kDecMaxPages = 256;                 // block-table entries of a split kept in shared memory
static_assert(kDecPhases * kDecRegRows == 128, "dn <= 128 in registers");

// The cluster exchanges of mla_decode: weak asynchronous stores into another block's shared
// memory (st.async, sm_90+), each completing its bytes on the receiver's mbarrier, which the receiver
// waits on.  A cluster barrier with release semantics (cg's cluster.sync()) compiles to MEMBAR.ALL.GPU
// on sm_90 -- a wait until every earlier memory access of the thread is performed GPU-wide, taken
// three times per block while the next kernels' weight copies fill the memory system.
__device__ __forceinline__ uint32_t cluster_addr(const void* local, uint32_t rank) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(local)), "r"(rank));
#endif
  return r;
}
__device__ __forceinline__ void st_async_b32(uint32_t addr, uint32_t v, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(addr), "r"(v),
               "r"(bar)
               : "memory");
#endif
}
__device__ __forceinline__ void st_async_v2f32(uint32_t addr, float a, float b, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];\n" ::"r"(addr),
               "f"(a), "f"(b), "r"(bar)
               : "memory");
#endif
}
struct DecodeParams {
  const bf16* q;        // [R, h, dn + 64]
  const bf16* ckv;      // [R, 576]
  const float* cos;     // [R, 32]
  const float* sin;
  const bf16* norm_w;   // [512]
  const bf16* w;        // [h * (dn + dv), 512]
  bf16* kv;             // this layer's [capacity, 576]
  const int64_t* slots; // [R]
  const int32_t* block_table;  // [R, max_pages]
  const int32_t* cache_lens;   // [R]
  bf16* out;            // [R, h, dv]
  int64_t capacity;
  int heads, dn, dv, page_size, max_pages, num_pages;
  float eps, scale_log2;
  bool interleave, early;
  KD_TRACE_FIELD
};

template <int NS>
__global__ void __launch_bounds__(kThreads, 2) mla_decode_kernel(const DecodeParams p) {
  extern __shared__ __align__(128) uint8_t ring[];  // NS stages of kDecTile cache rows
  __shared__ __align__(16) bf16 qs[kDecD];           // the head's attention query (all 8 blocks' columns)
  __shared__ __align__(16) bf16 newk[kDecD];         // the new token's cache row
  __shared__ float qn[kDecMaxDn];
  __shared__ __align__(16) float red[kWarps][kDecCols];
  __shared__ int pg[kDecMaxPages];                  // the split's block-table entries (when they fit)
  __shared__ float sc[kDecTile];                    // the tile's scores (log2 domain)
  __shared__ float ps[kDecTile];                    // its probabilities against the running max
  __shared__ float s_alpha;                         // the running sums' rescale factor
  __shared__ __align__(16) bf16 o_s[kDecDc];
  // the two exchanges' barriers (query columns, partials) and every split's partial, pushed here by
  // its block (recv_o[k], recv_ml[k] = split k's latent sum and (max, sum))
  __shared__ alignas(8) uint64_t xbar[2];
  __shared__ __align__(16) float recv_o[kDecC][kDecDc];
  __shared__ float2 recv_ml[kDecC];
  cg::cluster_group cluster = cg::this_cluster();
  const int s = int(cluster.block_rank());
  const int h = blockIdx.x / kDecC, r = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gi = tid % kDecGroups, rp = tid / kDecGroups;
  const int64_t head_w = int64_t(h) * (p.dn + p.dv) * kDecDc;
  KD_TRACE(p.trace, 0);

  // ---- before the wait: weights into registers ----
  uint4 wk[kDecRegRows];
  const bf16* wuk = p.w + head_w + s * kDecCols + gi * 8;
#pragma unroll
  for (int i = 0; i < kDecRegRows; ++i) {
    const int d = rp + kDecPhases * i;
    wk[i] = d < p.dn ? ld_stream_early(reinterpret_cast<const uint4*>(wuk + int64_t(d) * kDecDc))
                     : make_uint4(0, 0, 0, 0);
  }
  const int rpb = ((p.dv + kDecC - 1) / kDecC + kWuvRowsPerWarp - 1) / kWuvRowsPerWarp * kWuvRowsPerWarp;
  const bool uv_warp = warp * kWuvRowsPerWarp < rpb;
  const int d0 = s * rpb + warp * kWuvRowsPerWarp, dv_w = uv_warp ? p.dv : 0;
  uint4 wv[kWuvRowsPerWarp][kDecDc / kWuvCols];
  wuv_load_rows(p.w + head_w + int64_t(p.dn) * kDecDc + 8 * lane, d0, dv_w, kDecDc, kDecDc / kWuvCols, wv);
  uint4 nw[kDecDc / 256];  // kv_a_layernorm's weight, for the block that computes the new cache row
  if (warp == kWarps - 1) {
#pragma unroll
    for (int i = 0; i < kDecDc / 256; ++i)
      nw[i] = ld_stream_early(reinterpret_cast<const uint4*>(p.norm_w + 8 * (lane + 32 * i)));
  }
  if (tid == 0) {  // initialised before the cluster barrier below lets anyone push here
    mbar_init(&xbar[0], 1);
    mbar_init(&xbar[1], 1);
    fence_mbar_init();
  }
  // every block of the cluster is running before any writes into another's shared memory
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");

  // ---- the split's committed keys ----
  KD_TRACE(p.trace, 1);
  if (!p.early) pdl_wait();
  const int max_keys = p.max_pages * p.page_size;
  const int L = min(max(__ldcg(p.cache_lens + r), 0), max_keys - 1);
  int chunk = (L + 1 + kDecC - 1) / kDecC;
  chunk = (chunk + kDecTile - 1) / kDecTile * kDecTile;
  const int kb = min(s * chunk, L + 1), ke = min(L + 1, kb + chunk);
  const int ce = min(ke, L);  // committed keys [kb, ce); the new token's key L belongs to the split with ke = L + 1
  const bool owner = kb <= L && L < ke;
  const int tiles = ce > kb ? (ce - kb + kDecTile - 1) / kDecTile : 0;
  const int32_t* bt_r = p.block_table + int64_t(r) * p.max_pages;
  // The split's block-table entries into shared memory once (when they fit), so that a tile's copies
  // wait for one L2 round trip (the rows), not two (the entry, then the rows).
  const int pg0 = kb / p.page_size, npg = ce > kb ? (ce - 1) / p.page_size - pg0 + 1 : 0;
  const bool pg_cached = npg <= kDecMaxPages;
  if (pg_cached)
    for (int i = tid; i < npg; i += kThreads) pg[i] = __ldcg(bt_r + pg0 + i);
  __syncthreads();
  auto load_tile = [&](int t, int stage) {
    const int key = tid >> 3, sub = tid & 7;  // 8 threads per key row
    const int pos = kb + t * kDecTile + key;
    const bf16* src = p.kv;
    int bytes = 0;
    if (pos < ce) {
      const int lp = pos / p.page_size;
      const int page = pg_cached ? pg[lp - pg0] : __ldcg(bt_r + lp);
      if (page >= 0 && page < p.num_pages) {
        src = p.kv + (int64_t(page) * p.page_size + (pos - lp * p.page_size)) * kDecD;
        bytes = 16;
      }
    }
    uint8_t* dst = ring + stage * kDecStageBytes + key * kDecRowBytes;
#pragma unroll
    for (int c = sub; c < kDecChunks; c += 8) cp_async16(smem_u32(dst + c * 16), bytes ? src + c * 8 : p.kv, bytes);
  };
  static_assert(kThreads / 8 == kDecTile && kDecTile == 32,
                "one pass of the block loads one stage; warp 0 owns a tile");
#pragma unroll
  for (int st = 0; st < NS; ++st) {
    if (st < tiles) load_tile(st, st);
    cp_async_commit();
  }
  if (p.early) pdl_wait();
  KD_TRACE(p.trace, 2);
  pdl_launch_dependents();

  // ---- 1. the query, the new token's cache row, q_abs ----
  const int qd = p.dn + kDecDr;
  const bf16* qrow = p.q + (int64_t(r) * p.heads + h) * qd;
  for (int i = tid; i < p.dn; i += kThreads) qn[i] = __bfloat162float(qrow[i]);
  if (tid < kDecDr / 2)
    rope_pair(qrow + p.dn, qs + kDecDc, p.cos[int64_t(r) * (kDecDr / 2) + tid], p.sin[int64_t(r) * (kDecDr / 2) + tid],
              tid, kDecDr, p.interleave);
  if (owner && warp == kWarps - 1) {
    // Every load of the chain first (ckv, k_pe's pair, cos / sin, the slot), then the norm and RoPE.
    const bf16* c = p.ckv + int64_t(r) * kDecD;
    uint4 craw[kDecDc / 256];
#pragma unroll
    for (int i = 0; i < kDecDc / 256; ++i) craw[i] = *reinterpret_cast<const uint4*>(c + 8 * (lane + 32 * i));
    const float x1 = __bfloat162float(c[kDecDc + (p.interleave ? 2 * lane : lane)]);
    const float x2 = __bfloat162float(c[kDecDc + (p.interleave ? 2 * lane + 1 : lane + kDecDr / 2)]);
    const float cs = p.cos[int64_t(r) * (kDecDr / 2) + lane], sn = p.sin[int64_t(r) * (kDecDr / 2) + lane];
    const int64_t slot = p.slots[r];
    float v[kDecDc / 256][8];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kDecDc / 256; ++i) {
      unpack8(craw[i], v[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(v[i][j], v[i][j], ss);
    }
    const float rs = rsqrtf(warp_sum(ss) / float(kDecDc) + p.eps);
#pragma unroll
    for (int i = 0; i < kDecDc / 256; ++i)
      *reinterpret_cast<uint4*>(newk + 8 * (lane + 32 * i)) = norm_row8(nw[i], v[i], rs);
    newk[kDecDc + lane] = __float2bfloat16(x1 * cs - x2 * sn);  // rope_pair's arithmetic
    newk[kDecDc + lane + kDecDr / 2] = __float2bfloat16(x2 * cs + x1 * sn);
    __syncwarp();
    if (h == 0 && slot >= 0 && slot < p.capacity) {
      uint4* dst = reinterpret_cast<uint4*>(p.kv + slot * kDecD);
      for (int i = lane; i < kDecChunks; i += 32) dst[i] = reinterpret_cast<const uint4*>(newk)[i];
    }
  }
  __syncthreads();  // qn
  {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    auto row = [&](const uint4& raw, int d) {
      float f[8];
      unpack8(raw, f);
      const float qv = qn[d];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(qv, f[j], acc[j]);
    };
#pragma unroll
    for (int i = 0; i < kDecRegRows; ++i)
      if (rp + kDecPhases * i < p.dn) row(wk[i], rp + kDecPhases * i);
    for (int d = rp + kDecPhases * kDecRegRows; d < p.dn; d += kDecPhases)  // dn > 128
      row(__ldg(reinterpret_cast<const uint4*>(wuk + int64_t(d) * kDecDc)), d);
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // the warp's 4 row phases of each column group (lanes gi, gi + 8, ..)
      acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 8);
      acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
    }
    if (lane < kDecGroups) {
      float4* dst = reinterpret_cast<float4*>(&red[warp][8 * lane]);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
  __syncthreads();
  KD_TRACE(p.trace, 3);
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block of the cluster has started
  if (tid == 0) {  // this block's single arrival on each, with the bytes the 8 blocks push
    mbar_expect_tx(&xbar[0], kDecC * kDecCols * 2);
    mbar_expect_tx(&xbar[1], kDecC * (kDecDc * 4 + 8));
  }
  if (tid < kDecCols) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += red[w][tid];
    const bf16 b = __float2bfloat16(v);
    // columns tid, tid + 1 as one word from the even thread, to every block
    const uint32_t lo = __bfloat16_as_ushort(b);
    const uint32_t hi = __shfl_down_sync(0xffffffffu, lo, 1);
    if ((tid & 1) == 0) {
#pragma unroll
      for (int k = 0; k < kDecC; ++k)
        st_async_b32(cluster_addr(qs + s * kDecCols + tid, k), lo | (hi << 16), cluster_addr(&xbar[0], k));
    }
  }
  mbar_wait(&xbar[0], 0);  // 2. every block's query row is whole
  KD_TRACE(p.trace, 4);

  // Scores: 8 threads per key (tid / 8), each 9 of the row's 72 pieces (tid % 8 + 8 k), summed over
  // the 8; warp 0 runs the online softmax of the tile (max, probabilities, running sum) and every
  // thread rescales and accumulates its two latent dims.
  const int kj = tid >> 3, sub = tid & 7;
  const uint4* qv = reinterpret_cast<const uint4*>(qs) + sub;  // read per tile (registers are short)
  float m_run = -INFINITY, l_run = 0.f;  // warp 0's copy is the one used
  float o0 = 0.f, o1 = 0.f;              // this thread's latent dims 2 tid, 2 tid + 1
  auto tile_step = [&](const uint8_t* rows, int n) {  // after a barrier that made `rows` visible
    float a = 0.f;
    if (kj < n) {
      const uint4* krow = reinterpret_cast<const uint4*>(rows + kj * kDecRowBytes);
#pragma unroll
      for (int k = 0; k < kDecChunks / 8; ++k) a = dot8(krow[sub + 8 * k], qv[8 * k], a);
    }
    a += __shfl_xor_sync(0xffffffffu, a, 1);
    a += __shfl_xor_sync(0xffffffffu, a, 2);
    a += __shfl_xor_sync(0xffffffffu, a, 4);
    if (sub == 0) sc[kj] = kj < n ? a * p.scale_log2 : -INFINITY;
    __syncthreads();
    if (warp == 0) {
      const float sj = sc[lane];
      const float m_new = fmaxf(m_run, warp_max(sj));
      const float pj = exp2f(sj - m_new);          // 0 past n
      const float alpha = exp2f(m_run - m_new);    // 0 while m_run is -inf
      l_run = fmaf(l_run, alpha, warp_sum(pj));
      m_run = m_new;
      ps[lane] = pj;
      if (lane == 0) s_alpha = alpha;
    }
    __syncthreads();
    const float alpha = s_alpha;
    o0 *= alpha;
    o1 *= alpha;
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
      const float pj = ps[j];
      const uint32_t v2 = *reinterpret_cast<const uint32_t*>(rows + j * kDecRowBytes + 4 * tid);
      o0 = fmaf(pj, bf16_lo(v2), o0);
      o1 = fmaf(pj, bf16_hi(v2), o1);
    }
  };
  // Tile t sits in copy group t: NS groups before the loop, then one per iteration from the second
  // on (the refill of the stage the previous iteration read, issued once every thread is past it).
  // Before iteration t >= 1's wait NS + t - 1 groups are committed, so "at most NS - 2 pending"
  // means groups 0 .. t have landed.
  static_assert(NS >= 2, "a refill lags one iteration behind");
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<NS - 2>();
    __syncthreads();
    if (t == 0) KD_TRACE(p.trace, 8);
    if (t == tiles - 1) KD_TRACE(p.trace, 10);
    if (t >= 1) {
      if (t - 1 + NS < tiles) load_tile(t - 1 + NS, (t - 1) % NS);
      cp_async_commit();
    }
    tile_step(ring + (t % NS) * kDecStageBytes, min(kDecTile, ce - (kb + t * kDecTile)));
    if (t == 0) KD_TRACE(p.trace, 9);
  }
  if (owner) {
    __syncthreads();  // sc, ps and s_alpha are rewritten
    tile_step(reinterpret_cast<const uint8_t*>(newk), 1);
    KD_TRACE(p.trace, 11);
  }
#pragma unroll
  for (int k = 0; k < kDecC; ++k) {  // this split's partial to every block (warp 0's running max and sum)
    const uint32_t bar = cluster_addr(&xbar[1], k);
    st_async_v2f32(cluster_addr(&recv_o[s][2 * tid], k), o0, o1, bar);
    if (tid == 0) st_async_v2f32(cluster_addr(&recv_ml[s], k), m_run, l_run, bar);
  }
  KD_TRACE(p.trace, 5);
  mbar_wait(&xbar[1], 0);  // 3. every split's partial is here
  KD_TRACE(p.trace, 6);

  float mk[kDecC], lk[kDecC], mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < kDecC; ++k) {
    mk[k] = recv_ml[k].x;
    lk[k] = recv_ml[k].y;
    mx = fmaxf(mx, mk[k]);
  }
  float sum = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int k = 0; k < kDecC; ++k) {
    const float wgt = mk[k] == -INFINITY ? 0.f : exp2f(mk[k] - mx);
    const float2 o = reinterpret_cast<const float2*>(recv_o[k])[tid];
    sum = fmaf(wgt, lk[k], sum);
    a0 = fmaf(wgt, o.x, a0);
    a1 = fmaf(wgt, o.y, a1);
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  reinterpret_cast<__nv_bfloat162*>(o_s)[tid] = __floats2bfloat162_rn(a0 * inv, a1 * inv);
  __syncthreads();  // o_s is whole (nothing reads another block's shared memory)
  if (uv_warp)
    wuv_rows_times(o_s + 8 * lane, kDecDc / kWuvCols, wv, lane, d0, dv_w, p.out, (int64_t(r) * p.heads + h) * p.dv);
  KD_TRACE(p.trace, 7);
}

// The most clusters of mla_decode_kernel<NS> (kDecC blocks each, NS ring stages) resident on
// the current device at once, by the occupancy API: 0 when a block's static and dynamic shared memory
// exceed the per-block limit (or the query fails).  Cached per device.  H200 (ncu, RESULTS.md run
// 138): 30 at 2 stages (two 98 KB blocks per SM), 15 at 3 (135 KB: one block per SM, and 132 SMs
// hold only 15 groups of 8 within a GPC).
template <int NS>
int decode_max_clusters(const cudaDeviceProp& prop, int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0: not asked yet; else clusters + 1 (any thread)
  if (device >= 0 && device < kMaxDevices) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c - 1;
  }
  auto kernel = mla_decode_kernel<NS>;
  int clusters = 0;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t dyn = size_t(NS) * kDecStageBytes;
  if (attr.sharedSizeBytes + dyn <= prop.sharedMemPerBlockOptin) {
    raise_dynamic_smem(kernel, int(dyn));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kDecC);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = dyn;
    cudaLaunchAttribute cluster[1];
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = kDecC;
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    cfg.attrs = cluster;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query means "do not rely on more stages", not an error
      clusters = 0;
    }
  }
  if (device >= 0 && device < kMaxDevices) cache[device].store(clusters + 1, std::memory_order_relaxed);
  return clusters;
}

template <int NS>
void launch_mla_decode(DecodeParams p, int R, cudaStream_t stream) {
  auto kernel = mla_decode_kernel<NS>;
  KD_TRACE_SET(p, kTraceMlaDecode, dim3(unsigned(p.heads * kDecC), unsigned(R)));
  raise_dynamic_smem(kernel, NS * kDecStageBytes);
  launch_kernel_ex(kernel, dim3(unsigned(p.heads * kDecC), unsigned(R)), dim3(kThreads), dim3(kDecC, 1, 1),
                   size_t(NS) * kDecStageBytes, stream, launch_pdl(), p);
}

at::Tensor mla_decode_cuda(const at::Tensor& q, const at::Tensor& ckv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& norm_weight, double eps, const at::Tensor& w_kv_b, at::Tensor& kv_cache,
                           int64_t layer, const at::Tensor& slots, const at::Tensor& block_table,
                           const at::Tensor& cache_lens, double softmax_scale, bool interleave, bool prefix_ready) {
  constexpr const char* op = "kdtree::mla_decode";
  check_prepare_tensors(op, q, ckv, cos, sin, norm_weight, w_kv_b, kv_cache, slots);
  check_cuda_tensor(block_table, op, "block_table", at::kInt, 2);
  check_cuda_tensor(cache_lens, op, "cache_lens", at::kInt, 1);
  for (const at::Tensor* t : {&block_table, &cache_lens})
    KD_CHECK(t->device() == q.device(), op, ": every tensor must be on ", q.device(), ", got ", t->device());
  const int64_t R = q.size(0), heads = q.size(1), dn = q.size(2) - kDecDr;
  KD_CHECK(norm_weight.size(0) == kDecDc && kv_cache.size(3) == kDecD, op, ": the CUDA kernel needs K2's latent sizes, "
           "norm_weight [", kDecDc, "] and cache rows of ", kDecD, ", got ", norm_weight.sizes(), " and ",
           kv_cache.sizes());
  KD_CHECK(dn >= 1 && dn <= kDecMaxDn, op, ": dn (q's last dim - 64) must be in [1, ", kDecMaxDn, "], got ", dn);
  KD_CHECK(heads >= 1 && w_kv_b.size(1) == kDecDc && w_kv_b.size(0) % heads == 0 && w_kv_b.size(0) / heads > dn, op,
           ": w_kv_b must be [h * (dn + dv), 512] with h = ", heads, ", dn = ", dn, ", got ", w_kv_b.sizes());
  const int64_t dv = w_kv_b.size(0) / heads - dn;
  KD_CHECK(dv <= kDecMaxDv, op, ": the CUDA kernel needs dv <= ", kDecMaxDv, ", got ", dv);
  KD_CHECK(ckv.size(0) == R && ckv.size(1) == kDecD, op, ": ckv must be [R, 576] with R = ", R, ", got ", ckv.sizes());
  KD_CHECK(cos.size(0) == R && cos.size(1) == kDecDr / 2 && sin.sizes() == cos.sizes(), op,
           ": cos and sin must be [R, 32], got ", cos.sizes(), " and ", sin.sizes());
  KD_CHECK(slots.size(0) == R && cache_lens.size(0) == R && block_table.size(0) == R, op,
           ": slots, cache_lens and block_table must have R = ", R, " rows");
  KD_CHECK(layer >= 0 && layer < kv_cache.size(0), op, ": layer must be in [0, ", kv_cache.size(0), "), got ", layer);
  KD_CHECK(R <= 65535 && heads * kDecC <= INT32_MAX, op, ": at most 65535 requests, got ", R);
  const int64_t capacity = kv_cache.size(1) * kv_cache.size(2);
  KD_CHECK(block_table.size(1) >= 1 && block_table.size(1) * kv_cache.size(2) <= (int64_t(1) << 24), op,
           ": block_table must have between 1 and 2^24 / page_size pages per request, got ", block_table.sizes());
  at::Tensor out = at::empty({R, heads, dv}, q.options());
  if (R == 0) return out;
  const c10::cuda::CUDAGuard guard(q.device());
  DecodeParams p{reinterpret_cast<const bf16*>(q.data_ptr()), reinterpret_cast<const bf16*>(ckv.data_ptr()),
                 cos.data_ptr<float>(), sin.data_ptr<float>(), reinterpret_cast<const bf16*>(norm_weight.data_ptr()),
                 reinterpret_cast<const bf16*>(w_kv_b.data_ptr()),
                 reinterpret_cast<bf16*>(kv_cache.data_ptr()) + layer * capacity * kDecD, slots.data_ptr<int64_t>(),
                 block_table.data_ptr<int32_t>(), cache_lens.data_ptr<int32_t>(),
                 reinterpret_cast<bf16*>(out.data_ptr()), capacity, int(heads), int(dn), int(dv),
                 int(kv_cache.size(2)), int(block_table.size(1)), int(kv_cache.size(1)), float(eps),
                 float(softmax_scale * 1.44269504088896341), interleave, prefix_ready};
  // Ring stages (the keys' copies in flight per block):
  // - 3 when the launch fills at most half the SMs (room beside the neighbouring kernels' blocks) and
  //   all its clusters fit on the device at once at 3 stages (K2's 8 heads per TP-8 rank on an H200:
  //   64 blocks, 8 clusters of the 15 that fit): a split's third 32-key tile (L + 1 in 513 .. 768) no
  //   longer waits for the first to be consumed.  k2_slice 0.3172 -> 0.3134 ms (run 134) and
  //   0.3141 -> 0.3114 (run 135), the same tokens;
  // - 2 otherwise (98 KB a block with the push exchange's 24 KB).  2p2b's 16 clusters at 3 stages
  //   measured 0.5503 -> 0.5874 ms (run 134), at 4 stages 7-9 % slower (runs 73, 104): only 15
  //   clusters of 135 KB blocks fit on the H200, so the 16th waits for another to finish (run 138:
  //   its blocks enter ~9 us after the others; ncu 19.0-19.6 vs 12.8-13.3 us a launch);
  // - 2 wherever a block's shared memory does not hold more (sm_120's 99 KB a block: no cluster fits
  //   at 3 stages, decode_max_clusters<3> is 0).
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t clusters = int64_t(p.heads) * R;
  const bool three = clusters * kDecC <= prop->multiProcessorCount / 2 &&
                     clusters <= decode_max_clusters<3>(*prop, q.get_device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (three)
    launch_mla_decode<3>(p, int(R), stream);
  else
    launch_mla_decode<2>(p, int(R), stream);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("mla_prepare", &mla_prepare_cuda);
  m.impl("mla_output", &mla_output_cuda);
  m.impl("mla_decode", &mla_decode_cuda);
}

}  // namespace kdtree
