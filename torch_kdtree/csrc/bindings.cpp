// Every kdtree:: schema lives here, once.  CPU kernels are the pure-torch references
// registered from Python (torch_kdtree/ops); CUDA kernels register themselves in the .cu
// file of their family with TORCH_LIBRARY_IMPL(kdtree, CUDA, m).
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>

#ifdef KDTREE_TRACE
#include <tuple>
namespace kdtree {
std::tuple<at::Tensor, at::Tensor> trace_take(int64_t mode);  // trace.cu
}
#endif

namespace kdtree {
namespace {
std::atomic<bool> pdl_option{true};

void set_launch_options(bool pdl) { pdl_option.store(pdl, std::memory_order_relaxed); }
bool launch_options() { return pdl_option.load(std::memory_order_relaxed); }
}  // namespace

bool launch_pdl() { return launch_options(); }  // pdl.cuh
}  // namespace kdtree

TORCH_LIBRARY(kdtree, m) {
  // How the CUDA kernels launch, process-wide (torch_kdtree/ops/launch.py; the C++ never reads the
  // environment): pdl -- with programmatic dependent launch (csrc/pdl.cuh).  Read at each launch, so
  // a CUDA graph keeps the value it was captured with.  _launch_options returns pdl.
  m.def("_set_launch_options(bool pdl) -> ()", &kdtree::set_launch_options);
  m.def("_launch_options() -> bool", &kdtree::launch_options);

  // DDTree (ddtree.md): best-first tree from per-depth top-K log-probs.
  m.def("ddtree_build(Tensor logprobs, Tensor token_ids, Tensor root_tokens, int budget)"
        " -> (Tensor tokens, Tensor parents, Tensor depths, Tensor visible)");
  // Walk the verified tree with the target's per-node tokens.
  m.def("tree_accept(Tensor tokens, Tensor parents, Tensor target_tokens)"
        " -> (Tensor indices, Tensor lengths, Tensor next_tokens)");
  // Move accepted entries of every layer to the slots right after the committed prefix.
  m.def("kv_commit(Tensor(a!) kv_cache, Tensor block_table, Tensor cache_lens,"
        " Tensor indices, Tensor lengths) -> ()");

  // ---- draft top-K (ops/topk.py, csrc/topk.cu) ----
  // Fused log-softmax + top-K over the vocabulary (ranked by float32 logit, ties lower id first).
  m.def("draft_topk(Tensor logits, int k) -> (Tensor logprobs, Tensor token_ids)");
  // One vocabulary shard: its top-k raw logits, global ids and its log-sum-exp.
  m.def("draft_topk_partial(Tensor logits, int k, int vocab_start)"
        " -> (Tensor values, Tensor token_ids, Tensor lse)");
  // Merge P shards' partial results [P, R, L, k_in] into the unsplit top-k.
  m.def("draft_topk_merge(Tensor values, Tensor token_ids, Tensor lse, int k)"
        " -> (Tensor logprobs, Tensor token_ids)");

  // ---- MLA tree attention (ops/mla.py, csrc/mla.cu) ----
  // Absorbed-MLA attention of N tree nodes x H heads over one layer's paged latent cache
  // (d_k 576 = 512 latent + 64 rope, d_v 512): node i sees positions [0, cache_lens[r]) and
  // tree node j (stored at cache_lens[r] + j) iff visible[r, i, j].
  // prefix_ready: cache_lens, block_table and the committed rows [0, cache_lens) were written two or
  // more kernels before this one, so the CUDA kernel may read them before its programmatic-launch wait.
  // kv_scale: with a float8_e4m3fn kv_cache (an fp8 latent cache), its float32 [num_pages, page_size]
  // per-row scales (key = row * scale); None with a bf16 / fp32 cache.
  m.def("mla_tree_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_lens,"
        " Tensor visible, float softmax_scale, bool prefix_ready=False, Tensor? kv_scale=None) -> Tensor");
  // Same, into caller-owned out [R, N, H, 512] and optionally lse float32 [R, N, H] (natural log).
  m.def("mla_tree_attention_out(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_lens,"
        " Tensor visible, float softmax_scale, Tensor(a!) out, Tensor(b!)? lse, bool prefix_ready=False,"
        " Tensor? kv_scale=None) -> ()");

  // RoPE, kv_a_layernorm, the cache write (in place, at kv_cache[layer] and the flat slots) and the
  // W_UK absorption of a decode / tree-verify pass: the query [M, h, dc + dr] of mla_tree_attention
  // (ops/mla_absorb.py, csrc/mla_absorb.cu).
  m.def("mla_prepare(Tensor q, Tensor ckv, Tensor cos, Tensor sin, Tensor norm_weight, float eps,"
        " Tensor w_kv_b, Tensor(a!) kv_cache, int layer, Tensor slots, bool interleave) -> Tensor");
  // The heads' values from the attention's latent output: o_lat [M, h, dc] @ W_UV[h]^T -> [M, h, dv].
  m.def("mla_output(Tensor o_lat, Tensor w_kv_b, int qk_nope_head_dim) -> Tensor");
  // mla_output(mla_tree_attention(...)) as one op -> [R, N, H, dv]: on CUDA the attention's split
  // merge and the W_UV product share a kernel (the latent rows are never written).
  m.def("mla_tree_attention_output(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_lens,"
        " Tensor visible, float softmax_scale, Tensor w_kv_b, int qk_nope_head_dim, bool prefix_ready=False)"
        " -> Tensor");
  // One token per request, the whole absorbed-MLA core: mla_prepare (the cache write at slots, which
  // must be position cache_lens[r] of each request), the attention over positions [0, cache_lens + 1)
  // and the W_UV product -> [R, h, dv]; one launch on CUDA.
  m.def("mla_decode(Tensor q, Tensor ckv, Tensor cos, Tensor sin, Tensor norm_weight, float eps, Tensor w_kv_b,"
        " Tensor(a!) kv_cache, int layer, Tensor slots, Tensor block_table, Tensor cache_lens, float softmax_scale,"
        " bool interleave, bool prefix_ready=False) -> Tensor");

  // ---- INT4 MoE (ops/moe.py, csrc/moe.cu) ----
  // Compressed-tensors pack-quantized [E, N, K/8] int32 + bf16 [E, N, K/group] scales -> the
  // kernel's fragment layout: qweight int32 [E, N/16, K/64, 128], scales bf16 [E, N/16, K/group, 16].
  m.def("int4_repack(Tensor packed, Tensor scale, int group_size) -> (Tensor qweight, Tensor scales)");
  // Routed-expert MLP, out-variant: everything the kernels need lives in the caller's
  // workspace (uint8, size from ops.moe.int4_moe_plan), so it can sit in a CUDA graph.
  m.def("int4_moe_out(Tensor x, Tensor w13_qweight, Tensor w13_scales, Tensor w2_qweight,"
        " Tensor w2_scales, Tensor topk_ids, Tensor topk_weights, Tensor? expert_map, int group_size,"
        " int block_size, int k_splits, Tensor(a!) workspace, Tensor(b!) out) -> ()");
  // Functional form: allocates the workspace (size depends on shapes only) and the output.
  // Optionally plus a bf16 shared expert (shared_gate / shared_up [Is, H], shared_down [H, Is],
  // weight 1) and a residual [T, H] added after rounding (the decoder layer's residual add).
  m.def("int4_moe(Tensor x, Tensor w13_qweight, Tensor w13_scales, Tensor w2_qweight,"
        " Tensor w2_scales, Tensor topk_ids, Tensor topk_weights, Tensor? expert_map, int group_size,"
        " int block_size, int k_splits, Tensor? shared_gate=None, Tensor? shared_up=None,"
        " Tensor? shared_down=None, Tensor? residual=None) -> Tensor");

  // ---- bf16 MoE for decode-sized batches (ops/moe_gemv.py, csrc/moe_gemv.cu) ----
  // Routed experts with bf16 weights gate/up [E, I, H], down [E, H, I]: one GEMV per
  // (token, slot), out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])).
  // Optionally plus a shared expert (shared_gate / shared_up [Is, H], shared_down [H, Is], weight 1),
  // and plus a residual [T, H] after rounding (the decoder layer's residual add).
  // route_logits: a launch-order hint with no effect on the result (see ops/moe_gemv.py).
  m.def("moe_gemv(Tensor x, Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor topk_ids,"
        " Tensor topk_weights, Tensor? shared_gate=None, Tensor? shared_up=None, Tensor? shared_down=None,"
        " Tensor? residual=None, Tensor? route_logits=None) -> Tensor");

  // noaux_tc expert selection from router logits [T, E] (fp32): sigmoid scores, + bias to choose
  // (optionally group-limited), top_k largest first (ties: lower id), weights = scores of the chosen
  // (renormalised to sum 1 if asked) * scaling.
  m.def("moe_route(Tensor logits, Tensor bias, int top_k, int n_group=1, int topk_group=1,"
        " bool renormalize=True, float scaling=1.0) -> (Tensor topk_ids, Tensor topk_weights)");

  // The MoE block's input: x_norm = RMSNorm(x) * norm_weight (bf16), logits = x_norm @ router_weight.T
  // (fp32), then moe_route's choice from the logits -- one launch on CUDA.
  m.def("moe_router(Tensor x, Tensor norm_weight, float eps, Tensor router_weight, Tensor bias, int top_k,"
        " int n_group=1, int topk_group=1, bool renormalize=True, float scaling=1.0)"
        " -> (Tensor x_norm, Tensor logits, Tensor topk_ids, Tensor topk_weights)");

  // ---- decode-sized linear layers (ops/gemv.py, csrc/gemv.cu) ----
  // out_i = prologue(x) @ weights[i].T for up to 4 weights [N_i, K] sharing x [M, K]; the prologue
  // is x, RMSNorm(x) * norm_weight, or silu(x) * up; with one weight, optionally + residual.  The
  // first fp32_outputs outputs are the fp32 sums; return_input appends the prologue's output.
  m.def("gemv(Tensor x, Tensor[] weights, Tensor? norm_weight=None, float eps=1e-06, Tensor? up=None,"
        " Tensor? residual=None, int fp32_outputs=0, bool return_input=False) -> Tensor[]");

  // ---- tree-sized linear layers (ops/gemm_rows.py, csrc/gemm_rows.cu) ----
  // y_i = x @ weights[i].T for x [M <= 32, K] and up to 3 weights [N_i, K] in one launch: each weight
  // streamed once through tensor cores.
  m.def("gemm_rows(Tensor x, Tensor[] weights) -> Tensor[]");

#ifdef KDTREE_TRACE
  // A diagnostic build's kernel phase stamps (csrc/trace.cuh; mode 1 zeroes them): stamps [records,
  // kTraceMaxBlocks, 2 x kTracePhases] and each record's kind and grid [records, 3], int64 on the CPU.
  m.def("_trace(int mode) -> (Tensor stamps, Tensor meta)", &kdtree::trace_take);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("cuda_archs", []() -> std::string {
#ifdef KDTREE_CUDA_ARCHS
    return KDTREE_CUDA_ARCHS;
#else
    return "";
#endif
  }, "TORCH_CUDA_ARCH_LIST the CUDA kernels were compiled for ('' when built CPU-only)");
}
