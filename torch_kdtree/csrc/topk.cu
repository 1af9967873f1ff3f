// Draft top-K: kdtree::draft_topk, draft_topk_partial, draft_topk_merge.  Semantics, and the
// pure-torch references these kernels must match (ids exactly, log-probs to float32 rounding):
// torch_kdtree/ops/topk.py.
//
// Order.  Every entry gets a distinct integer key = orderable(value) << id_bits | (id_max - id):
// a larger key is a larger float32 value, then a lower id (-0 is folded into +0, every NaN into
// one NaN above +inf).  The top-k is the k largest keys.
//
// draft_topk / draft_topk_partial on logits [rows = R*L, V] run two kernels:
//  1. chunk kernel, grid (rows, S), 512 threads: a block owns C <= 16384 consecutive entries of
//     one row (S*k <= 16384 candidates per row).  It reads them once (16-byte loads where the
//     rows are aligned) into shared memory as orderable value bits, counting the first digit on
//     the way, reduces the chunk's max and sum(exp(x - max)), and radix-selects the chunk's top
//     min(k, n) keys: 11-bit digits from the top of the key, one shared-memory histogram per
//     digit (warp-aggregated atomics), a block scan to find the digit of the k-th key, stopping
//     as soon as the k-th key's bin is taken whole (2-3 digits typically; a Python model of the
//     algorithm averaged 2.7).  Survivors go to a workspace [rows, S, k] (key 0 = none).
//  2. row kernel, one block of 1024 threads per row: combines the S (max, sum) pairs into the
//     row's log-sum-exp (the block holding the row max contributes exp(x - max) terms exactly
//     as torch.log_softmax computes them), radix-selects the top k of the S*k candidates (16
//     per thread, in registers), bitonic-sorts the k survivors (one per thread; shuffles for
//     strides < 32, shared memory above) and writes them.
// Bound: one read of the logits (R*L*V*2 bytes in bf16: 4.9 MB at R=1, L=15, V=163840, ~1.2 us
// at the H200's HBM rate); at small R the chain of dependent steps (load, select digits, the
// row kernel's digits and bitonic stages) and the select passes' ~100 instructions per entry
// bound the latency instead.
//
// draft_topk_merge on [P, rows, k_in] candidates: one block per row runs the same select and
// sort over the P*k_in keys (id_bits = 32, re-read from global/L2 on every digit) and
// logsumexp over the P parts' lse.
//
// Every size is fixed by the shapes (workspace from the caching allocator, no host sync), so
// all three ops can be captured in CUDA graphs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>

