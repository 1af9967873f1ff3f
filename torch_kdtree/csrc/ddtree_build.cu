// ddtree_build CUDA kernel (semantics: shared/docs/ddtree.md, restated in torch_kdtree/ops/ddtree.py,
// whose pure-torch reference this must equal bit for bit, ties included).
//
// One block of 512 threads per request.  Warps 0-7 build the tree; warps 8-15 clear the [N, N]
// visibility matrix meanwhile.  Every lp row (and the token ids when L*K <= 2048) is first
// cached in shared memory.  The build takes one of two exact paths, chosen on the device per
// request:
//
// Select path (B >= kSelectMinBudget and every lp <= 0; model: tests/ddtree_select_model.py).
// With lp <= 0 a node never precedes its parent or its left sibling in the total order (score
// desc, parent index asc, rank asc), so the pop sequence is the first B nodes of the whole tree
// in that order, and any score threshold t whose node set S_t = {score >= t} (prefix-closed)
// holds >= B nodes contains them.
//  1. t: the 8 warps probe 8 thresholds at once on the spine-deviation family F = {(0,..,0,r)}
//     (L sorted rows: one binary search per lane), narrowing t until B <= count_F(t) <= 9B/8;
//     count_F <= count, so S_t holds >= B nodes.  1-3 rounds on the benchmark's drafts.
//  2. S_t level by level into slots (the children of a node with score s at depth d are the
//     ranks r with f32(s + lp[d][r]) >= t, a prefix found by binary search; a block scan
//     places them).  More than kCap = 2048 nodes: give up.
//  3. Bitonic sort of (score desc, slot) keys.  Every adjacent equal-score pair that can matter
//     (in the first B + 1, or in the run tied with the B-th) is checked against the total order
//     through the sorted positions of the parents (parents sort earlier, so a full pass of
//     checks proves the order by induction).  A miss sorts again by (score, parent's position,
//     slot) and checks again; a second miss gives up.
//  Giving up (peaked drafts whose S_t is too big, heavy ties, lp > 0) costs the select work
//  and runs the serial path.
//
// Serial path (warp 0; model: tests/ddtree_loop_model.py): the best-first loop, latency-bound.
//  - `cur`, the next key to pop, is held by every lane (no broadcast on the pop chain).  A pop
//    decodes it, loads the parent's score and two log-probs from shared memory and forms the
//    sibling key a and the first-child key b.  The next `cur` is min(a, b, rest), with rest =
//    min(list head, pool best) kept uniform.
//  - The rest of the frontier lives in a sorted list of up to 32 keys, one per lane: per pop it
//    loses its head if that was popped and gains the new keys not popped (two ballots and one
//    variable shuffle).  Keys pushed past lane 31 go to an unsorted overflow pool in shared
//    memory whose best key is tracked; only a pop from the pool rescans it.
//  A key is 64 bits, smaller = popped first: high word ~orderable(score), low word parent |
//  rank | depth: exactly the reference's order.
//
// What bounds it (estimates, not measured yet): select ~ 4 block barriers and two 10-step
// binary searches per tree level (2-3 levels on the benchmark's drafts) plus the sort (66
// barrier stages at 2048 keys): ~5-15k cycles; serial ~200 cycles per pop (~200 SASS
// instructions, two chains of ~100 cycles).  Fixed: the launch, one global round trip for lp,
// the output stores, and the N*N-byte visibility clear (1 MB at B = 1024, bound by one SM's
// store rate, ~8 us, overlapped with the build).
#include "check.h"
#include "pdl.cuh"  // raise_dynamic_smem
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace kdtree {
namespace {

constexpr int kMaxBudget = 1024;
constexpr int kMaxNodes = kMaxBudget + 1;
constexpr int kMaxDepth = 32;
constexpr int kMaxK = 1024;
constexpr int kBuildThreads = 512;  // warps 0-7 build, warps 8-15 clear the visibility matrix
constexpr int kGroup = 256;         // the build warps (named barrier 1)
constexpr int kGroupWarps = kGroup / 32;
constexpr int kSelectMinBudget = 32;  // below this the serial loop is as cheap (and cannot give up)
constexpr int kCap = 2048;             // nodes the select path may enumerate (slot: 11 bits)
constexpr int kMaxRounds = 12;
constexpr int kIdsCacheMax = 2048;  // token ids cached too when L*K <= this (16 KB)
constexpr unsigned kFull = 0xffffffffu;
constexpr uint64_t kEmpty = ~0ull;

// Dynamic shared memory (bytes).  The select path's sort keys / level scores share one region
// with the serial path's node scores and pool: the serial loop runs only after the select path
// gave up.
constexpr int kOffNodeInfo = 0;                      // u32[kMaxNodes]: parent << 16 | rank << 6 | depth
constexpr int kOffUnion = 4112;                      // 16 KB, below
constexpr int kOffPool = kOffUnion + 4112;           //   serial: f32 node_score[kMaxNodes], u64 pool[kMaxNodes + 1]
constexpr int kOffPinfo = kOffUnion + 8 * kCap;      //   select: u64 key[kCap] over f32 sc[kCap]; then u32 pinfo[kCap]
constexpr int kOffTmp = kOffPinfo + 4 * kCap;        // select: i32[kCap] child offsets, then sorted positions
constexpr int kOffMisc = kOffTmp + 4 * kCap;         // i32[32]: probe counts [2][8], scan sums [8], flags, num_nodes
constexpr int kOffLp = kOffMisc + 128;
constexpr int kSmemMax = 101376;                     // sm_120's opt-in limit per block
constexpr int kLpCacheMaxFloats = (kSmemMax - kOffLp) / 4 / 16 * 16;
static_assert(kOffPool + 8 * (kMaxNodes + 1) <= kOffPinfo, "serial arrays overflow the shared region");
static_assert(kOffLp % 16 == 0, "lp cache alignment");
constexpr int kMiscCounts = 0, kMiscScan = 16, kMiscNodes = 24, kMiscFail1 = 25, kMiscFail2 = 26;
constexpr int kMiscRoot = 28;  // int64 root token (8-byte aligned)

__host__ __device__ inline int lp_cache_bytes(int L, int kc) { return (L * kc * 4 + 15) & ~15; }

__device__ __forceinline__ uint32_t orderable(float f) {  // unsigned order = float order (-0 < +0)
  const uint32_t u = __float_as_uint(f);
  return u ^ (uint32_t(int32_t(u) >> 31) | 0x80000000u);
}
__device__ __forceinline__ float from_orderable(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// The score must not be -0 (it would sort apart from +0): every score here is a float sum whose
// left operand is never -0 (the root's 0, or an earlier sum), so none is; the serial path's
// first key is +0-fixed explicitly.
__device__ __forceinline__ uint64_t make_key(float score, int parent, int rank, int depth) {
  return (uint64_t(~orderable(score)) << 32) | (uint32_t(parent) << 16) | (uint32_t(rank) << 6) | uint32_t(depth);
}
__device__ __forceinline__ uint64_t shfl64(uint64_t v, int src) { return __shfl_sync(kFull, v, src); }
__device__ __forceinline__ uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t max64(uint64_t a, uint64_t b) { return a < b ? b : a; }
__device__ __forceinline__ void group_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kGroup) : "memory"); }

