"""Does compute-sanitizer racecheck understand a partial named barrier next to __syncthreads?

ddtree_build's kernel (csrc/ddtree_build.cu) has 8 warps build the tree in shared memory with a
named barrier (``bar.sync 1, 256``) while 8 other warps clear global memory, then a block-wide
``__syncthreads()`` before every thread reads what the builders wrote.  Racecheck (run 11)
reported hazards between those writes and reads.  This kernel has exactly that barrier pattern
and nothing else; it is race-free by construction, so a hazard reported here is racecheck's.

Run (GPU):  compute-sanitizer --tool racecheck python tools/racecheck_named_barrier.py
"""
import torch
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
__global__ void pattern(int* out, int n_clear) {
  __shared__ int data[512];
  if (threadIdx.x < 256) {
    data[threadIdx.x] = threadIdx.x;                      // builders write ...
    asm volatile("bar.sync 1, 256;" ::: "memory");         // ... sync among themselves ...
    data[256 + threadIdx.x] = data[255 - threadIdx.x] + 1;  // ... and write again
  } else {
    for (int i = threadIdx.x - 256; i < n_clear; i += 256) out[512 + i] = 0;  // clearers
  }
  __syncthreads();
  out[threadIdx.x] = data[(threadIdx.x * 7) % 512];        // everyone reads the builders' data
}
torch::Tensor run(int64_t n_clear) {
  auto out = torch::empty({512 + n_clear}, torch::dtype(torch::kInt).device(torch::kCUDA));
  pattern<<<4, 512>>>(out.data_ptr<int>(), int(n_clear));
  return out;
}
"""


def main():
    ext = load_inline("racecheck_named_barrier", cpp_sources="torch::Tensor run(int64_t n_clear);",
                      cuda_sources=CUDA, functions=["run"], verbose=False)
    out = ext.run(1 << 16).cpu()
    data = list(range(256)) + [256 - i for i in range(256)]  # data[256 + t] = (255 - t) + 1
    want = torch.tensor([data[(t * 7) % 512] for t in range(512)], dtype=torch.int32)
    assert torch.equal(out[:512], want) and not out[512:].any()
    print("ok")


if __name__ == "__main__":
    main()
