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
// and keeps them in registers as orderable keys (NV slots of 16 bytes per thread, 16-byte loads
// where the row is aligned).  The CTAs talk through distributed shared memory and cluster
// barriers (no workspace, no atomics in global memory, no second launch), three barriers a row:
//  1. each CTA: max, sum(exp(x - CTA max)) (ex2.approx), and each thread's largest key.
//  2. threshold tau = the k-th largest of the row's per-thread maxima (two 8-bit radix rounds
//     on 16 key bits, every CTA summing the S histograms itself).  At least k entries are >= tau,
//     so every top-k entry is; with 4096 threads per row it keeps ~1.15 k entries (k = 1024,
//     normal logits) down to ~k (small k).  Fewer threads with entries than k: tau keeps all.
//  3. every warp reserves slots in the leader CTA's candidate buffer (one remote atomic) and
//     writes its entries >= tau there (distributed shared memory), each CTA its (max, sum) too.
//  4. the leader combines the S (max, sum) pairs into log-sum-exp (the CTA holding the row max
//     contributes its exp(x - max) terms unscaled).  More than 2048 candidates (ties, flat rows):
//     the exact top k by a block radix select over the whole row, re-read from L2 (slow, never
//     for the bench's rows).  More than 1024: trimmed to exactly k (block radix select).  Then a
//     bitonic sort of the keys in registers (shuffles below stride 32, shared memory for
//     32..256, in-thread above), and the first k are written.
// Bound: one read of the logits (4.9 MB at R=1, L=15, V=163840 bf16, 1.6 us at 3 TB/s; 39 MB at
// R=8, 13 us).  Measured (H200, first version with four barriers and no trim): R=1 14-19 us for
// k <= 256, 30 us at k=1024; R=8 72-133 us: a row is a latency chain (load, barriers, the leader's
// sort: 55 stages at k=1024, 15 at k=16, 64-bit keys, so the shuffle stages cost 2 warp-shuffles
// per key against the SM's one per clock), and R=8 runs ~3.6 waves of such chains.  Per entry
// ~25 instructions (convert, max, exp, compares).  bf16 V=163840 uses 64 registers (a few spill)
// so two CTAs can share an SM at R=8; at R=1 the launch asks for over half an SM's shared memory
// to keep one CTA per SM.  Clusters need sm_90+ (sm_90 and sm_120 are the build targets).
//
// draft_topk_merge: csrc/topk_merge.cu; the block-wide select helpers: csrc/topk_select.cuh.
//
// Every size is fixed by the shapes (no host sync, no data-dependent allocation), so all three
// ops can be captured in CUDA graphs.
#include "check.h"
#include "topk_select.cuh"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>
#include <ATen/ATen.h>

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
constexpr int kCap = 2048;                    // candidates the leader sorts, at most
constexpr int kIdBits = 18;                   // index in the row < kMaxVocab
constexpr uint32_t kIdMask = (1u << kIdBits) - 1u;
constexpr int kDigitBins = 256;               // 8-bit digits
static_assert((1 << kIdBits) >= kMaxVocab, "row index must fit its key bits");
static_assert(2 * kDigitBins == kThreads, "one thread zeroes one bin of the two histograms");
static_assert(kCap >= 2 * kMaxK && kCap % kThreads == 0 && kCap / kThreads <= 4, "sort layout");

struct TopkShared {
  uint32_t hist[2][kDigitBins];  // this CTA's digit counts for the two threshold rounds
  uint32_t warp_u[kWarps];       // warp max keys, later warp candidate counts
  float warp_f[kWarps];          // warp sums of exp
  uint32_t scan_tot[kDigitBins / 32];
  uint32_t dec_bin, dec_above, dec_cnt, dec_found;  // the current digit's decision
  uint32_t cursor;               // leader only: candidates claimed (may pass kCap)
  float cta_max[kMaxCluster];    // leader only: each CTA's max and sum(exp(x - max))
  float cta_sum[kMaxCluster];
  float row_max, row_logsum;     // leader only
  uint64_t cand[kCap];           // leader only: the gathered candidates' keys
};