struct Build {
  const float* lp_g;  // this request's lp [L][K] in global memory
  const float* lp;    // shared cache: the first kc ranks of every row, row stride kc
  int L, K, kc, budget;
  uint32_t* node_info;
  int* misc;
  unsigned char* smem;
  __device__ float lp_at(int d, int r) const { return r < kc ? lp[d * kc + r] : __ldg(lp_g + d * K + r); }
};

// ---------------------------------------------------------------------------------- serial
__device__ __forceinline__ void serial_build(const Build& b) {
  const int lane = threadIdx.x & 31;
  const int L = b.L, K = b.K, kc = b.kc, N = b.budget + 1;
  float* node_score = reinterpret_cast<float*>(b.smem + kOffUnion);
  uint64_t* pool = reinterpret_cast<uint64_t*>(b.smem + kOffPool);
  uint32_t* node_info = b.node_info;
  // Every lane computes the same uniform values and stores the same value to the same shared
  // address, and later reads back only what it wrote itself: no __syncwarp is needed.
  node_score[0] = 0.0f;
  node_info[0] = 0u;
  uint64_t cur = make_key(__fadd_rn(b.lp[0], 0.0f), 0, 0, 1);  // next key to pop; + 0 turns -0 into +0
  uint64_t key = kEmpty;        // sorted list, one key per lane
  uint64_t head = kEmpty;       // the list's lane-0 key (uniform)
  uint64_t pool_best = kEmpty;  // the pool's best key (uniform)
  uint64_t rest = kEmpty;       // min(head, pool_best)
  bool rest_in_list = false;    // head < pool_best
  int len = 0;                  // keys in the list (uniform)
  int pool_size = 0;
  int pool_best_idx = -1;
  auto push_pool = [&](uint64_t x) {
    if (x == kEmpty) return;
    pool[pool_size] = x;
    if (x < pool_best) {
      pool_best = x;
      pool_best_idx = pool_size;
    }
    ++pool_size;
  };
  int n = 1;
  for (; n < N; ++n) {
    if (cur == kEmpty) break;  // no candidates left: fewer than B nodes exist
    const uint64_t second = shfl64(key, 1);  // depends only on `key`: off the pop chain

    const uint32_t lo = uint32_t(cur);
    const float s = from_orderable(~uint32_t(cur >> 32));
    const int p = int(lo >> 16);
    const int rank = int((lo >> 6) & 0x3ffu);
    const int d = int(lo & 0x3fu);
    const float sp = node_score[p];
    const float lp_sib = b.lp_at(d - 1, min(rank + 1, K - 1));
    const float lp_child = b.lp[min(d, L - 1) * kc];
    node_score[n] = s;
    node_info[n] = lo;
    const uint64_t ka = rank + 1 < K ? make_key(__fadd_rn(sp, lp_sib), p, rank + 1, d) : kEmpty;
    const uint64_t kb = d < L ? make_key(__fadd_rn(s, lp_child), n, 0, d + 1) : kEmpty;
    const uint64_t x = min64(ka, kb), y = max64(ka, kb);
    // Next pop: the best of x and the rest (keys are unique, so x != rest unless both are
    // empty).  The list loses its head when that is popped and gains the new keys not popped.
    const bool chain = x < rest;
    const int drop = (!chain && rest_in_list) ? 1 : 0;
    const bool from_pool = !chain && !rest_in_list && rest != kEmpty;
    const uint64_t next = chain ? x : rest;
    const uint64_t ins1 = chain ? y : x;  // ins1 < ins2 unless both are empty
    const uint64_t ins2 = chain ? kEmpty : y;
    // Merge: M = (list minus its head if dropped) + {ins1, ins2}, sorted; the list keeps
    // M[0..31] and M[32..] goes to the pool.  ins1 sits at pa, ins2 at pb1, and every other
    // M[i] is the old key at i + drop - (i > pa) - (i > pb1).
    const int pa = __popc(__ballot_sync(kFull, key < ins1)) - drop;
    const int pb1 = __popc(__ballot_sync(kFull, key < ins2)) - drop + 1;
    const int src = lane + drop - (lane > pa) - (lane > pb1);
    const uint64_t moved = shfl64(key, src & 31);
    const uint64_t merged = lane == pa ? ins1 : lane == pb1 ? ins2 : src > 31 ? kEmpty : moved;
    const int len_new = len - drop + (ins1 != kEmpty) + (ins2 != kEmpty);
    uint64_t ov0 = kEmpty, ov1 = kEmpty;
    if (len_new > 32) {  // uniform: M[32] (and M[33] after a pop from the pool) spill
      const int src32 = 32 + drop - (32 > pa) - (32 > pb1);
      const uint64_t moved32 = shfl64(key, min(src32, 31));
      ov0 = pa == 32 ? ins1 : pb1 == 32 ? ins2 : src32 > 31 ? kEmpty : moved32;
      if (len_new > 33) ov1 = pb1 == 33 ? ins2 : shfl64(key, 31);  // only when drop == 0
    }
    head = min64(drop ? second : head, ins1);  // = M[0]
    key = merged;
    len = min(len_new, 32);
    if (from_pool) {
      pool[pool_best_idx] = pool[pool_size - 1];
      --pool_size;
      // Rescan the pool for its best key: lane-local min, then 32-bit warp reductions.
      uint64_t best = kEmpty;
      int best_i = 0x7fffffff;
      for (int i = lane; i < pool_size; i += 32) {
        const uint64_t v = pool[i];
        if (v < best) {
          best = v;
          best_i = i;
        }
      }
      const uint32_t hi_min = __reduce_min_sync(kFull, uint32_t(best >> 32));
      const uint32_t lo_min = __reduce_min_sync(kFull, uint32_t(best >> 32) == hi_min ? uint32_t(best) : ~0u);
      pool_best = (uint64_t(hi_min) << 32) | lo_min;
      pool_best_idx = int(__reduce_min_sync(kFull, best == pool_best ? uint32_t(best_i) : ~0u));
    }
    push_pool(ov0);
    push_pool(ov1);
    rest_in_list = head < pool_best;
    rest = rest_in_list ? head : pool_best;
    cur = next;
  }
  if (lane == 0) b.misc[kMiscNodes] = n;
}

