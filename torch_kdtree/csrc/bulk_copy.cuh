// Bulk copies global -> shared memory through the copy engine (cp.async.bulk, sm_90+: both of our
// targets) completed on shared-memory barriers (mbarrier): the weight stream of gemv.cu's ring kernel.
//
// One copy moves up to a few KB with one instruction and is tracked by the barrier's transaction
// count, not by per-thread load slots, so a warp can keep many KB of weight bytes in flight with
// no registers.  Usage (one barrier per ring stage, arrival count 1):
//   producer lane: mbar_init once, fence_mbar_init; per fill: bulk_load(dst, src, bytes, bar)
//     (arrive + expect_tx, then the copy);
//   consumers: mbar_wait(bar, parity), parity flipping each time the stage is refilled;
//   before a stage the warp has read is refilled: __syncwarp, then fence_proxy_async by the producer
//     (the refill is a write by the async proxy after generic-proxy reads).
#pragma once

#include "cp_async.cuh"  // smem_u32

#include <cstdint>

namespace kdtree {
namespace {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#endif
}

// Makes barrier initialisations visible to the async proxy (the copy engine) and the other threads.
__device__ __forceinline__ void fence_mbar_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Orders this thread's (and, after a __syncwarp/__syncthreads, the group's) generic-proxy accesses to
// shared memory before later async-proxy ones (a bulk copy into a buffer that was just read).
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Arrives on the barrier with `bytes` of expected transactions (the copies or remote stores that
// complete on it count them down).
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
#endif
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst; the
// barrier's phase completes when they have landed.  Arrives on the barrier (count 1) with the
// expected transaction bytes first.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  mbar_expect_tx(bar, bytes);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}

// Blocks until the barrier's phase with this parity (0, 1, 0, ... per completed fill) has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#endif
}

}  // namespace
}  // namespace kdtree