struct Digit {
  uint32_t bin, above, cnt;
  bool found;
};

// One digit of a cluster-wide radix select.  Every CTA of the cluster calls it with the same
// need after adding its keys' digits to `hist` (its own copy).  Returns, identically in every
// CTA, the bin holding the need-th largest key counted over the cluster, the keys in higher bins
// (above) and in that bin (cnt); found = false when fewer than need keys were counted.
__device__ Digit cluster_pick(cg::cluster_group& cluster, TopkShared& sh, uint32_t* hist, int S, uint32_t need) {
  cluster.sync();  // every CTA's counts are complete and visible (arrive.release / wait.acquire)
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  uint32_t c = 0, incl = 0;
  if (t < kDigitBins) {  // warps 0..7, whole warps: thread t owns bin 255 - t (highest first)
    const int bin = kDigitBins - 1 - t;
    for (int r = 0; r < S; ++r) c += cluster.map_shared_rank(hist, r)[bin];
    incl = c;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
      if (lane >= off) incl += x;
    }
    if (lane == 31) sh.scan_tot[warp] = incl;
  }
  __syncthreads();
  if (t < kDigitBins) {
    for (int w = 0; w < warp; ++w) incl += sh.scan_tot[w];
    const uint32_t excl = incl - c;  // keys in bins above mine
    if (excl < need && need <= incl) {  // exactly one thread when the cluster counted >= need keys
      sh.dec_bin = uint32_t(kDigitBins - 1 - t);
      sh.dec_above = excl;
      sh.dec_cnt = c;
      sh.dec_found = 1;
    }
    if (t == kDigitBins - 1 && incl < need) sh.dec_found = 0;  // the only writer in that case
  }
  __syncthreads();
  // The fields are rewritten only after the next cluster barrier, which every thread of this
  // CTA reaches after reading them here.
  return Digit{sh.dec_bin, sh.dec_above, sh.dec_cnt, sh.dec_found != 0};
}

// Bitonic sort, descending, of keys[0, n2) (n2 a power of two <= kCap) held in registers: thread
// t holds element t + q * kThreads in v[q] for q < max(1, n2 / kThreads); threads whose elements
// lie at or above n2 hold anything and only ever exchange with each other.  Strides below 32
// use shuffles, strides >= kThreads stay in the thread, the rest go through buf[kCap].
__device__ __forceinline__ uint64_t keep(uint64_t mine, uint64_t other, int i, int size, int stride) {
  const bool desc = (i & size) == 0, lower = (i & stride) == 0;  // lower index keeps the larger key
  return (lower == desc) ? (mine > other ? mine : other) : (mine < other ? mine : other);
}
__device__ __forceinline__ void cmpx(uint64_t& lo, uint64_t& hi, bool desc) {
  if (desc ? lo < hi : lo > hi) {
    const uint64_t x = lo;
    lo = hi;
    hi = x;
  }
}
__device__ void bitonic_sort_any(uint64_t (&v)[4], int n2, uint64_t* buf) {
  const int t = threadIdx.x;
  const int Q = n2 > kThreads ? n2 / kThreads : 1;
  for (int size = 2; size <= n2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= kThreads) {  // partner q ^ (stride / kThreads) in this thread; i & size is
        if (stride == kThreads) {  // the same for both elements of a pair
          cmpx(v[0], v[1], ((t + 0 * kThreads) & size) == 0);
          if (Q == 4) cmpx(v[2], v[3], ((t + 2 * kThreads) & size) == 0);
        } else {  // stride == 2 * kThreads, Q == 4
          cmpx(v[0], v[2], ((t + 0 * kThreads) & size) == 0);
          cmpx(v[1], v[3], ((t + 1 * kThreads) & size) == 0);
        }
      } else if (stride >= 32) {
        __syncthreads();  // the previous stage's reads are done
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (q < Q) buf[t + q * kThreads] = v[q];
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (q < Q) {
            const int i = t + q * kThreads;
            v[q] = keep(v[q], buf[i ^ stride], i, size, stride);
          }
      } else if ((t & ~31) < n2) {  // warp-uniform: warps holding only padding (n2 < 512) idle,
#pragma unroll                     // leaving the SM's shuffle unit to the others
        for (int q = 0; q < 4; ++q)
          if (q < Q) {
            const int i = t + q * kThreads;
            v[q] = keep(v[q], __shfl_xor_sync(0xFFFFFFFFu, v[q], stride), i, size, stride);
          }
      }
    }
  }
}

