// Draft top-K: kdtree::draft_topk, draft_topk_partial, draft_topk_merge.  Semantics, and the
// pure-torch references these kernels must match (ids exactly, log-probs to float32 rounding):
// torch_kdtree/ops/topk.py.
//
// Order.  Every entry gets a distinct integer key = orderable(value) << 18 | (2^18 - 1 - id): a
// larger key is a larger float32 value, then a lower id (-0 is folded into +0, every NaN into
// one NaN above +inf).  The top-k is the k largest keys.
//
// draft_topk / draft_topk_partial: ONE kernel, one thread-block cluster of S <= 8 CTAs (512
// threads each) per row of logits [rows = R*L, V]; CTA c owns the row's entries [c*C, c*C + C)
// and keeps them as raw values (NV slots of 16 bytes per thread, 16-byte loads where the row is
// aligned) in registers or in its shared memory (see Bound below).  Per entry the hot passes do ~5 instructions (a shift or mask to
// float, NaN-propagating bf16x2 maxima per slot, exp); orderable keys are made only in slots
// whose max reaches the threshold (the old per-entry key conversion and two counting passes
// cost ~25).  No CTA writes another's shared memory; they read each other's (distributed shared
// memory) after cluster barriers, two a row (one when k * S <= 512):
//  1. each CTA: max, sum(exp(x - CTA max)) (ex2.approx), each thread's largest key, and a local
//     threshold tau_c = the m-th largest of its 512 thread maxima (two 8-bit radix rounds on 16
//     key bits, block barriers only), m = ceil(k / S): at least m entries of the CTA are >= tau_c.
//     Barrier 1 (split: the exp sum runs between arrive and wait): tau = min over the CTAs, so at
//     least S * m >= k entries of the row are >= tau and every top-k entry is.  With k * S <= 512
//     each CTA takes m = k instead (its own top-k entries are >= tau_c) and skips barrier 1.
//     Candidates kept (simulated, normal logits): ~1.35 k at k = 1024, ~35 at k = 16.
//  2. each CTA compacts its entries >= tau into its own candidate list; barrier 2.
//  3. every CTA reads the S lists (<= 2048 candidates in all; more, from ties or flat rows: the
//     exact top k by a block radix select over the whole row re-read from L2 in every CTA, slow
//     and never for the bench's rows), the S (max, sum) pairs (log-sum-exp), and counting-sorts
//     the candidates by bucket = their value's top 16 bits above the smallest tau_c's (1024
//     buckets, the top one open-ended; the same buckets in every CTA).  A candidate's position in
//     the output = the candidates in higher buckets + the larger ones in its own bucket; CTA c
//     places a contiguous run of buckets (those starting below min(total, k), split by start into
//     S runs) and writes the candidates placed below k.
//     No sort: the old leader's bitonic sort of ~1.2 k keys took ~10 us at k = 1024.
//  4. a split barrier (arrive after the last remote read, wait before exit) keeps every CTA's
//     shared memory alive while the others read it.
// Bound: one read of the logits (4.9 MB at R=1, L=15, V=163840 bf16, 1.6 us at 3 TB/s; 39 MB at
// R=8, 13 us); a row is a latency chain (load, barriers), so the time is about (rows / clusters
// held at once) x one row's latency.  bf16 V <= 163840 has two instances: the chunk in registers
// (64 of them, two CTAs per SM) and the chunk in shared memory (40 registers, 67 KB, three CTAs
// per SM on an H200: R=8's 120 rows then take 3 waves instead of 4); launches in waves take the
// second where three fit (not on sm_120's 100 KB SMs).  At R=1 (one wave) the launch asks for over
// half an SM's shared memory to keep one CTA per SM.  Clusters need sm_90+ (the build targets).
//
// draft_topk_merge: csrc/topk_merge.cu; the block-wide select helpers: csrc/topk_select.cuh.
//
// Every size is fixed by the shapes (no host sync, no data-dependent allocation), so all three
// ops can be captured in CUDA graphs.
#include "check.h"
#include "pdl.cuh"  // raise_dynamic_smem
#include "topk_select.cuh"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kdtree {
namespace {

namespace cg = cooperative_groups;

// --------------------------------------------------------------------------------------------
// draft_topk / draft_topk_partial: one thread-block cluster per row
// --------------------------------------------------------------------------------------------

constexpr int kThreads = 512;                 // per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCluster = 8;                // portable cluster size
constexpr int kCap = 2048;                    // candidates of a row, at most (else the exact fallback)
constexpr int kPer = kCap / kThreads;         // candidates a thread holds in the placement
constexpr int kIdBits = 18;                   // index in the row < kMaxVocab
constexpr uint32_t kIdMask = (1u << kIdBits) - 1u;
constexpr int kDigitBins = 256;               // 8-bit digits of the threshold select
constexpr int kBuckets = 1024;                // placement buckets
static_assert((1 << kIdBits) >= kMaxVocab, "row index must fit its key bits");
static_assert(2 * kDigitBins == kThreads, "one thread zeroes one bin of the two histograms");
static_assert(kBuckets == 2 * kThreads, "two buckets per thread");
static_assert(kCap >= kMaxK && kCap % kThreads == 0, "candidate layout");

struct TopkShared {
  uint32_t hist[2][kDigitBins];  // this CTA's digit counts for the two threshold rounds
  uint32_t bcnt[kBuckets];       // candidates per bucket (the whole row's)
  uint32_t bpos[kBuckets];       // a bucket's start (candidates in higher buckets), then its end
  uint32_t warp_u[kWarps];       // warp max keys
  float warp_f[kWarps];          // warp sums of exp
  uint32_t scan_tot[32];
  uint32_t dec_bin, dec_above, dec_cnt, dec_found;  // the current digit's decision
  uint32_t tau_c;                // published: this CTA's threshold
  uint32_t tau_min;              // the smallest tau_c of the cluster (the placement's bucket base)
  uint32_t ncand, ncand2;        // published: this CTA's candidates (after the fallback: ncand2)
  float cta_max, cta_sum;        // published: this CTA's max and sum(exp(x - max))
  uint32_t off[kMaxCluster + 1]; // where each CTA's list starts in the row's candidates
  uint32_t own_lo, own_hi;       // the bucket-order positions this CTA places
  float row_max, row_logsum;
  uint64_t cand[kCap];           // published: this CTA's candidates' keys
};
// Dynamic shared memory: the CTA's chunk of raw logits (NV slots of 16 bytes per thread) until
// the compaction, then the placement's (or the fallback's) scratch; never read by other CTAs.
union TopkScratch {
  uint64_t all[kCap];            // the row's candidates, in bucket order
  SelectShared sel;              // the fallback's radix select
};
// kSmem: the chunk lives in this dynamic shared memory (the passes re-read it) instead of
// registers, so an instance needs ~40 registers and three CTAs share an SM where shared memory
// allows (H200: 3 x 67 KB); the register instances use 64 (two per SM) or more.
extern __shared__ uint4 topk_dyn[];
template <int NV, bool kSmem>
constexpr size_t dyn_smem_bytes() {
  constexpr size_t chunk = kSmem ? sizeof(uint4) * NV * kThreads : 0;
  return chunk > sizeof(TopkScratch) ? chunk : sizeof(TopkScratch);
}
template <typename Tr, int NV, bool kSmem>
constexpr int min_ctas_per_sm() {
  return kSmem ? 3 : (NV * Tr::kVec <= 40 ? 2 : 1);  // register instances: 2 up to V = 163840
}

struct Digit {
  uint32_t bin, above, cnt;
  bool found;
};

// One digit of a block-wide radix select over 256 bins: every thread calls it after adding its
// keys' digits to hist.  Returns, identically in every thread, the bin holding the need-th
// largest key, the keys in higher bins (above) and in that bin (cnt); found = false when fewer
// than need keys were counted.
__device__ Digit block_digit(TopkShared& sh, const uint32_t* hist, uint32_t need) {
  __syncthreads();  // counts complete
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t c = 0, incl = 0;
  if (t < kDigitBins) {  // warps 0..7, whole warps: thread t owns bin 255 - t (highest first)
    c = hist[kDigitBins - 1 - t];
    incl = warp_inclusive_scan(c);
    if (lane == 31) sh.scan_tot[warp] = incl;
  }
  __syncthreads();
  if (t < kDigitBins) {
    for (int w = 0; w < warp; ++w) incl += sh.scan_tot[w];
    const uint32_t excl = incl - c;  // keys in bins above mine
    if (excl < need && need <= incl) {  // exactly one thread when >= need keys were counted
      sh.dec_bin = uint32_t(kDigitBins - 1 - t);
      sh.dec_above = excl;
      sh.dec_cnt = c;
      sh.dec_found = 1;
    }
    if (t == kDigitBins - 1 && incl < need) sh.dec_found = 0;  // the only writer in that case
  }
  __syncthreads();
  // Rewritten only after the next call's second barrier, which every thread reaches after
  // reading them here.
  return Digit{sh.dec_bin, sh.dec_above, sh.dec_cnt, sh.dec_found != 0};
}

// The two halves of a cluster barrier: arrive releases this thread's earlier writes (and ends
// its reads of other CTAs' shared memory), wait acquires every CTA's released writes.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// Thread t of the CTA with cluster rank c holds NV slots of W = Tr::kVec consecutive raw values:
// slot j covers chunk entries [(j * kThreads + t) * W, +W), chunk = row entries [c * C, c * C + n).
// Entries past n read as -inf; they never become candidates (the compaction checks the index).
// Per entry the hot passes only convert to float (a shift or a mask), take NaN-propagating maxima
// (two bf16 at a time) and exp; orderable keys are made only for the few entries that can be
// candidates (a slot whose max reaches the threshold).
__device__ __forceinline__ uint32_t max_nan_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// Per half: 0xFFFF where a >= b or unordered (NaN), else 0.
__device__ __forceinline__ uint32_t geu_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("set.geu.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float ex2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
template <typename Tr>
struct Slots;
template <>
struct Slots<Bf16> {
  static constexpr uint16_t kNegInf = 0xFF80u;
  static constexpr uint32_t kNegInfWord = 0xFF80FF80u;
  __device__ static uint32_t raw(const uint4& s, int e) { return ((&s.x)[e >> 1] >> (16 * (e & 1))) & 0xFFFFu; }
  __device__ static float value(const uint4& s, int e) {
    const uint32_t w = (&s.x)[e >> 1];
    return __uint_as_float((e & 1) ? (w & 0xFFFF0000u) : (w << 16));
  }
  __device__ static float slot_max(const uint4& s) {  // NaN if any entry is NaN
    const uint32_t m = max_nan_bf16x2(max_nan_bf16x2(s.x, s.y), max_nan_bf16x2(s.z, s.w));
    return max_nan(__uint_as_float(m << 16), __uint_as_float(m & 0xFFFF0000u));
  }
  __device__ static uint32_t raw_of(float x) { return __float_as_uint(x) >> 16; }  // x: a bf16 value
  __device__ static uint32_t top16(uint32_t key) { return key; }
};
template <>
struct Slots<F32> {
  static constexpr uint32_t kNegInf = 0xFF800000u;
  static constexpr uint32_t kNegInfWord = 0xFF800000u;
  __device__ static uint32_t raw(const uint4& s, int e) { return (&s.x)[e]; }
  __device__ static float value(const uint4& s, int e) { return __uint_as_float((&s.x)[e]); }
  __device__ static float slot_max(const uint4& s) {
    return max_nan(max_nan(__uint_as_float(s.x), __uint_as_float(s.y)),
                   max_nan(__uint_as_float(s.z), __uint_as_float(s.w)));
  }
  __device__ static uint32_t raw_of(float x) { return __float_as_uint(x); }
  __device__ static uint32_t top16(uint32_t key) { return key >> 16; }
};

// An empty asm that "rewrites" the register slots: values unpacked from them in one pass cannot
// be kept alive into the next (the compiler would otherwise hold every unpacked key and spill).
// A no-op for shared-memory chunks (their registers are dead after the load).
template <bool kSmem, int NV>
__device__ __forceinline__ void launder(uint4 (&s)[NV]) {
  if constexpr (!kSmem) {
#pragma unroll
    for (int j = 0; j < NV; ++j) asm volatile("" : "+r"(s[j].x), "+r"(s[j].y), "+r"(s[j].z), "+r"(s[j].w));
  }
}

template <typename Tr>
__device__ __forceinline__ float key_to_float(uint32_t key) {
  return Tr::to_float(Tr::from_orderable(key));
}

template <typename Tr, int NV, bool kSmem>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm<Tr, NV, kSmem>())
topk_cluster_kernel(const typename Tr::Raw* __restrict__ logits, int V, int C, int S, int k, bool vec_ok,
                    bool local_tau, int64_t vocab_start, bool partial, float* __restrict__ out_val,
                    int64_t* __restrict__ out_id, float* __restrict__ out_lse) {
  using Raw = typename Tr::Raw;
  using Sl = Slots<Tr>;
  constexpr int W = Tr::kVec;
  constexpr int kKeyBits = Tr::kBits + kIdBits;
  __shared__ TopkShared sh;
  TopkScratch& scratch = *reinterpret_cast<TopkScratch*>(topk_dyn);
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / S;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int c0 = rank * C;
  const int n = max(0, min(V - c0, C));
  const Raw* src = logits + row * int64_t(V) + c0;

  (&sh.hist[0][0])[t] = 0;
  sh.bcnt[t] = 0;
  sh.bcnt[t + kThreads] = 0;
  if (t == 0) {
    sh.ncand = 0;
    sh.ncand2 = 0;
    sh.own_lo = 0xFFFFFFFFu;
    sh.own_hi = 0;
  }

  // ---- load: 16-byte loads of whole slots where aligned, scalar loads for the rest ----
  uint4 s[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int slot = j * kThreads + t;
    s[j] = make_uint4(Sl::kNegInfWord, Sl::kNegInfWord, Sl::kNegInfWord, Sl::kNegInfWord);
    if (vec_ok && (slot + 1) * W <= n) s[j] = __ldg(reinterpret_cast<const uint4*>(src) + slot);
  }
  if (!vec_ok || n % W != 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int base = (j * kThreads + t) * W;
      if (!(vec_ok && base + W <= n) && base < n) {
        Raw r[W];
#pragma unroll
        for (int e = 0; e < W; ++e) r[e] = base + e < n ? src[base + e] : Raw(Sl::kNegInf);
        if constexpr (W == 8) {
          s[j] = make_uint4(r[0] | (uint32_t(r[1]) << 16), r[2] | (uint32_t(r[3]) << 16),
                            r[4] | (uint32_t(r[5]) << 16), r[6] | (uint32_t(r[7]) << 16));
        } else {
          s[j] = make_uint4(r[0], r[1], r[2], r[3]);
        }
      }
    }
  }
  // Slot maxima (NaN-propagating), kept for the compaction where registers allow.  A thread's
  // slots in shared memory are only ever read back by the thread itself: no barrier.
  constexpr bool kKeepMax = Tr::kBits == 16 && !kSmem;
  float smax[kKeepMax ? NV : 1];
  float tmaxf = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const float m = Sl::slot_max(s[j]);
    if constexpr (kKeepMax) smax[j] = m;
    if constexpr (kSmem) topk_dyn[j * kThreads + t] = s[j];
    tmaxf = max_nan(tmaxf, m);
  }
  auto slot_at = [&](int j) -> uint4 {
    if constexpr (kSmem) return topk_dyn[j * kThreads + t];
    else return s[j];
  };
  // this thread's largest key (0: it holds no entry)
  const uint32_t tmax = t * W < n ? Tr::orderable(Sl::raw_of(tmaxf)) : 0u;
  const uint32_t wmax = __reduce_max_sync(0xFFFFFFFFu, tmax);
  if (lane == 0) sh.warp_u[warp] = wmax;
  __syncthreads();  // histograms zeroed, warp maxima published

  // ---- local threshold: the m-th largest thread maximum, on 16 key bits (two 8-bit rounds) ----
  // At least m entries of this CTA (those maxima) are >= it.  Fewer than m threads with entries:
  // tau_c = 1 keeps them all.
  const uint32_t m16 = Sl::top16(tmax);
  hist_add(sh.hist[0], tmax != 0, m16 >> 8);  // warp-aggregated: most maxima share a bin
  uint32_t tau_c = 1;
  {
    uint32_t need = local_tau ? uint32_t(k) : uint32_t((k + S - 1) / S);
    const Digit hi = block_digit(sh, sh.hist[0], need);
    if (hi.found) {
      need -= hi.above;
      hist_add(sh.hist[1], tmax != 0 && (m16 >> 8) == hi.bin, m16 & 0xFFu);
      const Digit lo = block_digit(sh, sh.hist[1], need);  // found: bin hi.bin holds >= need maxima
      const uint32_t t16 = (hi.bin << 8) | lo.bin;
      tau_c = max(1u, Tr::kBits == 16 ? t16 : t16 << 16);
    }
  }
  if (t == 0) sh.tau_c = tau_c;  // read after barrier 1 (global threshold) or 2 (bucket base)
  if (!local_tau) cluster_arrive();  // barrier 1, first half
  uint32_t ckey = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) ckey = max(ckey, sh.warp_u[w]);
  const float cmax = ckey == 0 ? -INFINITY : key_to_float<Tr>(ckey);
  float tsum = 0.0f;  // sum(exp(x - CTA max)), while the other CTAs reach barrier 1
  launder<kSmem>(s);
  if (cmax != -INFINITY) {  // entries past n are -inf: exp gives 0
    constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const uint4 sj = slot_at(j);
#pragma unroll
      for (int e = 0; e < W; ++e) tsum += ex2_approx((Sl::value(sj, e) - cmax) * kLog2e);
    }
  }
  uint32_t tau = tau_c;  // candidates: key >= tau
  if (!local_tau) {
    cluster_wait();  // barrier 1, second half: every CTA's tau_c published
    const uint32_t x = lane < S ? *cluster.map_shared_rank(&sh.tau_c, lane) : 0xFFFFFFFFu;
    tau = __reduce_min_sync(0xFFFFFFFFu, x);
  }

  // ---- compact this CTA's entries >= tau into its own list (one shared atomic per warp) ----
  // Only slots whose max reaches tau's value (or is NaN) are looked at entry by entry.
  float tau_f = tau <= Tr::orderable(Sl::kNegInf) ? -INFINITY : key_to_float<Tr>(tau);
  if (!(tau_f == tau_f)) tau_f = -INFINITY;
  auto slot_may_hold = [&](int j, const uint4& sj) -> bool {
    float m;
    if constexpr (kKeepMax) m = smax[j];
    else m = Sl::slot_max(sj);
    return !(m < tau_f);
  };
  // key >= tau  <=>  !(value < tau_f): tau_f is the value of key tau, -0 == +0 in both orders,
  // and NaN (the largest key) fails every float comparison.  Entries past n read as -inf: they
  // pass only when tau_f = -inf, and are checked by index then.
  const bool check_index = tau_f == -INFINITY;
  auto take = [&](const uint4& sj, int j, int e) -> bool {
    return !(Sl::value(sj, e) < tau_f) && (!check_index || (j * kThreads + t) * W + e < n);
  };
  // bf16 above a finite threshold: two entries per comparison (HSET2, unordered counts as >=).
  const bool packed = Tr::kBits == 16 && !check_index;
  const uint32_t tau2 = Sl::raw_of(tau_f) * 0x10001u;
  launder<kSmem>(s);
  uint32_t cnt = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const uint4 sj = slot_at(j);
    if (slot_may_hold(j, sj)) {
      if (packed) {
        uint32_t c = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) c += __popc(geu_bf16x2((&sj.x)[w], tau2));
        cnt += c >> 4;  // 16 bits per entry taken
      } else {
#pragma unroll
        for (int e = 0; e < W; ++e) cnt += take(sj, j, e) ? 1u : 0u;
      }
    }
  }
  const uint32_t incl = warp_inclusive_scan(cnt);
  uint32_t base = 0;
  if (lane == 31 && incl != 0) base = atomicAdd(&sh.ncand, incl);
  base = __shfl_sync(0xFFFFFFFFu, base, 31);
  const float ws = warp_sum(tsum);
  if (lane == 0) sh.warp_f[warp] = ws;
  if (cnt != 0) {
    launder<kSmem>(s);
    uint32_t pos = base + incl - cnt;
    auto emit = [&](const uint4& sj, int j, int e) {
      if (pos < uint32_t(kCap))
        sh.cand[pos] = (uint64_t(Tr::orderable(Sl::raw(sj, e))) << kIdBits) |
                       (kIdMask - uint32_t(c0 + (j * kThreads + t) * W + e));
      ++pos;
    };
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const uint4 sj = slot_at(j);
      if (slot_may_hold(j, sj)) {
        if (packed) {
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const uint32_t r = geu_bf16x2((&sj.x)[w], tau2);
            if (r & 0xFFFFu) emit(sj, j, 2 * w);
            if (r & 0xFFFF0000u) emit(sj, j, 2 * w + 1);
          }
        } else {
#pragma unroll
          for (int e = 0; e < W; ++e)
            if (take(sj, j, e)) emit(sj, j, e);
        }
      }
    }
  }
  __syncthreads();  // warp sums in place
  if (t == 0) {
    float cs = 0.0f;
    for (int w = 0; w < kWarps; ++w) cs += sh.warp_f[w];
    sh.cta_max = cmax;
    sh.cta_sum = cmax == -INFINITY ? 0.0f : cs;
  }
  cluster.sync();  // barrier 2: every CTA's list, count and (max, sum) published

  // ---- the row's log-sum-exp and the lists' offsets (warp 0, the same in every CTA) ----
  auto publish_offsets = [&](uint32_t c) {  // c: lane's CTA's list length (0 for lanes >= S)
    const uint32_t sc = warp_inclusive_scan(c);
    if (lane == 0) sh.off[0] = 0;
    if (lane < S) sh.off[lane + 1] = sc;
  };
  if (warp == 0) {
    const TopkShared* rs = cluster.map_shared_rank(&sh, lane < S ? lane : 0);
    const float m = lane < S ? rs->cta_max : -INFINITY;
    const float sm = lane < S ? rs->cta_sum : 0.0f;
    const uint32_t nc = lane < S ? rs->ncand : 0u;  // issued with the two above: one round trip
    const uint32_t tmin = __reduce_min_sync(0xFFFFFFFFu, lane < S ? rs->tau_c : 0xFFFFFFFFu);
    const float rm = warp_max(m);
    // the CTA holding the row max contributes its exp(x - max) terms unscaled
    const float part = warp_sum(m == -INFINITY ? 0.0f : (m == rm ? sm : sm * expf(m - rm)));
    if (lane == 0) {
      sh.row_max = rm;
      sh.row_logsum = logf(part);
      sh.tau_min = tmin;
    }
    publish_offsets(nc);
  }
  __syncthreads();
  uint32_t total = sh.off[S];
  // The buckets, the same in every CTA of the cluster (each CTA decides ownership from its own
  // bucket starts, so the starts must agree): bucket 0 starts 128 value steps below the smallest
  // tau_c (every candidate is above it), values 1023 steps above share the top bucket.  With
  // each CTA's own tau_c (local mode) a CTA whose chunk lies far below the row's top (an
  // all-negative block of the vocabulary) put every top candidate in its top bucket at start 0,
  // so no CTA placed the positions it should have.
  uint32_t base16 = Sl::top16(sh.tau_min) - min(Sl::top16(sh.tau_min), 128u);
  if (total > uint32_t(kCap)) {
    // More than 2048 entries tie with or sit above tau (ties, flat rows; never for the bench's
    // rows): every CTA finds the exact k-th largest key of the whole row by a block radix
    // select (re-reading the row from L2) and lists its own entries among the top k.
    const Raw* rowp = logits + row * int64_t(V);
    auto key_at = [&](int j, uint64_t& key) -> bool {
      const int i = j * kThreads + t;
      if (i >= V) {
        key = 0;
        return false;
      }
      key = (uint64_t(Tr::orderable(uint32_t(rowp[i]))) << kIdBits) | uint64_t(kIdMask - uint32_t(i));
      return true;
    };
    const int iters = (V + kThreads - 1) / kThreads;
    uint64_t prefix;
    int shift;
    radix_select<kThreads, 0>(scratch.sel, key_at, iters, kKeyBits, uint32_t(k), false, prefix, shift);
    for (int i = t; i - t < n; i += kThreads) {  // warp-uniform trip count
      const bool valid = i < n;
      const uint64_t key = valid ? (uint64_t(Tr::orderable(uint32_t(src[i]))) << kIdBits) |
                                       uint64_t(kIdMask - uint32_t(c0 + i)) : 0;
      const bool take = valid && shr(key, shift) >= prefix;
      const int pos = warp_claim(take, &sh.ncand2);
      if (take) sh.cand[pos] = key;  // exactly k keys over the row: pos < k
    }
    base16 = Sl::top16(uint32_t((prefix << shift) >> kIdBits));
    cluster.sync();  // every CTA's exact list published
    if (warp == 0) publish_offsets(lane < S ? cluster.map_shared_rank(&sh, lane)->ncand2 : 0u);
    __syncthreads();
    total = sh.off[S];
  }

  // ---- place: counting sort of the row's candidates by bucket, then ranks within buckets ----
  // Every CTA places (measured: letting only 2 of 8 place and the rest leave early, to free SMs
  // when the launch runs in waves, made R = 8 slower: 66.6 against 63.5 us at k = 1024).
  auto bucket = [&](uint64_t key) -> uint32_t {
    const uint32_t v16 = Sl::top16(uint32_t(key >> kIdBits));
    return v16 <= base16 ? 0u : min(uint32_t(kBuckets - 1), v16 - base16);  // non-decreasing in key
  };
  uint64_t v[kPer];
