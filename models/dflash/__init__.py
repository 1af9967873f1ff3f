"""DFlash block-diffusion drafter (z-lab's public format): config, model with a static context
KV cache, random writer.

Use from a generate loop (R requests, block size bs, L = bs - 1 draft depths, n taps of width H):

    drafter = DFlashDraftModel.from_pretrained(path, device="cuda")        # bf16 as shipped
    drafter.bind_target(target.model.embed_tokens, target.lm_head)          # borrowed, not owned
    drafter.setup_cache(R, capacity)            # capacity >= longest prompt + max_new_tokens

    # prefill: the target returns, for every prompt token, the outputs of the layers
    # drafter.target_layer_ids concatenated tap-major -> taps [R, P, n*H]
    drafter.append_context(taps, valid=attention_mask.bool())   # or lengths=[R]; positions 0..
    root = first generated token [R]            # sits at position context_lengths[r]

    # one step (fixed shapes; capturable in a CUDA graph, no host sync):
    logits = drafter(root)                      # [R, L, V]; row i-1 = depth i
    #   (or hidden = drafter(root, return_hidden=True) -> [R, L, H] for a sharded head)
    lp, ids = log_softmax(logits.float()).topk(K)  -> kdtree.ddtree_build(lp, ids, root, B)
    verify the tree with the target, which also returns node_taps [R, B + 1, n*H]
    acc = kdtree.tree_accept(tree.tokens, tree.parents, post)
    drafter.append_context(node_taps, acc.lengths, indices=acc.indices[:, :bs])
    root = acc.next_tokens

    drafter.reset_context(finished_mask)        # a slot reused for a new request

Context positions are the slot indices 0, 1, ... of each request's context, so the target's
positions must count the same tokens (left padding excluded).
"""
from .configuration import DFlashConfig, default_target_layer_ids
from .modeling import DFlashDraftModel
from .writer import random_drafter, write_random_drafter

__all__ = ["DFlashConfig", "DFlashDraftModel", "default_target_layer_ids", "random_drafter", "write_random_drafter"]