// The same with n2 fixed at compile time: every stage unrolled, its stride and the pair
// directions constants (the runtime loop spends most of a stage on bookkeeping).
template <int N2>
__device__ __forceinline__ void bitonic_sort_fixed(uint64_t (&v)[4], uint64_t* buf) {
  constexpr int n2 = N2;
  constexpr int kLog = N2 <= 1 ? 0 : 1 + (N2 <= 2 ? 0 : 1 + (N2 <= 4 ? 0 : 1 + (N2 <= 8 ? 0 : 1 + (N2 <= 16 ? 0 : 1 +
                       (N2 <= 32 ? 0 : 1 + (N2 <= 64 ? 0 : 1 + (N2 <= 128 ? 0 : 1 + (N2 <= 256 ? 0 : 1 +
                       (N2 <= 512 ? 0 : 1 + (N2 <= 1024 ? 0 : 1))))))))));
  static_assert((1 << kLog) == N2, "N2 is a power of two");
  const int t = threadIdx.x;
  constexpr int Q = n2 > kThreads ? n2 / kThreads : 1;
#pragma unroll
  for (int a = 1; a <= kLog; ++a) {
    const int size = 1 << a;
#pragma unroll
    for (int b = a - 1; b >= 0; --b) {
      const int stride = 1 << b;
      if (stride >= kThreads) {  // partner q ^ (stride / kThreads) in this thread; i & size is
        if (stride == kThreads) {  // the same for both elements of a pair
          cmpx(v[0], v[1], ((t + 0 * kThreads) & size) == 0);
          if (Q == 4) cmpx(v[2], v[3], ((t + 2 * kThreads) & size) == 0);
        } else {  // stride == 2 * kThreads, Q == 4
          cmpx(v[0], v[2], ((t + 0 * kThreads) & size) == 0);
          cmpx(v[1], v[3], ((t + 1 * kThreads) & size) == 0);
        }
      } else if (stride >= 32) {
        __syncthreads();  // the previous stage's reads are done
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (q < Q) buf[t + q * kThreads] = v[q];
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (q < Q) {
            const int i = t + q * kThreads;
            v[q] = keep(v[q], buf[i ^ stride], i, size, stride);
          }
      } else if ((t & ~31) < n2) {  // warp-uniform: warps holding only padding (n2 < 512) idle,
#pragma unroll                     // leaving the SM's shuffle unit to the others
        for (int q = 0; q < 4; ++q)
          if (q < Q) {
            const int i = t + q * kThreads;
            v[q] = keep(v[q], __shfl_xor_sync(0xFFFFFFFFu, v[q], stride), i, size, stride);
          }
      }
    }
  }
}

// Bitonic sort of n2 <= kCap keys (see bitonic_sort_any); n2 <= 1024 takes an unrolled instance.
__device__ void bitonic_sort_regs(uint64_t (&v)[4], int n2, uint64_t* buf) {
  switch (n2) {
    case 1: return;
    case 2: bitonic_sort_fixed<2>(v, buf); return;
    case 4: bitonic_sort_fixed<4>(v, buf); return;
    case 8: bitonic_sort_fixed<8>(v, buf); return;
    case 16: bitonic_sort_fixed<16>(v, buf); return;
    case 32: bitonic_sort_fixed<32>(v, buf); return;
    case 64: bitonic_sort_fixed<64>(v, buf); return;
    case 128: bitonic_sort_fixed<128>(v, buf); return;
    case 256: bitonic_sort_fixed<256>(v, buf); return;
    case 512: bitonic_sort_fixed<512>(v, buf); return;
    case 1024: bitonic_sort_fixed<1024>(v, buf); return;
    default: bitonic_sort_any(v, n2, buf); return;
  }
}