// ---------------------------------------------------------------------------------- select
// Ranks r < K with f32(s + row[r]) >= t: a prefix (the row is sorted descending and float
// addition is monotone).
__device__ __forceinline__ int count_at_least(const Build& b, int d, float s, float t) {
  int lo = 0, hi = b.K;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__fadd_rn(s, b.lp_at(d, mid)) >= t)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// In-place exclusive scan of a[0..n) by the build group; returns the total.
__device__ __forceinline__ int group_exclusive_scan(int* a, int n, int* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int carry = 0;
  for (int base = 0; base < n; base += kGroup) {
    const int i = base + int(threadIdx.x);
    const int v = i < n ? a[i] : 0;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) wsum[warp] = x;
    group_sync();
    int before = carry, chunk = 0;
#pragma unroll
    for (int w = 0; w < kGroupWarps; ++w) {
      const int sw = wsum[w];
      before += w < warp ? sw : 0;
      chunk += sw;
    }
    if (i < n) a[i] = before + x - v;
    carry += chunk;
    group_sync();  // wsum is reused by the next chunk; a[] is final
  }
  return carry;
}

// Ascending bitonic sort of key[0..n), n a power of two, by the build group.
__device__ __forceinline__ void group_bitonic_sort(uint64_t* key, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < (n >> 1); i += kGroup) {
        const int lo = ((i & ~(j - 1)) << 1) | (i & (j - 1));
        const int hi = lo + j;
        const uint64_t a = key[lo], c = key[hi];
        if ((a > c) == ((lo & k) == 0)) {
          key[lo] = c;
          key[hi] = a;
        }
      }
      group_sync();
    }
  }
}

