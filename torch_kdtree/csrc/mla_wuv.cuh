// The W_UV product of absorbed MLA (the heads' values from a latent row), shared by mla_output's
// kernel (mla_absorb.cu) and mla_tree_attention_output's merge kernel (mla.cu), so that both give
// the same bits.  Warp layout: a warp owns kWuvRowsPerWarp consecutive W_UV rows d0 .. of one head,
// held in registers; lane l holds the 16-byte pieces at columns 8 l + kWuvCols·j (j < groups <= G)
// of each.  Per latent row: each lane's dot8 over its pieces in j order, a warp sum per W_UV row,
// and lane q stores output d0 + q.
#pragma once

#include "bf16_vec.cuh"
#include "warp_reduce.cuh"
#include <cuda_bf16.h>

#include <cstdint>

namespace kdtree {
namespace {

constexpr int kWuvRowsPerWarp = 4;
constexpr int kWuvCols = 256;  // latent columns per piece index j (32 lanes x 8)

// The warp's W_UV rows d0 .. d0 + kWuvRowsPerWarp - 1 (those below dv) into registers; w = the
// head's first W_UV row + 8·lane, rows dc apart.  Weights only (no kernel writes them), so callers
// issue these loads before their programmatic-launch wait (ld_stream_early).
template <int G>
__device__ __forceinline__ void wuv_load_rows(const __nv_bfloat16* w, int d0, int dv, int dc, int groups,
                                              uint4 (&wr)[kWuvRowsPerWarp][G]) {
#pragma unroll
  for (int q = 0; q < kWuvRowsPerWarp; ++q)
#pragma unroll
    for (int j = 0; j < G; ++j)
      wr[q][j] = (d0 + q < dv && j < groups)
                     ? ld_stream_early(reinterpret_cast<const uint4*>(w + int64_t(d0 + q) * dc + kWuvCols * j))
                     : make_uint4(0, 0, 0, 0);
}

// out[at + d0 + q] = bf16(W_UV row d0 + q · the latent row) for the warp's rows below dv; o = the
// latent row + 8·lane (global or shared memory), out + at = the head's dv outputs for this token.
template <int G>
__device__ __forceinline__ void wuv_rows_times(const __nv_bfloat16* o, int groups,
                                               const uint4 (&wr)[kWuvRowsPerWarp][G], int lane, int d0, int dv,
                                               __nv_bfloat16* out, int64_t at) {
  float acc[kWuvRowsPerWarp] = {};
#pragma unroll
  for (int j = 0; j < G; ++j) {
    if (j < groups) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + kWuvCols * j);
#pragma unroll
      for (int q = 0; q < kWuvRowsPerWarp; ++q) acc[q] = dot8(ov, wr[q][j], acc[q]);
    }
  }
#pragma unroll
  for (int q = 0; q < kWuvRowsPerWarp; ++q) {
    const float v = warp_sum(acc[q]);
    if (lane == q && d0 + q < dv) out[at + d0 + q] = __float2bfloat16(v);
  }
}

}  // namespace
}  // namespace kdtree