namespace kdtree {
namespace {

constexpr int kMaxK = 1024;
constexpr int kMaxVocab = 262144;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kChunkThreads = 512;
constexpr int kChunkTarget = 8192;      // entries per chunk block when k allows it
constexpr int kMaxChunk = 16384;        // entries per chunk block, at most
constexpr int kChunkIdBits = 14;        // chunk-local index < kMaxChunk
constexpr int kRowThreads = 1024;
constexpr int kRowItems = 16;           // candidates per row-kernel thread
constexpr int kMaxCandidates = kRowThreads * kRowItems;  // S*k per row
constexpr int kRowIdBits = 18;          // index in the row < kMaxVocab
static_assert((1 << kChunkIdBits) >= kMaxChunk, "chunk index must fit its key bits");
static_assert((1 << kRowIdBits) >= kMaxVocab, "row index must fit its key bits");
static_assert(kRowThreads >= kMaxK, "the row sort holds one key per thread");
static_assert(kBins % kChunkThreads == 0 && kBins % kRowThreads == 0, "bins split evenly over threads");

// bfloat16 logits, read as raw 16-bit patterns.
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

template <int THREADS>
__device__ __forceinline__ float block_max(float v, SelectShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (lane == 0) sh.red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? sh.red[lane] : -INFINITY;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    if (lane == 0) sh.bcast = v;
  }
  __syncthreads();
  return sh.bcast;
}

// Only thread 0's result is meaningful.
template <int THREADS>
__device__ __forceinline__ float block_sum_to_thread0(float v, SelectShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  if (lane == 0) sh.red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? sh.red[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  }
  return v;
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

template <typename Tr>
__global__ void __launch_bounds__(kChunkThreads)
topk_chunk_kernel(const typename Tr::Raw* __restrict__ logits, int V, int C, int S, int k, bool vec_ok,
                  uint64_t* __restrict__ cand, float2* __restrict__ stats) {
  using Raw = typename Tr::Raw;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  Raw* ord = reinterpret_cast<Raw*>(dyn_smem);  // orderable value bits of the chunk
  __shared__ SelectShared sh;
  const int64_t row = blockIdx.x;
  const int c = blockIdx.y;
  const int c0 = c * C;
  const int n = max(0, min(V - c0, C));
  const Raw* src = logits + row * V + c0;
  uint64_t* out = cand + (row * S + c) * int64_t(k);
  const int k_eff = min(k, n);
  for (int p = k_eff + int(threadIdx.x); p < k; p += kChunkThreads) out[p] = 0;

  // Load, keep orderable bits, track the max, and count the select's first digit (the top 11
  // bits of the value) on the way.  Loops are warp-uniform: hist_add needs every lane.
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) sh.hist[b] = 0;
  __syncthreads();
  constexpr int kFirstShift = Tr::kBits - kDigitBits;
  float tmax = -INFINITY;
  int done = 0;
  if (vec_ok) {
    constexpr int kVec = Tr::kVec;
    constexpr int kBatch = 4;  // 16-byte loads in flight per thread
    union Pack {
      uint4 u;
      Raw r[kVec];
    };
    const int nvec = n / kVec;
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    uint4* ord4 = reinterpret_cast<uint4*>(ord);
    for (int v0 = 0; v0 < nvec; v0 += kBatch * kChunkThreads) {
      Pack in[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int v = v0 + b * kChunkThreads + int(threadIdx.x);
        if (v < nvec) in[b].u = __ldg(src4 + v);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int v = v0 + b * kChunkThreads + int(threadIdx.x);
        const bool valid = v < nvec;
        Pack o;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const uint32_t r = valid ? uint32_t(in[b].r[e]) : 0u;
          const uint32_t key = Tr::orderable(r);
          if (valid) tmax = fmaxf(tmax, Tr::to_float(r));
          o.r[e] = Raw(key);
          hist_add(sh.hist, valid, key >> kFirstShift);
        }
        if (valid) ord4[v] = o.u;
      }
    }
    done = nvec * kVec;
  }
  for (int i0 = done; i0 < n; i0 += kChunkThreads) {
    const int i = i0 + int(threadIdx.x);
    const bool valid = i < n;
    const uint32_t r = valid ? uint32_t(src[i]) : 0u;
    const uint32_t key = Tr::orderable(r);
    if (valid) {
      tmax = fmaxf(tmax, Tr::to_float(r));
      ord[i] = Raw(key);
    }
    hist_add(sh.hist, valid, key >> kFirstShift);
  }
  const float m = block_max<kChunkThreads>(tmax, sh);  // its barrier also publishes ord[]

  // sum(exp(x - chunk max)); -inf entries add 0, an all -inf chunk has sum 0.
  float s = 0.0f;
  if (m != -INFINITY)
    for (int i = threadIdx.x; i < n; i += kChunkThreads) s += expf(Tr::to_float(Tr::from_orderable(ord[i])) - m);
  s = block_sum_to_thread0<kChunkThreads>(s, sh);
  if (threadIdx.x == 0) stats[row * S + c] = make_float2(m, s);
  if (k_eff == 0) return;

  using Key = typename Tr::ChunkKey;
  const int iters = (n + kChunkThreads - 1) / kChunkThreads;
  auto key_at = [&](int j, Key& key) -> bool {
    const int i = j * kChunkThreads + int(threadIdx.x);
    if (i >= n) {
      key = 0;
      return false;
    }
    key = (Key(ord[i]) << kChunkIdBits) | Key(kMaxChunk - 1 - i);
    return true;
  };
  constexpr int kBitsChunk = Tr::kBits + kChunkIdBits;
  static_assert(kBitsChunk <= 8 * int(sizeof(Key)), "chunk key type too narrow");
  Key prefix = 0;
  int shift = kBitsChunk;  // with prefix 0: take everything
  if (k_eff < n)
    radix_select<kChunkThreads, 0>(sh, key_at, iters, kBitsChunk, uint32_t(k_eff), true, prefix, shift);
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int j = 0; j < iters; ++j) {
    Key key;
    const bool take = key_at(j, key) && shr(key, shift) >= prefix;
    const int pos = warp_claim(take, &sh.count);
    if (take && pos < k_eff) {
      const int i = j * kChunkThreads + int(threadIdx.x);
      out[pos] = (uint64_t(ord[i]) << kRowIdBits) | uint64_t((1 << kRowIdBits) - 1 - (c0 + i));
    }
  }
}