// Checks the sorted keys against the total order (see the header); sets *fail on a miss.
// pos[slot] = sorted position.  Ends with a group barrier.
__device__ __forceinline__ bool group_order_holds(const uint64_t* key, const uint32_t* pinfo, const int* pos, int n, int B,
                                  int* fail) {
  const uint32_t hi_b = n > B ? uint32_t(key[B - 1] >> 32) : 0u;
  for (int i = threadIdx.x; i < n - 1; i += kGroup) {
    const uint64_t ku = key[i], kv = key[i + 1];
    const uint32_t hu = uint32_t(ku >> 32);
    if (hu != uint32_t(kv >> 32)) continue;
    if (!(i < B || (n > B && hu == hi_b))) continue;
    const int u = int(ku & 0xfffu), v = int(kv & 0xfffu);
    const int pu = int(pinfo[u] >> 16), pv = int(pinfo[v] >> 16);
    const int qu = pu ? pos[pu - 1] : -1, qv = pv ? pos[pv - 1] : -1;
    if (!(qu < qv || (qu == qv && u < v))) atomicOr(fail, 1);  // an atomic: no racecheck report
  }
  group_sync();
  return *fail == 0;
}

// Returns true (uniformly over the build group) when it built the tree into node_info.
__device__ __forceinline__ bool select_build(const Build& b) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = b.L, K = b.K, B = b.budget;
  uint64_t* key = reinterpret_cast<uint64_t*>(b.smem + kOffUnion);
  float* sc = reinterpret_cast<float*>(b.smem + kOffUnion);
  uint32_t* pinfo = reinterpret_cast<uint32_t*>(b.smem + kOffPinfo);
  int* tmp = reinterpret_cast<int*>(b.smem + kOffTmp);
  int* misc = b.misc;

  // 1. Threshold.  Lane d of every warp: spine[d] = the f32 sum of lp[0..d-1][0] in depth order.
  const int d_lane = min(lane, L - 1);
  float spine = 0.0f;
  for (int j = 0; j < d_lane; ++j) spine = __fadd_rn(spine, b.lp[j * b.kc]);
  // Every row's best must be <= 0 (then scores never grow along a path).
  if (!__all_sync(kFull, b.lp[d_lane * b.kc] <= 0.0f)) return false;
  float t = -INFINITY;
  if (int64_t(L) * K >= B) {
    const float first = __fadd_rn(spine, b.lp[d_lane * b.kc]);
    const float last = __fadd_rn(spine, b.lp_at(d_lane, K - 1));
    uint64_t lo = __reduce_min_sync(kFull, orderable(last));       // count_F(lo) = L*K >= B
    uint64_t hi = uint64_t(__reduce_max_sync(kFull, orderable(first))) + 1;  // count_F(hi) = 0 < B
    int cnt_lo = L * K;
    for (int round = 0; round < kMaxRounds && hi - lo > 1 && cnt_lo > B + B / 8; ++round) {
      const uint64_t lo0 = lo, span = hi - lo;
      const float tp = from_orderable(uint32_t(lo0 + span * uint64_t(warp + 1) / (kGroupWarps + 1)));
      int c = lane < L ? count_at_least(b, lane, spine, tp) : 0;
      c = int(__reduce_add_sync(kFull, uint32_t(c)));
      int* cnt = misc + kMiscCounts + (round & 1) * kGroupWarps;  // double-buffered: one barrier a round
      if (lane == 0) cnt[warp] = c;
      group_sync();
      uint64_t new_hi = hi;
      for (int w = 0; w < kGroupWarps; ++w) {
        const uint64_t pw = lo0 + span * uint64_t(w + 1) / (kGroupWarps + 1);
        const int cw = cnt[w];
        if (cw >= B) {
          lo = pw;
          cnt_lo = cw;
        } else if (pw < new_hi) {
          new_hi = pw;
        }
      }
      hi = new_hi;
    }
    t = from_orderable(uint32_t(lo));
  }

  // 2. S_t level by level: slot = level-order index; pinfo = (parent slot + 1) << 16 | rank << 6 | depth.
  const int n1 = count_at_least(b, 0, 0.0f, t);
  if (n1 > kCap) return false;
  for (int r = threadIdx.x; r < n1; r += kGroup) {
    sc[r] = __fadd_rn(0.0f, b.lp_at(0, r));
    pinfo[r] = (uint32_t(r) << 6) | 1u;
  }
  int beg = 0, end = n1;
  for (int d = 1; d < L && end > beg; ++d) {
    const int np = end - beg;
    group_sync();  // the previous level's nodes are written
    for (int i = threadIdx.x; i < np; i += kGroup) tmp[i] = count_at_least(b, d, sc[beg + i], t);
    group_sync();
    const int total = group_exclusive_scan(tmp, np, misc + kMiscScan);
    if (end + total > kCap) return false;  // uniform; every read of this level is done
    for (int j = threadIdx.x; j < total; j += kGroup) {
      int lo = 0, hi = np - 1;  // the last parent k with tmp[k] <= j owns child j
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tmp[mid] <= j)
          lo = mid;
        else
          hi = mid - 1;
      }
      const int r = j - tmp[lo];
      const int ps = beg + lo;
      sc[end + j] = __fadd_rn(sc[ps], b.lp_at(d, r));
      pinfo[end + j] = (uint32_t(ps + 1) << 16) | (uint32_t(r) << 6) | uint32_t(d + 1);
    }
    beg = end;
    end += total;
  }
  const int n = end;
  int n_pad = 2;
  while (n_pad < n) n_pad <<= 1;

  // 3. Sort keys (score desc, slot); sc and key share memory, so read every score first.
  float s_reg[kCap / kGroup];
  group_sync();
