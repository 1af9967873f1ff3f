// kdtree::mla_tree_attention(_out): absorbed-MLA attention of N tree nodes x H heads over one
// layer's paged latent cache (semantics and reference: torch_kdtree/ops/mla.py).
//
// Rows: the N·H (node, head) pairs of one request form an [M = N·H, 576] matrix (q's memory
// order, row = node·H + head); all of them attend to the same keys (MQA), so a CTA takes BM rows
// and streams the request's keys through shared memory once for all of them.  Keys of request r
// are positions [0, L + N), L = cache_lens[r] read on the device: the committed prefix [0, L) is
// visible to every row (no mask), tree node j at L + j only where visible[r, node, j] (only the
// last tiles pay for the mask).  Each key row (576 bf16 = 1152 B) is fetched by 16-byte
// cp.async through the block table, so any page size works.
//
// Tiling (CTA = RG row groups x 4 d_v quarters of warps; warp (rg, dq)):
//   S = Q·Kᵀ   : warp computes its row group's 16·MT rows x its BN/4 keys of the tile
//                (mma.sync m16n8k16 bf16, 36 k-steps; A = Q from smem, B = K rows, ldmatrix).
//   softmax    : row maxima exchanged through smem (4 partials per row), log2-domain online
//                softmax with one running max per row shared by the 4 warps, P (bf16) to smem.
//   O += P·V   : warp owns 16·MT rows x 128 dims of O in registers (64·MT floats per thread);
//                V = the first 512 columns of the same K tile (ldmatrix.trans), P via ldmatrix.
//   Large (sm_90, 227 KB smem): MT 2, RG 2 -> BM 64, BN 64, 2 stages, 8 warps, 225 KB, 1 CTA/SM.
//   Small (few rows, and every config on sm_120's 99 KB): MT 1, RG 1 -> BM 16, BN 32, 2 stages,
//   4 warps, 91 KB (2 CTAs/SM on sm_90).
// What bounds it: FLOPs = M·S·2·(576 + 512) against bytes ≈ 1152·S per request (1.89·M FLOP/B);
// below ~80 rows the key stream (HBM) bounds it, above it the tensor cores -- and there, with
// mma.sync, the ldmatrix traffic: per 64x64 tile each warp reads ~76 KB of smem (Q 36 KB, K 18 KB,
// P 4 KB, V 16 KB) for 272 mma, ~4.7k cycles per tile at 128 B/clk vs ~3.6k of mma at the
// measured 645 TFLOP/s, so the 64-row tile tops out near 440 TFLOP/s on an H200 [calc].  Row blocks of one
// (request, split) are adjacent in the grid (blockIdx.x), so they run together and share each
// key page through L2: DRAM reads every page once per (request, split).
//
// Long contexts with few rows (flash-decoding): the grid has a static number of splits per
// request (from static shapes: R, M, max_pages·page_size, SM count); on the device each split
// takes chunk = roundup(max(ceil((L+N)/splits), kMinChunk), BN) keys (kMinChunk = 64 for every
// row count: on the H200 a 64-key floor beat 128 and 256 in every verify-shaped cell measured,
// e.g. N 17 x H 16 over 768 keys 16.2 vs 29.1 us, run 29), splits past the end exit.
// Partial O (normalised, fp32) and log2-LSE go to a workspace sized from static shapes; a
// combine kernel (4 blocks per row, 128 dims each; 8 warps each summing every 8th split, then
// added in warp order) merges them in a fixed order (deterministic).  One split writes the output
// directly.  Nothing depends on data on the host: one CUDA graph serves every length.
//
// An fp8 cache (template parameter F8; kv_cache float8_e4m3fn rows of 640 B -- the 512 latent values
// in e4m3, then the 64 rope values in bf16 -- + kv_scale fp32 [num_pages, page_size], the latent's
// power-of-two scales, models/kimi_k2/cache.py): each key row is copied as it is stored -- 40
// 16-byte cp.async per row through the block table (4 threads per row, 10 chunks each) plus one
// 4-byte cp.async of the row's scale -- into a ring stage: the 32 e4m3 latent chunks to the
// stage's latent rows, the 8 bf16 rope chunks to its rope rows (rope_off), the scale after them.
// Each thread then converts the latent chunks it copied into ONE bf16 latent tile (lat_off),
// exactly the dequantised keys: e4m3x4_to_bf16x4 (PRMT / shift / mask puts each code's bits in a
// bf16 as value·2^-120, two bf16 multiplies by 2^120 and by the scale; an e4m3 value times a power
// of two is exact in bf16).  S = Q·Kᵀ takes its 32 latent k-steps from that tile and its 4 rope
// k-steps from the ring stage, in the bf16 path's order and accumulator chains; P·V reads the
// latent tile.  So an fp8 call gives the same bits as a bf16 call on the dequantised cache (same
// tile, order and splits at every N·H: the splits depend on shapes only, and both tiles' shared
// memory allows the same CTAs per SM).  The rope stays bf16 because e4m3's 3 mantissa bits, which
// move each value by up to 2^-4 of itself, cost the shipped pair 1.3 % of its greedy tokens when
// the rope went through them too (cache.py).
//   Staging: the ring holds STAGES stages of BN·(512 + 128 + 4) B beside one bf16 latent tile of
//   BN·1024 B.  Small: Q 18,432 + latent tile 32,768 + 2 x 20,608 + P 1,024 + 256 = 93,696 B
//   (bf16: 93,440; 2 CTAs/SM on sm_90, fits sm_120's 99 KB).  Large: 73,728 + 65,536 + 2 x 41,216
//   + 8,192 + 1,024 = 230,912 B, within sm_90's 232,448 opt-in (the whole 640-byte rows beside a
//   whole 1,152-byte key tile, session 41's layout, needed 239,104: fp8 then read through the
//   16-row tile at every size, at 0.41-0.65x bf16's speed for N·H >= 64 in run 188).
//   No in-place conversion (an fp8 tile in the upper half of its own bf16 stage would be overwritten
//   while unread unless converted in dependency order or through registers).
//   Order per tile j: wait for tile j's copies, barrier (every warp done with tile j - 1's latent
//   tile and ring stage; the scales, copied by other threads, visible), issue tile j + 1's copies
//   into the other stage, convert tile j, barrier, compute -- the copy of j + 1 overlaps
//   conversion and compute of j as in the bf16 ring; one barrier more per tile.  Tile j's stage
//   is next written by tile j + 2's copies, issued after iteration j + 1's first barrier.
//   Registers (ptxas -v, CUDA 13.0, sm_90): fp8 Small 186 (148 before the rope moved to the ring),
//   Large 254 with an 8-byte spill; sm_120: Small 184 (the large tiles do not fit its shared
//   memory and compile to a trap).  The bf16 instantiations' SASS is unchanged by the fp8 layout.
//   The conversion re-reads %tid.x so that its addresses are not held across the loop.
//   What bounds it: the conversion is ~46 thread instructions per 16-byte e4m3 chunk (LDS.128, 4 x
//   (2 PRMT, 2 shifts, 2 LOP3, 4 HMUL2.BF16), 2 STS.128, addresses), ~2.9 per byte or ~46 warp
//   instructions per key.  Measured on the H200 with all-e4m3 rows and a 64-row fp8 tile (run 179):
//   0.90-0.95x the bf16 kernel's speed in every cell -- the kernel is not bandwidth-bound, so fewer
//   bytes buy nothing and the conversion costs.  The present layout has not run on a GPU yet.
//   e4m3fn's NaN codes read as ±480·scale (the cache's quantiser clamps to ±448: never written).
#include "bf16_vec.cuh"
#include "check.h"
#include "cp_async.cuh"
#include "mma_sync.cuh"
#include "mla_wuv.cuh"
#include "pdl.cuh"
#include "warp_reduce.cuh"
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace kdtree {
namespace {

constexpr int kD = 576;               // key dim: 512 latent + 64 rope
constexpr int kDV = 512;              // value dim: the latent part of the same row
constexpr int kRowChunks = kD / 8;    // 72 16-byte chunks per row
constexpr int kRowBytes = kD * 2;     // 1152
constexpr int kF8RowBytes = kDV + 2 * (kD - kDV);  // 640: 512 e4m3 latent values, then 64 bf16 rope values
constexpr int kF8RowChunks = kF8RowBytes / 16;     // 40 16-byte chunks
constexpr int kF8LatentChunks = kDV / 16;          // the first 32 are e4m3, the last 8 bf16
// Fewest keys per split (a split costs its Q load and an fp32 partial O + its combine); the
// split count itself comes from choose_splits' wave model.
constexpr int kMinChunk = 64;
constexpr int kMaxSplits = 256;
constexpr int kCombineWarps = 8;      // per combine block, each taking every 8th split
constexpr int kCombineUnroll = 4;     // splits in flight per combine warp
constexpr int kCombineDims = 128;     // output dims per combine block (one float4 per lane)
constexpr float kLn2 = 0.69314718055994531f;
constexpr float kLog2e = 1.44269504088896341f;

struct Params {
  const __nv_bfloat16* q;      // [R, M, 576]
  const __nv_bfloat16* kv;     // [num_pages, page_size, 576]: bf16, or e4m3 bytes (the fp8 instantiation)
  const int32_t* block_table;  // [R, max_pages]
  const int32_t* cache_lens;   // [R]
  const bool* visible;         // [R, N, N]
  __nv_bfloat16* out;          // [R, M, 512]
  float* lse;                  // [R, M] natural log, or null
  float* o_part;               // [R, splits, M, 512] normalised partial O (splits > 1)
  float* lse_part;             // [R, splits, M] log2-domain partial LSE (splits > 1)
  int N, H, M;
  int page_size, max_pages;
  int64_t num_pages;
  int max_keys;                // max_pages * page_size
  int num_splits;
  bool early;                  // committed key tiles copied before pdl_wait (prefix_ready)
  float scale_log2;            // softmax_scale * log2(e)
  const float* kv_scale;       // [num_pages, page_size] (fp8: key = row * scale)
};

// Barrier for the 128 threads (4 warps) of one row group; id 0 is __syncthreads'.
__device__ __forceinline__ void row_group_sync(int rg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(rg + 1) : "memory");
}
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 4-byte cp.async (through L1; .cg copies 16 bytes only): an fp8 key row's scale.  src_bytes = 0
// writes a zero.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Four e4m3 codes (one 32-bit word, code k in byte k) times a power-of-two scale -> four bf16 in
// two words (code 2i + k in half k of word i), exactly: each code's 7 magnitude bits shifted into
// a bf16's exponent-and-mantissa field (and its sign into bf16's) is the code's value times 2^-120
// for normal codes and subnormal ones alike (bf16 and e4m3 both have an implicit-1 form and a
// subnormal form; the exponent biases differ by 120), so one bf16 multiply by 2^120 gives the
// code's value (a normal bf16: e4m3's smallest subnormal is 2^-9) and a second one by the scale the
// dequantised key -- exact, as the product of a 4-significant-bit value and a power of two is
// while it stays in bf16's normal range (scales in [2^-117, 2^118]; the cache's quantiser writes
// 2^ceil(log2(max|row| / 448))).  e4m3fn's NaN code (0x7f / 0xff) reads as ±480·scale, never NaN:
// the quantiser clamps to ±448, so only a NaN entry writes it.  PRMT's sign-replicate selectors
// put each code in the low byte of a 16-bit half and its sign in all 8 bits above it; << 4 then
// moves the code to bits 4..11 and a copy of the sign to bit 15, and the mask keeps bits 4..10
// (magnitude) and 15 (sign) of each half.
__device__ __forceinline__ uint2 e4m3x4_to_bf16x4(uint32_t w, __nv_bfloat162 scale) {
  uint32_t lo, hi;
  asm("prmt.b32 %0, %1, 0, 0x9180;\n" : "=r"(lo) : "r"(w));
  asm("prmt.b32 %0, %1, 0, 0xB3A2;\n" : "=r"(hi) : "r"(w));
  lo = (lo << 4) & 0x87F087F0u;
  hi = (hi << 4) & 0x87F087F0u;
  const __nv_bfloat162 two120 = __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
  __nv_bfloat162 a = __hmul2(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&lo), two120), scale);
  __nv_bfloat162 b = __hmul2(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&hi), two120), scale);
  return make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
}

