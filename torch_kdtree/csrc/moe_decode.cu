// int4_moe's decode path (off unless KDTREE_INT4_DECODE=1: run 40 measured it slower than the
// grouped path at T = 1, 2 and 4 on the H200): for a handful of (token, expert) slots (T·k <= 32)
// the grouped GEMMs of moe.cu (align, gate/up, down, combine: four launches with a sort and a
// padded expert block each) have nothing to share between tokens, so two GEMV launches read
// every touched expert's weights once instead.  Same inputs, layout (ops/moe.py), workspace
// (its act region) and numerics (bf16 dequantisation q · scale as in dequant_a, fp32 tensor-core
// accumulation, bf16 activations, the top-k terms summed in order j = 0..k-1 in fp32).
//
//   1. gate/up: grid (I / 16, T·k, K splits), 8 warps.  Block = one slot, one 16-channel tile pair
//      (gate tile 2i and up tile 2i + 1 of w13) and one K split (up to 4, when a call has few
//      blocks; the fp32 sums then go to the workspace's y region and down's prologue adds the
//      splits in order); warp w of the unit's W takes the k64 tiles w, w + W, ... of H, four in
//      flight per lane (one 16-byte load per tile and lane: exactly its A fragments of four
//      mma.m16n8k16 steps) and the tiles' scales, with x (staged in shared memory) as the B
//      operand in all eight columns.  A fixed-order sum of
//      the eight warps' partials in shared memory, then act[slot, 16 i + r] = bf16(silu(g) · u).
//   2. down: grid (ceil(H / 64), T), 4 warps.  Warp = one 16-channel tile of out for one token:
//      all of its k slots' tiles (k · I / 64 16-byte loads per lane, sixteen in flight), B = the
//      slot's activations staged in shared memory; per k64 tile the fp32 partial times the router
//      weight is added to the output accumulator, in slot order.
// Programmatic dependent launch (pdl.cuh): down reads the routing (two kernels back) before its
// wait and prefetches all of its weight tiles into L2 while gate/up runs.
#include "moe_decode.h"