// Thread t of the CTA with cluster rank c holds NV slots of W = Tr::kVec consecutive entries:
// slot j covers chunk entries [(j * kThreads + t) * W, +W), chunk = row entries [c * C, c * C + n).
// Keys are orderable value bits (bf16: two 16-bit keys per word, the even entry in the low half;
// float32: one per word); 0 marks no entry (real keys are >= 0x7F: -inf maps there).
template <typename Tr>
struct Slots;
template <>
struct Slots<Bf16> {
  __device__ static uint32_t get(const uint4& s, int e) { return ((&s.x)[e >> 1] >> (16 * (e & 1))) & 0xFFFFu; }
  __device__ static void convert(uint4& s, int nvalid) {  // raw bf16 bits -> keys
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t raw = (&s.x)[w];
      const uint32_t lo = 2 * w < nvalid ? Bf16::orderable(raw & 0xFFFFu) : 0u;
      const uint32_t hi = 2 * w + 1 < nvalid ? Bf16::orderable(raw >> 16) : 0u;
      (&s.x)[w] = lo | (hi << 16);
    }
  }
  __device__ static uint32_t top16(uint32_t key) { return key; }
};
template <>
struct Slots<F32> {
  __device__ static uint32_t get(const uint4& s, int e) { return (&s.x)[e]; }
  __device__ static void convert(uint4& s, int nvalid) {
#pragma unroll
    for (int w = 0; w < 4; ++w) (&s.x)[w] = w < nvalid ? F32::orderable((&s.x)[w]) : 0u;
  }
  __device__ static uint32_t top16(uint32_t key) { return key >> 16; }
};

// An empty asm that "rewrites" the slots: values unpacked from them in one pass cannot be kept
// alive into the next (the compiler would otherwise hold every unpacked key and spill).
template <int NV>
__device__ __forceinline__ void launder(uint4 (&s)[NV]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) asm volatile("" : "+r"(s[j].x), "+r"(s[j].y), "+r"(s[j].z), "+r"(s[j].w));
}

template <typename Tr>
__device__ __forceinline__ float key_to_float(uint32_t key) {
  return Tr::to_float(Tr::from_orderable(key));
}