// Byte offset of 16-byte chunk c of row `row` in a [rows][72 chunks] tile (Q or K).  The 1152 B
// pitch is a multiple of 128 B, so the 8 rows an ldmatrix reads would share banks; XOR-ing the
// chunk with row & 7 (which stays inside its group of 8 chunks, 72 = 9·8) spreads them.
__device__ __forceinline__ uint32_t kv_off(int row, int c) {
  return uint32_t(row * kRowBytes + ((c ^ (row & 7)) << 4));
}
// An fp8 cache's tiles (the F8 instantiations): the converted latent keys, [BN][64 chunks] bf16
// (1024 B pitch), and the rope part of a ring stage, [BN][8 chunks] bf16 (128 B pitch), each with
// kv_off's XOR so that the 8 rows an ldmatrix reads fall in 8 different bank groups.
__device__ __forceinline__ uint32_t lat_off(int row, int c) {
  return uint32_t(row * (kDV * 2) + ((c ^ (row & 7)) << 4));
}
__device__ __forceinline__ uint32_t rope_off(int row, int c) {
  return uint32_t(row * ((kD - kDV) * 2) + ((c ^ (row & 7)) << 4));
}
// Same for the [BM][BN] bf16 P tile (BN/8 chunks per row).
template <int BN>
__device__ __forceinline__ uint32_t p_off(int row, int c) {
  constexpr int kCP = BN / 8;
  return uint32_t(row * BN * 2 + ((c ^ ((row / (8 / kCP)) & (kCP - 1))) << 4));
}