#include "bf16_vec.cuh"
#include "int4_mma.cuh"
#include "pdl.cuh"
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kdtree {
namespace {

constexpr int kDecWarps = 8;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kUpInFlight = 4;    // gate/up: k64 tiles per lane in flight (x2: gate and up)
constexpr int kMaxUpSplits = 4;
constexpr int kDownWarps = 4;      // down: warps (16-channel output tiles) per block
constexpr int kDownInFlight = 16;  // down: (slot, k64 tile) items per lane in flight
constexpr int kMaxTopk = 16;

template <typename IdT>
__device__ __forceinline__ int local_expert_l2(const IdT* ids, int64_t i, const int32_t* emap, int num_global, int E) {
  const int64_t id = static_cast<int64_t>(__ldcg(ids + i));
  if (id < 0 || id >= num_global) return -1;
  const int e = emap != nullptr ? __ldcg(emap + id) : static_cast<int>(id);
  return (e >= 0 && e < E) ? e : -1;
}

// Four k16 steps of one 16x64 weight tile (q: this lane's 16 bytes of it) against B, the tile's
// 64 activations (bf16 pairs load_b(w) = word w of the tile), into acc.  sp0 / sp1: this lane's
// scale pairs of the tile's k 0..31 and k 32..63 (the same word for groups of 64 and 128).
template <typename LoadB>
__device__ __forceinline__ void tile_mma(const uint4& q, uint32_t sp0, uint32_t sp1, LoadB load_b, float (&acc)[4]) {
  const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[4];
    dequant_a(qs[s], s < 2 ? sp0 : sp1, a);
    const uint32_t b[2] = {load_b(8 * s), load_b(8 * s + 4)};
    mma_bf16(acc, a, b);
  }
}

// Scale-pair words of k64 tile c for k 0..31 and 32..63 (row: the lane's words of one 16-channel
// tile, group i at word 8 i; group size 1 << gs_shift).
__device__ __forceinline__ uint32_t scale_lo(const uint32_t* row, int c, int gs_shift) {
  return __ldg(row + ((64 * c) >> gs_shift) * 8);
}
__device__ __forceinline__ uint32_t scale_hi(const uint32_t* row, int c, int gs_shift) {
  return __ldg(row + ((64 * c + 32) >> gs_shift) * 8);
}

template <typename IdT>
__global__ void __launch_bounds__(kDecThreads)
int4_decode_up_kernel(const bf16* __restrict__ x, const uint4* __restrict__ w13q, const bf16* __restrict__ w13s,
                      const IdT* __restrict__ ids, const int32_t* __restrict__ emap, int num_global, int E, int H,
                      int I, int gs_shift, int topk, bf16* __restrict__ act, float* __restrict__ partials) {
  extern __shared__ __align__(16) uint32_t s_x[];  // [H / 2] bf16 pairs: the slot's token
  __shared__ float red[kDecWarps][2][16];
  pdl_wait();  // the routing and x come from earlier kernels
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tp = blockIdx.x, slot = blockIdx.y, ks = blockIdx.z, nks = gridDim.z;
  const int gw = ks * kDecWarps + warp, nw = nks * kDecWarps;  // this warp among the unit's warps
  const int e = local_expert_l2(ids, slot, emap, num_global, E);
  float cg[4] = {0.f, 0.f, 0.f, 0.f}, cu[4] = {0.f, 0.f, 0.f, 0.f};
  if (e >= 0) {  // block-uniform
    const int KC = H / 64, MT = 2 * I / 16, G = H >> gs_shift;
    const uint4* wg = w13q + (int64_t(e) * MT + 2 * tp) * KC * 32 + lane;  // tile (e, 2 tp, c) at + 32 c
    const uint4* wu = wg + int64_t(KC) * 32;
    const uint32_t* sg = reinterpret_cast<const uint32_t*>(w13s + (int64_t(e) * MT + 2 * tp) * G * 16) + g;
    const uint32_t* su = sg + int64_t(G) * 8;
    // the first tiles' weights and scales in flight while x is staged
    auto load = [&](int c0, uint4 (&qg)[kUpInFlight], uint4 (&qu)[kUpInFlight], uint32_t (&sc)[kUpInFlight][4]) {
#pragma unroll
      for (int u = 0; u < kUpInFlight; ++u) {
        const int c = c0 + nw * u;
        if (c < KC) {
          qg[u] = ld_stream(wg + 32 * c);
          qu[u] = ld_stream(wu + 32 * c);
          sc[u][0] = scale_lo(sg, c, gs_shift);
          sc[u][1] = scale_hi(sg, c, gs_shift);
          sc[u][2] = scale_lo(su, c, gs_shift);
          sc[u][3] = scale_hi(su, c, gs_shift);
        }
      }
    };
    uint4 qg[kUpInFlight], qu[kUpInFlight];
    uint32_t sc[kUpInFlight][4];
    load(gw, qg, qu, sc);
    const uint4* xg = reinterpret_cast<const uint4*>(x + int64_t(slot / topk) * H);
    for (int i = threadIdx.x; i < H / 8; i += kDecThreads) reinterpret_cast<uint4*>(s_x)[i] = __ldcg(xg + i);
    __syncthreads();
    for (int c0 = gw; c0 < KC; c0 += nw * kUpInFlight) {
      if (c0 != gw) load(c0, qg, qu, sc);
#pragma unroll
      for (int u = 0; u < kUpInFlight; ++u) {
        const int c = c0 + nw * u;
        if (c < KC) {
          const uint32_t* xc = s_x + 32 * c + t;
          auto load_b = [&](int w) { return xc[w]; };
          tile_mma(qg[u], sc[u][0], sc[u][1], load_b, cg);
          tile_mma(qu[u], sc[u][2], sc[u][3], load_b, cu);
        }
      }
    }
  }
  // every column of C holds the same dot products: lanes t == 0 hold rows g (c[0]) and g + 8 (c[2])
  if (t == 0) {
    red[warp][0][g] = cg[0];
    red[warp][0][g + 8] = cg[2];
    red[warp][1][g] = cu[0];
    red[warp][1][g + 8] = cu[2];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float gv = 0.f, uv = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      gv += red[w][0][threadIdx.x];
      uv += red[w][1][threadIdx.x];
    }
    if (nks == 1) {
      act[int64_t(slot) * I + 16 * tp + threadIdx.x] = __float2bfloat16(gv / (1.f + __expf(-gv)) * uv);
    } else {  // K split: this block's sums; down adds the splits in order
      float* pp = partials + (int64_t(ks) * gridDim.y + slot) * 2 * I + 32 * tp + threadIdx.x;
      pp[0] = gv;
      pp[16] = uv;
    }
  }
}

