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
// barriers (no workspace, no atomics in global memory, no second launch):
//  1. each CTA: max, sum(exp(x - CTA max)) (ex2.approx), and each thread's largest key.
//  2. threshold tau = the k-th largest of the row's per-thread maxima (two 8-bit radix rounds
//     on 16 key bits, every CTA summing the S histograms itself).  At least k entries are >= tau,
//     so every top-k entry is; with 4096 threads per row it keeps ~1.15 k entries (k = 1024,
//     normal logits) down to ~k (small k).  Fewer threads with entries than k: tau keeps all.
//  3. count the entries >= tau (block scan gives each thread its slots); if more than 2048
//     (ties, flat rows), continue the radix select on the full keys of those entries, 8 bits a
//     round, until at most 2048 remain (keys are distinct, so the last digit leaves exactly k).
//  4. every CTA writes its candidates into the leader CTA's shared memory; the leader combines
//     the S (max, sum) pairs into log-sum-exp (the CTA holding the row max contributes its
//     exp(x - max) terms unscaled), bitonic-sorts the <= 2048 candidate keys in registers
//     (shuffles below stride 32, shared memory for 32..256) and writes the first k.
// Bound: one read of the logits (4.9 MB at R=1, L=15, V=163840 bf16, 1.6 us at 3 TB/s; 39 MB at
// R=8).  At R=1 the 120 CTAs (one per SM) are latency bound: the load, four cluster barriers
// (two threshold rounds, the count exchange, the gather), and the leader's sort (~66 stages at
// k=1024, ~15 at k=16); per entry only ~15 instructions (convert, max, exp, two compares).
// At R=8 (960 CTAs, 2 per SM for bf16 V=163840) the load and those instructions overlap
// across CTAs.  Clusters need sm_90+ (sm_90 and sm_120 are the build targets).
//
// draft_topk_merge on [P, rows, k_in] candidates: one block per row runs a block-wide radix
// select (11-bit digits, shared-memory histograms) and a bitonic sort over the P*k_in keys
// (id_bits = 32, re-read from global/L2 on every digit) and logsumexp over the P parts' lse.
//
// Every size is fixed by the shapes (no host sync, no data-dependent allocation), so all three
// ops can be captured in CUDA graphs.
#include "check.h"
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>