// F8: the cache is e4m3 latent + bf16 rope rows + fp32 scales.  Its STAGES-deep ring holds each
// tile's e4m3 latent rows [BN][512 B], its bf16 rope rows [BN][128 B] (rope_off) and its scales
// [BN][4 B] (kF8Stage bytes a stage) beside one bf16 tile of latent keys [BN][1024 B] (lat_off)
// that each tile's latent is converted into; Q·Kᵀ reads the rope where it landed in the ring
// (header: "An fp8 cache").  The bf16 cache's ring holds whole bf16 key tiles.
template <int MT, int RG, int BN, int STAGES, bool F8>
struct Tile {
  static constexpr int kWarps = RG * 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBM = RG * MT * 16;
  static constexpr int kKW = BN / 4;   // keys per warp in S
  static constexpr int kNT = kKW / 8;  // n8 tiles per warp in S
  static constexpr int kQBytes = kBM * kRowBytes;
  static constexpr int kKBytes = F8 ? BN * kDV * 2 : BN * kRowBytes;  // fp8: the bf16 latent tile
  static constexpr int kF8Stage = BN * (kF8RowBytes + 4);  // e4m3 latent rows, bf16 rope rows, scales
  static constexpr int kKRegion = F8 ? kKBytes + STAGES * kF8Stage : STAGES * kKBytes;
  static constexpr int kPBytes = kBM * BN * 2;
  static constexpr int kSmem = kQBytes + kKRegion + kPBytes + 4 * kBM * 4;
  static_assert(kNT == 1 || kNT == 2, "a warp's S slice is one or two n8 tiles");
  static_assert(BN % (kThreads / (F8 ? 4 : 8)) == 0, "key loads: 8 threads per bf16 key row, 4 per fp8 row");
  static_assert(STAGES >= 2, "double buffering at least");
  static_assert(kF8Stage % 16 == 0, "fp8 stages stay 16-byte aligned");
};

// Split s of request r covers keys [begin, end); empty when begin >= end.
__device__ __forceinline__ void split_range(int total, int splits, int s, int bn, int& begin, int& end) {
  int chunk = (total + splits - 1) / splits;
  chunk = max(chunk, kMinChunk);
  chunk = (chunk + bn - 1) / bn * bn;
  begin = min(s * chunk, total);  // s < splits <= 256 and chunk <= ceil(total/splits) + max(256, bn): no overflow
  end = min(total, begin + chunk);
}

