// Warp-wide float reductions (xor butterfly over the full warp; every lane gets the result), shared
// by the kernel families.
#pragma once

namespace kdtree {
namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Block-wide RMS scales of R rows over a block of W warps: ss[m] is this thread's sum of squares
// of row m; on return (after a barrier) rscale[m] = rsqrt(Σ / n + eps) for every thread, the warps'
// sums added in warp order.  red: shared scratch.
template <int R, int W>
__device__ __forceinline__ void block_rms_scale(const float (&ss)[R], float (&red)[R][W], float (&rscale)[R], int n,
                                                float eps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int m = 0; m < R; ++m) {
    const float t = warp_sum(ss[m]);
    if (lane == 0) red[m][warp] = t;
  }
  __syncthreads();
  if (threadIdx.x < R) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < W; ++i) t += red[threadIdx.x][i];
    rscale[threadIdx.x] = rsqrtf(t / float(n) + eps);
  }
  __syncthreads();
}

}  // namespace
}  // namespace kdtree
