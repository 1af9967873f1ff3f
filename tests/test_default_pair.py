"""The shipped default pair (models/default_pair, issue 48) under the sacred rule: greedy DDTree
equals greedy autoregressive decoding on the pair's held-out code prompts -- on the CPU in fp32
token for token, on CUDA in bf16 (CUDA graphs, compiled steps) up to the bf16 ties that
``assert_equal_up_to_bf16_ties`` demonstrates.  The pair is committed, so its absence fails."""
import pytest
import torch
from conftest import one_thread, requires_cuda_kernel

from torch_kdtree.models.pair import DEFAULT_PAIR_DIR, default_prompts, has_default_pair, load_default_pair


def _batch(tokenizer, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n held-out prompts (cycled), each ``<bos> text`` as in training, left-padded: (ids, mask)."""
    texts = default_prompts()
    assert texts, f"{DEFAULT_PAIR_DIR}: no prompts.json"
    rows = [[tokenizer.bos_token_id] + tokenizer(texts[r % len(texts)], add_special_tokens=False)["input_ids"]
            for r in range(n)]
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
