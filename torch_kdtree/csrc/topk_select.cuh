// Shared by csrc/topk.cu and csrc/topk_merge.cu: the orderable-key traits of the two logit
// dtypes and a block-wide radix select + bitonic sort over 64-bit keys (11-bit digits,
// shared-memory histograms with warp-aggregated adds).
#pragma once

#include <cstdint>

#include "warp_reduce.cuh"

namespace kdtree {
namespace {

constexpr int kMaxK = 1024;
constexpr int kMaxVocab = 262144;
// block-wide select: 11-bit digits; the merge kernel's block size
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kRowThreads = 1024;
static_assert(kRowThreads >= kMaxK, "the merge sort holds one key per thread");
static_assert(kBins % kRowThreads == 0, "bins split evenly over threads");

struct Bf16 {
  using Raw = uint16_t;
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

// Inclusive prefix sum of v over the lanes of a warp.  All 32 lanes must call it.
__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t t = __shfl_up_sync(0xFFFFFFFFu, v, off);
    if (lane >= off) v += t;
  }
  return v;
}

template <int THREADS>
__device__ __forceinline__ uint32_t block_inclusive_scan(uint32_t v, uint32_t* warp_total) {
  constexpr int kWarps = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_inclusive_scan(v);
  if (lane == 31) warp_total[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = warp_inclusive_scan(lane < kWarps ? warp_total[lane] : 0u);
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

}  // namespace
}  // namespace kdtree
