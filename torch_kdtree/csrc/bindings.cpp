// Every kdtree:: schema lives here, once.  CPU kernels are the pure-torch references
// registered from Python (torch_kdtree/ops); CUDA kernels register themselves in the .cu
// file of their family with TORCH_LIBRARY_IMPL(kdtree, CUDA, m).
#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(kdtree, m) {
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

  // ---- INT4 MoE (ops/moe.py, csrc/moe.cu) ----

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