template <typename Tr, int NV>
__global__ void __launch_bounds__(kThreads, (NV * Tr::kVec <= 40) ? 2 : 1)  // 2 CTAs per SM up to V = 163840
topk_cluster_kernel(const typename Tr::Raw* __restrict__ logits, int V, int C, int S, int k, bool vec_ok,
                    int64_t vocab_start, bool partial, float* __restrict__ out_val, int64_t* __restrict__ out_id,
                    float* __restrict__ out_lse) {
  using Raw = typename Tr::Raw;
  using Sl = Slots<Tr>;
  constexpr int W = Tr::kVec;
  constexpr int kKeyBits = Tr::kBits + kIdBits;
  __shared__ TopkShared sh;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int64_t row = blockIdx.x / S;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int c0 = rank * C;
  const int n = max(0, min(V - c0, C));
  const Raw* src = logits + row * int64_t(V) + c0;

  (&sh.hist[0][0])[t] = 0;
  if (t == 0) sh.cursor = 0;  // the others add to the leader's only after a cluster barrier

  // ---- load: 16-byte loads of whole slots where aligned, scalar loads for the rest ----
  uint4 s[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int slot = j * kThreads + t;
    s[j] = make_uint4(0u, 0u, 0u, 0u);
    if (vec_ok && (slot + 1) * W <= n) s[j] = __ldg(reinterpret_cast<const uint4*>(src) + slot);
  }
  if (!vec_ok || n % W != 0) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int base = (j * kThreads + t) * W;
      if (!(vec_ok && base + W <= n) && base < n) {
        Raw r[W];
#pragma unroll
        for (int e = 0; e < W; ++e) r[e] = base + e < n ? src[base + e] : Raw(0);
        if constexpr (W == 8) {
          s[j] = make_uint4(r[0] | (uint32_t(r[1]) << 16), r[2] | (uint32_t(r[3]) << 16),
                            r[4] | (uint32_t(r[5]) << 16), r[6] | (uint32_t(r[7]) << 16));
        } else {
          s[j] = make_uint4(r[0], r[1], r[2], r[3]);
        }
      }
    }
  }
  uint32_t tmax = 0;  // this thread's largest key (0: it holds no entry)
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    Sl::convert(s[j], n - (j * kThreads + t) * W);
#pragma unroll
    for (int e = 0; e < W; ++e) tmax = max(tmax, Sl::get(s[j], e));
  }
  const uint32_t wmax = __reduce_max_sync(0xFFFFFFFFu, tmax);
  if (lane == 0) sh.warp_u[warp] = wmax;
  __syncthreads();  // histograms zeroed, warp maxima published

  // ---- threshold: the k-th largest thread maximum, on 16 key bits (two 8-bit rounds) ----
  // At least k entries (those maxima) are >= it, so every top-k entry is: it is a valid lower
  // bound for the candidates, and with many more threads than k it keeps about 1.15 k entries.
  const uint32_t m16 = Sl::top16(tmax);
  hist_add(sh.hist[0], tmax != 0, m16 >> 8);  // warp-aggregated: most maxima share a bin
  uint32_t ckey = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) ckey = max(ckey, sh.warp_u[w]);
  const float cmax = ckey == 0 ? -INFINITY : key_to_float<Tr>(ckey);
  float tsum = 0.0f;  // sum(exp(x - CTA max)), overlapping the cluster barrier below
  launder(s);
  if (cmax != -INFINITY) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const uint32_t key = Sl::get(s[j], e);
        const float p = __expf(key_to_float<Tr>(key) - cmax);
        tsum += key != 0 ? p : 0.0f;
      }
  }
  uint32_t tau = 1;  // candidates: key >= tau (1: every entry)
  {
    uint32_t need = uint32_t(k);
    const Digit hi = cluster_pick(cluster, sh, sh.hist[0], S, need);
    if (hi.found) {  // otherwise fewer than k threads hold entries: keep them all
      need -= hi.above;
      hist_add(sh.hist[1], tmax != 0 && (m16 >> 8) == hi.bin, m16 & 0xFFu);
      const Digit lo = cluster_pick(cluster, sh, sh.hist[1], S, need);
      const uint32_t t16 = (hi.bin << 8) | lo.bin;  // lo.found: bin hi.bin holds >= need maxima
      tau = max(1u, Tr::kBits == 16 ? t16 : t16 << 16);
    }
  }

  // ---- gather the entries >= tau into the leader's cand[] (distributed shared memory) ----
  // One remote atomic per warp reserves its slots; the sort makes the order irrelevant.  Past
  // kCap nothing is written, and the leader falls back to an exact select (below).
  auto id_key = [&](int j, int e) -> uint32_t { return kIdMask - uint32_t(c0 + (j * kThreads + t) * W + e); };
  launder(s);
  uint32_t cnt = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j)