template <typename Tr>
__global__ void __launch_bounds__(kRowThreads, 1)
topk_row_kernel(const uint64_t* __restrict__ cand, const float2* __restrict__ stats, int S, int k,
                int64_t vocab_start, bool partial, float* __restrict__ out_val, int64_t* __restrict__ out_id,
                float* __restrict__ out_lse) {
  __shared__ SelectShared sh;
  __shared__ uint64_t sorted[kRowThreads];
  __shared__ float row_max, row_logsum;
  const int64_t row = blockIdx.x;
  const int ncand = S * k;
  const int n2 = next_pow2(k);
  sorted[threadIdx.x] = 0;
  if (threadIdx.x < 32) {  // S <= 32 chunk statistics -> row max and sum(exp(x - max))
    const int lane = threadIdx.x;
    const float2 st = lane < S ? stats[row * S + lane] : make_float2(-INFINITY, 0.0f);
    float m = st.x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    float s = st.x == -INFINITY ? 0.0f : (st.x == m ? st.y : st.y * expf(st.x - m));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
    if (lane == 0) {
      row_max = m;
      row_logsum = logf(s);
    }
  }
  const uint64_t* mine = cand + row * int64_t(ncand);
  uint64_t keys[kRowItems];
#pragma unroll
  for (int j = 0; j < kRowItems; ++j) {
    const int i = j * kRowThreads + int(threadIdx.x);
    keys[j] = i < ncand ? mine[i] : 0;
  }
  auto key_at = [&](int j, uint64_t& key) -> bool {
    key = keys[j];
    return key != 0;
  };
  uint64_t prefix;
  int shift;
  radix_select<kRowThreads, kRowItems>(sh, key_at, kRowItems, Tr::kBits + kRowIdBits, uint32_t(k), false, prefix,
                                       shift);
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRowItems; ++j) {
    const bool take = keys[j] != 0 && shr(keys[j], shift) >= prefix;
    const int pos = warp_claim(take, &sh.count);
    if (take && pos < k) sorted[pos] = keys[j];
  }
  __syncthreads();
  const uint64_t key = bitonic_sort_desc_1024(sorted[threadIdx.x], sorted, n2);
  const float m = row_max, ls = row_logsum;
  if (int(threadIdx.x) < k) {
    const int i = threadIdx.x;
    const int id = (1 << kRowIdBits) - 1 - int(key & ((1u << kRowIdBits) - 1u));
    const float x = Tr::to_float(Tr::from_orderable(uint32_t(key >> kRowIdBits)));
    const int64_t o = row * k + i;
    out_val[o] = partial ? x : (x - m) - ls;  // torch.log_softmax's (x - max) - log(sum)
    out_id[o] = vocab_start + id;
  }
  if (partial && threadIdx.x == 0) out_lse[row] = ls + m;  // torch.logsumexp's log(sum) + max
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

// S chunks of C entries (C a multiple of 8 so chunk starts keep 16-byte alignment), with
// C <= kMaxChunk, S <= 32 and S*k <= kMaxCandidates.
void plan_chunks(int64_t V, int64_t k, int& S, int& C) {
  const int64_t by_vocab = ceil_div(V, kChunkTarget);
  const int64_t by_k = std::max<int64_t>(1, kMaxCandidates / k);
  const int64_t s = std::max<int64_t>(1, std::min(by_vocab, by_k));
  const int64_t c = ceil_div(ceil_div(V, s), 8) * 8;
  S = int(ceil_div(V, c));  // no empty chunk
  C = int(c);
  TORCH_INTERNAL_ASSERT(C <= kMaxChunk && S <= 32 && int64_t(S) * k <= kMaxCandidates, "draft_topk chunk plan");
}

void check_logits(const char* op, const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got ", logits.device());
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat, op,
              ": logits must be bfloat16 or float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 3, op, ": logits must have 3 dimensions [R, L, V], got shape ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous(), op, ": logits must be contiguous");
  const int64_t V = logits.size(2);
  TORCH_CHECK(V >= 1 && V <= kMaxVocab, op, ": vocabulary size V = logits.shape[2] must be in [1, ", kMaxVocab,
              "], got ", V);
  TORCH_CHECK(k >= 1 && k <= kMaxK, op, ": k must be in [1, ", kMaxK, "], got ", k);
  TORCH_CHECK(k <= V, op, ": k = ", k, " exceeds the vocabulary size V = ", V);
}

