// KD_CHECK: TORCH_CHECK without std::ostream.
//
// On the lent H200 image (torch 2.11) an extension built there crashed inside
// std::basic_ostream::_M_insert<long> the first time a TORCH_CHECK message formatted a number
// (the locale facets of the libstdc++ the process loaded do not match the headers the extension
// was compiled with).  These checks build their message with std::to_string and plain string
// appends, which touch no locale, and throw c10::Error (Python RuntimeError) directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace kdtree {
namespace detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    s += v ? "true" : "false";
  } else {
    s += std::to_string(v);
  }
}

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace detail
}  // namespace kdtree

#define KD_CHECK(cond, ...)                                                                           \
  do {                                                                                                \
    if (C10_UNLIKELY(!(cond))) {                                                                      \
      throw ::c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},                       \
                         ::kdtree::detail::cat(__VA_ARGS__));                                         \
    }                                                                                                 \
  } while (0)

namespace kdtree {

// The structural checks every CUDA entry point makes on a tensor argument of `op`.
inline void check_cuda_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int dim) {
  KD_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
  KD_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  KD_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
  KD_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The optional bf16 shared expert of moe_gemv / int4_moe (all three or none: gate / up [Is, H],
// down [H, Is], Is a positive multiple of 8, 16-byte aligned, on x's device) and the optional bf16
// residual [T, H] on x's device.  Returns Is (0 without a shared expert).
inline int64_t check_shared_expert(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& gate,
                                   const std::optional<at::Tensor>& up, const std::optional<at::Tensor>& down,
                                   const std::optional<at::Tensor>& residual) {
  const int64_t T = x.size(0), H = x.size(1);
  int64_t Is = 0;
  if (gate.has_value() || up.has_value() || down.has_value()) {
    KD_CHECK(gate.has_value() && up.has_value() && down.has_value(), op,
             ": shared_gate, shared_up and shared_down come together");
    check_cuda_tensor(*gate, op, "shared_gate", at::kBFloat16, 2);
    check_cuda_tensor(*up, op, "shared_up", at::kBFloat16, 2);
    check_cuda_tensor(*down, op, "shared_down", at::kBFloat16, 2);
    Is = gate->size(0);
    KD_CHECK(gate->size(1) == H && up->sizes() == gate->sizes() && down->size(0) == H && down->size(1) == Is &&
                 Is > 0 && Is % 8 == 0,
             op, ": shared_gate / shared_up must be [Is, H = ", H, "] and shared_down [H, Is] with Is a positive "
             "multiple of 8, got ", gate->sizes(), ", ", up->sizes(), ", ", down->sizes());
    for (const at::Tensor* t : {&*gate, &*up, &*down}) {
      KD_CHECK(t->device() == x.device(), op, ": all inputs must be on one device");
      KD_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, ": the shared expert's weights must be "
               "16-byte aligned");
    }
  }
  if (residual.has_value()) {
    check_cuda_tensor(*residual, op, "residual", at::kBFloat16, 2);
    KD_CHECK(residual->size(0) == T && residual->size(1) == H && residual->device() == x.device(), op,
             ": residual must be [T, H] = [", T, ", ", H, "] on x's device, got ", residual->sizes());
  }
  return Is;
}

// The optional route_logits of moe_gemv (a launch-order hint, ops/moe_gemv.py): the fp32
// logits [T, E] kdtree::moe_route chose topk_ids from, on x's device.
inline void check_route_logits(const char* op, const std::optional<at::Tensor>& logits, const at::Tensor& x,
                               const at::Tensor& topk_ids) {
  if (!logits.has_value()) return;
  KD_CHECK(logits->is_cuda() && logits->device() == x.device(), op, ": route_logits must be on x's device, got ",
           logits->device());
  KD_CHECK(logits->scalar_type() == at::kFloat && logits->dim() == 2 && logits->size(0) == topk_ids.size(0), op,
           ": route_logits must be float32 [T = ", topk_ids.size(0), ", E] (moe_route's logits), got ",
           logits->scalar_type(), " ", logits->sizes());
}

}  // namespace kdtree
