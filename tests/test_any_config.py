"""Any DeepseekV3-shaped config runs: sizes outside a kernel's contract are the plan's business.

Checkpoints written in the shipped formats (models/kimi_k2/writer.py) at test sizes -- the
writer's defaults (latent 32 + rope 8), hidden 64 with expert width 32, INT4 or bf16 experts --
load through ``from_pretrained``, prefill and generate through the same API, and greedy DDTree
equals greedy autoregressive decoding (fp32, CPU).  The plan says which fallbacks it took.
"""
import pytest
import torch

from conftest import HAS_CUDA
from torch_kdtree.models import KimiK2ForCausalLM
from torch_kdtree.models.generation.tiny import tiny_drafter
from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass
from torch_kdtree.models.kimi_k2.writer import write_random_checkpoint

CONFIGS = {
    "writer_defaults": {},  # kv_lora_rank 32, qk_rope_head_dim 8, hidden 128, expert width 64
    "hidden64_width32": {"hidden_size": 64, "moe_intermediate_size": 32, "intermediate_size": 96},
}


def _load(tmp_path_factory, name: str, int4: bool, device: str = "cpu", dtype=torch.float32):
    path = tmp_path_factory.mktemp(f"{name}_{'int4' if int4 else 'bf16'}")
    write_random_checkpoint(path, CONFIGS[name], int4=int4, seed=3)
    return KimiK2ForCausalLM.from_pretrained(path).to(device, dtype).eval()


def _prompts(vocab: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded request
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("int4", [False, True], ids=["bf16_experts", "int4_experts"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_small_configs_load_prefill_and_generate_ddtree_equal_to_autoregressive(name, int4, tmp_path_factory):
    model = _load(tmp_path_factory, name, int4)
    ids, mask = _prompts(model.config.vocab_size)
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None,
                        drafter=tiny_drafter(model, seed=5, block_size=4), tree_budget=6)
    assert ar.shape == (2, 19) and torch.equal(dd, ar)
    # the plan a CUDA device with every kernel would make says what it leaves to torch, once
    plan = plan_pass(model.to(torch.bfloat16), tokens=1, rows=2, tree=True, target=Target("cuda", True, ALL))
    c = model.config
    latent = c.kv_lora_rank == 512 and c.qk_rope_head_dim == 64
    assert {lp.attention for lp in plan.layers} == ({"prepare"} if latent else {"torch"})
    assert sum(r.startswith(f"latent {c.kv_lora_rank} + rope {c.qk_rope_head_dim}") for r in plan.reasons) == \
        (0 if latent else 1)
    experts = model.model.layers[-1].mlp.experts
    if int4 and name == "hidden64_width32":  # outside int4_moe's tiles: stored dequantised, said by the plan
        assert not experts.is_int4 and any("outside int4_moe's tiles" in r for r in plan.reasons)
    else:
        assert experts.is_int4 == int4


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and the compiled CUDA kernels")
@pytest.mark.parametrize("int4", [False, True], ids=["bf16_experts", "int4_experts"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_small_configs_generate_with_the_plans_fallbacks(name, int4, tmp_path_factory):
    """On CUDA in bf16, with CUDA graphs and compiled steps: the plan's torch fallbacks run beside the
    kernels whose contracts the sizes meet; greedy DDTree equals autoregressive up to bf16 ties."""
    from test_generate import assert_equal_up_to_bf16_ties

    model = _load(tmp_path_factory, name, int4, "cuda", torch.bfloat16)
    ids, mask = _prompts(model.config.vocab_size, "cuda")
    ar = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    drafter = tiny_drafter(model, seed=5, block_size=4).to("cuda", torch.bfloat16)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, drafter=drafter,
                        tree_budget=6)
    assert_equal_up_to_bf16_ties(model, ids, mask, dd, ar)