#pragma unroll
  for (int q = 0; q < kPer; ++q) {  // the kPer (mostly remote) loads in flight together
    const uint32_t p = uint32_t(t + q * kThreads);
    v[q] = 0;
    if (p < total) {
      int r = 0;
#pragma unroll
      for (int i = 1; i < kMaxCluster; ++i)
        if (i < S && sh.off[i] <= p) r = i;
      const uint64_t* list = r == rank ? sh.cand : cluster.map_shared_rank(sh.cand, r);
      v[q] = list[p - sh.off[r]];
    }
  }
  // Plain shared atomics, one per candidate: the candidates of a warp fall in many buckets, and
  // warp aggregation (match_any, as hist_add does) cost more than the few conflicts it saves
  // (measured, R 1 k 1024: histogram 3.7k -> 1.9k cycles, scatter 4.1k -> 3.1k, 14.1 -> 12.7 us).
#pragma unroll
  for (int q = 0; q < kPer; ++q)
    if (v[q] != 0) atomicAdd(&sh.bcnt[bucket(v[q])], 1u);
  __syncthreads();  // bucket counts complete; every read of another CTA done
  cluster_arrive();  // final barrier, first half
  {
    // thread t owns buckets hi = 1023 - 2t and hi - 1: starts = candidates in higher buckets
    const int hi = kBuckets - 1 - 2 * t;
    const uint32_t a = sh.bcnt[hi], b = sh.bcnt[hi - 1];
    const uint32_t incl_b = block_inclusive_scan<kThreads>(a + b, sh.scan_tot);
    const uint32_t excl = incl_b - (a + b);
    sh.bpos[hi] = excl;
    sh.bpos[hi - 1] = excl + a;
  }
  __syncthreads();
  // CTA c places the buckets that start below tk = min(total, k) and whose start * S / tk is c:
  // a contiguous range [own_lo, own_hi) of the bucket order, about tk / S candidates.
  const uint32_t tk = min(total, uint32_t(k));
  bool own[kPer];
  uint32_t lo = 0xFFFFFFFFu, hi_end = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    own[q] = false;
    if (v[q] != 0) {
      const uint32_t b = bucket(v[q]), st = sh.bpos[b];
      own[q] = st < tk && (st * uint32_t(S)) / tk == uint32_t(rank);
      if (own[q]) {
        lo = min(lo, st);
        hi_end = max(hi_end, st + sh.bcnt[b]);
      }
    }
  }
  lo = __reduce_min_sync(0xFFFFFFFFu, lo);
  hi_end = __reduce_max_sync(0xFFFFFFFFu, hi_end);
  if (lane == 0 && lo != 0xFFFFFFFFu) {
    atomicMin(&sh.own_lo, lo);
    atomicMax(&sh.own_hi, hi_end);
  }
  // Every warp has read the bucket starts before any warp's scatter advances them: a warp that
  // read a start already advanced by another warp's scatter took its candidates for another CTA's
  // (dropping them) and stretched own_hi over unwritten entries, whose garbage keys then landed
  // on output positions (mostly position 0).  Seen only in launches in waves (warps of a CTA far
  // apart in time); racecheck does not report it (the writes are atomics).
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kPer; ++q)
    if (own[q]) scratch.all[atomicAdd(&sh.bpos[bucket(v[q])], 1u)] = v[q];  // any order in a bucket
  __syncthreads();  // all[own_lo, own_hi) in bucket order; bpos[b] = the end of an owned bucket b
  const float m = sh.row_max, ls = sh.row_logsum;
  const uint32_t own_lo = sh.own_lo, own_hi = sh.own_hi;  // lo = ~0, hi = 0: nothing to place
  for (uint32_t p = own_lo + t; own_lo < own_hi && p < own_hi; p += kThreads) {  // neighbours: mostly one bucket
    const uint64_t x = scratch.all[p];
    const uint32_t id = uint32_t(x & kIdMask);
    const uint32_t b = bucket(x), end = sh.bpos[b];
    const uint32_t begin = end - sh.bcnt[b];
    uint32_t pos = begin;  // candidates in higher buckets, then the larger ones in this bucket
    for (uint32_t j = begin; j < end; ++j) pos += scratch.all[j] > x ? 1u : 0u;
    if (pos < uint32_t(k)) {
      const float xv = key_to_float<Tr>(uint32_t(x >> kIdBits));
      const int64_t o = row * k + pos;
      out_val[o] = partial ? xv : (xv - m) - ls;  // torch.log_softmax's (x - max) - log(sum)
      out_id[o] = vocab_start + int64_t(kIdMask - id);
    }
  }
  if (partial && rank == 0 && t == 0) out_lse[row] = ls + m;  // torch.logsumexp's log(sum) + max
  cluster_wait();  // final barrier: no CTA leaves while another may still read its lists
}

