// int4_moe's decode path (moe_decode.cu), called by run_moe in moe.cu.
#pragma once

#include <cuda_bf16.h>
#include <vector_types.h>

#include <cstdint>

namespace kdtree {

// T · k at most this: two GEMV launches.  On the H200 they beat the grouped path for the K2 TP-8
// rank at T = 1, 2 and 4 (15.7 vs 25.1, 24.8 vs 37.2, 45.1 vs 55.5 us; bench/RESULTS.md run 45).
constexpr int64_t kInt4DecodeMaxSlots = 32;
constexpr int64_t kInt4DecodeMaxBytes = 32 * 1024;  // shared memory for a token's x (H) or k · I activations

// Optional parts of a decode-path call: a bf16 shared expert (weight 1; all three or none) gate /
// up [Is, H], down [H, Is] with its activations act_s [T, Is], and a residual [T, H] added after
// rounding (out = bf16(residual + bf16(routed sum + shared))).
struct Int4DecodeExtra {
  const __nv_bfloat16* shared_gate = nullptr;
  const __nv_bfloat16* shared_up = nullptr;
  const __nv_bfloat16* shared_down = nullptr;
  int64_t Is = 0;
  __nv_bfloat16* act_s = nullptr;
  const __nv_bfloat16* residual = nullptr;
};

struct Int4DecodeArgs {
  const __nv_bfloat16* x;     // [T, H]
  const uint4* w13q;          // [E, 2 I / 16, H / 64, 32] (16-byte units of the kernel layout)
  const __nv_bfloat16* w13s;  // [E, 2 I / 16, H / group, 16]
  const uint4* w2q;           // [E, H / 16, I / 64, 32]
  const __nv_bfloat16* w2s;   // [E, H / 16, I / group, 16]
  const void* topk_ids;       // [T, topk] int32 or int64
  const float* topk_weights;  // [T, topk]
  const int32_t* emap;        // [num_global] or null
  int64_t T, topk, H, I, E, num_global, group_size;
  __nv_bfloat16* act;         // [T · topk, I] (the workspace's act region)
  __nv_bfloat16* out;         // [T, H]
  Int4DecodeExtra extra;      // optional shared expert and residual
};

// Whether a call of this shape takes the decode path (shape only, so CUDA-graph safe).
bool int4_decode_applies(int64_t T, int64_t topk, int64_t H, int64_t I);

void int4_moe_decode(const Int4DecodeArgs& args, bool ids_int64);

}  // namespace kdtree