#pragma unroll
    for (int e = 0; e < W; ++e) cnt += Sl::get(s[j], e) >= tau ? 1u : 0u;
  uint32_t incl = cnt;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
    if (lane >= off) incl += x;
  }
  uint32_t base = 0;
  if (lane == 31 && incl != 0) base = atomicAdd(cluster.map_shared_rank(&sh.cursor, 0), incl);
  base = __shfl_sync(0xFFFFFFFFu, base, 31);
  float ws = tsum;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ws += __shfl_xor_sync(0xFFFFFFFFu, ws, off);
  if (lane == 0) sh.warp_f[warp] = ws;
  {
    launder(s);
    uint64_t* dst = cluster.map_shared_rank(sh.cand, 0);
    uint32_t pos = base + incl - cnt;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < W; ++e) {
        const uint32_t key = Sl::get(s[j], e);
        if (key >= tau) {
          if (pos < uint32_t(kCap)) dst[pos] = (uint64_t(key) << kIdBits) | id_key(j, e);
          ++pos;
        }
      }
  }
  __syncthreads();  // warp sums in place
  if (t == 0) {     // this CTA's max and sum(exp(x - max)), into the leader's shared memory
    float cs = 0.0f;
    for (int w = 0; w < kWarps; ++w) cs += sh.warp_f[w];
    TopkShared* leader = cluster.map_shared_rank(&sh, 0);
    leader->cta_max[rank] = cmax;
    leader->cta_sum[rank] = cmax == -INFINITY ? 0.0f : cs;
  }
  cluster.sync();  // candidates and statistics in the leader; nobody reads another CTA after this
  if (rank != 0) return;

  // ---- leader: the row's log-sum-exp ----
  if (warp == 0) {
    const float m = lane < S ? sh.cta_max[lane] : -INFINITY;
    const float sm = lane < S ? sh.cta_sum[lane] : 0.0f;
    float rm = m;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) rm = fmaxf(rm, __shfl_xor_sync(0xFFFFFFFFu, rm, off));
    // the CTA holding the row max contributes its exp(x - max) terms unscaled
    float part = m == -INFINITY ? 0.0f : (m == rm ? sm : sm * expf(m - rm));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xFFFFFFFFu, part, off);
    if (lane == 0) {
      sh.row_max = rm;
      sh.row_logsum = logf(part);
    }
  }
  __shared__ SelectShared sel;
  const uint32_t total = sh.cursor;
  int ncand = int(min(total, uint32_t(kCap)));
  if (total > uint32_t(kCap)) {
    // More than 2048 entries tie with or sit above tau (ties, flat rows; never for the bench's
    // rows): the exact top k by a block radix select over the whole row, re-read from L2.
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
    radix_select<kThreads, 0>(sel, key_at, iters, kKeyBits, uint32_t(k), false, prefix, shift);
    if (t == 0) sel.count = 0;
    __syncthreads();
    for (int j = 0; j < iters; ++j) {
      uint64_t key;
      const bool take = key_at(j, key) && shr(key, shift) >= prefix;
      const int pos = warp_claim(take, &sel.count);
      if (take && pos < k) sh.cand[pos] = key;
    }
    ncand = k;
  }
  __syncthreads();  // cand[] and the row statistics in place

  // ---- leader: sort the candidates, write the top k ----
  int n2 = 1;
  while (n2 < ncand) n2 <<= 1;
  uint64_t v[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = t + q * kThreads;
    v[q] = i < ncand ? sh.cand[i] : 0;  // 0 sorts below every real key
  }
  if (n2 > kMaxK) {  // n2 = 2048 > next_pow2(k)
    // More than 1024 candidates (k = 1024 keeps ~1.2 k): select the k largest first (block radix
    // select, ~2 digits) so the bitonic sort runs over 1024 keys instead of 2048; the shuffle
    // stages, bound by the SM's one warp-shuffle per clock, dominate its cost.
    auto key_at = [&](int q, uint64_t& key) -> bool {
      key = v[q];
      return key != 0;
    };
    uint64_t prefix;
    int shift;
    radix_select<kThreads, 4>(sel, key_at, 4, kKeyBits, uint32_t(k), false, prefix, shift);
    if (t == 0) sel.count = 0;
    __syncthreads();  // every thread read its v[] from cand[] before radix_select's barriers
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const bool take = v[q] != 0 && shr(v[q], shift) >= prefix;
      const int pos = warp_claim(take, &sel.count);
      if (take && pos < k) sh.cand[pos] = v[q];
    }
    __syncthreads();
    n2 = next_pow2(k);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = t + q * kThreads;
      v[q] = i < k ? sh.cand[i] : 0;
    }
  }
  bitonic_sort_regs(v, n2, sh.cand);
  const float m = sh.row_max, ls = sh.row_logsum;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = t + q * kThreads;
    if (i < k) {
      const uint64_t key = v[q];
      const float x = key_to_float<Tr>(uint32_t(key >> kIdBits));
      const int64_t o = row * k + i;
      out_val[o] = partial ? x : (x - m) - ls;  // torch.log_softmax's (x - max) - log(sum)
      out_id[o] = vocab_start + int64_t(kIdMask - uint32_t(key & kIdMask));
    }
  }
  if (partial && t == 0) out_lse[row] = ls + m;  // torch.logsumexp's log(sum) + max
}