// host side
// --------------------------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// S CTAs per row (a power of two <= 8: about two 16-byte loads per thread each, so V=163840 bf16
// takes S=8), C entries each (a multiple of 8: chunk starts keep 16-byte alignment), and the
// slots per thread nv >= C / (W * kThreads) the kernel must hold (rounded up to an instance).
struct ClusterPlan {
  int S, C, nv;
};
ClusterPlan plan_cluster(int64_t V, int W) {
  const int64_t want = ceil_div(V, int64_t(kThreads) * W * 2);
  int S = 1;
  while (S < want && S < kMaxCluster) S <<= 1;
  const int64_t C = ceil_div(ceil_div(V, S), 8) * 8;
  const int64_t nv = ceil_div(ceil_div(C, W), kThreads);
  TORCH_INTERNAL_ASSERT(C * S >= V && nv * W <= 64, "draft_topk cluster plan");
  return {S, int(C), int(nv)};
}

void check_logits(const char* op, const at::Tensor& logits, int64_t k) {
  KD_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got ", logits.device());
  KD_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat, op,
              ": logits must be bfloat16 or float32, got ", logits.scalar_type());
  KD_CHECK(logits.dim() == 3, op, ": logits must have 3 dimensions [R, L, V], got shape ", logits.sizes());
  KD_CHECK(logits.is_contiguous(), op, ": logits must be contiguous");
  const int64_t V = logits.size(2);
  KD_CHECK(V >= 1 && V <= kMaxVocab, op, ": vocabulary size V = logits.shape[2] must be in [1, ", kMaxVocab,
              "], got ", V);
  KD_CHECK(k >= 1 && k <= kMaxK, op, ": k must be in [1, ", kMaxK, "], got ", k);
  KD_CHECK(k <= V, op, ": k = ", k, " exceeds the vocabulary size V = ", V);
}

