// kdtree::moe_gemv: routed experts with bf16 weights for decode-sized token counts (semantics,
// rounding points and the reference: torch_kdtree/ops/moe_gemv.py).
//
// A handful of tokens touch k experts each, so the work is reading those experts' weights once:
// a GEMV per (token, slot), bound by HBM.  Two launches, both with shapes from static sizes only
// (CUDA-graph safe), no atomics, fixed summation orders (deterministic):
//   1. gate/up: grid (ceil(max(I, Is) / 8), T·k [+ T]); warp = one channel i of one slot: the dot
//      products of gate row i and up row i of expert ids[slot] (or of the shared expert, slots
//      T·k + t) with x[token] (16-byte streaming loads along H, eight chunks of each row in flight
//      per lane), a xor-shuffle sum, then act[slot, i] = bf16(silu(bf16(g)) · bf16(u)).
//   2. down: grid (ceil(H / 8), T); warp = one output row h of one token: each lane sums
//      w_j · (its chunks of down row h of expert e_j · act[slot j]) over the slots, four slots'
//      rows in flight at a time (the shared expert's first chunks loaded up front), then one
//      xor-shuffle sum: out = bf16(Σ_j w_j · y_j [+ y_shared]) in fp32 [then bf16(residual + out)].
// Both launches use programmatic dependent launch (pdl.cuh).  Before its wait, gate/up prefetches
// the shared expert's rows into L2; when the caller passes route_logits (x was complete before the
// kdtree::moe_route launched just before this op, which chose the routing from those logits: the
// model's router gemv, then moe_route), the shared expert's blocks instead come first in the grid
// and run whole before the wait.  Before its wait, down prefetches the shared expert's row into
// L2; it reads the routing after the wait (moe_down_kernel says why).
// Ids outside [0, E) contribute nothing (eager calls reject them first): nothing is read out of
// bounds.  Needs H and I multiples of 8 (16-byte rows); no tensor cores (a GEMV has nothing to
// reuse), so the same code runs on sm_90 and sm_120.
#include "bf16_vec.cuh"
#include "check.h"
#include "pdl.cuh"
#include "trace.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace kdtree {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxTopk = 16;
constexpr int kSlotBatch = 4;  // down: slots whose rows a warp streams together
constexpr int kSharedBatch = 2;  // down: 16-byte chunks per lane of the shared expert's row loaded up front

// NB 16-byte chunks (c, c + 32, ...) of a gate row and an up row against x: all loads first.
// kCg: x through L2 (ld.global.cg), for blocks that read it before their programmatic-launch wait.
template <int NB, bool kCg = false>
__device__ __forceinline__ void gate_up_chunks(const uint4* gr, const uint4* ur, const uint4* xr, int c, float& g,
                                               float& u) {
  uint4 gv[NB], uv[NB], xv[NB];
#pragma unroll
  for (int s = 0; s < NB; ++s) {
    gv[s] = ld_stream(gr + c + 32 * s);
    uv[s] = ld_stream(ur + c + 32 * s);
  }
#pragma unroll
  for (int s = 0; s < NB; ++s) xv[s] = kCg ? __ldcg(xr + c + 32 * s) : __ldg(xr + c + 32 * s);
  // A memory barrier for the warp's loads: ptxas cannot sink a load below it, so all 3·NB loads
  // are in flight together (without it, it interleaved them with the FMAs of earlier chunks,
  // about two weight loads in flight per lane).  The lanes of a short last batch diverge (the
  // loops' bounds depend on the lane), hence the active mask.  Without it: 2p2b's decode step 0.6265
  // against 0.6183 ms (RESULTS.md run 84).
  __syncwarp(__activemask());
#pragma unroll
  for (int s = 0; s < NB; ++s) {
    g = dot8(gv[s], xv[s], g);
    u = dot8(uv[s], xv[s], u);
  }
}

