// noaux_tc expert selection of one token by one block (thread e = expert e), shared by
// kdtree::moe_route (moe_route.cu: from logits) and kdtree::moe_router (moe_router.cu: RMSNorm +
// router GEMV + this, in one launch).  Semantics: torch_kdtree/ops/moe_route.py.
#pragma once

#include "check.h"
#include "warp_reduce.cuh"

#include <cmath>
#include <cstdint>

namespace kdtree {
namespace {

constexpr int kRouteMaxExperts = 1024;
constexpr int kRouteMaxTopk = 32;
constexpr int kRouteMaxGroups = 64;

// The routing arguments both ops take (E experts): clear errors before any launch.
inline void check_route_args(const char* op, int64_t E, int64_t top_k, int64_t n_group, int64_t topk_group) {
  KD_CHECK(E >= 1 && E <= kRouteMaxExperts, op, ": E must be in [1, ", kRouteMaxExperts, "], got ", E);
  KD_CHECK(top_k >= 1 && top_k <= kRouteMaxTopk && top_k <= E, op, ": top_k must be in [1, min(", kRouteMaxTopk,
           ", E)], got ", top_k);
  KD_CHECK(n_group >= 1 && n_group <= kRouteMaxGroups && E % n_group == 0, op,
           ": n_group must divide E and be in [1, ", kRouteMaxGroups, "], got ", n_group);
  KD_CHECK(n_group == 1 || (E / n_group >= 2 && topk_group >= 1 && topk_group <= n_group &&
                            topk_group * (E / n_group) >= top_k),
           op, ": with n_group > 1, groups need >= 2 experts and topk_group in [1, n_group] keeping >= top_k "
           "experts, got n_group = ", n_group, ", topk_group = ", topk_group);
}

struct RouteSmem {
  float score[kRouteMaxExperts];
  float choice[kRouteMaxExperts];
  float cand[kRouteMaxExperts];         // the candidates' choices, in expert order
  float warp_top[kRouteMaxExperts / 32];
  int warp_count[kRouteMaxExperts / 32];
  float bound;
  float group_score[kRouteMaxGroups];
  bool keep[kRouteMaxGroups];
  int sel_id[kRouteMaxTopk];
};

// Entries of v[0 .. n) that beat v[i]: larger, or equal at a lower index (a total order, so ranks
// are distinct).
__device__ __forceinline__ int rank_of(const float* v, int n, int i) {
  const float mine = v[i];
  int rank = 0;
  for (int j = 0; j < n; ++j) rank += (v[j] > mine) || (v[j] == mine && j < i);
  return rank;
}

// Called by every thread of a block with blockDim.x >= max(E, n_group); thread e passes expert e's
// logit and correction bias (ignored for e >= E).  Writes ids_row[0 .. k) and weights_row[0 .. k);
// ends unsynchronised after warp 0's reads and writes (callers __syncthreads() before reusing sm).
//   1. thread e: score = sigmoid(logit) (fp32, expf), choice = score + bias (NaN -> -inf);
//   2. with n_group > 1: thread g sums its group's two largest choices, ranks the groups (ties:
//      lower group first) and the experts of groups outside the best topk_group get -inf;
//   3. the top-k, largest first (ties: lower id first), by ranks among candidates: the warps'
//      largest choices are distinct experts, so the k-th largest of them (or -inf with fewer than k
//      warps) is a lower bound of the k-th largest choice, and only the experts at or above it can
//      rank below k.  They are compacted in expert order (ballots); each counts the candidates
//      that beat it, which are exactly the experts that do (a thread per expert counting all E
//      took ~9 us at E = 384 on the H200, an L1 round trip per expert);
//   4. warp 0, lane j: w_j = score[id_j] (/ Σ_j w_j + 1e-20 when renormalising) · scaling, the sum
//      taken in slot order by every lane (a thread 0 doing all k took ~0.5 us of dependent
//      shared-memory loads).
__device__ __forceinline__ void route_select(float logit, float bias, int E, int k, int n_group,
                                             int topk_group, bool renormalize, float scaling,
                                             int32_t* __restrict__ ids_row, float* __restrict__ weights_row,
                                             RouteSmem& sm) {
  const int e = threadIdx.x;
  if (e < E) {
    const float s = 1.f / (1.f + expf(-logit));
    const float c = s + bias;
    sm.score[e] = s;
    sm.choice[e] = isnan(c) ? -INFINITY : c;
  }
  __syncthreads();
  if (n_group > 1) {
    const int gsize = E / n_group;
    if (e < n_group) {
      float a = -INFINITY, b = -INFINITY;  // the two largest of the group, a >= b
      for (int j = e * gsize; j < (e + 1) * gsize; ++j) {
        const float v = sm.choice[j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      sm.group_score[e] = a + b;
    }
    __syncthreads();
    if (e < n_group) sm.keep[e] = rank_of(sm.group_score, n_group, e) < topk_group;
    __syncthreads();
    if (e < E && !sm.keep[e / gsize]) sm.choice[e] = -INFINITY;
    __syncthreads();
  }
  const int lane = e & 31, warp = e >> 5, warps = blockDim.x >> 5;
  const float c = e < E ? sm.choice[e] : -INFINITY;
  const float top = warp_max(c);
  if (lane == 0) sm.warp_top[warp] = top;
  if (e == 0) sm.bound = -INFINITY;  // fewer than k warps: every expert is a candidate
  __syncthreads();
  if (e < warps && rank_of(sm.warp_top, warps, e) == k - 1) sm.bound = sm.warp_top[e];
  __syncthreads();
  const bool cand = e < E && c >= sm.bound;
  const unsigned votes = __ballot_sync(0xffffffffu, cand);
  if (lane == 0) sm.warp_count[warp] = __popc(votes);
  __syncthreads();
  int pos = 0, n = 0;
  for (int w = 0; w < warps; ++w) {
    const int cnt = sm.warp_count[w];
    pos += w < warp ? cnt : 0;
    n += cnt;
  }
  pos += __popc(votes & ((1u << lane) - 1u));
  if (cand) sm.cand[pos] = c;
  __syncthreads();
  if (cand) {  // candidates are in expert order, so a lower position is a lower id
    const int rank = rank_of(sm.cand, n, pos);
    if (rank < k) sm.sel_id[rank] = e;
  }
  __syncthreads();
  if (warp == 0) {  // lane j < k writes slot j (k <= 32); every lane sums the k scores in slot order
    const int id = lane < k ? sm.sel_id[lane] : 0;
    const float s = lane < k ? sm.score[id] : 0.f;
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(0xffffffffu, s, j);
    if (lane < k) {
      ids_row[lane] = id;
      weights_row[lane] = (renormalize ? s / (sum + 1e-20f) : s) * scaling;
    }
  }
}

}  // namespace
}  // namespace kdtree