// The dynamic shared memory to request.  A launch with no more CTAs than SMs (R = 1: 120 CTAs)
// is latency bound, and each CTA has a whole SM's worth of per-entry work; asking for more than
// half of an SM's shared memory keeps the CTAs one per SM, used only when the GPU still holds
// every cluster at once that way (cudaOccupancyMaxActiveClusters, cached per instance, S and
// device).  Otherwise the instance's own need (its chunk and scratch).
template <typename Tr, int NV, bool kSmem>
size_t launch_smem(int64_t rows, int S, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  auto kernel = topk_cluster_kernel<Tr, NV, kSmem>;
  const size_t need = dyn_smem_bytes<NV, kSmem>();
  size_t dyn = need;
  const size_t spread = std::max(need, prop->sharedMemPerMultiprocessor / 2 + 1);
  if (rows * S <= prop->multiProcessorCount && device < 64 && sizeof(TopkShared) + spread <= prop->sharedMemPerBlockOptin) {
    cudaFuncAttributes fa;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    if (fa.sharedSizeBytes + spread <= prop->sharedMemPerBlockOptin) {
      raise_dynamic_smem(kernel, int(spread));
      static std::atomic<int> max_clusters[4][64];  // [log2 S][device]: max active clusters + 1, 0 = unknown
      const int lg = S >= 8 ? 3 : S >= 4 ? 2 : S >= 2 ? 1 : 0;
      int cached = max_clusters[lg][device].load();
      if (cached == 0) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(unsigned(S));
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = spread;
        cfg.stream = stream;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = unsigned(S);
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
          (void)cudaGetLastError();  // no answer: do not spread
          n = 0;
        }
        cached = n + 1;
        max_clusters[lg][device].store(cached);
      }
      if (rows <= int64_t(cached - 1)) dyn = spread;
    }
  }
  // Static plus dynamic shared memory above 48 KB needs the opt-in (the launch fails otherwise).
  if (sizeof(TopkShared) + dyn + 1024 > 48 * 1024)
    raise_dynamic_smem(kernel, int(dyn));
  return dyn;
}