#pragma unroll
  for (int k = 0; k < kCap / kGroup; ++k) {
    const int i = threadIdx.x + k * kGroup;
    s_reg[k] = i < n ? sc[i] : 0.0f;
  }
  group_sync();
#pragma unroll
  for (int k = 0; k < kCap / kGroup; ++k) {
    const int i = threadIdx.x + k * kGroup;
    if (i < n_pad) key[i] = i < n ? (uint64_t(~orderable(s_reg[k])) << 32) | uint32_t(i) : kEmpty;
  }
  group_sync();
  group_bitonic_sort(key, n_pad);
  for (int i = threadIdx.x; i < n; i += kGroup) tmp[int(key[i] & 0xfffu)] = i;  // sorted positions
  group_sync();
  if (!group_order_holds(key, pinfo, tmp, n, B, misc + kMiscFail1)) {
    // Second pass: (score, parent's position + 1, slot); the root's children get 0.
    for (int i = threadIdx.x; i < n; i += kGroup) {
      const uint64_t k = key[i];
      const int p = int(pinfo[int(k & 0xfffu)] >> 16);
      const uint32_t pp = p ? uint32_t(tmp[p - 1] + 1) : 0u;
      key[i] = (k & 0xffffffff00000000ull) | (uint64_t(pp) << 12) | (k & 0xfffu);
    }
    group_sync();
    group_bitonic_sort(key, n_pad);
    for (int i = threadIdx.x; i < n; i += kGroup) tmp[int(key[i] & 0xfffu)] = i;
    group_sync();
    if (!group_order_holds(key, pinfo, tmp, n, B, misc + kMiscFail2)) return false;
  }

  // 4. The first B in order become nodes 1..nb.
  const int nb = min(B, n);
  for (int i = threadIdx.x; i < nb; i += kGroup) {
    const uint32_t info = pinfo[int(key[i] & 0xfffu)];
    const int p = int(info >> 16);
    const uint32_t parent = p ? uint32_t(tmp[p - 1] + 1) : 0u;
    b.node_info[i + 1] = (parent << 16) | (info & 0xffffu);
  }
  if (threadIdx.x == 0) {
    b.node_info[0] = 0u;
    misc[kMiscNodes] = nb + 1;
  }
  return true;
}