template <int MT, int RG, int BN, int STAGES, bool F8>
__device__ __forceinline__ void attention_tile_loop(const Params& p) {
  using T = Tile<MT, RG, BN, STAGES, F8>;
  constexpr int kBM = T::kBM, kKW = T::kKW, kNT = T::kNT;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK = sQ + T::kQBytes;          // bf16: the ring; fp8: the one bf16 latent tile
  uint8_t* sF8_ptr = smem + T::kQBytes + T::kKBytes;  // fp8: the ring (stage s at s * kF8Stage)
  uint8_t* sP_ptr = smem + T::kQBytes + T::kKRegion;
  const uint32_t sP = smem_u32(sP_ptr);
  float* sRed = reinterpret_cast<float*>(sP_ptr + T::kPBytes);  // [4][BM]: row maxima, then row sums

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rg = warp >> 2, dq = warp & 3;
  const int rb = blockIdx.x, split = blockIdx.y, r = blockIdx.z;
  const int N = p.N, M = p.M, H = p.H;
  const int row0 = rb * kBM;

  // Programmatic dependent launch (pdl.cuh): the query and the new tokens' cache rows [L, L + N)
  // may come from the previous kernel.  With p.early (the caller's prefix_ready) the lengths, the
  // block table and the committed rows [0, L) were written two or more kernels back, so they are
  // read before the wait, through L2; otherwise the kernel waits first.
  // Only the small tile (decode) copies early: the large one (verify) has no registers to spare.
  const bool early = STAGES == 2 && MT == 1 && p.early;
  if (!early) {
    pdl_wait();
    pdl_launch_dependents();
  }
  // The host checked max_keys >= N; a bad length must not send reads past the block table.
  const int L = min(max(__ldcg(p.cache_lens + r), 0), p.max_keys - N);
  const int total = L + N;
  int k_begin, k_end;
  split_range(total, p.num_splits, split, BN, k_begin, k_end);
  if (k_begin >= k_end) {  // only splits > 0 can be empty: mark their rows for the combine
    if (early) {
      pdl_wait();
      pdl_launch_dependents();
    }
    for (int i = tid; i < kBM; i += T::kThreads)
      if (row0 + i < M) p.lse_part[(int64_t(r) * p.num_splits + split) * M + row0 + i] = -INFINITY;
    return;
  }
  const int n_tiles = (k_end - k_begin + BN - 1) / BN;
  const int32_t* bt_r = p.block_table + int64_t(r) * p.max_pages;
  auto load_tile = [&](int tile, int stage) {
    if constexpr (F8) {
      // 4 threads per key: the 40 chunks of the cache row (thread sub takes chunks sub + 4i, the
      // ones it converts): its 32 e4m3 latent chunks to the stage's latent rows, its 8 bf16 rope
      // chunks to the stage's rope rows; from sub 0, the row's scale (after both)
      constexpr int kKeysPerPass = T::kThreads / 4;
      const uint32_t dst = smem_u32(sF8_ptr) + stage * T::kF8Stage;
      const int sub = tid & 3;
#pragma unroll
      for (int pass = 0; pass < BN / kKeysPerPass; ++pass) {
        const int key = pass * kKeysPerPass + (tid >> 2);
        const int pos = k_begin + tile * BN + key;
        int64_t row = -1;  // page * page_size + slot; -1: zero-fill
        if (pos < k_end) {  // pos < max_keys, so pos / page_size < max_pages
          const int lp = pos / p.page_size;
          const int page = __ldcg(bt_r + lp);
          if (page >= 0 && page < p.num_pages) row = int64_t(page) * p.page_size + (pos - lp * p.page_size);
        }
        const int bytes = row >= 0 ? 16 : 0;
        const uint8_t* kv8 = reinterpret_cast<const uint8_t*>(p.kv);
        const uint8_t* src = row >= 0 ? kv8 + row * kF8RowBytes : kv8;
#pragma unroll
        for (int c = sub; c < kF8RowChunks; c += 4)
          cp_async16(c < kF8LatentChunks ? dst + key * kDV + c * 16 : dst + BN * kDV + rope_off(key, c - kF8LatentChunks),
                     bytes ? src + c * 16 : kv8, bytes);
        if (sub == 0)
          cp_async4(dst + BN * kF8RowBytes + key * 4, row >= 0 ? p.kv_scale + row : p.kv_scale, row >= 0 ? 4 : 0);
      }
    } else {
      constexpr int kKeysPerPass = T::kThreads / 8;
      const uint32_t dst = sK + stage * T::kKBytes;
      const int sub = tid & 7;
#pragma unroll
      for (int pass = 0; pass < BN / kKeysPerPass; ++pass) {
        const int key = pass * kKeysPerPass + (tid >> 3);
        const int pos = k_begin + tile * BN + key;
        const __nv_bfloat16* src = p.kv;
        int bytes = 0;
        if (pos < k_end) {  // pos < max_keys, so pos / page_size < max_pages
          const int lp = pos / p.page_size;
          const int page = __ldcg(bt_r + lp);
          if (page >= 0 && page < p.num_pages) {
            src = p.kv + (int64_t(page) * p.page_size + (pos - lp * p.page_size)) * kD;
            bytes = 16;
          }
        }
#pragma unroll
        for (int c = sub; c < kRowChunks; c += 8) cp_async16(dst + kv_off(key, c), bytes ? src + c * 8 : p.kv, bytes);
      }
    }
  };
  // fp8: the latent of the tile in ring stage `stage` -> the bf16 latent tile at sK (lat_off), each
  // thread converting the 16-byte chunks it copied itself; the scales were copied by other threads,
  // so the caller has passed a barrier since the copies' wait.  The rope stays in the stage.
  auto convert_tile = [&](int stage) {
    if constexpr (F8) {
      constexpr int kKeysPerPass = T::kThreads / 4;
      const uint8_t* src = sF8_ptr + stage * T::kF8Stage;
      const float* scales = reinterpret_cast<const float*>(src + BN * kF8RowBytes);
      uint8_t* dst = smem + T::kQBytes;
      int tid_v;  // re-read here: keeps the conversion's addresses out of the registers live across the loop
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid_v));
      const int sub = tid_v & 3;
#pragma unroll
      for (int pass = 0; pass < BN / kKeysPerPass; ++pass) {
        const int key = pass * kKeysPerPass + (tid_v >> 2);
        const unsigned short sb = (unsigned short)(__float_as_uint(scales[key]) >> 16);  // a power of two: exact
        const __nv_bfloat162 scale = __halves2bfloat162(__ushort_as_bfloat16(sb), __ushort_as_bfloat16(sb));
        static_assert(kF8LatentChunks % 4 == 0, "every thread converts latent chunks only");
#pragma unroll
        for (int i = 0; i < kF8LatentChunks / 4; ++i) {  // 16 e4m3 latent values -> bf16 chunks 2c, 2c + 1
          const int c = sub + 4 * i;
          const uint4 w = *reinterpret_cast<const uint4*>(src + key * kDV + c * 16);
          const uint2 a = e4m3x4_to_bf16x4(w.x, scale), b = e4m3x4_to_bf16x4(w.y, scale);
          const uint2 e = e4m3x4_to_bf16x4(w.z, scale), f = e4m3x4_to_bf16x4(w.w, scale);
          *reinterpret_cast<uint4*>(dst + lat_off(key, 2 * c)) = make_uint4(a.x, a.y, b.x, b.y);
          *reinterpret_cast<uint4*>(dst + lat_off(key, 2 * c + 1)) = make_uint4(e.x, e.y, f.x, f.y);
        }
      }
    }
  };
  // ---- loads ----
  // Before the wait (p.early): the first `pre` tiles, those made of committed keys only (below L),
  // at most one per stage.  With two stages every wait in the loop is for all copies issued, so
  // the copy groups need no further bookkeeping; deeper rings keep the plain order.
  int pre = 0;
  if (early)
    while (pre < min(n_tiles, STAGES) && k_begin + (pre + 1) * BN <= L) ++pre;
  for (int s = 0; s < pre; ++s) load_tile(s, s);
  cp_async_commit();
  if (early) {
    pdl_wait();
    pdl_launch_dependents();
  }
  {
    const __nv_bfloat16* q_r = p.q + int64_t(r) * M * kD;
    for (int i = tid; i < kBM * kRowChunks; i += T::kThreads) {
      const int row = i / kRowChunks, c = i - row * kRowChunks;
      const bool ok = row0 + row < M;
      cp_async16(sQ + kv_off(row, c), ok ? q_r + int64_t(row0 + row) * kD + c * 8 : p.q, ok ? 16 : 0);
    }
  }
  if (pre == 0) load_tile(0, 0);
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < STAGES - 1; ++s) {
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();
  }

  // ---- per-thread state: rows lrow(mi, h) = rg·16·MT + mi·16 + g + 8h ----
  float o[MT][16][4];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][n][e] = 0.f;
  float m_run[MT][2], l_run[MT][2];
  int node[MT][2];  // tree node of the row, -1 for padding rows
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[mi][h] = -INFINITY;
      l_run[mi][h] = 0.f;
      const int grow = row0 + rg * 16 * MT + mi * 16 + g + 8 * h;
      node[mi][h] = grow < M ? grow / H : -1;
    }
  const bool* vis_r = p.visible + int64_t(r) * N * N;
  const int wrow = rg * 16 * MT;  // first CTA row of this warp's row group

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile j landed for every thread; every warp is done with tile j - 1
    {
      const int nt = j + STAGES - 1;
      if (nt < n_tiles && nt >= pre) load_tile(nt, nt % STAGES);
      cp_async_commit();
    }
    if constexpr (F8) {  // every warp is done with tile j - 1's bf16 keys (the barrier above)
      convert_tile(j % STAGES);
      __syncthreads();  // tile j's bf16 keys complete
    }
    const uint32_t sKs = F8 ? sK : sK + (j % STAGES) * T::kKBytes;

    // S = Q·Kᵀ for rows of this row group x keys [dq·KW, dq·KW + KW) of the tile
    float s[MT][kNT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;
    // key(row, c): the address of 16-byte chunk c (of 72) of key `row` of tile j in shared memory
    auto qk_step = [&](int ks, float (&acc)[MT][kNT][4], auto key) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) ldsm_x4(a[mi], sQ + kv_off(wrow + mi * 16 + (lane & 15), 2 * ks + (lane >> 4)));
      uint32_t b[kNT][2];
      if constexpr (kNT == 2) {
        uint32_t bb[4];
        ldsm_x4(bb, key(dq * kKW + (lane >> 4) * 8 + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
        b[0][0] = bb[0];
        b[0][1] = bb[1];
        b[kNT - 1][0] = bb[2];
        b[kNT - 1][1] = bb[3];
      } else {
        ldsm_x2(b[0][0], b[0][1], key(dq * kKW + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    };
    // k-steps [ks0, ks1): one accumulator would chain 36 dependent mma in the small tile, so even
    // steps go to s and odd ones to s_odd there (summed after the last step)
    float s_odd[MT][kNT][4] = {};
    auto qk_steps = [&](int ks0, int ks1, auto key) {
      if constexpr (MT * kNT == 1) {
#pragma unroll 2
        for (int ks = ks0; ks < ks1; ks += 2) {
          qk_step(ks, s, key);
          qk_step(ks + 1, s_odd, key);
        }
      } else {
#pragma unroll 4
        for (int ks = ks0; ks < ks1; ++ks) qk_step(ks, s, key);
      }
    };
    if constexpr (!F8) {
      qk_steps(0, kD / 16, [&](int row, int c) { return sKs + kv_off(row, c); });
    } else {
      // fp8: the 32 latent k-steps from the bf16 latent tile, the 4 rope k-steps from this tile's
      // ring stage, in the bf16 path's order and chains, so the sums are the bf16 path's bits
      const uint32_t sRope = smem_u32(sF8_ptr) + (j % STAGES) * T::kF8Stage + BN * kDV;
      qk_steps(0, kDV / 16, [&](int row, int c) { return sK + lat_off(row, c); });
      qk_steps(kDV / 16, kD / 16, [&](int row, int c) { return sRope + rope_off(row, c - 2 * kF8LatentChunks); });
    }
    if constexpr (MT * kNT == 1) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][0][e] += s_odd[0][0][e];
    }

    // scale to log2 units; mask keys past the split and invisible tree nodes
    const int tile_start = k_begin + j * BN;
    const bool masked = tile_start + BN > min(L, k_end);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[mi][ni][e] * p.scale_log2;
          if (masked) {
            const int pos = tile_start + dq * kKW + ni * 8 + 2 * t + (e & 1);
            const int nd = node[mi][e >> 1];
            bool ok = pos < k_end;
            if (ok && pos >= L && nd >= 0) ok = vis_r[int64_t(nd) * N + (pos - L)];
            if (!ok) v = -INFINITY;
          }
          s[mi][ni][e] = v;
        }

    // row maxima over the whole tile: 4 lanes per row in a warp, 4 warps per row through smem
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * h], s[mi][ni][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (t == 0) sRed[dq * kBM + wrow + mi * 16 + g + 8 * h] = mx;
      }
    row_group_sync(rg);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int lr = wrow + mi * 16 + g + 8 * h;
        const float m_tile = fmaxf(fmaxf(sRed[lr], sRed[kBM + lr]), fmaxf(sRed[2 * kBM + lr], sRed[3 * kBM + lr]));
        const float m_new = fmaxf(m_run[mi][h], m_tile);
        const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that saw nothing yet stays at 0
        const float alpha = fast_exp2(m_run[mi][h] - base);
        m_run[mi][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int ni = 0; ni < kNT; ++ni) {
          const float p0 = fast_exp2(s[mi][ni][2 * h] - base);
          const float p1 = fast_exp2(s[mi][ni][2 * h + 1] - base);
          sum += p0 + p1;
          const int chunk = dq * kNT + ni;  // key dq·KW + ni·8 + 2t lies in chunk (dq·KW + ni·8) / 8
          *reinterpret_cast<uint32_t*>(sP_ptr + p_off<BN>(lr, chunk) + 4 * t) = pack_bf16x2(p0, p1);
        }
        l_run[mi][h] = l_run[mi][h] * alpha + sum;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
          o[mi][n][2 * h] *= alpha;
          o[mi][n][2 * h + 1] *= alpha;
        }
      }
    row_group_sync(rg);

    // O[:, dq·128 : dq·128 + 128] += P · V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) ldsm_x4(a[mi], sP + p_off<BN>(wrow + mi * 16 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t b[4];
        const int vrow = kk * 16 + (lane & 15), vc = dq * 16 + np * 2 + (lane >> 4);
        ldsm_x4_trans(b, F8 ? sK + lat_off(vrow, vc) : sKs + kv_off(vrow, vc));
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          mma_bf16(o[mi][2 * np], a[mi], b[0], b[1]);
          mma_bf16(o[mi][2 * np + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- row sums: 4 lanes, then 4 warps (fixed order); every warp of the row group gets the same ----
  // sRed's last readers (the row maxima of the last tile) passed the second row-group barrier.
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mi][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t == 0) sRed[dq * kBM + wrow + mi * 16 + g + 8 * h] = l;
    }
  row_group_sync(rg);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = wrow + mi * 16 + g + 8 * h;
      const int grow = row0 + lr;
      if (grow >= M) continue;
      const float l = ((sRed[lr] + sRed[kBM + lr]) + sRed[2 * kBM + lr]) + sRed[3 * kBM + lr];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse2 = l > 0.f ? m_run[mi][h] + log2f(l) : -INFINITY;
      if (p.num_splits == 1) {
        __nv_bfloat16* dst = p.out + (int64_t(r) * M + grow) * kDV + dq * 128 + 2 * t;
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<uint32_t*>(dst + n * 8) = pack_bf16x2(o[mi][n][2 * h] * inv, o[mi][n][2 * h + 1] * inv);
        if (p.lse != nullptr && dq == 0 && t == 0) p.lse[int64_t(r) * M + grow] = lse2 * kLn2;
      } else {
        const int64_t prow = (int64_t(r) * p.num_splits + split) * M + grow;
        float* dst = p.o_part + prow * kDV + dq * 128 + 2 * t;
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[mi][n][2 * h] * inv, o[mi][n][2 * h + 1] * inv);
        if (dq == 0 && t == 0) p.lse_part[prow] = lse2;
      }
    }
}