template <typename Tr, int NV, bool kSmem>
void launch_cluster(const at::Tensor& logits, int64_t rows, const ClusterPlan& plan, int64_t k, int64_t vocab_start,
                    bool partial, at::Tensor& out_val, at::Tensor& out_id, at::Tensor& out_lse) {
  using Raw = typename Tr::Raw;
  const int V = int(logits.size(2));
  const bool vec_ok = V % Tr::kVec == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  // Each CTA's own top-k bound (no threshold barrier) while the S lists stay short.
  const bool local_tau = plan.S == 1 || k * plan.S <= kThreads;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows * plan.S));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cfg.dynamicSmemBytes = launch_smem<Tr, NV, kSmem>(rows, plan.S, cfg.stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.S);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, topk_cluster_kernel<Tr, NV, kSmem>,
                                    reinterpret_cast<const Raw*>(logits.data_ptr()), V, plan.C, plan.S, int(k), vec_ok,
                                    local_tau, vocab_start, partial, out_val.data_ptr<float>(),
                                    out_id.data_ptr<int64_t>(),
                                    partial ? out_lse.data_ptr<float>() : static_cast<float*>(nullptr)));
}

// Whether to run the shared-memory-chunk instance with NV slots: when the launch runs in waves
// (more CTAs than SMs; one wave is latency bound and keeps the register instance) and three of
// its CTAs fit on one SM (H200: yes; sm_120, 100 KB per SM: no, the register instance keeps two
// per SM).
template <int NV>
bool use_smem_chunk(const at::Tensor& logits, int64_t rows, int S) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(logits.get_device());
  const size_t per_cta = sizeof(TopkShared) + dyn_smem_bytes<NV, true>() + prop->reservedSharedMemPerBlock;
  const bool fits = 3 * per_cta <= prop->sharedMemPerMultiprocessor;
  return fits && rows * S > prop->multiProcessorCount;
}

