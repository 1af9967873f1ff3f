// INT4 (w4a16) tensor-core helpers shared by the int4_moe kernels (moe.cu: the grouped GEMMs;
// moe_decode.cu: the decode GEMVs).  The weight layout is documented in torch_kdtree/ops/moe.py.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kdtree {
namespace {

using bf16 = __nv_bfloat16;
using bf162 = __nv_bfloat162;

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared (through L2 only); with pred false the destination is zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred = true) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <int kLut>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return r;
}

__device__ __forceinline__ bf162 as_bf162(uint32_t v) {
  union { uint32_t u; bf162 h; } x;
  x.u = v;
  return x.h;
}
__device__ __forceinline__ uint32_t as_u32(bf162 h) {
  union { uint32_t u; bf162 h; } x;
  x.h = h;
  return x.u;
}

// One lane's A fragment of a 16x16 weight tile from its int32 (nibble slot j at bits 4j):
// register i = slots (i, i + 4) = lop3 of q >> 4i; scale pair = (scale of row g, row g + 8).
__device__ __forceinline__ void dequant_a(uint32_t q, uint32_t scale_pair, uint32_t (&a)[4]) {
  constexpr uint32_t kMask = 0x000f000fu;
  constexpr uint32_t kExp = 0x43004300u;  // bf16x2 (128, 128)
  const bf162 k136 = as_bf162(0x43084308u);  // bf16x2 (136, 136): 128 + stored (q + 8) - 136 = q
  const bf162 sp = as_bf162(scale_pair);
  const bf162 s_lo = __low2bfloat162(sp);    // rows g      (registers 0 and 2)
  const bf162 s_hi = __high2bfloat162(sp);   // rows g + 8  (registers 1 and 3)
  // (a & b) | c with a = 0xF0, b = 0xCC, c = 0xAA -> 0xEA
  a[0] = as_u32(__hmul2(__hsub2(as_bf162(lop3<0xEA>(q, kMask, kExp)), k136), s_lo));
  a[1] = as_u32(__hmul2(__hsub2(as_bf162(lop3<0xEA>(q >> 4, kMask, kExp)), k136), s_hi));
  a[2] = as_u32(__hmul2(__hsub2(as_bf162(lop3<0xEA>(q >> 8, kMask, kExp)), k136), s_lo));
  a[3] = as_u32(__hmul2(__hsub2(as_bf162(lop3<0xEA>(q >> 12, kMask, kExp)), k136), s_hi));
}

template <typename IdT>
__device__ __forceinline__ int local_expert(const IdT* ids, int64_t i, const int32_t* emap, int num_global, int E) {
  const int64_t id = static_cast<int64_t>(ids[i]);
  if (id < 0 || id >= num_global) return -1;
  const int e = emap != nullptr ? emap[id] : static_cast<int>(id);
  return (e >= 0 && e < E) ? e : -1;
}

}  // namespace
}  // namespace kdtree
