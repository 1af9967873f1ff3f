"""Typed wrappers over the ``torch.ops.kdtree`` ops; importing registers CPU and fake kernels."""
from ._checks import set_value_checks, value_checks
from .launch import pdl, pdl_enabled, set_pdl
from .ddtree import (Accepted, Tree, ddtree_build, ddtree_build_reference, kv_commit, kv_commit_reference,
                     tree_accept, tree_accept_reference)

# ---- draft top-K ----
from .topk import (PartialTopK, TopK, draft_topk, draft_topk_merge, draft_topk_merge_reference, draft_topk_partial,
                   draft_topk_partial_reference, draft_topk_reference)

# ---- MLA tree attention ----
from .mla import mla_tree_attention, mla_tree_attention_out_reference, mla_tree_attention_reference
from .mla_absorb import (mla_decode, mla_decode_reference, mla_output, mla_output_reference, mla_prepare,
                         mla_prepare_reference, mla_tree_attention_output, mla_tree_attention_output_reference)

# ---- INT4 MoE ----
from .moe import (Int4MoEPlan, Int4MoEWeights, int4_dequantize, int4_layout_fits, int4_moe, int4_moe_out,
                  int4_moe_plan, int4_moe_reference, int4_moe_weights, int4_moe_workspace, int4_repack, int4_repack_reference,
                  int4_unpack)

# ---- bf16 MoE for decode-sized batches ----
from .moe_gemv import moe_gemv, moe_gemv_reference

# ---- decode-sized linear layers (fused RMSNorm / SwiGLU prologue, residual epilogue) ----
from .gemv import gemv, gemv_reference

# ---- tree-sized linear layers (the weight streamed once through tensor cores) ----
from .gemm_rows import gemm_rows, gemm_rows_pays, gemm_rows_reference

# ---- noaux_tc routing ----
from .moe_route import moe_route, moe_route_reference

# ---- the MoE block's norm + router GEMV + routing in one op ----
from .moe_router import moe_router, moe_router_reference