namespace kdtree {
namespace {

namespace cg = cooperative_groups;

constexpr int kMaxK = 1024;
constexpr int kMaxVocab = 262144;
// the merge kernel's block-wide select
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kRowThreads = 1024;
static_assert(kRowThreads >= kMaxK, "the merge sort holds one key per thread");
static_assert(kBins % kRowThreads == 0, "bins split evenly over threads");

struct Bf16 {
  using Raw = uint16_t;
  using ChunkKey = uint32_t;  // 16 value bits + 14 index bits
  static constexpr int kBits = 16;
  static constexpr int kVec = 8;  // per 16-byte load
  __device__ static float to_float(uint32_t raw) { return __uint_as_float(raw << 16); }
  __device__ static uint32_t orderable(uint32_t raw) {
    uint32_t u = raw & 0xFFFFu;
    const uint32_t mag = u & 0x7FFFu;
    if (mag == 0) u = 0;                    // -0 == +0
    else if (mag > 0x7F80u) u = 0x7FC0u;    // NaN
    return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
  }
  __device__ static uint32_t from_orderable(uint32_t o) {
    return (o & 0x8000u) ? (o & 0x7FFFu) : (~o & 0xFFFFu);
  }
};

struct F32 {
  using Raw = uint32_t;
  using ChunkKey = uint64_t;  // 32 value bits + 14 index bits
  static constexpr int kBits = 32;
  static constexpr int kVec = 4;
  __device__ static float to_float(uint32_t raw) { return __uint_as_float(raw); }
  __device__ static uint32_t orderable(uint32_t u) {
    const uint32_t mag = u & 0x7FFFFFFFu;
    if (mag == 0) u = 0;
    else if (mag > 0x7F800000u) u = 0x7FC00000u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  __device__ static uint32_t from_orderable(uint32_t o) {
    return (o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o;
  }
};

struct SelectShared {
  uint32_t hist[kBins];
  uint32_t warp_total[32];
  uint32_t bin, above, cnt;  // the current digit's decision
  uint32_t count;            // compaction cursor
  float red[32];
  float bcast;
};

template <typename Key>
__device__ __forceinline__ Key shr(Key x, int s) { return s >= int(8 * sizeof(Key)) ? Key(0) : Key(x >> s); }

// Adds one to hist[bin] for every active lane; lanes with equal bins add once (peaked logits put
// most of a warp into one bin).  All 32 lanes must call it.
__device__ __forceinline__ void hist_add(uint32_t* hist, bool active, uint32_t bin) {
  if (__ballot_sync(0xFFFFFFFFu, active) == 0) return;  // later digits: most warps match nothing
  const uint32_t peers = __match_any_sync(0xFFFFFFFFu, active ? bin : 0xFFFFFFFFu);
  if (active && __ffs(peers) - 1 == int(threadIdx.x & 31)) atomicAdd(&hist[bin], uint32_t(__popc(peers)));
}

// A slot for every lane with take = true, from one atomic per warp.  All 32 lanes must call it.
__device__ __forceinline__ int warp_claim(bool take, uint32_t* cursor) {
  const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, take);
  if (ballot == 0) return -1;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(cursor, uint32_t(__popc(ballot)));
  base = __shfl_sync(0xFFFFFFFFu, base, leader);
  return take ? int(base + __popc(ballot & ((1u << lane) - 1u))) : -1;
}

template <int THREADS>
__device__ __forceinline__ uint32_t block_inclusive_scan(uint32_t v, uint32_t* warp_total) {
  constexpr int kWarps = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t t = __shfl_up_sync(0xFFFFFFFFu, v, off);
    if (lane >= off) v += t;
  }
  if (lane == 31) warp_total[warp] = v;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < kWarps ? warp_total[lane] : 0u;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t t = __shfl_up_sync(0xFFFFFFFFu, w, off);
      if (lane >= off) w += t;
    }
    if (lane < kWarps) warp_total[lane] = w;
  }
  __syncthreads();
  return v + (warp > 0 ? warp_total[warp - 1] : 0u);
}


// Block-wide radix select.  key_at(j, key) yields this thread's j-th key and whether it exists,
// for j < iters (the same iters in every thread; ITERS > 0 fixes it at compile time so that keys
// held in a register array stay in registers).  Keys are distinct and below 2^bits (bits >= 11),
// and at least k of them exist.  With first_digit_counted, sh.hist already holds the counts of
// the top 11-bit digit of every key (and a barrier has passed since).  On return, exactly k keys
// satisfy shr(key, shift) >= prefix: they are the k largest.  Every thread returns the same
// (prefix, shift).
template <int THREADS, int ITERS, typename Key, typename KeyAt>
__device__ void radix_select(SelectShared& sh, KeyAt key_at, int iters, int bits, uint32_t k,
                             bool first_digit_counted, Key& prefix_out, int& shift_out) {
  constexpr int kPerThread = kBins / THREADS;
  Key prefix = 0;
  int shift = bits;
  uint32_t need = k;  // keys still to take among those matching prefix
  bool counted = first_digit_counted;
  while (shift > 0) {
    const int d = shift < kDigitBits ? shift : kDigitBits;
    const int low = shift - d;
    const uint32_t mask = (1u << d) - 1u;
    if (!counted) {
      for (int b = threadIdx.x; b < kBins; b += THREADS) sh.hist[b] = 0;
      __syncthreads();
      const int n_it = ITERS > 0 ? ITERS : iters;
#pragma unroll
      for (int j = 0; j < n_it; ++j) {
        Key key;
        const bool valid = key_at(j, key);
        hist_add(sh.hist, valid && shr(key, shift) == prefix, uint32_t(key >> low) & mask);
      }
    }
    counted = false;
    __syncthreads();
    // Everyone has read the previous digit's decision by now.  The default only survives if the
    // counts were inconsistent (never for valid inputs); it keeps the loop finite.
    if (threadIdx.x == 0) {
      sh.bin = 0;
      sh.above = 0;
      sh.cnt = 0xFFFFFFFFu;
    }
    // Thread t owns bins [hi - kPerThread, hi), counted from the top, so an inclusive scan
    // gives the number of keys in bins >= its lowest bin.
    const int hi = kBins - int(threadIdx.x) * kPerThread;
    uint32_t local = 0;
#pragma unroll
    for (int b = 1; b <= kPerThread; ++b) local += sh.hist[hi - b];
    const uint32_t incl = block_inclusive_scan<THREADS>(local, sh.warp_total);
    const uint32_t excl = incl - local;
    if (excl < need && need <= incl) {  // exactly one thread: the need-th key is in its bins
      uint32_t acc = excl;
#pragma unroll
      for (int b = 1; b <= kPerThread; ++b) {
        const uint32_t c = sh.hist[hi - b];
        if (acc + c >= need) {
          sh.bin = uint32_t(hi - b);
          sh.above = acc;
          sh.cnt = c;
          break;
        }
        acc += c;
      }
    }
    __syncthreads();
    const uint32_t bin = sh.bin, above = sh.above, cnt = sh.cnt;
    prefix = (prefix << d) | bin;
    need -= above;
    shift = low;
    if (cnt == need) break;  // the k-th key's bin is taken whole
  }
  prefix_out = prefix;
  shift_out = shift;
}

