// 16-byte asynchronous copies global -> shared memory (cp.async, through L2 only) and the
// shared-memory address they take, shared by the MLA attention (mla.cu), mla_decode
// (mla_absorb.cu) and the bulk-copy helpers (bulk_copy.cuh).  int4_mma.cuh keeps its own forms
// (a predicate argument; a commit without a memory clobber) for the INT4 MoE kernels.
#pragma once

#include <cstdint>

namespace kdtree {
namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// src_bytes = 0 writes 16 zero bytes and reads nothing (padding rows, keys past the end).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Blocks until at most kPending of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace
}  // namespace kdtree