constexpr int kSm120SmemPerBlock = 101376;

template <int MT, int RG, int BN, int STAGES, bool F8>
__global__ void __launch_bounds__(Tile<MT, RG, BN, STAGES, F8>::kThreads, RG == 1 ? 2 : 1)
mla_tree_attention_kernel(const Params p) {
  // programmatic dependent launch (pdl.cuh): attention_tile_loop waits after its first key copies
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  // The host launches a tile only where the device's opt-in shared memory holds it, so tiles
  // larger than sm_120's 99 KB are never compiled for it.
  if constexpr (Tile<MT, RG, BN, STAGES, F8>::kSmem <= kSm120SmemPerBlock)
    attention_tile_loop<MT, RG, BN, STAGES, F8>(p);
  else
    __trap();
#else
  attention_tile_loop<MT, RG, BN, STAGES, F8>(p);
#endif
}

// The split weights of one row, shared by the combine and merge-output kernels so that both merge
// with the same bits: wts[s] = 2^(lse_s − m) for the row's splits (lse_s at lse_part[base + s·M]),
// 0 for an empty split (its O was never written), m = the block's max of the lse_s (returned; every
// thread gets it).  The block's 8 warps (kCombineWarps = kOutWarps) each reduce their maxima, then
// the warps' maxima are combined in warp order.  Ends with a barrier: wts is complete for every thread.
__device__ __forceinline__ float split_weights(const float* __restrict__ lse_part, int64_t base, int M, int splits,
                                               float* wts, float (&red)[kCombineWarps]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float m = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += kCombineWarps * 32) {
    const float ls = lse_part[base + int64_t(s) * M];
    wts[s] = ls;
    m = fmaxf(m, ls);
  }
  m = warp_max(m);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) m = fmaxf(m, red[w]);
  for (int s = threadIdx.x; s < splits; s += kCombineWarps * 32) {
    const float ls = wts[s];
    wts[s] = (ls == -INFINITY || m == -INFINITY) ? 0.f : exp2f(ls - m);
  }
  __syncthreads();
  return m;
}

// Σ_s wts[s] in a fixed order, for one warp: lane sums s ≡ lane (mod 32) in increasing s, then the
// xor tree (every lane gets the sum).
__device__ __forceinline__ float split_weight_sum(const float* wts, int splits, int lane) {
  float wsum = 0.f;
  for (int s = lane; s < splits; s += 32) wsum += wts[s];
  return warp_sum(wsum);
}