// Bitonic sort, descending, of n <= 1024 keys held one per thread of a 1024-thread block
// (thread t holds element t; threads t >= n hold anything and do not disturb [0, n)).  Strides
// below 32 exchange through shuffles, larger ones through buf[1024]; returns thread t's sorted key.
__device__ uint64_t bitonic_sort_desc_1024(uint64_t v, uint64_t* buf, int n) {
  const int t = threadIdx.x;
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      uint64_t other;
      if (stride >= 32) {
        buf[t] = v;
        __syncthreads();
        other = buf[t ^ stride];
        __syncthreads();
      } else {
        other = __shfl_xor_sync(0xFFFFFFFFu, v, stride);
      }
      // In a descending run the lower index of a pair keeps the larger key.
      const bool desc = (t & size) == 0;
      const bool lower = (t & stride) == 0;
      v = (lower == desc) ? (v > other ? v : other) : (v < other ? v : other);
    }
  }
  return v;
}

__device__ __forceinline__ int next_pow2(int k) {
  int n = 1;
  while (n < k) n <<= 1;
  return n;
}

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
  uint32_t hist[2][kDigitBins];  // this CTA's digit counts; alternate rounds use alternate halves
  uint32_t warp_u[kWarps];       // warp max keys, later warp candidate counts
  float warp_f[kWarps];          // warp sums of exp
  uint32_t scan_tot[kDigitBins / 32];
  uint32_t dec_bin, dec_above, dec_cnt, dec_found;  // the current digit's decision
  uint32_t cta_count;            // published to the cluster: this CTA's candidates
  float cta_max, cta_sum;        // published to the cluster: max and sum(exp(x - max))
  uint32_t cta_offset, total;    // this CTA's first slot in the leader's cand[], the cluster's count
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
__device__ void bitonic_sort_regs(uint64_t (&v)[4], int n2, uint64_t* buf) {
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
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (q < Q) {
            const int i = t + q * kThreads;
            v[q] = keep(v[q], __shfl_xor_sync(0xFFFFFFFFu, v[q], stride), i, size, stride);
          }
      }
    }
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
  if (tmax != 0) atomicAdd(&sh.hist[0][m16 >> 8], 1u);
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
  int round = 0;  // cluster_pick rounds so far: round r counts into hist[r & 1]
  uint32_t tau = 1;  // candidates: key >= tau (1: every entry)
  {
    uint32_t need = uint32_t(k);
    const Digit hi = cluster_pick(cluster, sh, sh.hist[0], S, need);
    ++round;
    if (hi.found) {  // otherwise fewer than k threads hold entries: keep them all
      need -= hi.above;
      if (tmax != 0 && (m16 >> 8) == hi.bin) atomicAdd(&sh.hist[1][m16 & 0xFFu], 1u);
      const Digit lo = cluster_pick(cluster, sh, sh.hist[1], S, need);
      ++round;
      const uint32_t t16 = (hi.bin << 8) | lo.bin;  // lo.found: bin hi.bin holds >= need maxima
      tau = max(1u, Tr::kBits == 16 ? t16 : t16 << 16);
    }
  }

  // Candidate filter: key >= tau, and (after a refinement) full key >= floor_key:floor_id.
  bool refined = false;
  uint32_t floor_key = 0, floor_id = 0;
  auto id_key = [&](int base, int j, int e) -> uint32_t { return kIdMask - uint32_t(base + (j * kThreads + t) * W + e); };
  auto passes = [&](int j, int e) -> bool {
    const uint32_t key = Sl::get(s[j], e);
    return key >= tau && (!refined || key > floor_key || (key == floor_key && id_key(c0, j, e) >= floor_id));
  };

  // Counts this thread's candidates, its first slot among the CTA's, the CTA's and the cluster's
  // totals and this CTA's first slot in the leader's cand[] (sh.cta_offset, sh.total).
  auto count_and_exchange = [&](bool with_stats) -> uint32_t {
    launder(s);
    uint32_t cnt = 0;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < W; ++e) cnt += passes(j, e) ? 1u : 0u;
    uint32_t incl = cnt;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t x = __shfl_up_sync(0xFFFFFFFFu, incl, off);
      if (lane >= off) incl += x;
    }
    if (lane == 31) sh.warp_u[warp] = incl;
    if (with_stats) {
      float ws = tsum;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ws += __shfl_xor_sync(0xFFFFFFFFu, ws, off);
      if (lane == 0) sh.warp_f[warp] = ws;
    }
    __syncthreads();
    uint32_t before = 0, cta_total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const uint32_t c = sh.warp_u[w];
      before += w < warp ? c : 0u;
      cta_total += c;
    }
    if (t == 0) {
      sh.cta_count = cta_total;
      if (with_stats) {
        float cs = 0.0f;
        for (int w = 0; w < kWarps; ++w) cs += sh.warp_f[w];
        sh.cta_max = cmax;
        sh.cta_sum = cmax == -INFINITY ? 0.0f : cs;
      }
    }
    cluster.sync();
    if (warp == 0) {
      const uint32_t c = lane < S ? *cluster.map_shared_rank(&sh.cta_count, lane) : 0u;
      const uint32_t off = __reduce_add_sync(0xFFFFFFFFu, lane < rank ? c : 0u);
      const uint32_t total = __reduce_add_sync(0xFFFFFFFFu, c);
      if (lane == 0) {
        sh.cta_offset = off;
        sh.total = total;
      }
    }
    if (with_stats && rank == 0 && warp == 1) {  // the row's max and log(sum(exp(x - max)))
      const float m = lane < S ? *cluster.map_shared_rank(&sh.cta_max, lane) : -INFINITY;
      const float sm = lane < S ? *cluster.map_shared_rank(&sh.cta_sum, lane) : 0.0f;
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
    __syncthreads();
    return before + incl - cnt;
  };

  uint32_t first = count_and_exchange(true);
  if (sh.total > uint32_t(kCap)) {
    // Too many entries tie with or sit above tau (ties, flat rows): select on the full keys
    // (value, then lower id) among them, 8 bits a round, until at most kCap remain.  Keys are
    // distinct, so the last digit leaves exactly k.
    uint32_t need = uint32_t(k), above = 0;
    uint64_t prefix = 0;  // the top kKeyBits - shift bits of the need-th largest key
    int shift = kKeyBits;
    while (true) {
      const int d = shift < 8 ? shift : 8;
      const int low = shift - d;
      uint32_t* h = sh.hist[round & 1];
      if (t < kDigitBins) h[t] = 0;  // its last readers passed the cluster barrier of the last round
      __syncthreads();
      int base = c0;
      asm volatile("" : "+r"(base));  // keeps the 64-bit keys from being hoisted (and held) across rounds
      launder(s);
#pragma unroll
      for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int e = 0; e < W; ++e) {
          const uint32_t key = Sl::get(s[j], e);
          const uint64_t f = (uint64_t(key) << kIdBits) | id_key(base, j, e);
          if (key >= tau && (f >> shift) == prefix) atomicAdd(&h[uint32_t(f >> low) & ((1u << d) - 1u)], 1u);
        }
      const Digit g = cluster_pick(cluster, sh, h, S, need);
      ++round;
      prefix = (prefix << d) | (g.found ? g.bin : 0u);
      shift = low;
      if (!g.found) break;  // inconsistent counts (never for valid inputs); keeps the loop finite
      above += g.above;
      need -= g.above;
      if (above + g.cnt <= uint32_t(kCap) || shift == 0) break;
    }
    // keys >= prefix << shift: exactly the above + cnt entries the last round counted
    const uint64_t lo = prefix << shift;
    floor_key = uint32_t(lo >> kIdBits);
    floor_id = uint32_t(lo) & kIdMask;
    refined = true;
    first = count_and_exchange(false);
  }

  // ---- gather into the leader's cand[] (distributed shared memory) ----
  {
    launder(s);
    uint64_t* dst = cluster.map_shared_rank(sh.cand, 0);
    uint32_t pos = sh.cta_offset + first;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < W; ++e)
        if (passes(j, e)) {
          if (pos < uint32_t(kCap)) dst[pos] = (uint64_t(Sl::get(s[j], e)) << kIdBits) | id_key(c0, j, e);
          ++pos;
        }
  }
  const int ncand = int(min(sh.total, uint32_t(kCap)));
  cluster.sync();  // candidates in place; no CTA touches another's shared memory after this
  if (rank != 0) return;

  // ---- leader: sort the candidates, write the top k ----
  int n2 = 1;
  while (n2 < ncand) n2 <<= 1;
  uint64_t v[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = t + q * kThreads;
    v[q] = i < ncand ? sh.cand[i] : 0;  // 0 sorts below every real key
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

__global__ void __launch_bounds__(kRowThreads, 1)
topk_merge_kernel(const float* __restrict__ values, const int64_t* __restrict__ ids, const float* __restrict__ lse,
                  int P, int64_t rows, int kin, int k, float* __restrict__ out_lp, int64_t* __restrict__ out_id) {
  __shared__ SelectShared sh;
  __shared__ uint64_t sorted[kRowThreads];
  __shared__ float row_lse;
  const int64_t row = blockIdx.x;
  const int n = P * kin;
  const int n2 = next_pow2(k);
  sorted[threadIdx.x] = 0;
  if (threadIdx.x < 32) {  // logsumexp over the parts, as torch.logsumexp (an infinite max counts as 0)
    const int lane = threadIdx.x;
    float m = -INFINITY;
    for (int p = lane; p < P; p += 32) m = fmaxf(m, lse[p * rows + row]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    const float mu = isinf(m) ? 0.0f : m;
    float s = 0.0f;
    for (int p = lane; p < P; p += 32) s += expf(lse[p * rows + row] - mu);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
    if (lane == 0) row_lse = logf(s) + mu;
  }
  auto key_at = [&](int j, uint64_t& key) -> bool {
    const int i = j * kRowThreads + int(threadIdx.x);
    if (i >= n) {
      key = 0;
      return false;
    }
    const int p = i / kin, q = i - p * kin;
    const int64_t o = (int64_t(p) * rows + row) * kin + q;
    key = (uint64_t(F32::orderable(__float_as_uint(values[o]))) << 32) | uint64_t(0xFFFFFFFFu - uint32_t(ids[o]));
    return true;
  };
  const int iters = (n + kRowThreads - 1) / kRowThreads;
  uint64_t prefix;
  int shift;
  radix_select<kRowThreads, 0>(sh, key_at, iters, 64, uint32_t(k), false, prefix, shift);
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int j = 0; j < iters; ++j) {
    uint64_t key;
    const bool take = key_at(j, key) && shr(key, shift) >= prefix;
    const int pos = warp_claim(take, &sh.count);
    if (take && pos < k) sorted[pos] = key;
  }
  __syncthreads();
  const uint64_t key = bitonic_sort_desc_1024(sorted[threadIdx.x], sorted, n2);
  const float lse_all = row_lse;
  if (int(threadIdx.x) < k) {
    const int i = threadIdx.x;
    const int64_t o = row * k + i;
    out_lp[o] = __uint_as_float(F32::from_orderable(uint32_t(key >> 32))) - lse_all;
    out_id[o] = int64_t(0xFFFFFFFFu - uint32_t(key));
  }
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

template <typename Tr, int NV>
void launch_cluster(const at::Tensor& logits, int64_t rows, const ClusterPlan& plan, int64_t k, int64_t vocab_start,
                    bool partial, at::Tensor& out_val, at::Tensor& out_id, at::Tensor& out_lse) {
  using Raw = typename Tr::Raw;
  const int V = int(logits.size(2));
  const bool vec_ok = V % Tr::kVec == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(rows * plan.S));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = at::cuda::getCurrentCUDAStream();
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

std::tuple<at::Tensor, at::Tensor> draft_topk_merge_cuda(const at::Tensor& values, const at::Tensor& token_ids,
                                                        const at::Tensor& lse, int64_t k) {
  const char* op = "kdtree::draft_topk_merge";
  KD_CHECK(values.is_cuda() && token_ids.is_cuda() && lse.is_cuda(), op, ": inputs must be CUDA tensors");
  KD_CHECK(values.device() == token_ids.device() && values.device() == lse.device(), op,
              ": all inputs must be on one device");
  KD_CHECK(values.scalar_type() == at::kFloat, op, ": values must be float32, got ", values.scalar_type());
  KD_CHECK(token_ids.scalar_type() == at::kLong, op, ": token_ids must be int64, got ", token_ids.scalar_type());
  KD_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32, got ", lse.scalar_type());
  KD_CHECK(values.dim() == 4, op, ": values must have 4 dimensions [P, R, L, k_in], got shape ", values.sizes());
  KD_CHECK(token_ids.sizes() == values.sizes(), op, ": token_ids shape ", token_ids.sizes(), " != values shape ",
              values.sizes());
  KD_CHECK(lse.dim() == 3 && lse.size(0) == values.size(0) && lse.size(1) == values.size(1) &&
                  lse.size(2) == values.size(2),
              op, ": lse must have shape [P, R, L], got ", lse.sizes());
  KD_CHECK(values.is_contiguous() && token_ids.is_contiguous() && lse.is_contiguous(), op,
              ": values, token_ids and lse must be contiguous");
  const int64_t P = values.size(0), R = values.size(1), L = values.size(2), kin = values.size(3);
  KD_CHECK(P >= 1 && kin >= 1, op, ": need at least one part with at least one entry");
  KD_CHECK(k >= 1 && k <= kMaxK, op, ": k must be in [1, ", kMaxK, "], got ", k);
  KD_CHECK(k <= P * kin, op, ": k = ", k, " exceeds the ", P, " x ", kin, " candidates");
  KD_CHECK(P * kin <= (int64_t(1) << 30), op, ": too many candidates per row (P * k_in = ", P * kin, ")");
  const c10::cuda::CUDAGuard guard(values.device());
  auto opts = values.options();
  at::Tensor logprobs = at::empty({R, L, k}, opts);
  at::Tensor ids = at::empty({R, L, k}, opts.dtype(at::kLong));
  const int64_t rows = R * L;
  KD_CHECK(rows <= INT32_MAX, op, ": R * L = ", rows, " rows is too many for one launch");
  if (rows > 0) {
    topk_merge_kernel<<<unsigned(rows), kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        values.data_ptr<float>(), token_ids.data_ptr<int64_t>(), lse.data_ptr<float>(), int(P), rows, int(kin),
        int(k), logprobs.data_ptr<float>(), ids.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {logprobs, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("draft_topk", &draft_topk_cuda);
  m.impl("draft_topk_partial", &draft_topk_partial_cuda);
  m.impl("draft_topk_merge", &draft_topk_merge_cuda);
}

}  // namespace kdtree
