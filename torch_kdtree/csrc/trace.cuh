// Phase stamps for kernel timelines, a diagnostic build only (KDTREE_TRACE=1 at build time,
// setup.py; tools/trace_decode.py reads them).  In a normal build the stamps compile to nothing and
// no kernel's parameters change.
//
// Each traced launch gets a record of kTraceMaxBlocks x kTraceStamps uint64: thread 0 of block b
// writes, at phase i of its kernel, %globaltimer (ns, comparable across SMs and kernels) at
// [b][2 i] and its SM's clock64 at [b][2 i + 1].  Records are handed out by the host in launch
// order (a launch captured in a CUDA graph keeps its record, so each replay overwrites it); the
// host keeps each record's kernel kind and grid.  kdtree::_trace (bindings.cpp) returns them.
#pragma once

#include <cstdint>

namespace kdtree {

constexpr int kTraceMaxBlocks = 1024;
constexpr int kTracePhases = 12;
constexpr int kTraceStamps = 2 * kTracePhases;

enum TraceKind : int {
  kTraceGemv = 1,
  kTraceMlaDecode = 2,
  kTraceMoeRoute = 3,
  kTraceMoeGateUp = 4,
  kTraceMoeDown = 5,
  kTraceInt4Up = 6,
  kTraceInt4Down = 7
};

#ifdef KDTREE_TRACE
// This launch's record (nullptr once every record is taken); allocated on the first call, which
// must come before any CUDA-graph capture.
uint64_t* trace_record(int kind, unsigned grid_x, unsigned grid_y);

__device__ __forceinline__ void trace_stamp(uint64_t* rec, int phase) {
  if (rec == nullptr || threadIdx.x != 0) return;
  const unsigned b = blockIdx.x + gridDim.x * blockIdx.y;
  if (b >= unsigned(kTraceMaxBlocks)) return;
  uint64_t g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g)::"memory");
  const long long c = clock64();
  rec[b * kTraceStamps + 2 * phase] = g;
  rec[b * kTraceStamps + 2 * phase + 1] = uint64_t(c);
}
#define KD_TRACE(rec, phase) ::kdtree::trace_stamp((rec), (phase))
#define KD_TRACE_FIELD uint64_t* trace = nullptr;
#define KD_TRACE_SET(p, kind, grid) ((p).trace = ::kdtree::trace_record((kind), (grid).x, (grid).y))
// for kernels with plain argument lists: a last parameter `trace` and its launch argument
#define KD_TRACE_PARAM , uint64_t* trace
#define KD_TRACE_ARG(kind, grid) , ::kdtree::trace_record((kind), (grid).x, (grid).y)
#else
#define KD_TRACE(rec, phase) ((void)0)
#define KD_TRACE_FIELD
#define KD_TRACE_SET(p, kind, grid) ((void)0)
#define KD_TRACE_PARAM
#define KD_TRACE_ARG(kind, grid)
#endif

}  // namespace kdtree
