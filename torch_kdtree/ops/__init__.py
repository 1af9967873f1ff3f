"""Typed wrappers over the ``torch.ops.kdtree`` ops; importing registers CPU and fake kernels."""
from ._checks import set_value_checks, value_checks
from .ddtree import (Accepted, Tree, ddtree_build, ddtree_build_reference, kv_commit, kv_commit_reference,
                     tree_accept, tree_accept_reference)

# ---- draft top-K ----
from .topk import (PartialTopK, TopK, draft_topk, draft_topk_merge, draft_topk_merge_reference, draft_topk_partial,
                   draft_topk_partial_reference, draft_topk_reference)

# ---- MLA tree attention ----

# ---- INT4 MoE ----