template <typename Tr>
void launch_topk(const at::Tensor& logits, int64_t k, int64_t vocab_start, bool partial, at::Tensor& out_val,
                 at::Tensor& out_id, at::Tensor& out_lse) {
  using Raw = typename Tr::Raw;
  const int64_t rows = logits.size(0) * logits.size(1);
  const int64_t V = logits.size(2);
  if (rows == 0) return;
  TORCH_CHECK(rows <= INT32_MAX, "draft_topk: R * L = ", rows, " rows is too many for one launch");
  int S, C;
  plan_chunks(V, k, S, C);
  auto opts = logits.options();
  at::Tensor cand = at::empty({rows, S, k}, opts.dtype(at::kLong));
  at::Tensor stats = at::empty({rows, S, 2}, opts.dtype(at::kFloat));
  const bool vec_ok = V % Tr::kVec == 0 && reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0;
  const size_t smem = size_t(C) * sizeof(Raw);
  auto chunk_kernel = topk_chunk_kernel<Tr>;
  // Static + dynamic shared memory can pass 48 KB even when the dynamic part alone does not
  // (seen on the H200: bf16 chunks of 32 KB failed to launch), so always opt in.
  C10_CUDA_CHECK(cudaFuncSetAttribute(chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const auto stream = at::cuda::getCurrentCUDAStream();
  chunk_kernel<<<dim3(unsigned(rows), unsigned(S)), kChunkThreads, smem, stream>>>(
      reinterpret_cast<const Raw*>(logits.data_ptr()), int(V), C, S, int(k), vec_ok,
      reinterpret_cast<uint64_t*>(cand.data_ptr<int64_t>()), reinterpret_cast<float2*>(stats.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  topk_row_kernel<Tr><<<unsigned(rows), kRowThreads, 0, stream>>>(
      reinterpret_cast<const uint64_t*>(cand.data_ptr<int64_t>()), reinterpret_cast<const float2*>(stats.data_ptr<float>()),
      S, int(k), vocab_start, partial, out_val.data_ptr<float>(), out_id.data_ptr<int64_t>(),
      partial ? out_lse.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dispatch_topk(const at::Tensor& logits, int64_t k, int64_t vocab_start, bool partial, at::Tensor& out_val,
                   at::Tensor& out_id, at::Tensor& out_lse) {
  const c10::cuda::CUDAGuard guard(logits.device());
  if (logits.scalar_type() == at::kBFloat16)
    launch_topk<Bf16>(logits, k, vocab_start, partial, out_val, out_id, out_lse);
  else
    launch_topk<F32>(logits, k, vocab_start, partial, out_val, out_id, out_lse);
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
  TORCH_CHECK(vocab_start >= 0 && vocab_start + logits.size(2) - 1 <= INT32_MAX, op,
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
  TORCH_CHECK(values.is_cuda() && token_ids.is_cuda() && lse.is_cuda(), op, ": inputs must be CUDA tensors");
  TORCH_CHECK(values.device() == token_ids.device() && values.device() == lse.device(), op,
              ": all inputs must be on one device");
  TORCH_CHECK(values.scalar_type() == at::kFloat, op, ": values must be float32, got ", values.scalar_type());
  TORCH_CHECK(token_ids.scalar_type() == at::kLong, op, ": token_ids must be int64, got ", token_ids.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32, got ", lse.scalar_type());
  TORCH_CHECK(values.dim() == 4, op, ": values must have 4 dimensions [P, R, L, k_in], got shape ", values.sizes());
  TORCH_CHECK(token_ids.sizes() == values.sizes(), op, ": token_ids shape ", token_ids.sizes(), " != values shape ",
              values.sizes());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == values.size(0) && lse.size(1) == values.size(1) &&
                  lse.size(2) == values.size(2),
              op, ": lse must have shape [P, R, L], got ", lse.sizes());
  TORCH_CHECK(values.is_contiguous() && token_ids.is_contiguous() && lse.is_contiguous(), op,
              ": values, token_ids and lse must be contiguous");
  const int64_t P = values.size(0), R = values.size(1), L = values.size(2), kin = values.size(3);
  TORCH_CHECK(P >= 1 && kin >= 1, op, ": need at least one part with at least one entry");
  TORCH_CHECK(k >= 1 && k <= kMaxK, op, ": k must be in [1, ", kMaxK, "], got ", k);
  TORCH_CHECK(k <= P * kin, op, ": k = ", k, " exceeds the ", P, " x ", kin, " candidates");
  TORCH_CHECK(P * kin <= (int64_t(1) << 30), op, ": too many candidates per row (P * k_in = ", P * kin, ")");
  const c10::cuda::CUDAGuard guard(values.device());
  auto opts = values.options();
  at::Tensor logprobs = at::empty({R, L, k}, opts);
  at::Tensor ids = at::empty({R, L, k}, opts.dtype(at::kLong));
  const int64_t rows = R * L;
  TORCH_CHECK(rows <= INT32_MAX, op, ": R * L = ", rows, " rows is too many for one launch");
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
