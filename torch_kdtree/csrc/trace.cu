// The host side of trace.cuh: the record buffer and kdtree::_trace (a KDTREE_TRACE build only).
#ifdef KDTREE_TRACE
#include "trace.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <mutex>
#include <tuple>
#include <vector>

namespace kdtree {
namespace {

constexpr int64_t kTraceRecords = 1024;
constexpr int64_t kRecordWords = int64_t(kTraceMaxBlocks) * kTraceStamps;
constexpr size_t kBufferBytes = size_t(kTraceRecords * kRecordWords * 8);

struct TraceState {
  std::mutex mu;
  uint64_t* buf = nullptr;
  std::vector<int64_t> meta;  // per record: kind, grid x, grid y
};

TraceState& state() {
  static TraceState s;
  return s;
}

}  // namespace

// mode 1: zero every record (the records stay assigned).  Returns the stamps
// [records, kTraceMaxBlocks, kTraceStamps] and the records' kind and grid [records, 3], int64 on the CPU.
std::tuple<at::Tensor, at::Tensor> trace_take(int64_t mode) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t n = int64_t(s.meta.size()) / 3;
  at::Tensor stamps = at::zeros({n, kTraceMaxBlocks, kTraceStamps}, at::kLong);
  at::Tensor meta = at::empty({n, 3}, at::kLong);
  for (int64_t i = 0; i < 3 * n; ++i) meta.data_ptr<int64_t>()[i] = s.meta[size_t(i)];
  if (s.buf != nullptr) {
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    if (mode == 1) {
      C10_CUDA_CHECK(cudaMemset(s.buf, 0, kBufferBytes));
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    } else if (n > 0) {
      C10_CUDA_CHECK(cudaMemcpy(stamps.data_ptr(), s.buf, size_t(n * kRecordWords * 8), cudaMemcpyDeviceToHost));
    }
  }
  return {stamps, meta};
}

uint64_t* trace_record(int kind, unsigned grid_x, unsigned grid_y) {
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.buf == nullptr) {
    C10_CUDA_CHECK(cudaMalloc(&s.buf, kBufferBytes));
    C10_CUDA_CHECK(cudaMemset(s.buf, 0, kBufferBytes));
  }
  const int64_t i = int64_t(s.meta.size()) / 3;
  if (i >= kTraceRecords) return nullptr;
  s.meta.insert(s.meta.end(), {int64_t(kind), int64_t(grid_x), int64_t(grid_y)});
  return s.buf + i * kRecordWords;
}

}  // namespace kdtree
#endif
