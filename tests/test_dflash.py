"""DFlash drafter: forward against an independent per-head float64 re-implementation, the static
context cache (chunking, batching, tree-accept gathers, capacity), the public checkpoint format
(round trip, quirks, strict refusals), torch.compile, and CUDA graphs on a GPU."""
import copy
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from torch_kdtree.models.dflash import (DFlashConfig, DFlashDraftModel, default_target_layer_ids, random_drafter,
                                        write_random_drafter)
from torch_kdtree.ops import set_value_checks, value_checks

from .conftest import requires_cuda

V, H = 256, 64


def make_target(seed: int, vocab: int = V, hidden: int = H, dtype=torch.float32):
    """Random stand-ins for the target's embedding and lm_head."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(vocab, hidden, dtype=dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=gen))
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5)
    return embed, head


def yarn_fields():
    return dict(max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0})


# --------------------------------------------------------------------------------------------
# The oracle: everything from the weights, per request and per head, in float64
# --------------------------------------------------------------------------------------------

def transformers_rope(config: DFlashConfig):
    """inv_freq and amplitude as transformers computes them for a Qwen3 config (an independent
    oracle): its default-RoPE expression, and its own YaRN initialiser."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    d = config.to_dict()
    d.pop("architectures"), d.pop("auto_map")
    qwen3 = Qwen3Config(**d)
    rope_type = qwen3.rope_parameters["rope_type"]
    if rope_type == "default":
        base, dim = qwen3.rope_parameters["rope_theta"], qwen3.head_dim
        return (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))).double(), 1.0
    inv_freq, amplitude = ROPE_INIT_FUNCTIONS[rope_type](qwen3)
    return inv_freq.double(), float(amplitude)


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope_pairs(x, positions, inv_freq, amplitude):
    """Rotate each (x_i, x_{i + D/2}) pair by position * inv_freq_i; x [T, D]."""
    half = x.shape[-1] // 2
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    c, s = torch.cos(angle) * amplitude, torch.sin(angle) * amplitude
    a, b = x[:, :half], x[:, half:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def reference_draft(model: DFlashDraftModel, embed_w, head_w, context_taps, root: int):
    """Logits [bs - 1, V] of one request whose context is the taps [c, n*H] at positions 0..c-1."""
    cfg = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    inv_freq, amp = transformers_rope(cfg)
    eps, d, g, bs = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.block_size
    c = context_taps.shape[0]
    ctx = rms(context_taps.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed_w.double()[[root] + [cfg.mask_token_id] * (bs - 1)]
    ctx_pos, blk_pos = list(range(c)), list(range(c, c + bs))
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        hn = rms(x, w[p + "input_layernorm.weight"], eps)
        heads = []
        for h in range(cfg.num_attention_heads):
            kv = h // g
            wq = w[p + "self_attn.q_proj.weight"][h * d:(h + 1) * d]
            wk = w[p + "self_attn.k_proj.weight"][kv * d:(kv + 1) * d]
            wv = w[p + "self_attn.v_proj.weight"][kv * d:(kv + 1) * d]
            q = rope_pairs(rms(hn @ wq.T, w[p + "self_attn.q_norm.weight"], eps), blk_pos, inv_freq, amp)
            k_ctx = rope_pairs(rms(ctx @ wk.T, w[p + "self_attn.k_norm.weight"], eps), ctx_pos, inv_freq, amp)
            k_blk = rope_pairs(rms(hn @ wk.T, w[p + "self_attn.k_norm.weight"], eps), blk_pos, inv_freq, amp)
            keys, values = torch.cat([k_ctx, k_blk]), torch.cat([ctx @ wv.T, hn @ wv.T])
            heads.append(torch.softmax(q @ keys.T / math.sqrt(d), dim=-1) @ values)  # no causal mask
        x = x + torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T
        hn = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = hn @ w[p + "mlp.gate_proj.weight"].T, hn @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x[1:], w["norm.weight"], eps) @ head_w.double().T


def draft_one_shot(model, taps, lengths, roots, capacity=32):
    model.setup_cache(taps.shape[0], capacity)
    model.append_context(taps, lengths)
    return model(roots)


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_forward_matches_dense_per_head_reference(rope, fresh_seed):
    fields = yarn_fields() if rope == "yarn" else {}
    model = random_drafter(seed=fresh_seed, **fields)
    embed, head = make_target(fresh_seed + 1)
    model.bind_target(embed, head)
    gen = torch.Generator().manual_seed(fresh_seed)
    lengths = torch.tensor([7, 0, 3])
    taps = torch.randn(3, 7, model.config.num_taps * H, generator=gen)
    roots = torch.randint(0, V, (3,), generator=gen)
    with torch.no_grad():
        got = draft_one_shot(model, taps, lengths, roots)
    assert got.shape == (3, model.config.block_size - 1, V)
    for r in range(3):
        want = reference_draft(model, embed.weight, head.weight, taps[r, :lengths[r]], int(roots[r]))
        torch.testing.assert_close(got[r].double(), want, rtol=1e-4, atol=1e-4)


def test_rope_matches_transformers_qwen3_rotary_embedding():
    for fields in ({}, yarn_fields()):
        model = random_drafter(**fields)
        inv_freq, amp = transformers_rope(model.config)
        assert torch.equal(model._inv_freq, inv_freq.float())
        assert model.rope_amplitude == amp


def test_return_hidden_then_lm_head_equals_logits(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    embed, head = make_target(fresh_seed)
    model.bind_target(embed, head)
    taps = torch.randn(2, 5, model.config.num_taps * H)
    with torch.no_grad():
        model.setup_cache(2, 16)
        model.append_context(taps, torch.tensor([5, 2]))
        hidden = model(torch.tensor([3, 4]), return_hidden=True)
        logits = model(torch.tensor([3, 4]))
    assert hidden.shape == (2, model.config.block_size - 1, H)
    torch.testing.assert_close(head(hidden), logits, rtol=0, atol=0)


def test_target_weights_can_be_bound_as_tensors(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    embed, head = make_target(fresh_seed)
    taps, lengths, roots = torch.randn(2, 4, model.config.num_taps * H), torch.tensor([4, 1]), torch.tensor([7, 9])
    with torch.no_grad():
        a = draft_one_shot(model.bind_target(embed, head), taps, lengths, roots)
        b = draft_one_shot(model.bind_target(embed.weight, head.weight), taps, lengths, roots)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_draft_call_leaves_the_context_unchanged(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    with torch.no_grad():
        model.setup_cache(2, 16)
        model.append_context(torch.randn(2, 6, model.config.num_taps * H), torch.tensor([6, 3]))
        lengths = model.context_lengths.clone()
        k = [model.context_k[:, r, :int(lengths[r])].clone() for r in range(2)]
        first = model(torch.tensor([1, 2]))
        model(torch.tensor([5, 6]))
        again = model(torch.tensor([1, 2]))
    assert torch.equal(model.context_lengths, lengths)
    for r in range(2):
        assert torch.equal(model.context_k[:, r, :int(lengths[r])], k[r])
    torch.testing.assert_close(first, again, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# The context cache
# --------------------------------------------------------------------------------------------

def test_context_appended_in_chunks_equals_one_shot(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    gen = torch.Generator().manual_seed(fresh_seed)
    total = torch.tensor([9, 4, 0])
    taps = torch.randn(3, 9, model.config.num_taps * H, generator=gen)
    roots = torch.tensor([11, 12, 13])
    with torch.no_grad():
        one_shot = draft_one_shot(model, taps, total, roots)
        cache_one_shot = model.context_k.clone(), model.context_v.clone()
        # Chunks of different sizes per request: [4, 1, 0], then [2, 3, 0], then [3, 0, 0].
        chunks = [torch.tensor([4, 1, 0]), torch.tensor([2, 3, 0]), torch.tensor([3, 0, 0])]
        model.setup_cache(3, 32)
        start = torch.zeros(3, dtype=torch.long)
        for n in chunks:
            chunk = torch.zeros(3, 4, taps.shape[-1])
            for r in range(3):
                chunk[r, :n[r]] = taps[r, start[r]:start[r] + n[r]]
            model.append_context(chunk, n)
            start += n
        chunked = model(roots)
    assert model.context_lengths.tolist() == total.tolist()
    for r in range(3):
        n = int(total[r])
        torch.testing.assert_close(model.context_k[:, r, :n], cache_one_shot[0][:, r, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.context_v[:, r, :n], cache_one_shot[1][:, r, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


def test_batched_requests_equal_single_runs(fresh_seed):
    model = random_drafter(seed=fresh_seed, **yarn_fields())
    model.bind_target(*make_target(fresh_seed))
    gen = torch.Generator().manual_seed(fresh_seed)
    lengths = torch.tensor([10, 1, 6, 0])
    taps = torch.randn(4, 10, model.config.num_taps * H, generator=gen)
    roots = torch.randint(0, V, (4,), generator=gen)
    with torch.no_grad():
        batched = draft_one_shot(model, taps, lengths, roots, capacity=24)
        for r in range(4):
            single = draft_one_shot(model, taps[r:r + 1, :int(lengths[r])], None, roots[r:r + 1], capacity=11)
            torch.testing.assert_close(batched[r], single[0], rtol=1e-5, atol=1e-5)


def test_valid_mask_under_left_padding_equals_lengths(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    lengths = torch.tensor([6, 2, 4])
    taps = torch.randn(3, 6, model.config.num_taps * H)
    padded = torch.zeros_like(taps)
    valid = torch.zeros(3, 6, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()):
        padded[r, 6 - n:] = taps[r, :n]
        valid[r, 6 - n:] = True
    roots = torch.tensor([1, 2, 3])
    with torch.no_grad():
        want = draft_one_shot(model, taps, lengths, roots)
        model.setup_cache(3, 32)
        model.append_context(padded, valid=valid)
        got = model(roots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_append_of_tree_accepted_nodes_equals_appending_the_path_taps(fresh_seed):
    """The DDTree hand-off: taps of all N verified nodes + tree_accept's (indices, lengths)."""
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    gen = torch.Generator().manual_seed(fresh_seed)
    n_nodes, f = 9, model.config.num_taps * H
    node_taps = torch.randn(2, n_nodes, f, generator=gen)
    indices = torch.tensor([[0, 2, 5, -1, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    prompt = torch.randn(2, 3, f, generator=gen)
    roots = torch.tensor([21, 22])
    with torch.no_grad():
        model.setup_cache(2, 32)
        model.append_context(prompt)
        model.append_context(node_taps, lengths, indices=indices[:, :model.config.block_size])
        got = model(roots)
        path = torch.zeros(2, 3, f)
        path[0] = node_taps[0, [0, 2, 5]]
        path[1, 0] = node_taps[1, 0]
        model.setup_cache(2, 32)
        model.append_context(prompt)
        model.append_context(path, torch.tensor([3, 1]))
        want = model(roots)
    assert model.context_lengths.tolist() == [6, 4]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # without lengths: the indices >= 0 are the accepted nodes
        model.setup_cache(2, 32)
        model.append_context(prompt)
        model.append_context(node_taps, indices=indices[:, :model.config.block_size])
        torch.testing.assert_close(model(roots), want, rtol=1e-5, atol=1e-5)


def test_draft_feeds_ddtree_build_and_tree_accept_feeds_append_context(fresh_seed):
    """One DDTree step's drafter hand-offs with the real ops: logits -> top-K -> ddtree_build;
    tree_accept's (indices, lengths) -> append_context; the context grows by the accept lengths."""
    from torch_kdtree.ops import ddtree_build, tree_accept
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    r, f, budget, k = 3, model.config.num_taps * H, 6, 4
    with torch.no_grad():
        model.setup_cache(r, 32)
        model.append_context(torch.randn(r, 5, f), torch.tensor([5, 3, 1]))
        roots = torch.tensor([7, 8, 9])
        lp, ids = torch.log_softmax(model(roots).float(), dim=-1).topk(k, dim=-1)
        tree = ddtree_build(lp, ids, roots, budget)
        # A target that agrees with the drafter's top-1 at every depth, so paths get accepted.
        depth = tree.depths.clamp(min=0, max=model.config.num_draft_depths - 1).long()
        target_tokens = ids[torch.arange(r)[:, None], depth, 0]
        accepted = tree_accept(tree.tokens, tree.parents, target_tokens)
        before = model.context_lengths.clone()
        node_taps = torch.randn(r, budget + 1, f)
        model.append_context(node_taps, accepted.lengths, indices=accepted.indices[:, :model.config.block_size])
        assert model(accepted.next_tokens).shape == (r, model.config.num_draft_depths, V)
    assert accepted.lengths.min() >= 1
    assert torch.equal(model.context_lengths, before + accepted.lengths)


def test_capacity_overflow_raises_in_eager_mode():
    model = random_drafter()
    model.setup_cache(2, 5)
    taps = torch.randn(2, 4, model.config.num_taps * H)
    with torch.no_grad():
        model.append_context(taps, torch.tensor([4, 1]))
        with pytest.raises(ValueError, match="capacity 5 exceeded"):
            model.append_context(taps, torch.tensor([2, 0]))
        assert model.context_lengths.tolist() == [4, 1]  # nothing written on error
        with value_checks(False):  # as under a graph: clamped, never out of bounds
            model.append_context(taps, torch.tensor([4, 4]))
    assert model.context_lengths.tolist() == [5, 5]


def test_reset_context_empties_only_the_masked_requests(fresh_seed):
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    taps = torch.randn(2, 5, model.config.num_taps * H)
    roots = torch.tensor([3, 4])
    with torch.no_grad():
        model.setup_cache(2, 16)
        model.append_context(taps, torch.tensor([5, 5]))
        model.reset_context(torch.tensor([False, True]))
        assert model.context_lengths.tolist() == [5, 0]
        model.append_context(taps, torch.tensor([0, 2]))
        got = model(roots)
        want = draft_one_shot(model, taps, torch.tensor([5, 2]), roots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_calls_raise_clear_errors():
    model = random_drafter()
    with pytest.raises(RuntimeError, match="setup_cache"):
        model.append_context(torch.randn(1, 1, model.config.num_taps * H))
    model.setup_cache(2, 8)
    with pytest.raises(RuntimeError, match="bind_target"):
        model(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"taps must be \[R=2, A, 128\]"):
        model.append_context(torch.randn(2, 3, H))
    with pytest.raises(ValueError, match="lengths must lie in"):
        model.append_context(torch.randn(2, 3, 2 * H), torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="hidden size 32"):
        model.bind_target(*make_target(0, hidden=32))
    with pytest.raises(ValueError, match="mask_token_id 255"):
        model.bind_target(*make_target(0, vocab=100))


# --------------------------------------------------------------------------------------------
# Checkpoint format
# --------------------------------------------------------------------------------------------

def test_default_target_layer_ids_follow_the_dflash_rule():
    assert default_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]  # Kimi-K2.5-DFlash
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 2) == [1, 5]
    assert default_target_layer_ids(7, 3) == [1, 2, 4]  # 1 + 1.5 = 2.5 rounds half to even
    d = random_drafter(num_target_layers=61, num_hidden_layers=6).config.to_dict()
    del d["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(d).target_layer_ids == [1, 12, 24, 35, 47, 58]


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path, fresh_seed):
    model = random_drafter(seed=fresh_seed, **yarn_fields())
    embed, head = make_target(fresh_seed)
    taps, lengths, roots = torch.randn(2, 6, model.config.num_taps * H), torch.tensor([6, 2]), torch.tensor([5, 6])
    model.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32 and loaded.config == model.config
    with torch.no_grad():
        want = draft_one_shot(model.bind_target(embed, head), taps, lengths, roots)
        got = draft_one_shot(loaded.bind_target(embed, head), taps, lengths, roots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    # A re-export with the "model." prefix loads the same weights.
    state = load_file(tmp_path / "model.safetensors")
    os.makedirs(tmp_path / "prefixed")
    save_file({f"model.{k}": v for k, v in state.items()}, tmp_path / "prefixed" / "model.safetensors")
    (tmp_path / "prefixed" / "config.json").write_text((tmp_path / "config.json").read_text())
    prefixed = DFlashDraftModel.from_pretrained(tmp_path / "prefixed")
    for k, v in loaded.state_dict().items():
        assert torch.equal(prefixed.state_dict()[k], v)


def test_written_bf16_drafter_loads_in_bf16_with_public_names(tmp_path):
    config = write_random_drafter(tmp_path, seed=3)
    state = load_file(tmp_path / "model.safetensors")
    assert len(state) == 3 + 11 * config.num_hidden_layers
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert "layers.1.self_attn.q_norm.weight" in state and "fc.weight" in state
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"target_layer_ids": config.target_layer_ids, "mask_token_id": config.mask_token_id,
                                  "block_size": config.block_size}
    model = DFlashDraftModel.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    assert DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).dtype == torch.float32


def test_intermediate_size_missing_from_config_is_taken_from_the_checkpoint(tmp_path):
    config = write_random_drafter(tmp_path, intermediate_size=80)
    d = json.loads((tmp_path / "config.json").read_text())
    del d["intermediate_size"], d["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    model = DFlashDraftModel.from_pretrained(tmp_path)
    assert model.config.intermediate_size == 80 and model.config.vocab_size is None
    assert model.layers[1].mlp.down_proj.weight.shape == (config.hidden_size, 80)


KIMI_K25_DFLASH = {  # the shipped config.json of z-lab/Kimi-K2.5-DFlash (docs/dflash.md)
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "hidden_size": 7168, "vocab_size": 163840, "head_dim": 128, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 6, "num_target_layers": 61, "intermediate_size": 18432, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144, "rope_theta": 50000.0, "block_size": 8, "torch_dtype": "bfloat16",
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
    "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
}


def test_kimi_k25_drafter_config_reads_as_documented():
    cfg = DFlashConfig.from_dict(KIMI_K25_DFLASH)
    assert (cfg.block_size, cfg.num_draft_depths, cfg.mask_token_id, cfg.rms_norm_eps) == (8, 7, 163838, 1e-5)
    assert cfg.dtype == "bfloat16" and cfg.num_taps == 6
    shapes = DFlashDraftModel.expected_tensors(cfg)
    assert len(shapes) == 69
    assert shapes["fc.weight"] == (7168, 6 * 7168) and shapes["layers.0.self_attn.q_proj.weight"] == (8192, 7168)
    assert shapes["layers.5.self_attn.k_proj.weight"] == (1024, 7168)
    assert shapes["layers.5.mlp.down_proj.weight"] == (7168, 18432)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    assert model.rope_amplitude == 1.0  # mscale = mscale_all_dim = 1: the file's semantics
    inv_freq, amp = transformers_rope(cfg)
    assert amp == 1.0 and torch.equal(model._inv_freq, inv_freq.float())


def test_config_format_variants():
    base = copy.deepcopy(KIMI_K25_DFLASH)
    # rope_parameters (new transformers) and rope_scaling + rope_theta (old) mean the same.
    new = copy.deepcopy(base)
    new["rope_parameters"] = {**new.pop("rope_scaling"), "rope_theta": new.pop("rope_theta")}
    assert DFlashConfig.from_dict(new) == DFlashConfig.from_dict(base)
    # block_size: dflash_config's wins over the top-level key.
    nested = copy.deepcopy(base)
    nested["dflash_config"]["block_size"] = 16
    assert DFlashConfig.from_dict(nested).block_size == 16
    # K2.6's deepseek_yarn: YaRN with mscale = mscale_all_dim = 1.
    k26 = copy.deepcopy(base)
    k26["rope_scaling"] = {k: v for k, v in k26["rope_scaling"].items() if not k.startswith("mscale")}
    k26["rope_scaling"]["rope_type"] = "deepseek_yarn"
    with torch.device("meta"):
        assert DFlashDraftModel(DFlashConfig.from_dict(k26)).rope_amplitude == 1.0
        # Plain YaRN without mscale keys: transformers' 0.1 ln(64) + 1; attention_factor overrides.
        plain = copy.deepcopy(k26)
        plain["rope_scaling"]["rope_type"] = "yarn"
        assert DFlashDraftModel(DFlashConfig.from_dict(plain)).rope_amplitude == pytest.approx(1.4158883083359672)
        cfg = DFlashConfig.from_dict(base)
        cfg.rope_parameters["attention_factor"] = 1.4158883083359672
        assert DFlashDraftModel(cfg).rope_amplitude == 1.4158883083359672
    # Round trips through the writer's format, an amplitude override included.
    assert DFlashConfig.from_dict(DFlashConfig.from_dict(k26).to_dict()) == DFlashConfig.from_dict(k26)
    for fields in ({}, yarn_fields()):
        cfg = random_drafter(**fields).config
        cfg.rope_parameters["attention_factor"] = 1.25
        again = DFlashConfig.from_dict(cfg.to_dict())
        assert again == cfg
        with torch.device("meta"):
            assert DFlashDraftModel(again).rope_amplitude == 1.25


BAD_CONFIGS = [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures must contain"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"use_attention_sink": True}, "attention sinks"),
    ({"kv_lora_rank": 512}, "kv_lora_rank"),
    ({"attention_type": "mla"}, "attention_type='mla'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
    ({"dflash_config": {"target_layer_ids": [1, 5]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 9]}}, r"outside \[0, num_target_layers=8\)"),
    ({"dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 5], "input_embedding_scale": 2.0}},
     "input_embedding_scale"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_that_changes_the_math_is_refused_by_name(change, message):
    d = random_drafter().config.to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict(d)


def _corrupt(state, kind):
    if kind == "missing":
        del state["layers.1.mlp.up_proj.weight"]
    elif kind == "unexpected":
        state["lm_head.weight"] = torch.zeros(V, H, dtype=torch.bfloat16)
    elif kind == "shape":
        state["layers.0.self_attn.k_proj.weight"] = state["layers.0.self_attn.k_proj.weight"].T.contiguous()
    elif kind == "dtype":
        state["norm.weight"] = state["norm.weight"].half()


@pytest.mark.parametrize("kind,message", [
    ("missing", r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"),
    ("unexpected", r"unexpected tensors: \['lm_head.weight'\]"),
    ("shape", r"layers.0.self_attn.k_proj.weight: shape \[64, 32\], expected \[32, 64\]"),
    ("dtype", r"norm.weight: dtype F16, expected torch.bfloat16"),
])
def test_bad_checkpoint_tensors_raise_errors_naming_them(tmp_path, kind, message):
    write_random_drafter(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    _corrupt(state, kind)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_pickle_checkpoints_are_not_loaded(tmp_path):
    write_random_drafter(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin.*pickle checkpoints are not loaded"):
        DFlashDraftModel.from_pretrained(tmp_path)


# --------------------------------------------------------------------------------------------
# Compile and CUDA graphs
# --------------------------------------------------------------------------------------------

def _step(model, taps, lengths, roots):
    model.append_context(taps, lengths)
    return model(roots)


def test_step_compiles_with_fullgraph_and_equals_eager(fresh_seed):
    torch._dynamo.reset()
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    gen = torch.Generator().manual_seed(fresh_seed)
    f = model.config.num_taps * H
    compiled = torch.compile(_step, fullgraph=True)
    prompt = torch.randn(2, 6, f, generator=gen)
    with torch.no_grad():
        model.setup_cache(2, 40)
        model.append_context(prompt, torch.tensor([6, 2]))
        eager_model = copy.deepcopy(model)
        for _ in range(3):  # several steps: the compiled step advances the device lengths itself
            taps = torch.randn(2, model.config.block_size, f, generator=gen)
            lengths = torch.randint(1, model.config.block_size + 1, (2,), generator=gen)
            roots = torch.randint(0, V, (2,), generator=gen)
            want = _step(eager_model, taps, lengths, roots)
            got = compiled(model, taps, lengths, roots)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(model.context_lengths, eager_model.context_lengths)


def test_compiled_step_writes_the_context_cache_in_place(fresh_seed):
    """The compiled step (append_context, then a draft) writes the context cache with index_put_ on
    the whole [L, R, S, Hkv, D] tensors: inductor's code holds no temporary copy of a layer's cache
    (writes through a layer's view made it copy each layer's K and V out and back in every step)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = random_drafter(seed=fresh_seed)
    model.bind_target(*make_target(fresh_seed))
    f = model.config.num_taps * H
    gen = torch.Generator().manual_seed(fresh_seed)
    with torch.no_grad():
        model.setup_cache(2, 40)
        eager_model = copy.deepcopy(model)
        taps = torch.randn(2, model.config.block_size, f, generator=gen)
        args = (taps, torch.tensor([2, 3]), torch.tensor([1, 2]))
        got, codes = run_and_get_code(torch.compile(_step, fullgraph=True), model, *args)
        want = _step(eager_model, *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.context_k, eager_model.context_k, rtol=1e-5, atol=1e-5)  # eager's entries
    torch.testing.assert_close(model.context_v, eager_model.context_v, rtol=1e-5, atol=1e-5)
    layer_buffer = "empty_strided_cpu(" + str(tuple(model.context_k.shape[1:]))
    assert codes and not any(layer_buffer in code for code in codes)


def _relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@requires_cuda
def test_cuda_bf16_draft_matches_cpu_fp32(fresh_seed):
    """Same bf16-representable weights and inputs; only the arithmetic differs (CPU: float32)."""
    model = random_drafter(seed=fresh_seed, dtype=torch.bfloat16, **yarn_fields())
    embed, head = make_target(fresh_seed, dtype=torch.bfloat16)
    taps = torch.randn(3, 12, model.config.num_taps * H).bfloat16()
    lengths, roots = torch.tensor([12, 5, 0]), torch.tensor([1, 2, 3])
    with torch.no_grad():
        cpu = copy.deepcopy(model).float().bind_target(copy.deepcopy(embed).float(), copy.deepcopy(head).float())
        want = draft_one_shot(cpu, taps.float(), lengths, roots)
        gpu = model.cuda().bind_target(embed.cuda(), head.cuda())
        got = draft_one_shot(gpu, taps.cuda(), lengths.cuda(), roots.cuda())
    assert got.dtype == torch.bfloat16
    assert _relative_error(got.cpu(), want) < 3e-2  # measured ~0.6-1 % for bf16 arithmetic on the CPU


@requires_cuda
def test_cuda_graph_replay_of_a_step_equals_eager(fresh_seed):
    """append_context + draft captured once in a torch.cuda.CUDAGraph, replayed with new inputs."""
    model = random_drafter(seed=fresh_seed, dtype=torch.bfloat16).cuda()
    embed, head = make_target(fresh_seed, dtype=torch.bfloat16)
    model.bind_target(embed.cuda(), head.cuda())
    f, bs = model.config.num_taps * H, model.config.block_size
    set_value_checks(False)
    try:
        with torch.no_grad():
            model.setup_cache(2, 64)
            model.append_context(torch.randn(2, 5, f, device="cuda", dtype=torch.bfloat16), torch.tensor([5, 3], device="cuda"))
            eager_model = copy.deepcopy(model)
            s_taps = torch.zeros(2, bs, f, device="cuda", dtype=torch.bfloat16)
            s_lengths = torch.zeros(2, dtype=torch.int64, device="cuda")
            s_roots = torch.zeros(2, dtype=torch.int64, device="cuda")
            probe = copy.deepcopy(model)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up (allocator, kernels) on a throwaway copy
                _step(probe, s_taps, s_lengths, s_roots)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s_out = _step(model, s_taps, s_lengths, s_roots)
            gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
            for _ in range(4):
                taps = torch.randn(2, bs, f, device="cuda", generator=gen).to(torch.bfloat16)
                lengths = torch.randint(1, bs + 1, (2,), device="cuda", generator=gen)
                roots = torch.randint(0, V, (2,), device="cuda", generator=gen)
                s_taps.copy_(taps), s_lengths.copy_(lengths), s_roots.copy_(roots)
                graph.replay()
                want = _step(eager_model, taps, lengths, roots)
                torch.testing.assert_close(s_out.float(), want.float(), rtol=1e-2, atol=1e-2)
                assert torch.equal(model.context_lengths, eager_model.context_lengths)
    finally:
        set_value_checks(True)


@requires_cuda
def test_compiled_step_runs_as_cuda_graphs_without_skips(fresh_seed):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = random_drafter(seed=fresh_seed, dtype=torch.bfloat16).cuda()
    embed, head = make_target(fresh_seed, dtype=torch.bfloat16)
    model.bind_target(embed.cuda(), head.cuda())
    f, bs = model.config.num_taps * H, model.config.block_size
    compiled = torch.compile(_step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        model.setup_cache(2, 64)
        eager_model = copy.deepcopy(model)
        for i in range(5):
            taps = torch.randn(2, bs, f, device="cuda", dtype=torch.bfloat16)
            lengths = torch.tensor([bs, 1 + i % bs], device="cuda")
            roots = torch.tensor([i, 2 * i], device="cuda")
            got = compiled(model, taps, lengths, roots).clone()
            with value_checks(False):
                want = _step(eager_model, taps, lengths, roots)
            # inductor fuses the bf16 arithmetic differently from eager: compare by relative norm
            # (a few of 1536 logits differed by up to 0.033 on the H200 with an elementwise 0.02).
            # bf16 rounding alone spreads it over ~0.7e-2 to 1.1e-2 between seeds (CPU, 8 seeds;
            # the H200 gave 1.08e-2 at one seed, RESULTS run 72); a wrong computation is O(1).
            rel = (got.float() - want.float()).norm() / want.float().norm()
            assert rel < 2e-2, f"step {i}: relative error {rel:.2e}"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    recorded = [node for nodes in manager.roots.values() for node in nodes]
    assert recorded and all(isinstance(node, cudagraph_trees.CUDAGraphNode) for node in recorded)


# --------------------------------------------------------------------------------------------
# Attention over the live context slots only (live_slots_attention)
# --------------------------------------------------------------------------------------------

def _masked_sdpa(q, cache_k, cache_v, used, scale):
    """The oracle: every slot, the dead ones masked (the drafter's SDPA form, per request)."""
    r, t, heads, d = q.shape
    g = heads // cache_k.shape[2]
    keys = cache_k.repeat_interleave(g, dim=2).transpose(1, 2)     # [R, H, S, D]
    values = cache_v.repeat_interleave(g, dim=2).transpose(1, 2)
    mask = (torch.arange(cache_k.shape[1]) < used.unsqueeze(1))[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                           scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("parts", [1, 3, 8])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_live_slots_attention_equals_masked_attention_over_every_slot(parts, kv_heads, fresh_seed):
    """The partitioned form (segments by the torch reference, merged by log-sum-exp) equals one
    masked softmax over all slots: lengths inside the first partition, across partitions, the
    whole cache; partitions past the context contribute nothing."""
    from torch_kdtree.models.dflash.modeling import live_slots_attention, segments_reference

    gen = torch.Generator().manual_seed(fresh_seed)
    r, t, heads, d, slots = 4, 8, 4, 16, 200
    q = torch.randn(r, t, heads, d, generator=gen)
    cache_k = torch.randn(r, slots, kv_heads, d, generator=gen)
    cache_v = torch.randn(r, slots, kv_heads, d, generator=gen)
    used = torch.tensor([1, 37, 151, slots])
    got = live_slots_attention(q, cache_k, cache_v, used, 0.25, partitions=parts, segments=segments_reference)
    want = _masked_sdpa(q, cache_k, cache_v, used, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # what lies past the live slots never matters
    poisoned_k, poisoned_v = cache_k.clone(), cache_v.clone()
    for i, n in enumerate(used.tolist()):
        poisoned_k[i, n:], poisoned_v[i, n:] = 1e4, float("nan")
    again = live_slots_attention(q, poisoned_k, poisoned_v, used, 0.25, partitions=parts,
                                 segments=segments_reference)
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_live_partitions_fill_the_gpu_and_keep_partitions_long():
    from torch_kdtree.models.dflash.modeling import live_partitions

    assert live_partitions(1, 8, 283_792) == 32     # one request, a TP-8 rank's heads: 256 CTAs
    assert live_partitions(64, 8, 283_792) == 1     # 512 CTAs already
    assert live_partitions(1, 8, 2_064) == 4        # partitions of at least 512 slots
    assert live_partitions(1, 8, 100) == 1


def test_live_partitions_split_the_live_slots_not_the_capacity():
    """Each request's live slots spread over the P partitions (a 16k context of a 262k cache keeps
    all P CTAs busy, not the 2 of static slices): the segments tile [0, used) of their own request
    in order, none longer than ceil(used / P) rounded up to 16, none past used."""
    from torch_kdtree.models.dflash.modeling import live_slots_attention, segments_reference

    r, t, heads, d, slots, parts = 3, 2, 2, 8, 4096, 8
    seen = {}

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, used, scale):
        seen.update(cu_k=cu_k.tolist(), used=used.tolist(), max_k=max_k)
        return segments_reference(q, k, v, cu_q, cu_k, max_q, max_k, used, scale)

    used = torch.tensor([1000, 1, slots])
    q = torch.randn(r, t, heads, d)
    cache = torch.randn(r, slots, 1, d)
    live_slots_attention(q, cache, cache, used, 0.5, partitions=parts, segments=spy)
    assert len(seen["cu_k"]) == r * parts + 1 and seen["cu_k"][-1] == r * slots
    for i, n in enumerate(used.tolist()):
        chunk = (-(-n // parts) + 15) // 16 * 16
        lens = seen["used"][i * parts:(i + 1) * parts]
        starts = [s - i * slots for s in seen["cu_k"][i * parts:(i + 1) * parts]]
        assert sum(lens) == n and max(lens) == min(chunk, n) <= seen["max_k"]
        assert starts == [min(p * chunk, n) for p in range(parts)]
    assert seen["used"][:parts] == [128] * 7 + [104]   # 1,000 live slots: eight CTAs' worth of work
    assert seen["max_k"] == 512                        # the whole cache: 4,096 / 8


def test_drafter_with_live_slot_attention_equals_the_masked_form(fresh_seed):
    """The drafter's two attention forms (live_attention True / False) draft the same logits,
    batched requests of different context lengths, a capacity of several partitions."""
    model = random_drafter(seed=fresh_seed, dtype=torch.float32)
    embed, head = make_target(fresh_seed)
    model.bind_target(embed, head)
    f = model.config.num_taps * H
    gen = torch.Generator().manual_seed(fresh_seed)
    taps = torch.randn(3, 700, f, generator=gen)
    lengths, roots = torch.tensor([700, 5, 0]), torch.tensor([1, 2, 3])
    out = {}
    with torch.no_grad():
        for live in (False, True):
            model.live_attention = live
            out[live] = draft_one_shot(model, taps, lengths, roots, capacity=2048)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-4)


@requires_cuda
@pytest.mark.parametrize("slots,used", [(2064, [1, 9, 2064]), (70_000, [8, 4_000, 69_999])])
def test_cuda_live_slots_attention_equals_masked_sdpa(slots, used, fresh_seed):
    """flash attention's variable-length segments (CUDA, bf16) against the masked SDPA in fp32."""
    from torch_kdtree.models.dflash.modeling import live_attention_supported, live_slots_attention

    gen = torch.Generator(device="cuda").manual_seed(fresh_seed)
    r, t, heads, d = 3, 8, 8, 128
    q = torch.randn(r, t, heads, d, device="cuda", generator=gen).bfloat16()
    if not live_attention_supported(q):
        pytest.fail(f"flash attention with seqused_k is not available here (torch {torch.__version__}, "
                    f"{torch.cuda.get_device_name()}): the drafter would read its whole cache every step")
    cache_k = torch.randn(r, slots, 1, d, device="cuda", generator=gen).bfloat16()
    cache_v = torch.randn(r, slots, 1, d, device="cuda", generator=gen).bfloat16()
    used_t = torch.tensor(used, device="cuda")
    got = live_slots_attention(q, cache_k, cache_v, used_t, d ** -0.5)
    want = _masked_sdpa(q.float().cpu(), cache_k.float().cpu(), cache_v.float().cpu(), used_t.cpu(), d ** -0.5)
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_drafter_linears_that_read_one_input_share_a_gemm_rows_launch(monkeypatch, fresh_seed):
    """With rows_gemm, q / k / v (one input) run as one gemm_rows launch of three weights, gate / up as
    one of two, the others alone, and the draft is the nn.Linear draft's; a hook on a linear keeps it
    out of the shared launch."""
    from torch_kdtree.models.dflash import modeling
    from torch_kdtree.models.kimi_k2 import gemv
    from torch_kdtree.ops import gemm_rows_pays

    model = random_drafter(seed=fresh_seed, dtype=torch.float32)
    embed, head = make_target(fresh_seed)
    model.bind_target(embed, head)
    gen = torch.Generator().manual_seed(fresh_seed)
    taps = torch.randn(2, 12, model.config.num_taps * H, generator=gen)  # an append of 24 rows: cuBLAS
    lengths, roots = torch.tensor([12, 5]), torch.tensor([1, 2])
    assert gemm_rows_pays(2 * model.block_size, H) and not gemm_rows_pays(24, H)
    sizes = []
    real = modeling.gemm_rows
    spy = lambda x, w: sizes.append(len(w) if isinstance(w, list) else 1) or real(x, w)  # noqa: E731
    monkeypatch.setattr(modeling, "gemm_rows", spy)  # RowsLinear's own calls
    monkeypatch.setattr(gemv, "gemm_rows", spy)      # the shared launches (kimi_k2.gemv.linears)
    with torch.no_grad():
        model.rows_gemm = False
        want = draft_one_shot(model, taps, lengths, roots)
        model.rows_gemm = True
        got = draft_one_shot(model, taps, lengths, roots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    layers = len(model.layers)
    assert sizes.count(3) == layers and sizes.count(2) == layers  # the block's q + k + v, gate + up
    assert sizes.count(1) == 2 * layers  # its o_proj and down_proj
    sizes.clear()
    model.layers[0].self_attn.k_proj.register_forward_hook(lambda *a: None)
    with torch.no_grad():
        torch.testing.assert_close(draft_one_shot(model, taps, lengths, roots), want, rtol=1e-5, atol=1e-5)
    assert sizes.count(3) == layers - 1


@pytest.mark.parametrize("requests", [1, 2, 5])
def test_drafter_linears_through_gemm_rows_equal_nn_linear(requests, fresh_seed):
    """rows_gemm=True makes the drafter's own linears RowsLinear (same state dict, same outputs):
    calls of gemm_rows_pays' row counts run kdtree::gemm_rows (its CPU kernel here: one request's
    12-token append, two requests' 8-row block), others F.linear (five requests: 60 and 20 rows);
    rows_gemm=False restores nn.Linear."""
    from torch_kdtree.ops import gemm_rows_pays
    from torch_kdtree.models.dflash.modeling import RowsLinear

    model = random_drafter(seed=fresh_seed, dtype=torch.float32)
    embed, head = make_target(fresh_seed)
    model.bind_target(embed, head)
    gen = torch.Generator().manual_seed(fresh_seed)
    taps = torch.randn(requests, 12, model.config.num_taps * H, generator=gen)
    lengths = torch.tensor([12, 5, 1, 7, 3][:requests])
    roots = torch.tensor([1, 2, 3, 4, 5][:requests])
    # every linear of the tiny drafter has K < 4096: the rows alone decide
    assert max(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)) < 4096
    expect_calls = gemm_rows_pays(requests * 12, H) or gemm_rows_pays(requests * model.block_size, H)
    keys = set(model.state_dict())
    out = {}
    with torch.no_grad():
        for rows in (False, True):
            model.rows_gemm = rows
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out[rows] = draft_one_shot(model, taps, lengths, roots)
            calls = sum(e.name == "kdtree::gemm_rows" for e in prof.events())
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            assert all(isinstance(m, RowsLinear) == rows for m in linears)
            assert (calls > 0) == (rows and expect_calls), calls
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    model.rows_gemm = True
    model.setup_cache(1, 16)
    assert isinstance(copy.deepcopy(model).fc, RowsLinear)