// Slots 0 .. T·k - 1 are the routed (token, slot) pairs; with a shared expert, slots T·k + t are
// token t's shared expert (weights [Is, H], activations after the routed ones in act).
// shared_first (the caller's route_logits, with a shared expert): x was complete before the previous
// kernel (moe_route) let this grid launch, so the shared expert's blocks need nothing from that
// kernel.  They are then grid rows 0 .. T - 1 (dispatched first) and run whole without the
// programmatic-launch wait, beside moe_route, reading x through L2, and exit (freeing their slots
// for the routed blocks).  Writing act before the wait is safe because act is new memory the op
// allocated while the caller held moe_route's logits: moe_route reads only those and its bias (a
// weight), and everything before it is complete.  The routed slots follow as grid rows
// T .. T·k + T - 1.  The same arithmetic either way (the same bits).
// bench/RESULTS.md runs 148-149: waiting before the write (the blocks holding their slots until
// moe_route ends) was slower than not starting early at all; without the wait, 1.4 % faster on 2p2b.
__global__ void __launch_bounds__(kThreads)
moe_gate_up_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ gate,
                   const __nv_bfloat16* __restrict__ up, const int32_t* __restrict__ ids, int k, int E, int H,
                   int I, const __nv_bfloat16* __restrict__ shared_gate, const __nv_bfloat16* __restrict__ shared_up,
                   int Is, int T, bool shared_first, __nv_bfloat16* __restrict__ act KD_TRACE_PARAM) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  KD_TRACE(trace, 0);
  const int y = blockIdx.y;
  const bool is_shared = shared_first ? y < T : y >= T * k;
  const int slot = shared_first ? (is_shared ? T * k + y : y - T) : y;
  const int t = is_shared ? slot - T * k : slot / k;
  const int rows = is_shared ? Is : I;
  const int i = blockIdx.x * kWarps + warp;
  const bool now = shared_first && is_shared;  // x is complete already: no wait
  // Before the predecessor (the router) is done: only the shared expert's rows into L2.
  if (is_shared && !now && i < rows) {
    l2_prefetch_range(shared_gate + int64_t(i) * H, int64_t(H) * 2, lane);
    l2_prefetch_range(shared_up + int64_t(i) * H, int64_t(H) * 2, lane);
  }
  KD_TRACE(trace, 1);
  if (!now) pdl_wait();
  KD_TRACE(trace, 2);
  pdl_launch_dependents();
  if (i >= rows) return;
  const int e = is_shared ? 0 : ids[slot];
  float g = 0.f, u = 0.f;
  if (is_shared || (e >= 0 && e < E)) {
    const int chunks = H / 8;
    const uint4* xr = reinterpret_cast<const uint4*>(x + int64_t(t) * H);
    const int64_t row = is_shared ? int64_t(i) * H : (int64_t(e) * I + i) * H;
    const uint4* gr = reinterpret_cast<const uint4*>((is_shared ? shared_gate : gate) + row);
    const uint4* ur = reinterpret_cast<const uint4*>((is_shared ? shared_up : up) + row);
    auto dots = [&](auto cg) {
      constexpr bool kCg = decltype(cg)::value;
      int c = lane;
      for (; c + 32 * 7 < chunks; c += 32 * 8) gate_up_chunks<8, kCg>(gr, ur, xr, c, g, u);
      for (; c + 32 * 3 < chunks; c += 32 * 4) gate_up_chunks<4, kCg>(gr, ur, xr, c, g, u);
      for (; c < chunks; c += 32) gate_up_chunks<1, kCg>(gr, ur, xr, c, g, u);
    };
    if (now)
      dots(std::true_type{});
    else
      dots(std::false_type{});
  }
  KD_TRACE(trace, 3);
  g = warp_sum(g);
  u = warp_sum(u);
  if (lane == 0) {
    const float gb = round_bf16(g), ub = round_bf16(u);
    const int64_t at = is_shared ? int64_t(T) * k * I + int64_t(t) * Is + i : int64_t(slot) * I + i;
    act[at] = __float2bfloat16(silu_mul(gb, ub));
  }
  KD_TRACE(trace, 4);
}

