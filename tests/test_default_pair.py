"""The shipped default pair (models/default_pair, issue 48) under the sacred rule: greedy DDTree
equals greedy autoregressive decoding on the pair's held-out code prompts -- on the CPU in fp32
token for token, on CUDA in bf16 (CUDA graphs, compiled steps) up to the bf16 ties that
``assert_equal_up_to_bf16_ties`` demonstrates.  The pair is committed, so its absence fails."""
import pytest
import torch
from conftest import one_thread, requires_cuda_kernel

from torch_kdtree.models.pair import DEFAULT_PAIR_DIR, default_prompts, has_default_pair, load_default_pair, prompt_ids


def _batch(tokenizer, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n held-out prompts (cycled), each ``<bos> text`` as in training, left-padded: (ids, mask)."""
    texts = default_prompts()
    assert texts, f"{DEFAULT_PAIR_DIR}: no prompts.json"
    rows = [prompt_ids(tokenizer, texts[r % len(texts)]) for r in range(n)]
    rows = [row[:24 + 9 * r] for r, row in enumerate(rows)]  # different lengths: left padding in play
    width = max(map(len, rows))
    ids = torch.full((n, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def test_the_default_pair_is_committed():
    assert has_default_pair(), f"models/default_pair is part of the repository: {DEFAULT_PAIR_DIR}"


@pytest.mark.parametrize("budget", [8, 16])
def test_default_pair_greedy_ddtree_equals_autoregressive_fp32_cpu(budget):
    with one_thread():
        target, drafter, tokenizer = load_default_pair("cpu", torch.float32)
        ids, mask = _batch(tokenizer, 2, "cpu")
        common = dict(attention_mask=mask, max_new_tokens=48, eos_token_id=None)
        ar = target.generate(ids, **common)
        dd = target.generate(ids, drafter=drafter, tree_budget=budget, return_dict_in_generate=True, **common)
    assert ar.shape == (2, ids.shape[1] + 48)
    assert torch.equal(dd.sequences, ar)
    assert dd.mean_accept_length > 1.5  # the trained drafter is right most of the time (card: 4.4 at B = 8)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16"])
def test_default_pair_greedy_ddtree_equals_autoregressive_over_a_quantised_cache(kv_cache_dtype):
    """The sacred property with both decodings over the same fp8 (or bf16) latent cache (issue 50)."""
    with one_thread():
        target, drafter, tokenizer = load_default_pair("cpu", torch.float32)
        ids, mask = _batch(tokenizer, 2, "cpu")
        common = dict(attention_mask=mask, max_new_tokens=32, eos_token_id=None, kv_cache_dtype=kv_cache_dtype)
        ar = target.generate(ids, **common)
        dd = target.generate(ids, drafter=drafter, tree_budget=8, return_dict_in_generate=True, **common)
    assert torch.equal(dd.sequences, ar)
    assert dd.mean_accept_length > 1.5


def test_default_pair_fp8_cache_keeps_the_bf16_caches_top1_over_2000_greedy_tokens():
    """Issue 50's accuracy check on the shipped pair (fp32 model, CPU): 4 held-out prompts x 500
    greedy tokens decoded over a bf16 latent cache, the same tokens fed through an fp8 cache: the
    top-1 agrees wherever the decision is not a near-tie (the bf16 run's top-2 gap >= 2^-4 of the
    position's largest |logit|: e4m3 rounds each cached latent value by up to 2^-4 of itself), and
    at >= 99 % of all positions (issue 50's line).  Measured 2026-12-05 with the rope part in bf16:
    99.55 % of all 2,000 positions (39 % are near-ties: greedy code loops), every decided one;
    relative logit error max|d logit| / max|logit| median 0.0046, p99 0.068, max 0.14 (all 576 values
    in e4m3: 98.70 %, median 0.012, max 0.20)."""
    with one_thread():
        _fp8_agreement("cpu", torch.float32)


@requires_cuda_kernel("kdtree::mla_tree_attention")
def test_cuda_default_pair_fp8_cache_keeps_the_bf16_caches_top1_over_2000_greedy_tokens():
    """The same check on a GPU, the pair as stored (bf16 weights, INT4 experts): the bf16 cache's
    decode steps run the MLA decode kernels, the fp8 cache's mla_tree_attention over e4m3 rows and
    their scales (issue 50's accuracy line on a GPU)."""
    _fp8_agreement("cuda", torch.bfloat16)


def _fp8_agreement(device: str, dtype: torch.dtype) -> None:
    """4 held-out prompts x 500 greedy tokens over a bf16 cache, the same tokens through an fp8 one:
    top-1 agreement >= 99 % of all positions and of the decided ones (printed with the relative
    logit error)."""
    from test_kv_cache_fp8 import E4M3_HALF_STEP, _greedy_decode

    target, _, tokenizer = load_default_pair(device, dtype)
    texts = default_prompts()
    prompt = torch.stack([torch.tensor(prompt_ids(tokenizer, texts[r])[:32]) for r in range(4)]).to(device)
    with torch.no_grad():
        ref, tokens = _greedy_decode(target, prompt, 500, "bfloat16")
        fp8, _ = _greedy_decode(target, prompt, 500, "fp8", tokens)
    ref, fp8 = ref.float(), fp8.float()
    scale = ref.abs().amax(-1)
    decided = ref.topk(2, -1).values.diff(dim=-1).neg()[..., 0] >= E4M3_HALF_STEP * scale
    agree = fp8.argmax(-1) == ref.argmax(-1)
    error = (fp8 - ref).abs().amax(-1) / scale
    print(f"{device} {dtype}: fp8 vs bf16 cache, {agree.numel()} positions: top-1 agreement {agree.float().mean().item():.2%} at all, "
          f"{agree[decided].float().mean().item():.2%} at the {int(decided.sum())} decided; relative logit error "
          f"median {error.median().item():.4f}, p99 {error.quantile(0.99).item():.4f}, max {error.max().item():.4f}")
    assert agree.numel() == 2000 and decided.float().mean() >= 0.4
    assert agree[decided].float().mean() >= 0.99
    assert agree.float().mean() >= 0.99


@requires_cuda_kernel("kdtree::mla_tree_attention")
@pytest.mark.parametrize("budget,compile_step", [(16, "auto"), ("auto", "auto"), (8, False)])
def test_cuda_default_pair_greedy_ddtree_equals_autoregressive_bf16(budget, compile_step):
    """The pair as stored (bf16, INT4 experts) with CUDA graphs: compiled steps (the default) and
    eager ops in the graphs; four prompts of 128 tokens, checked past each accepted tie."""
    from test_generate import _greedy, assert_equal_up_to_bf16_ties

    target, drafter, tokenizer = load_default_pair("cuda")
    ids, mask = _batch(tokenizer, 4, "cuda")
    common = dict(attention_mask=mask, max_new_tokens=128, eos_token_id=None, compile_step=compile_step)
    ar = target.generate(ids, **common)
    dd = target.generate(ids, drafter=drafter, tree_budget=budget, **common)
    assert_equal_up_to_bf16_ties(target, ids, mask, dd, ar, resume=_greedy(target, compile_step))