template <typename IdT>
__global__ void __launch_bounds__(kDownWarps * 32)
int4_decode_down_kernel(const bf16* __restrict__ act, const float* __restrict__ partials, int nks,
                        const uint4* __restrict__ w2q, const bf16* __restrict__ w2s, const IdT* __restrict__ ids,
                        const float* __restrict__ topk_weights, const int32_t* __restrict__ emap, int num_global,
                        int E, int H, int I, int gs_shift, int topk, bf16* __restrict__ out) {
  extern __shared__ __align__(16) uint32_t s_act[];  // [topk][I / 2] bf16 pairs: this token's activations
  __shared__ int s_e[kMaxTopk];
  __shared__ float s_w[kMaxTopk];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int tok = blockIdx.y, m = blockIdx.x * kDownWarps + warp;
  const int MT = H / 16, KC = I / 64, G = I >> gs_shift;
  // Before gate/up is done: the routing (two kernels back, complete once gate/up let this grid
  // launch; read through L2) and this warp's weight tiles into L2.
  if (threadIdx.x < topk) {
    const int e = local_expert_l2(ids, int64_t(tok) * topk + threadIdx.x, emap, num_global, E);
    s_e[threadIdx.x] = e;
    s_w[threadIdx.x] = e >= 0 ? __ldcg(topk_weights + int64_t(tok) * topk + threadIdx.x) : 0.f;
  }
  __syncthreads();
  if (m < MT) {
    for (int j = 0; j < topk; ++j)
      if (s_e[j] >= 0) l2_prefetch_range(w2q + (int64_t(s_e[j]) * MT + m) * KC * 32, int64_t(KC) * 512, lane);
  }
  pdl_wait();
  pdl_launch_dependents();
  const int words = topk * (I / 2);
  if (nks == 1) {
    const uint4* ag = reinterpret_cast<const uint4*>(act + int64_t(tok) * topk * I);
    for (int i = threadIdx.x; i < words / 4; i += kDownWarps * 32) reinterpret_cast<uint4*>(s_act)[i] = __ldcg(ag + i);
  } else {  // sum gate/up's K splits in order, then silu(g) · u; unit = 4 channels of a slot
    const int slots = gridDim.y * topk, units = topk * (I / 4);
    for (int i = threadIdx.x; i < units; i += kDownWarps * 32) {
      const int j = i / (I / 4), ch = 4 * (i - j * (I / 4));  // channels ch .. ch + 3 of slot j
      const float* pp = partials + int64_t(tok * topk + j) * 2 * I + 32 * (ch / 16) + ch % 16;
      float4 gs[kMaxUpSplits], us[kMaxUpSplits];
#pragma unroll
      for (int q = 0; q < kMaxUpSplits; ++q)
        if (q < nks) {
          const float* p = pp + int64_t(q) * slots * 2 * I;
          gs[q] = __ldcg(reinterpret_cast<const float4*>(p));
          us[q] = __ldcg(reinterpret_cast<const float4*>(p + 16));
        }
      float4 g = gs[0], u = us[0];
#pragma unroll
      for (int q = 1; q < kMaxUpSplits; ++q)
        if (q < nks) {
          g.x += gs[q].x, g.y += gs[q].y, g.z += gs[q].z, g.w += gs[q].w;
          u.x += us[q].x, u.y += us[q].y, u.z += us[q].z, u.w += us[q].w;
        }
      const __nv_bfloat162 v0 = __floats2bfloat162_rn(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y);
      const __nv_bfloat162 v1 = __floats2bfloat162_rn(g.z / (1.f + __expf(-g.z)) * u.z, g.w / (1.f + __expf(-g.w)) * u.w);
      s_act[2 * i] = *reinterpret_cast<const uint32_t*>(&v0);
      s_act[2 * i + 1] = *reinterpret_cast<const uint32_t*>(&v1);
    }
  }
  __syncthreads();
  if (m >= MT) return;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const int items = topk * KC;  // (slot j, k64 tile c) in slot order
  for (int n0 = 0; n0 < items; n0 += kDownInFlight) {
    uint4 q[kDownInFlight];
    uint32_t sp[kDownInFlight][2];
#pragma unroll
    for (int u = 0; u < kDownInFlight; ++u) {
      const int n = n0 + u;
      if (n < items) {
        const int j = n / KC, c = n - j * KC, e = s_e[j];
        if (e >= 0) {
          q[u] = ld_stream(w2q + ((int64_t(e) * MT + m) * KC + c) * 32 + lane);
          const uint32_t* srow = reinterpret_cast<const uint32_t*>(w2s + (int64_t(e) * MT + m) * G * 16) + g;
          sp[u][0] = scale_lo(srow, c, gs_shift);
          sp[u][1] = scale_hi(srow, c, gs_shift);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kDownInFlight; ++u) {
      const int n = n0 + u;
      if (n < items) {
        const int j = n / KC, c = n - j * KC, e = s_e[j];
        if (e >= 0) {
          const uint32_t* ac = s_act + j * (I / 2) + 32 * c + t;
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          tile_mma(q[u], sp[u][0], sp[u][1], [&](int w) { return ac[w]; }, part);
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[r] = fmaf(s_w[j], part[r], acc[r]);
        }
      }
    }
  }
  if (t == 0) {
    bf16* o = out + int64_t(tok) * H + 16 * m + g;
    o[0] = __float2bfloat16(acc[0]);
    o[8] = __float2bfloat16(acc[2]);
  }
}

// gate/up's K split: about two blocks per SM in all (a unit = a slot's 32 w13 channels), at most
// kMaxUpSplits, at least 8 k64 tiles per split's warps, and the fp32 partials must fit the
// workspace region given to them (partial_bytes).
int up_splits(const Int4DecodeArgs& a, int sms) {
  const int64_t units = a.I / 16 * a.T * a.topk;
  int64_t ks = std::min<int64_t>({kMaxUpSplits, (2 * sms + units / 2) / units, a.H / 64 / kDecWarps});
  while (ks > 1 && ks * a.T * a.topk * 2 * a.I * 4 > a.partial_bytes) --ks;
  return int(std::max<int64_t>(ks, 1));
}

template <typename IdT>
void launch_decode(const Int4DecodeArgs& a, cudaStream_t stream, bool pdl) {
  const IdT* ids = static_cast<const IdT*>(a.topk_ids);
  const int T = int(a.T), k = int(a.topk), H = int(a.H), I = int(a.I), E = int(a.E), ng = int(a.num_global),
            gs_shift = a.group_size == 32 ? 5 : a.group_size == 64 ? 6 : 7;
  const int nks = up_splits(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  launch_kernel(&int4_decode_up_kernel<IdT>, dim3(unsigned(I / 16), unsigned(T * k), unsigned(nks)),
                dim3(kDecThreads), size_t(H) * 2, stream, pdl, a.x, a.w13q, a.w13s, ids, a.emap, ng, E, H, I,
                gs_shift, k, a.act, a.partials);
  const size_t smem = size_t(k) * I * 2;
  launch_kernel(&int4_decode_down_kernel<IdT>, dim3(unsigned((H / 16 + kDownWarps - 1) / kDownWarps), unsigned(T)),
                dim3(kDownWarps * 32), smem, stream, pdl, static_cast<const bf16*>(a.act),
                static_cast<const float*>(a.partials), nks, a.w2q, a.w2s, ids, a.topk_weights, a.emap, ng, E, H, I,
                gs_shift, k, a.out);
}

}  // namespace

bool int4_decode_applies(int64_t T, int64_t topk, int64_t H, int64_t I) {
  if (T * topk > kInt4DecodeMaxSlots || topk > kMaxTopk || topk * I * 2 > kInt4DecodeMaxBytes ||
      H * 2 > kInt4DecodeMaxBytes)
    return false;
  const char* v = std::getenv("KDTREE_INT4_DECODE");
  return v == nullptr ? kInt4DecodeDefault : std::strcmp(v, "0") != 0;
}

void int4_moe_decode(const Int4DecodeArgs& a, bool ids_int64) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool pdl = pdl_enabled("int4");
  if (ids_int64)
    launch_decode<int64_t>(a, stream, pdl);
  else
    launch_decode<int32_t>(a, stream, pdl);
}

}  // namespace kdtree
