// Programmatic dependent launch (PDL, sm_90+, so both of our targets), shared by the kernels of
// the decode step (gemv, moe_gemv, moe_route, mla, int4_moe).
//
// A kernel launched with the PDL attribute may become resident while its predecessor on the
// stream is still running, as soon as every block of the predecessor has called
// launch_dependents() or exited.  The rules every kernel here follows:
//   - pdl_wait() before reading anything the predecessor may have written and before writing
//     anything (an output may reuse memory the predecessor still reads); a block exits without
//     waiting only when other blocks of its grid do wait, so a grid never completes before its
//     predecessor has: int4_moe's unused expert blocks (nothing to do), and the shared-expert
//     blocks of moe_gemv given route_logits, which read only x (complete two kernels
//     back: the caller's promise) and write only memory the op allocated while holding the
//     predecessor's (moe_route's) one non-weight input;
//   - pdl_launch_dependents() only after pdl_wait() (or anywhere in a kernel launched without
//     PDL, such as int4_moe's align; or in a block that skips its wait, moe_gemv's route_logits
//     shared-expert blocks, when other blocks of the grid trigger only after theirs -- dependents
//     launch once every block has triggered or exited): a successor's pre-wait code may then rely
//     on everything two or more kernels back being complete;
//   - before the wait, only L2 prefetches of weights (l2_prefetch: L2 is the device's point of
//     coherence, so a prefetched line the predecessor is still writing is never read stale), loads
//     of model weights into registers (never written by any kernel of the step; gemv,
//     mla_absorb.cu's kernels, gemv's norm weight and moe_route's bias, with ld_stream_early's
//     or ld_early_f32's coherent ld.global: ptxas moves a read-only ld.global.nc whose result is
//     first used after griddepcontrol.wait to after it) or into shared memory (bulk copies or
//     cp.async: gemv's ring, the INT4 decode kernels) and
//     loads through L2 (ldcg, cp.async.cg) of data written two or more kernels back: the routing
//     in a successor of one of our kernels (which trigger only after their wait), and
//     mla_tree_attention's committed cache rows, lengths and block table when its caller passes
//     prefix_ready (the predecessor, ours or a plain launch that started only after everything
//     before it had completed, does not write them).
// Inductor's Triton kernels in the compiled generation steps are PDL launches too
// (models/generation/session.py, inductor_options): each waits (gdc_wait) before it reads what its
// predecessor wrote and triggers (gdc_launch_dependents) only after a wait, so the two-kernels-back
// rule above holds across them as long as every one of them waits somewhere -- a Triton kernel
// that never waited could complete before its predecessor.  tests/test_generate.py checks that
// every PDL-launched Triton kernel of the compiled AR and DDTree steps calls gdc_wait.
// Both instructions are no-ops in a normal launch.  Whether the kernels launch with PDL is one
// process-wide option, launch_pdl(), set from Python (torch_kdtree.envs' KDTREE_PDL at import,
// torch_kdtree.ops.set_pdl later) and read at each launch, so a CUDA graph keeps the value it was
// captured with.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace kdtree {

// Whether our kernels launch with programmatic dependent launch (bindings.cpp holds the option;
// kdtree::_set_launch_options sets it).
bool launch_pdl();

namespace {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A model weight's fp32 value loaded before pdl_wait: a coherent ld.global (volatile), which ptxas
// keeps before griddepcontrol.wait (bf16_vec.cuh's ld_stream_early says why).  Weights only.
__device__ __forceinline__ float ld_early_f32(const float* p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Fetch the 128-byte line holding p into L2 (no register result, no L1 allocation).
__device__ __forceinline__ void l2_prefetch(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The lanes of a warp prefetch `bytes` bytes from p into L2, one 128-byte line per lane per step.
__device__ __forceinline__ void l2_prefetch_range(const void* p, int64_t bytes, int lane) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = int64_t(lane) * 128; off < bytes; off += 32 * 128) l2_prefetch(c + off);
}

// Raises kernel's limit on dynamic shared memory (cudaFuncAttributeMaxDynamicSharedMemorySize) on
// the current device to at least `bytes`, and never lowers it.  Setting it to each launch's own size
// lowered it again after a larger launch of the same kernel that a CUDA graph still held; a profiler
// replaying that launch then failed it (ncu: "LaunchFailed" on gemv's dense down projection, whose
// input row is longer than the next layers').  Only the first call per (device, kernel, size above
// the last) reaches the driver.
template <typename... Params>
void raise_dynamic_smem(void (*kernel)(Params...), int bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> limit;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mu);
  int& current = limit[{device, reinterpret_cast<const void*>(kernel)}];
  if (bytes <= current) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  current = bytes;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl is true and
// thread-block clusters of `cluster` blocks when that is not (1, 1, 1).
template <typename... Params, typename... Args>
void launch_kernel_ex(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, size_t smem,
                      cudaStream_t stream, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   Args... args) {
  launch_kernel_ex(kernel, grid, block, dim3(1, 1, 1), smem, stream, pdl, args...);
}

}  // namespace
}  // namespace kdtree
