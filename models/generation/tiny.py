"""Tiny random target / drafter pairs, built deterministically on the fly (tests and the demo).

The target is a K2-shaped model scaled down (one dense and one MoE layer, 8 experts top-2,
hidden 64) except for the MLA latent row, which stays K2's 512 + 64 (the width of the latent
cache that ``kdtree::mla_tree_attention`` reads).  The drafter is a random DFlash drafter of
the target's hidden size tapping both target layers.
"""
from __future__ import annotations

import torch

TINY_TARGET = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
    "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "vocab_size": 128, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    # weights large enough that attention and experts steer the argmax (a 0.02 init mostly
    # maps the current token to the next one and loops)
    "initializer_range": 0.2,
}


def tiny_target(seed: int = 0, *, logit_scale: float = 1.0, **overrides):
    """A random :class:`KimiK2ForCausalLM` (fp32, eval) from :data:`TINY_TARGET` + ``overrides``.

    ``logit_scale`` multiplies ``lm_head`` (sharper next-token distributions than the near
    uniform ones of a 0.02-std init).  The routing bias is random too, so selection uses it.
    The global RNG is left as it was.
    """
    from torch_kdtree.models.kimi_k2 import KimiK2Config, KimiK2ForCausalLM
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    config = KimiK2Config.from_dict(k2_config_dict({**TINY_TARGET, **overrides}, int4=False))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = KimiK2ForCausalLM(config).float().eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
            for m in model.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def tiny_drafter(target, *, seed: int = 0, block_size: int = 4, num_hidden_layers: int = 1):
    """A random :class:`DFlashDraftModel` for ``target``: its hidden size and vocabulary, the last
    token id as the mask token, tapping every target layer."""
    from torch_kdtree.models.dflash import random_drafter

    c = target.config
    return random_drafter(seed=seed, hidden_size=c.hidden_size, num_hidden_layers=num_hidden_layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=c.vocab_size, mask_token_id=c.vocab_size - 1,
                          num_target_layers=c.num_hidden_layers, block_size=block_size,
                          target_layer_ids=list(range(c.num_hidden_layers)))


@torch.no_grad()
def quantize_experts_int4(model):
    """``model``'s routed experts quantised to compressed-tensors INT4 (symmetric, groups of 32:
    ``scale = bf16(absmax / 7)``, ``q = clamp(round(w / scale), -8, 7)``) and loaded with
    ``set_int4``, as a K2 checkpoint's experts load (tests and benches: the INT4 paths of a random
    model).  In place; returns ``model``."""
    from torch_kdtree.models.kimi_k2 import KimiK2Experts
    from torch_kdtree.models.kimi_k2.writer import pack_int4

    for experts in [m for m in model.modules() if isinstance(m, KimiK2Experts)]:
        parts = []
        for w in (experts.gate_proj, experts.up_proj, experts.down_proj):
            E, N, K = w.shape
            groups = w.detach().float().view(E, N, K // 32, 32)
            scale = (groups.abs().amax(-1) / 7).clamp_min(1e-6).to(torch.bfloat16)
            q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).view(E, N, K)
            parts += [pack_int4(q), scale]
        experts.set_int4(*parts)
    return model


__all__ = ["TINY_TARGET", "tiny_target", "tiny_drafter", "quantize_experts_int4"]