// The routing is read after the programmatic-launch wait: before it only the shared expert's row is
// prefetched into L2, and the routed rows stream whole in the slot loop.
// - Why: in 2p2b's traces (runs 128, 138) the early route's pre-wait part -- the ids' L2 round trip,
//   the routed rows' L2 prefetch and first chunks into registers -- took 2.5-3.6 us beside gate/up's
//   streaming while the wait then returned at once, so it sat on the critical path.
// - Run 141 (H200, 2p2b, interleaved ab twice): late route 0.5482 / 0.5480 ms a step against
//   0.5517 / 0.5504 early, the same tokens; capped at 96 registers (one q_a + kv_a gemv block beside
//   two down blocks) it was 0.5498 / 0.5495, not kept.
// - At most 128 registers (two blocks of kThreads per SM: H / 8 blocks per token in one wave; it
//   takes 106 on sm_90, 108 on sm_120, no spills).  __maxnreg__ rather than
//   __launch_bounds__(kThreads, 2): the SASS is then the one run 141 measured.
__global__ void __maxnreg__(128)
moe_down_kernel(const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ down,
                const int32_t* __restrict__ ids, const float* __restrict__ weights, int k, int E, int H, int I,
                const __nv_bfloat16* __restrict__ shared_down, int Is, int T,
                const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ out KD_TRACE_PARAM) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  KD_TRACE(trace, 0);
  const int t = blockIdx.y, h = blockIdx.x * kWarps + warp;
  const int chunks = I / 8, schunks = Is / 8;
  const uint4* sr = shared_down != nullptr ? reinterpret_cast<const uint4*>(shared_down + int64_t(h) * Is) : nullptr;
  // Before gate/up is done: the shared expert's row into L2.
  if (h < H && sr != nullptr) l2_prefetch_range(shared_down + int64_t(h) * Is, int64_t(Is) * 2, lane);
  KD_TRACE(trace, 1);
  pdl_wait();
  KD_TRACE(trace, 2);
  pdl_launch_dependents();
  if (h >= H) return;
  // The shared expert's first kSharedBatch chunks per lane; the routed rows stream whole in the slot loop.
  uint4 sw[kSharedBatch];
  if (sr != nullptr) {
#pragma unroll
    for (int q = 0; q < kSharedBatch; ++q)
      if (lane + 32 * q < schunks) sw[q] = ld_stream(sr + lane + 32 * q);
  }
  float acc = 0.f;
  // The shared expert (weight 1): its first kSharedBatch chunks per lane in flight with the
  // routed slots' loads, the rest (Is > 256 · kSharedBatch) after them.
  float sd = 0.f;
  uint4 sa[kSharedBatch];
  const uint4* sar = nullptr;
  if (shared_down != nullptr) {
    sar = reinterpret_cast<const uint4*>(act + int64_t(T) * k * I + int64_t(t) * Is);
#pragma unroll
    for (int q = 0; q < kSharedBatch; ++q)
      if (lane + 32 * q < schunks) sa[q] = __ldg(sar + lane + 32 * q);
  }
  for (int j0 = 0; j0 < k; j0 += kSlotBatch) {  // kSlotBatch slots' rows in flight together
    const uint4* wr[kSlotBatch];
    const uint4* ar[kSlotBatch];
    float wj[kSlotBatch], d[kSlotBatch];
    bool ok[kSlotBatch];
#pragma unroll
    for (int q = 0; q < kSlotBatch; ++q) {
      const int j = j0 + q, slot = t * k + j;
      const int e = j < k ? ids[slot] : -1;
      ok[q] = e >= 0 && e < E;
      wj[q] = ok[q] ? weights[slot] : 0.f;
      wr[q] = reinterpret_cast<const uint4*>(down + (int64_t(ok[q] ? e : 0) * H + h) * I);
      ar[q] = reinterpret_cast<const uint4*>(act + int64_t(ok[q] ? slot : 0) * I);
      d[q] = 0.f;
    }
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
      uint4 wv[kSlotBatch], av[kSlotBatch];
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q)
        if (ok[q]) wv[q] = ld_stream(wr[q] + c);
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q)
        if (ok[q]) av[q] = __ldg(ar[q] + c);
#pragma unroll
      for (int q = 0; q < kSlotBatch; ++q)
        if (ok[q]) d[q] = dot8(wv[q], av[q], d[q]);
    }
#pragma unroll
    for (int q = 0; q < kSlotBatch; ++q) acc = fmaf(wj[q], d[q], acc);
  }
  if (shared_down != nullptr) {
#pragma unroll
    for (int q = 0; q < kSharedBatch; ++q)
      if (lane + 32 * q < schunks) sd = dot8(sw[q], sa[q], sd);
    for (int c = lane + 32 * kSharedBatch; c < schunks; c += 32) sd = dot8(ld_stream(sr + c), __ldg(sar + c), sd);
    acc += sd;
  }
  KD_TRACE(trace, 3);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t at = int64_t(t) * H + h;
    float y = acc;
    if (residual != nullptr) y = round_bf16(acc) + __bfloat162float(residual[at]);
    out[at] = __float2bfloat16(y);
  }
  KD_TRACE(trace, 4);
}