// Grid (request·row, kDV / kCombineDims): block (rr, c) merges dims [c·128, c·128 + 128) of row rr,
// out = Σ_s 2^(lse_s − m) O_s / Σ_s 2^(lse_s − m).  The split weights are computed once into shared
// memory (no load waits on another inside the sum); warp w then sums the splits s ≡ w (mod
// kCombineWarps) in increasing s (one float4 per lane, kCombineUnroll loads in flight), and the
// warps' sums are added in warp order: a fixed order, so deterministic.  Few rows (decode) still
// fill 4 blocks per row and 8 warps per block.
__global__ void __launch_bounds__(kCombineWarps * 32)
mla_combine_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part, int R, int M, int splits,
                   __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ float combine_smem[];  // [splits] weights, then [kCombineWarps - 1][kCombineDims] partial sums
  __shared__ float red[kCombineWarps];
  float* wts = combine_smem;
  float4* part = reinterpret_cast<float4*>(combine_smem + ((splits + 3) & ~3));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  pdl_wait();  // the partials come from the attention kernel
  pdl_launch_dependents();
  const int rr = blockIdx.x;  // (request, row)
  if (rr >= R * M) return;
  const int r = rr / M, row = rr - r * M;
  const int64_t base = int64_t(r) * splits * M + row;  // split s at base + s * M
  const float m = split_weights(lse_part, base, M, splits, wts, red);
  const int dim4 = blockIdx.y * (kCombineDims / 4) + lane;  // this lane's float4 of the row
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll kCombineUnroll
  for (int s = warp; s < splits; s += kCombineWarps) {
    const float w = wts[s];
    if (w == 0.f) continue;  // warp-uniform
    const float4 v = reinterpret_cast<const float4*>(o_part + (base + int64_t(s) * M) * kDV)[dim4];
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  if (warp > 0) part[(warp - 1) * 32 + lane] = acc;
  __syncthreads();
  if (warp != 0) return;
  for (int w = 1; w < kCombineWarps; ++w) {
    const float4 v = part[(w - 1) * 32 + lane];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  const float wsum = split_weight_sum(wts, splits, lane);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  reinterpret_cast<uint2*>(out + (int64_t(r) * M + row) * kDV)[dim4] =
      make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
  if (lse != nullptr && blockIdx.y == 0 && lane == 0) lse[rr] = wsum > 0.f ? (m + log2f(wsum)) * kLn2 : -INFINITY;
}

// mla_tree_attention_output's second kernel: the split merge of one (request, node, head) row
// exactly as mla_combine_kernel computes it (the same weights, fp32 operations in the same order,
// the same bf16 rounding), kept in shared memory instead of written out, then W_UV's rows times
// it with mla_output's own code (mla_wuv.cuh): the same bits as the combine and mla_output
// launches, in one launch.  Grid (H · ceil(dv / 32), R · N tokens), 8 warps; warp w
// of block (h, b) owns W_UV rows 32 b + 4 w .. + 3 of head h, loaded into registers before the
// wait (lane l: columns 8 l + 256 j).  The merge: warp w sums the splits s ≡ w (mod 8) in
// increasing s for all 512 dims (four float4 per lane), warps 1-7 hand their sums to warp 0
// through shared memory, which adds them in warp order.  With one split the attention wrote the
// row (bf16) itself: o_lat, read as is.
constexpr int kOutWarps = 8;
constexpr int kOutRows = kOutWarps * kWuvRowsPerWarp;  // W_UV rows per block
constexpr int kOutGroups = kDV / kWuvCols;             // 16-byte pieces per lane of a W_UV row
static_assert(kOutWarps == kCombineWarps, "split_weights: the combine and merge-output blocks have the same warps");

__global__ void __launch_bounds__(kOutWarps * 32)
mla_merge_output_kernel(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                        const __nv_bfloat16* __restrict__ o_lat, const __nv_bfloat16* __restrict__ w_kv_b, int N,
                        int H, int splits, int dn, int dv, __nv_bfloat16* __restrict__ out) {
  __shared__ float wts[kMaxSplits];
  __shared__ float4 part[kOutWarps - 1][kDV / 4];
  __shared__ __align__(16) __nv_bfloat16 o_s[kDV];
  __shared__ float red[kOutWarps];
  __shared__ float s_inv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bph = (dv + kOutRows - 1) / kOutRows;
  const int h = blockIdx.x / bph, d0 = (blockIdx.x % bph) * kOutRows + warp * kWuvRowsPerWarp;
  const int tok = blockIdx.y, r = tok / N, node = tok - r * N, M = N * H, row = node * H + h;
  uint4 wr[kWuvRowsPerWarp][kOutGroups];
  wuv_load_rows(w_kv_b + (int64_t(h) * (dn + dv) + dn) * kDV + 8 * lane, d0, dv, kDV, kOutGroups, wr);
  pdl_wait();  // the partials (or the row) come from the attention kernel
  pdl_launch_dependents();
  if (o_part == nullptr) {
    if (threadIdx.x < kDV / 8)
      reinterpret_cast<uint4*>(o_s)[threadIdx.x] =
          reinterpret_cast<const uint4*>(o_lat + (int64_t(r) * M + row) * kDV)[threadIdx.x];
  } else {
    const int64_t base = int64_t(r) * splits * M + row;  // split s at base + s * M
    split_weights(lse_part, base, M, splits, wts, red);
    float4 acc[kDV / 128];
#pragma unroll
    for (int c = 0; c < kDV / 128; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 2
    for (int s = warp; s < splits; s += kOutWarps) {
      const float ws = wts[s];
      if (ws == 0.f) continue;  // warp-uniform
      const float4* v = reinterpret_cast<const float4*>(o_part + (base + int64_t(s) * M) * kDV) + lane;
      float4 x[kDV / 128];
#pragma unroll
      for (int c = 0; c < kDV / 128; ++c) x[c] = v[32 * c];
#pragma unroll
      for (int c = 0; c < kDV / 128; ++c) {
        acc[c].x += ws * x[c].x;
        acc[c].y += ws * x[c].y;
        acc[c].z += ws * x[c].z;
        acc[c].w += ws * x[c].w;
      }
    }
    if (warp > 0) {
#pragma unroll
      for (int c = 0; c < kDV / 128; ++c) part[warp - 1][32 * c + lane] = acc[c];
    }
    if (warp == 0) {  // Σ_s w_s as the combine sums it
      const float wsum = split_weight_sum(wts, splits, lane);
      if (lane == 0) s_inv = wsum > 0.f ? 1.f / wsum : 0.f;
    }
    __syncthreads();
    if (warp == 0) {
      const float inv = s_inv;
#pragma unroll
      for (int c = 0; c < kDV / 128; ++c) {
        float4 a = acc[c];
        for (int v = 1; v < kOutWarps; ++v) {
          const float4 b = part[v - 1][32 * c + lane];
          a.x += b.x;
          a.y += b.y;
          a.z += b.z;
          a.w += b.w;
        }
        reinterpret_cast<uint2*>(o_s)[32 * c + lane] =
            make_uint2(pack_bf16x2(a.x * inv, a.y * inv), pack_bf16x2(a.z * inv, a.w * inv));
      }
    }
  }
  __syncthreads();
  wuv_rows_times(o_s + 8 * lane, kOutGroups, wr, lane, d0, dv, out, (int64_t(tok) * H + h) * dv);
}

size_t combine_smem_bytes(int splits) {
  return sizeof(float) * (size_t((splits + 3) & ~3) + size_t(kCombineWarps - 1) * kCombineDims);
}

// ------------------------------------------------------------------------------------------------
// host side
// ------------------------------------------------------------------------------------------------

template <bool F8>
using SmallTile = Tile<1, 1, 32, 2, F8>;
template <bool F8>
using LargeTile = Tile<2, 2, 64, 2, F8>;

template <int MT, int RG, int BN, int STAGES, bool F8>
void launch_attention(const Params& p, int row_blocks, int R, cudaStream_t stream) {
  using T = Tile<MT, RG, BN, STAGES, F8>;
  auto kernel = mla_tree_attention_kernel<MT, RG, BN, STAGES, F8>;
  // Idempotent (not stream work, so allowed while capturing): more than 48 KB of dynamic shared
  // memory, and the largest shared-memory carveout so that two small tiles fit on an sm_90 SM.
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      int(cudaSharedmemCarveoutMaxShared)));
  const dim3 grid(unsigned(row_blocks), unsigned(p.num_splits), unsigned(R));
  launch_kernel(kernel, grid, dim3(T::kThreads), size_t(T::kSmem), stream, launch_pdl(), p);
}