void dispatch_topk(const at::Tensor& logits, int64_t k, int64_t vocab_start, bool partial, at::Tensor& out_val,
                   at::Tensor& out_id, at::Tensor& out_lse) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0) * logits.size(1);
  if (rows == 0) return;
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const ClusterPlan plan = plan_cluster(logits.size(2), bf16 ? Bf16::kVec : F32::kVec);
  KD_CHECK(rows * plan.S <= INT32_MAX, "draft_topk: R * L = ", rows, " rows is too many for one launch");
  // Instances: bf16 nv in {2, 5, 8} (V <= 65536, V = 163840, V <= 262144); float32 {4, 10, 16}.
  if (bf16) {
    if (plan.nv <= 2) launch_cluster<Bf16, 2, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else if (plan.nv <= 5 && use_smem_chunk<5>(logits, rows, plan.S))
      launch_cluster<Bf16, 5, true>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else if (plan.nv <= 5) launch_cluster<Bf16, 5, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else launch_cluster<Bf16, 8, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
  } else {
    if (plan.nv <= 4) launch_cluster<F32, 4, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else if (plan.nv <= 10) launch_cluster<F32, 10, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else launch_cluster<F32, 16, false>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
  }
}

std::tuple<at::Tensor, at::Tensor> draft_topk_cuda(const at::Tensor& logits, int64_t k) {
  check_logits("kdtree::draft_topk", logits, k);
  const int64_t R = logits.size(0), L = logits.size(1);
  auto opts = logits.options();
  at::Tensor logprobs = at::empty({R, L, k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({R, L, k}, opts.dtype(at::kLong));
  at::Tensor unused;
  dispatch_topk(logits, k, 0, false, logprobs, ids, unused);
  return {logprobs, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_topk_partial_cuda(const at::Tensor& logits, int64_t k,
                                                                      int64_t vocab_start) {
  const char* op = "kdtree::draft_topk_partial";
  check_logits(op, logits, k);
  KD_CHECK(vocab_start >= 0 && vocab_start + logits.size(2) - 1 <= INT32_MAX, op,
              ": the shard's ids [vocab_start, vocab_start + V) must lie in [0, 2**31), got vocab_start = ",
              vocab_start);
  const int64_t R = logits.size(0), L = logits.size(1);
  auto opts = logits.options();
  at::Tensor values = at::empty({R, L, k}, opts.dtype(at::kFloat));
  at::Tensor ids = at::empty({R, L, k}, opts.dtype(at::kLong));
  at::Tensor lse = at::empty({R, L}, opts.dtype(at::kFloat));
  dispatch_topk(logits, k, vocab_start, true, values, ids, lse);
  return {values, ids, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("draft_topk", &draft_topk_cuda);
  m.impl("draft_topk_partial", &draft_topk_partial_cuda);
}

}  // namespace kdtree
