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

}  // namespace kdtree