// Splits per request from static shapes only: minimise waves x (tiles per split + a fixed cost).
// The combine's share: its warps walk kCombineWarps * kCombineUnroll splits per round trip.
int choose_splits(int64_t ctas_per_split, int64_t ctas_per_wave, int64_t max_keys, int bn) {
  const int64_t limit = std::min<int64_t>(kMaxSplits, std::max<int64_t>(1, (max_keys + kMinChunk - 1) / kMinChunk));
  int best = 1;
  double best_cost = 0;
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t waves = (ctas_per_split * s + ctas_per_wave - 1) / ctas_per_wave;
    const int64_t keys = std::max<int64_t>((max_keys + s - 1) / s, kMinChunk);
    const double combine = s > 1 ? double((s + kCombineWarps * kCombineUnroll - 1) / (kCombineWarps * kCombineUnroll)) : 0.0;
    const double cost = double(waves) * double((keys + bn - 1) / bn + 4) + combine;
    if (s == 1 || cost < 0.97 * best_cost) {
      best = int(s);
      best_cost = cost;
    }
  }
  return best;
}

void check_cuda(const at::Tensor& t, const char* name, at::ScalarType dtype, int dim) {
  check_cuda_tensor(t, "kdtree::mla_tree_attention", name, dtype, dim);
}

// The attention launch of one call, and what its second kernel (combine or merge-output) needs.
struct AttentionRun {
  Params p;
  int splits = 1;
  at::Tensor o_part, lse_part;  // the workspace (splits > 1)
};

// Checks, the split choice and the attention launch.  `out` (the bf16 rows) is made by make_out
// after the split choice, so a caller that needs it only for one split can skip it; the kernel
// writes it only with one split.
template <typename MakeOut>
AttentionRun launch_tree_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& cache_lens, const at::Tensor& visible, double softmax_scale,
                                   MakeOut make_out, const std::optional<at::Tensor>& lse, bool prefix_ready,
                                   const std::optional<at::Tensor>& kv_scale);

void mla_tree_attention_out_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 const at::Tensor& cache_lens, const at::Tensor& visible, double softmax_scale,
                                 at::Tensor out, const std::optional<at::Tensor>& lse, bool prefix_ready,
                                 const std::optional<at::Tensor>& kv_scale) {
  constexpr const char* op = "kdtree::mla_tree_attention";
  check_cuda(q, "q", at::kBFloat16, 4);
  check_cuda(out, "out", at::kBFloat16, 4);
  KD_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.size(3) == kDV, op,
           ": out must be [R, N, H, ", kDV, "], got ", out.sizes());
  KD_CHECK(out.device() == q.device(), op, ": all inputs must be on one device");
  KD_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0, op, ": q, kv_cache and out must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(q.device());
  AttentionRun run = launch_tree_attention(q, kv_cache, block_table, cache_lens, visible, softmax_scale,
                                           [&](int) { return out; }, lse, prefix_ready, kv_scale);
  if (run.splits > 1) {
    const int64_t R = q.size(0), M = q.size(1) * q.size(2);
    const dim3 blocks(unsigned(R * M), unsigned(kDV / kCombineDims));  // R * M < 2^31 (checked)
    launch_kernel(mla_combine_kernel, blocks, dim3(kCombineWarps * 32), size_t(combine_smem_bytes(run.splits)),
                  at::cuda::getCurrentCUDAStream(), launch_pdl(), static_cast<const float*>(run.p.o_part),
                  static_cast<const float*>(run.p.lse_part), int(R), int(M), run.splits, run.p.out, run.p.lse);
  }
}

at::Tensor mla_tree_attention_output_cuda(const at::Tensor& q, const at::Tensor& kv_cache,
                                          const at::Tensor& block_table, const at::Tensor& cache_lens,
                                          const at::Tensor& visible, double softmax_scale, const at::Tensor& w_kv_b,
                                          int64_t qk_nope_head_dim, bool prefix_ready) {
  constexpr const char* op = "kdtree::mla_tree_attention_output";
  KD_CHECK(q.dim() == 4, op, ": q must be [R, N, H, 576], got ", q.sizes());
  check_cuda_tensor(w_kv_b, op, "w_kv_b", at::kBFloat16, 2);
  KD_CHECK(w_kv_b.device() == q.device(), op, ": q and w_kv_b must be on one device, got ", q.device(), " and ",
           w_kv_b.device());
  const int64_t R = q.size(0), N = q.size(1), H = q.size(2), dn = qk_nope_head_dim;
  KD_CHECK(dn >= 0 && H >= 1 && w_kv_b.size(1) == kDV && w_kv_b.size(0) % H == 0 && w_kv_b.size(0) / H > dn, op,
           ": w_kv_b must be [H * (dn + dv), ", kDV, "] with H = ", H, ", dn = ", dn, ", dv >= 1, got ",
           w_kv_b.sizes());
  KD_CHECK(reinterpret_cast<uintptr_t>(w_kv_b.data_ptr()) % 16 == 0, op, ": w_kv_b must be 16-byte aligned");
  KD_CHECK(kv_cache.scalar_type() == at::kBFloat16, op, ": kv_cache must be BFloat16, got ", kv_cache.scalar_type(),
           " (an fp8 cache is read by mla_tree_attention with its kv_scale)");
  const int64_t dv = w_kv_b.size(0) / H - dn;
  KD_CHECK(R * N <= 65535 && H * ((dv + kOutRows - 1) / kOutRows) <= INT32_MAX, op,
           ": at most 65535 (request, node) tokens, got R * N = ", R * N);
  at::Tensor out = at::empty({R, N, H, dv}, q.options());
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o_lat;
  AttentionRun run = launch_tree_attention(
      q, kv_cache, block_table, cache_lens, visible, softmax_scale,
      [&](int splits) {
        o_lat = splits > 1 ? at::Tensor() : at::empty({R, N, H, kDV}, q.options());
        return o_lat;
      },
      std::nullopt, prefix_ready, std::nullopt);
  if (R * N == 0) return out;
  const int bph = int((dv + kOutRows - 1) / kOutRows);
  launch_kernel(mla_merge_output_kernel, dim3(unsigned(H * bph), unsigned(R * N)), dim3(kOutWarps * 32), 0,
                at::cuda::getCurrentCUDAStream(), launch_pdl(),
                run.splits > 1 ? static_cast<const float*>(run.p.o_part) : nullptr,
                run.splits > 1 ? static_cast<const float*>(run.p.lse_part) : nullptr,
                run.splits > 1 ? nullptr : static_cast<const __nv_bfloat16*>(run.p.out),
                reinterpret_cast<const __nv_bfloat16*>(w_kv_b.data_ptr()), int(N), int(H), run.splits, int(dn),
                int(dv), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()));
  return out;
}

