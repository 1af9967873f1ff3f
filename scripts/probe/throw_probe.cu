#include <ATen/ATen.h>
#include <torch/library.h>
namespace { constexpr int kMax = 5;
at::Tensor f(const at::Tensor& x, int64_t b) { TORCH_CHECK(b <= kMax, "budget must be in [1, ", kMax, "], got ", b); return x + 1; } }
TORCH_LIBRARY(thr, m) { m.def("f(Tensor x, int b) -> Tensor"); }
TORCH_LIBRARY_IMPL(thr, CPU, m) { m.impl("f", &f); }
