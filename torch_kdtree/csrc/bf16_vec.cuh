// 16-byte vectors of eight bf16 values: streaming weight loads, fp32 dot products and SwiGLU, shared
// by the GEMV kernels (moe_gemv.cu, gemv.cu, moe_decode.cu) and the INT4 grouped GEMMs (moe.cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kdtree {
namespace {

// 16 bytes of a weight row: read once, so no L1 allocation.  Not volatile: the compiler may
// batch these loads ahead of the arithmetic.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// ld_stream for a weight load issued before pdl_wait (pdl.cuh) that must stay there: ptxas moves a
// read-only (.nc) load whose result is first used after griddepcontrol.wait to after it (sm_90
// SASS: LDG.E.128.CONSTANT after ACQBULK) but keeps a coherent one in place; volatile, so the
// compiler keeps the order too.  Only for data no kernel writes (model weights).
__device__ __forceinline__ uint4 ld_stream_early(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// The eight bf16 values of v as floats, in memory order.
__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  f[0] = bf16_lo(v.x), f[1] = bf16_hi(v.x), f[2] = bf16_lo(v.y), f[3] = bf16_hi(v.y);
  f[4] = bf16_lo(v.z), f[5] = bf16_hi(v.z), f[6] = bf16_lo(v.w), f[7] = bf16_hi(v.w);
}

// Σ of the 8 bf16 products of a and b, in fp32.
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
  acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
  acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
  acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
  acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
  acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
  acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
  acc = fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
  return acc;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// silu(g) · u in fp32 (the SwiGLU product of every MLP and expert kernel).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

}  // namespace
}  // namespace kdtree