at::Tensor moe_gemv_cuda(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                         const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         const std::optional<at::Tensor>& shared_gate, const std::optional<at::Tensor>& shared_up,
                         const std::optional<at::Tensor>& shared_down, const std::optional<at::Tensor>& residual,
                         const std::optional<at::Tensor>& route_logits) {
  constexpr const char* op = "kdtree::moe_gemv";
  check_cuda_tensor(x, op, "x", at::kBFloat16, 2);
  check_cuda_tensor(gate, op, "gate_proj", at::kBFloat16, 3);
  check_cuda_tensor(up, op, "up_proj", at::kBFloat16, 3);
  check_cuda_tensor(down, op, "down_proj", at::kBFloat16, 3);
  check_cuda_tensor(topk_ids, op, "topk_ids", at::kInt, 2);
  check_cuda_tensor(topk_weights, op, "topk_weights", at::kFloat, 2);
  for (const at::Tensor* t : {&gate, &up, &down, &topk_ids, &topk_weights})
    KD_CHECK(t->device() == x.device(), op, ": all inputs must be on one device");
  check_route_logits(op, route_logits, x, topk_ids);
  const int64_t T = x.size(0), H = x.size(1), E = gate.size(0), I = gate.size(1);
  KD_CHECK(gate.size(2) == H && up.sizes() == gate.sizes(), op, ": gate_proj and up_proj must be [E, I, H = ", H,
           "], got ", gate.sizes(), " and ", up.sizes());
  KD_CHECK(down.size(0) == E && down.size(1) == H && down.size(2) == I, op, ": down_proj must be [E, H, I] = [", E,
           ", ", H, ", ", I, "], got ", down.sizes());
  KD_CHECK(H % 8 == 0 && I % 8 == 0 && H > 0 && I > 0 && E > 0, op,
           ": H and I must be positive multiples of 8 and E >= 1, got H = ", H, ", I = ", I, ", E = ", E);
  KD_CHECK(topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(), op, ": topk_ids ", topk_ids.sizes(),
           " and topk_weights ", topk_weights.sizes(), " must both be [T = ", T, ", k]");
  const int64_t k = topk_ids.size(1);
  KD_CHECK(k >= 1 && k <= kMaxTopk, op, ": top-k must be in [1, ", kMaxTopk, "], got ", k);
  KD_CHECK(T <= 65535 && T * k <= 65535 && E * I * H < (int64_t(1) << 40), op,
           ": at most 65535 tokens and token-slots, got T = ", T, ", k = ", k);
  for (const at::Tensor* t : {&x, &gate, &up, &down})
    KD_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op,
             ": x, gate_proj, up_proj and down_proj must be 16-byte aligned");
  const int64_t Is = check_shared_expert(op, x, shared_gate, shared_up, shared_down, residual);
  const bool has_shared = Is > 0;
  KD_CHECK(T * (k + 1) <= 65535 || !has_shared, op, ": at most 65535 token-slots with the shared expert, got T = ", T);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // allocated while the caller holds route_logits (when given): see moe_gate_up_kernel's shared_first
  at::Tensor act = at::empty({T * k * I + T * Is}, x.options());
  const auto* sg = has_shared ? reinterpret_cast<const __nv_bfloat16*>(shared_gate->data_ptr()) : nullptr;
  const auto* su = has_shared ? reinterpret_cast<const __nv_bfloat16*>(shared_up->data_ptr()) : nullptr;
  const auto* sdp = has_shared ? reinterpret_cast<const __nv_bfloat16*>(shared_down->data_ptr()) : nullptr;
  const int64_t gu_rows = std::max(I, Is);
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  auto* actp = reinterpret_cast<__nv_bfloat16*>(act.data_ptr());
  const int32_t* idp = topk_ids.data_ptr<int32_t>();
  const bool pdl = launch_pdl();
  const dim3 gu_grid(unsigned((gu_rows + kWarps - 1) / kWarps), unsigned(T * k + (has_shared ? T : 0)));
  launch_kernel(moe_gate_up_kernel, gu_grid,
                dim3(kThreads), 0, stream, pdl, xp, reinterpret_cast<const __nv_bfloat16*>(gate.data_ptr()),
                reinterpret_cast<const __nv_bfloat16*>(up.data_ptr()), idp, int(k), int(E), int(H), int(I), sg, su,
                int(Is), int(T), has_shared && route_logits.has_value(), actp KD_TRACE_ARG(kTraceMoeGateUp, gu_grid));
  const dim3 down_grid(unsigned((H + kWarps - 1) / kWarps), unsigned(T));
  launch_kernel(moe_down_kernel, down_grid, dim3(kThreads), 0, stream, pdl,
                static_cast<const __nv_bfloat16*>(actp), reinterpret_cast<const __nv_bfloat16*>(down.data_ptr()), idp,
                topk_weights.data_ptr<float>(), int(k), int(E), int(H), int(I), sdp, int(Is), int(T),
                residual.has_value() ? reinterpret_cast<const __nv_bfloat16*>(residual->data_ptr()) : nullptr,
                reinterpret_cast<__nv_bfloat16*>(out.data_ptr()) KD_TRACE_ARG(kTraceMoeDown, down_grid));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("moe_gemv", &moe_gemv_cuda); }

}  // namespace kdtree