template <typename MakeOut>
AttentionRun launch_tree_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& cache_lens, const at::Tensor& visible, double softmax_scale,
                                   MakeOut make_out, const std::optional<at::Tensor>& lse, bool prefix_ready,
                                   const std::optional<at::Tensor>& kv_scale) {
  constexpr const char* op = "kdtree::mla_tree_attention";
  check_cuda(q, "q", at::kBFloat16, 4);
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  KD_CHECK(kv_cache.scalar_type() == at::kBFloat16 || fp8, op, ": kv_cache must be BFloat16 or Float8_e4m3fn (with "
           "kv_scale), got ", kv_cache.scalar_type());
  check_cuda(kv_cache, "kv_cache", kv_cache.scalar_type(), 3);
  if (fp8) {
    KD_CHECK(kv_scale.has_value(), op, ": kv_scale is required with a Float8_e4m3fn kv_cache (float32 [num_pages, "
             "page_size], the layer's per-token scales)");
    check_cuda(*kv_scale, "kv_scale", at::kFloat, 2);
    KD_CHECK(kv_scale->size(0) == kv_cache.size(0) && kv_scale->size(1) == kv_cache.size(1), op,
             ": kv_scale must be float32 [num_pages, page_size] = [", kv_cache.size(0), ", ", kv_cache.size(1),
             "], got ", kv_scale->sizes());
    KD_CHECK(kv_scale->device() == q.device(), op, ": all inputs must be on one device");
  } else {
    KD_CHECK(!kv_scale.has_value(), op, ": kv_scale is given but kv_cache is ", kv_cache.scalar_type(),
             ": scales belong to a Float8_e4m3fn cache");
  }
  check_cuda(block_table, "block_table", at::kInt, 2);
  check_cuda(cache_lens, "cache_lens", at::kInt, 1);
  check_cuda(visible, "visible", at::kBool, 3);
  const int64_t R = q.size(0), N = q.size(1), H = q.size(2);
  KD_CHECK(q.size(3) == kD, op, ": q head dim must be ", kD, " (512 absorbed latent + 64 rope), got ", q.size(3));
  if (fp8)
    KD_CHECK(kv_cache.size(2) == kF8RowBytes, op, ": an fp8 kv_cache must be [num_pages, page_size, ", kF8RowBytes,
             "] (512 e4m3 latent values, then 64 bf16 rope values as 128 bytes), got ", kv_cache.sizes());
  else
    KD_CHECK(kv_cache.size(2) == kD, op, ": kv_cache must be [num_pages, page_size, ", kD, "], got ", kv_cache.sizes());
  KD_CHECK(N >= 1 && H >= 1, op, ": q must have N >= 1 nodes and H >= 1 heads, got ", q.sizes());
  KD_CHECK(block_table.size(0) == R && cache_lens.size(0) == R, op, ": block_table and cache_lens must have R = ",
              R, " rows");
  KD_CHECK(visible.size(0) == R && visible.size(1) == N && visible.size(2) == N, op,
              ": visible must be [R, N, N], got ", visible.sizes());
  if (lse.has_value()) {
    check_cuda(*lse, "lse", at::kFloat, 3);
    KD_CHECK(lse->size(0) == R && lse->size(1) == N && lse->size(2) == H, op, ": lse must be [R, N, H], got ",
                lse->sizes());
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&kv_cache, &block_table, &cache_lens, &visible})
    KD_CHECK(t->device() == q.device(), op, ": all inputs must be on one device");
  if (lse.has_value()) KD_CHECK(lse->device() == q.device(), op, ": all inputs must be on one device");
  const int64_t num_pages = kv_cache.size(0), page_size = kv_cache.size(1), max_pages = block_table.size(1);
  KD_CHECK(num_pages >= 1 && page_size >= 1, op, ": kv_cache must hold at least one page, got ", kv_cache.sizes());
  const int64_t max_keys = max_pages * page_size;
  KD_CHECK(max_keys >= N, op, ": block_table has ", max_pages, " pages per request, too few for the N = ", N,
              " tree entries with page_size ", page_size);
  KD_CHECK(max_keys <= (int64_t(1) << 24), op, ": max_pages * page_size must be <= 2^24, got ", max_keys);
  const int64_t M = N * H;
  KD_CHECK(M <= (int64_t(1) << 22) && R <= 65535 && R * M <= int64_t(INT32_MAX), op,
           ": N * H must be <= 2^22, R <= 65535 and R * N * H < 2^31");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &kv_cache})
    KD_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, op, ": q, kv_cache and out must be 16-byte aligned");
  AttentionRun run;
  if (R == 0) return run;

  const c10::cuda::CUDAGuard guard(q.device());
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  // fp8 takes the tile bf16 takes (header: "An fp8 cache": its large tile fits sm_90, not sm_120).
  const int64_t large_smem = fp8 ? LargeTile<true>::kSmem : LargeTile<false>::kSmem;
  const bool large_fits = int64_t(prop->sharedMemPerBlockOptin) >= large_smem;
  const bool large = large_fits && M > SmallTile<false>::kBM;
  const int bm = large ? LargeTile<false>::kBM : SmallTile<false>::kBM;
  const int bn = large ? 64 : 32;
  const int64_t row_blocks = (M + bm - 1) / bm;
  const int64_t smem = large ? large_smem : (fp8 ? SmallTile<true>::kSmem : SmallTile<false>::kSmem);
  const int64_t ctas_per_sm = std::max<int64_t>(1, std::min<int64_t>(2, int64_t(prop->sharedMemPerMultiprocessor) / (smem + 1024)));
  const int64_t ctas_per_wave = int64_t(prop->multiProcessorCount) * ctas_per_sm;
  const int splits = choose_splits(R * row_blocks, ctas_per_wave, max_keys, bn);

  const at::Tensor out = make_out(splits);
  Params& p = run.p;
  p = Params{};
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  p.kv = reinterpret_cast<const __nv_bfloat16*>(kv_cache.data_ptr());  // fp8: the e4m3 rows' bytes
  p.kv_scale = fp8 ? kv_scale->data_ptr<float>() : nullptr;
  p.block_table = block_table.data_ptr<int32_t>();
  p.cache_lens = cache_lens.data_ptr<int32_t>();
  p.visible = visible.data_ptr<bool>();
  p.out = out.defined() ? reinterpret_cast<__nv_bfloat16*>(out.data_ptr()) : nullptr;
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.N = int(N);
  p.H = int(H);
  p.M = int(M);
  p.page_size = int(page_size);
  p.max_pages = int(max_pages);
  p.num_pages = num_pages;
  p.max_keys = int(max_keys);
  p.num_splits = splits;
  p.early = prefix_ready;
  p.scale_log2 = float(softmax_scale * double(kLog2e));
  run.splits = splits;
  if (splits > 1) {  // static size: one CUDA graph serves every length
    run.o_part = at::empty({R * splits * M * kDV}, q.options().dtype(at::kFloat));
    run.lse_part = at::empty({R * splits * M}, q.options().dtype(at::kFloat));
    p.o_part = run.o_part.data_ptr<float>();
    p.lse_part = run.lse_part.data_ptr<float>();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (large && fp8)
    launch_attention<2, 2, 64, 2, true>(p, int(row_blocks), int(R), stream);
  else if (large)
    launch_attention<2, 2, 64, 2, false>(p, int(row_blocks), int(R), stream);
  else if (fp8)
    launch_attention<1, 1, 32, 2, true>(p, int(row_blocks), int(R), stream);
  else
    launch_attention<1, 1, 32, 2, false>(p, int(row_blocks), int(R), stream);
  return run;
}

at::Tensor mla_tree_attention_cuda(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& cache_lens, const at::Tensor& visible, double softmax_scale,
                                   bool prefix_ready, const std::optional<at::Tensor>& kv_scale) {
  KD_CHECK(q.dim() == 4, "kdtree::mla_tree_attention: q must be [R, N, H, 576], got ", q.sizes());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), kDV}, q.options());
  mla_tree_attention_out_cuda(q, kv_cache, block_table, cache_lens, visible, softmax_scale, out, std::nullopt,
                              prefix_ready, kv_scale);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kdtree, CUDA, m) {
  m.impl("mla_tree_attention", &mla_tree_attention_cuda);
  m.impl("mla_tree_attention_out", &mla_tree_attention_out_cuda);
  m.impl("mla_tree_attention_output", &mla_tree_attention_output_cuda);
}

}  // namespace kdtree