// ---------------------------------------------------------------------------------- kernel
__global__ void __launch_bounds__(kBuildThreads)
ddtree_build_kernel(const float* __restrict__ logprobs, const int64_t* __restrict__ token_ids,
                    const int64_t* __restrict__ root_tokens, int L, int K, int kc, int cache_ids, int budget,
                    int64_t* __restrict__ tokens, int32_t* __restrict__ parents,
                    int32_t* __restrict__ depths, bool* __restrict__ visible) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int r = blockIdx.x;
  const int N = budget + 1;
  const float* lp_g = logprobs + int64_t(r) * L * K;
  const int64_t* ids_g = token_ids + int64_t(r) * L * K;
  bool* vis = visible + int64_t(r) * N * N;
  float* lp_s = reinterpret_cast<float*>(smem + kOffLp);
  int64_t* ids_s = reinterpret_cast<int64_t*>(smem + kOffLp + lp_cache_bytes(L, kc));
  uint32_t* node_info = reinterpret_cast<uint32_t*>(smem + kOffNodeInfo);
  int* misc = reinterpret_cast<int*>(smem + kOffMisc);

  // One global round trip for everything the build (and, when small, the output) reads.
  if (kc == K) {
    for (int i = threadIdx.x; i < L * K; i += blockDim.x) lp_s[i] = lp_g[i];
  } else {
    for (int i = threadIdx.x; i < L * kc; i += blockDim.x) lp_s[i] = lp_g[(i / kc) * K + i % kc];
  }
  if (cache_ids)
    for (int i = threadIdx.x; i < L * K; i += blockDim.x) ids_s[i] = ids_g[i];
  if (threadIdx.x == 0) {
    misc[kMiscFail1] = 0;
    misc[kMiscFail2] = 0;
    *reinterpret_cast<int64_t*>(misc + kMiscRoot) = root_tokens[r];
  }
  __syncthreads();

  if (threadIdx.x < kGroup) {
    const Build b{lp_g, lp_s, L, K, kc, budget, node_info, misc, smem};
    const bool done = budget >= kSelectMinBudget && select_build(b);
    if (!done) {
      group_sync();  // every select read is done before the serial loop reuses the memory
      if (threadIdx.x < 32) serial_build(b);
    }
  } else {
    // Clear the visibility matrix meanwhile (16-byte stores where aligned).
    const int64_t total = int64_t(N) * N;
    const int t = threadIdx.x - kGroup, nt = blockDim.x - kGroup;
    const int64_t misalign = int64_t((16 - (reinterpret_cast<uintptr_t>(vis) & 15)) & 15);
    const int64_t head = misalign < total ? misalign : total;
    for (int64_t i = t; i < head; i += nt) vis[i] = false;
    uint4* v4 = reinterpret_cast<uint4*>(vis + head);
    const int64_t n4 = (total - head) / 16;
    for (int64_t i = t; i < n4; i += nt) v4[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = head + n4 * 16 + t; i < total; i += nt) vis[i] = false;
  }
  __syncthreads();

  const int built = misc[kMiscNodes];
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    const int64_t o = int64_t(r) * N + i;
    if (i == 0) {
      tokens[o] = *reinterpret_cast<const int64_t*>(misc + kMiscRoot);
      parents[o] = -1;
      depths[o] = 0;
    } else if (i < built) {
      const uint32_t info = node_info[i];
      const int d = int(info & 0x3fu);
      const int at = (d - 1) * K + int((info >> 6) & 0x3ffu);
      tokens[o] = cache_ids ? ids_s[at] : ids_g[at];
      parents[o] = int(info >> 16);
      depths[o] = d;
    } else {
      tokens[o] = -1;
      parents[o] = -1;
      depths[o] = -1;
    }
    bool* row = vis + int64_t(i) * N;
    row[i] = true;
    if (i < built)
      for (int a = i; a > 0;) {
        a = int(node_info[a] >> 16);
        row[a] = true;
      }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ddtree_build_cuda(
    const at::Tensor& logprobs, const at::Tensor& token_ids, const at::Tensor& root_tokens, int64_t budget) {
  const char* op = "kdtree::ddtree_build";
  check_cuda_tensor(logprobs, op, "logprobs", at::kFloat, 3);
  check_cuda_tensor(token_ids, op, "token_ids", at::kLong, 3);
  check_cuda_tensor(root_tokens, op, "root_tokens", at::kLong, 1);
  KD_CHECK(token_ids.sizes() == logprobs.sizes(), op, ": token_ids shape ", token_ids.sizes(),
           " != logprobs shape ", logprobs.sizes());
  const int64_t R = logprobs.size(0), L = logprobs.size(1), K = logprobs.size(2);
  KD_CHECK(root_tokens.size(0) == R, op, ": root_tokens must have R = ", R, " entries, got ", root_tokens.size(0));
  KD_CHECK(L >= 1 && L <= kMaxDepth, op, ": depth L must be in [1, ", kMaxDepth, "], got ", L);
  KD_CHECK(K >= 1 && K <= kMaxK, op, ": K must be in [1, ", kMaxK, "], got ", K);
  KD_CHECK(budget >= 1 && budget <= kMaxBudget, op, ": budget must be in [1, ", kMaxBudget, "], got ", budget);
  KD_CHECK(logprobs.device() == token_ids.device() && logprobs.device() == root_tokens.device(),
           op, ": all inputs must be on one device");
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t N = budget + 1;
  auto opts = logprobs.options();
  at::Tensor tokens = at::empty({R, N}, opts.dtype(at::kLong));
  at::Tensor parents = at::empty({R, N}, opts.dtype(at::kInt));
  at::Tensor depths = at::empty({R, N}, opts.dtype(at::kInt));
  at::Tensor visible = at::empty({R, N, N}, opts.dtype(at::kBool));
  if (R > 0) {
    const int kc = int(std::min<int64_t>(K, kLpCacheMaxFloats / L));
    const int cache_ids = L * K <= kIdsCacheMax ? 1 : 0;
    const int smem = kOffLp + lp_cache_bytes(int(L), kc) + (cache_ids ? int(L * K) * 8 : 0);
    if (smem > 48 * 1024)
      raise_dynamic_smem(ddtree_build_kernel, smem);
    ddtree_build_kernel<<<R, kBuildThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        logprobs.data_ptr<float>(), token_ids.data_ptr<int64_t>(), root_tokens.data_ptr<int64_t>(), int(L),
        int(K), kc, cache_ids, int(budget), tokens.data_ptr<int64_t>(), parents.data_ptr<int32_t>(),
        depths.data_ptr<int32_t>(), visible.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {tokens, parents, depths, visible};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) { m.impl("ddtree_build", &ddtree_build_cuda); }

}  // namespace kdtree