// --------------------------------------------------------------------------------------------
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

// A launch with no more CTAs than SMs (R = 1: 120 CTAs) is latency bound, and each CTA has a
// whole SM's worth of per-entry work; the 64-register instances would let two CTAs share an SM.
// Asking for more than half of an SM's shared memory keeps them one per SM, used only when the
// GPU still holds every cluster at once that way (cudaOccupancyMaxActiveClusters, cached per
// instance, S and device).  Returns the dynamic shared memory to request (0: no spreading).
template <typename Tr, int NV>
size_t spread_smem(int64_t rows, int S, cudaStream_t stream) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  if (rows * S > prop->multiProcessorCount || device >= 64) return 0;
  const size_t dyn = prop->sharedMemPerMultiprocessor / 2 + 1;
  auto kernel = topk_cluster_kernel<Tr, NV>;
  cudaFuncAttributes fa;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  if (fa.sharedSizeBytes + dyn > prop->sharedMemPerBlockOptin) return 0;
  static std::atomic<int> max_clusters[4][64];  // [log2 S][device]: max active clusters + 1, 0 = unknown
  const int lg = S >= 8 ? 3 : S >= 4 ? 2 : S >= 2 ? 1 : 0;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dyn)));
  int cached = max_clusters[lg][device].load();
  if (cached == 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(rows * S));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = dyn;
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
  return rows <= int64_t(cached - 1) ? dyn : 0;
}

template <typename Tr, int NV>
void launch_cluster(const at::Tensor& logits, int64_t rows, const ClusterPlan& plan, int64_t k, int64_t vocab_start,
                    bool partial, at::Tensor& out_val, at::Tensor& out_id, at::Tensor& out_lse) {
  using Raw = typename Tr::Raw;
  const int V = int(logits.size(2));
  const bool vec_ok = V % Tr::kVec == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows * plan.S));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cfg.dynamicSmemBytes = spread_smem<Tr, NV>(rows, plan.S, cfg.stream);  // unused by the kernel
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.S);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, topk_cluster_kernel<Tr, NV>, reinterpret_cast<const Raw*>(logits.data_ptr()),
                                    V, plan.C, plan.S, int(k), vec_ok, vocab_start, partial,
                                    out_val.data_ptr<float>(), out_id.data_ptr<int64_t>(),
                                    partial ? out_lse.data_ptr<float>() : static_cast<float*>(nullptr)));
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
    if (plan.nv <= 2) launch_cluster<Bf16, 2>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else if (plan.nv <= 5) launch_cluster<Bf16, 5>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else launch_cluster<Bf16, 8>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
  } else {
    if (plan.nv <= 4) launch_cluster<F32, 4>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else if (plan.nv <= 10) launch_cluster<F32, 10>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
    else launch_cluster<F32, 16>(logits, rows, plan, k, vocab_start, partial, out_val, out_id, out_lse);
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
