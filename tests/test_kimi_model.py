"""Kimi K2 model: config reading, parity with transformers' DeepseekV3ForCausalLM, the absorbed
decode / tree-verify path through the paged latent cache, INT4 experts, compile and CUDA graphs.

Small K2-shaped configs in fp32 on CPU (kv_lora_rank 512 and qk_rope_head_dim 64 as in K2,
since the cache row of ``mla_tree_attention`` is 576 wide; everything else scaled down).
"""
import copy
import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from conftest import HAS_CUDA, one_thread, requires_cuda_kernel
from torch_kdtree.models import KimiK2Cache, KimiK2Config, KimiK2ForCausalLM
from torch_kdtree.models.kimi_k2 import CacheOverflowError, KimiK2Experts, KimiK2MLP
from torch_kdtree.ops import ddtree_build, int4_dequantize, kv_commit

VOCAB = 128
# The GPU decode path runs mla_tree_attention's CUDA kernel (branch mla); without it there is nothing to capture.
requires_mla_cuda = requires_cuda_kernel("kdtree::mla_tree_attention")


@pytest.fixture(autouse=True, scope="module")
def _inference_single_thread():
    """No autograd; one CPU thread (these matrices are tiny: extra threads only add contention)."""
    with one_thread(), torch.no_grad():
        yield


def k2_config_dict(**overrides) -> dict:
    """A K2 config.json as shipped (auto_map to remote code included), scaled down."""
    d = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "model_type": "kimi_k2", "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 1, "eos_token_id": 2, "ep_size": 1, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": 512,
        "max_position_embeddings": 262144, "moe_intermediate_size": 64, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 4, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": 32, "vocab_size": VOCAB,
    }
    d.update(overrides)
    return d


INT4_QUANTIZATION = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


INT4_SIZES = {"hidden_size": 128}  # int4_moe tiles: H a multiple of 128, I of 64


def make_model(seed: int = 0, **overrides) -> KimiK2ForCausalLM:
    torch.manual_seed(seed)
    model = KimiK2ForCausalLM(KimiK2Config.from_dict(k2_config_dict(**overrides))).float().eval()
    with torch.no_grad():  # a non-zero routing bias, so selection really uses it
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def transformers_twin(model: KimiK2ForCausalLM, config_dict: dict) -> DeepseekV3ForCausalLM:
    """transformers' own DeepseekV3ForCausalLM holding the same weights (fused gate_up experts)."""
    d = {k: v for k, v in config_dict.items() if k not in ("model_type", "auto_map")}
    config = DeepseekV3Config(**d)
    config._attn_implementation = "eager"
    twin = DeepseekV3ForCausalLM(config).float().eval()
    state = model.state_dict()
    theirs = {}
    for name, t in state.items():
        if name.endswith("experts.gate_proj"):
            theirs[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, state[name[:-9] + "up_proj"]], dim=1)
        elif not name.endswith("experts.up_proj"):
            theirs[name] = t
    missing, unexpected = twin.load_state_dict(theirs, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return twin


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def with_attention(plan, form: str):
    """``plan`` with every layer's attention form replaced by ``form`` (the MLA ops' forms run on the
    CPU through their reference kernels, in fp32 too)."""
    return replace(plan, layers=tuple(replace(lp, attention=form) for lp in plan.layers))


def decode_one_by_one(model, cache, tokens: torch.Tensor, attention: str | None = None) -> torch.Tensor:
    """Absorbed decode of tokens [R, T], one step per token, committing each; logits [R, T, V].
    ``attention``: the plan's attention form for every layer (default: the model's own plan)."""
    R, T = tokens.shape
    visible = torch.ones(R, 1, 1, dtype=torch.bool)
    plan = model.model.plan_pass(R, 1, tree=True, cache=cache)
    if attention is not None:
        plan = with_attention(plan, attention)
    out = []
    for t in range(T):
        out.append(model(tokens[:, t : t + 1], cache.lengths.long()[:, None], cache, visible, plan=plan).logits)
        cache.advance(1)
    return torch.cat(out, dim=1)


def prefilled_cache(model, prompts: list[torch.Tensor], max_tokens: int = 64, page_size: int = 4) -> KimiK2Cache:
    """A cache holding each prompt committed (right-padded prefill with input_lengths), its pages
    handed out in a shuffled order so the block table really matters."""
    cache = KimiK2Cache.for_model(model, len(prompts), max_tokens, page_size=page_size, dtype=torch.float32)
    shuffled = torch.randperm(cache.kv.shape[1], generator=torch.Generator().manual_seed(len(prompts)))
    cache.block_table.copy_(shuffled.view_as(cache.block_table))
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
    with torch.no_grad():
        model(ids, cache=cache, input_lengths=lengths, return_logits=False)
    cache.advance(lengths)
    return cache


# --------------------------------------------------------------------------------------------
# configuration and registration
# --------------------------------------------------------------------------------------------

def test_config_reads_shipped_k2_config_and_yarn_softmax_scale():
    k2_dims = {"hidden_size": 7168, "qk_nope_head_dim": 128, "v_head_dim": 128}
    c = KimiK2Config.from_dict(k2_config_dict(**k2_dims, quantization_config=INT4_QUANTIZATION))
    assert c.model_type == "kimi_k2"
    rope = c.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 64.0 and rope["rope_theta"] == 50000.0
    assert rope["original_max_position_embeddings"] == 4096 and rope["beta_fast"] == 32.0
    assert c.softmax_scale == pytest.approx(0.144680, abs=1e-6)  # kimi_k2.md, factor 64
    factor32 = k2_config_dict(**k2_dims, rope_scaling={**k2_config_dict()["rope_scaling"], "factor": 32.0})
    assert KimiK2Config.from_dict(factor32).softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert c.quantization_config == INT4_QUANTIZATION and isinstance(c.quantization_config, dict)
    assert c.topk_method == "noaux_tc" and c.scoring_func == "sigmoid" and c.tensor_prefix == ""
    assert c.rms_norm_eps == 1e-6 and c.routed_scaling_factor == 2.827 and c.rope_interleave is True
    # deepseek_v3 as model_type, rope_parameters as written by transformers 5, a save round trip
    d = k2_config_dict(model_type="deepseek_v3")
    d["rope_parameters"] = {**d.pop("rope_scaling"), "rope_type": "yarn", "rope_theta": 50000.0}
    assert KimiK2Config.from_dict(d).rope_parameters["factor"] == 64.0
    again = KimiK2Config.from_dict(c.to_dict())
    assert again.rope_parameters["factor"] == 64.0 and again.softmax_scale == c.softmax_scale


def test_config_reads_k25_wrapper_text_core():
    text = k2_config_dict(rms_norm_eps=1e-5, quantization_config=INT4_QUANTIZATION)
    text.pop("auto_map")
    text["rope_scaling"] = {**text["rope_scaling"], "type": "deepseek_yarn"}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 1152}, "tie_word_embeddings": False}
    c = KimiK2Config.from_dict(wrapper)
    assert c.tensor_prefix == "language_model."
    assert c.rms_norm_eps == 1e-5 and c.quantization_config == INT4_QUANTIZATION
    assert c.rope_parameters["rope_type"] == "yarn" and c.hidden_size == 64
    assert "tensor_prefix" not in c.to_dict()


def test_config_refuses_math_it_does_not_implement():
    with pytest.raises(ValueError, match="topk_method='greedy'"):
        KimiK2Config.from_dict(k2_config_dict(topk_method="greedy"))
    with pytest.raises(ValueError, match="scoring_func='softmax'"):
        KimiK2Config.from_dict(k2_config_dict(scoring_func="softmax"))
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        KimiK2Config.from_dict(k2_config_dict(moe_layer_freq=2))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        KimiK2Config.from_dict(k2_config_dict(hidden_act="gelu"))


def test_auto_classes_pick_ours_without_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(k2_config_dict()))  # carries auto_map to remote code
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is KimiK2Config
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is KimiK2ForCausalLM


# --------------------------------------------------------------------------------------------
# parity with transformers
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    {},
    {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},  # group-limited routing
    {"q_lora_rank": None, "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
], ids=["k2", "group_limited", "q_proj_factor32"])
def test_prefill_logits_match_transformers_deepseek_v3(overrides):
    model = make_model(1, **overrides)
    twin = transformers_twin(model, k2_config_dict(**overrides))
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(13)[None].expand(2, -1) + torch.tensor([[0], [3000]])  # YaRN ramp + long positions
    with torch.no_grad():
        ours = model(ids, positions).logits
        theirs = twin(ids, position_ids=positions).logits
    assert rel_err(ours, theirs) <= 1e-4


def test_taps_are_the_outputs_of_the_chosen_layers():
    model = make_model(3)
    twin = transformers_twin(model, k2_config_dict())
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, tap_layers=(1, 0, 2), return_logits=False)
        theirs = twin(ids, output_hidden_states=True).hidden_states  # embeddings, layers 0, 1, final norm
        logits = model(ids).logits
    H = 64
    assert out.logits is None and out.taps.shape == (1, 9, 3 * H)
    assert rel_err(out.taps[..., :H], theirs[2]) <= 1e-5  # tap order is the requested order
    assert rel_err(out.taps[..., H : 2 * H], theirs[1]) <= 1e-5
    assert rel_err(model.model.norm(out.taps[..., 2 * H :]), theirs[3]) <= 1e-5  # last layer, before the norm
    assert rel_err(model.lm_head(out.last_hidden_state), logits) <= 1e-6


# K2's window is 262,144 positions (YaRN factor 64 over 4096); these sit near 200k and at its end.
LONG_POSITIONS = (199_990, 262_120)


def test_logits_near_position_200k_match_transformers_deepseek_v3():
    """A prefill at positions 199,990 ... 200,010 (and up to K2's last position, 262,143), passed as
    transformers' position_ids, gives transformers' DeepseekV3 logits (fp32, relative error <= 1e-4).
    The RoPE angles are fp32 products position * inv_freq in both models, and the cos/sin tables are
    equal bit for bit: at 200k such an angle is off the exact one by up to ~8e-3 rad (fp32 spacing),
    which both models share -- as DeepSeek's reference code and vLLM's fp32 cos/sin cache do (fp64
    angles would move these logits by ~2e-5).  RoPE is relative, so a uniform shift of every
    position changes the logits only through that rounding: the equal tables pin the absolute angles."""
    model = make_model(50)
    twin = transformers_twin(model, k2_config_dict())
    T = 21
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(51))
    positions = torch.tensor(LONG_POSITIONS)[:, None] + torch.arange(T)
    assert int(positions.max()) == 262_140 < model.config.max_position_embeddings
    cos, sin = model.model.rotary_emb(positions)
    their_cos, their_sin = twin.model.rotary_emb(torch.zeros(1), positions)
    half = cos.shape[-1]
    assert torch.equal(cos, their_cos[..., :half]) and torch.equal(sin, their_sin[..., :half])
    ours = model(ids, position_ids=positions).logits
    theirs = twin(ids, position_ids=positions).logits
    assert rel_err(ours, theirs) <= 1e-4
    one_row = model(ids, position_ids=positions[:1]).logits  # [1, T] broadcast over requests, as transformers does
    assert torch.equal(one_row[0], ours[0]) and rel_err(one_row[1], twin(ids[1:], position_ids=positions[:1]).logits[0]) <= 1e-4
    with pytest.raises(ValueError, match="positions or position_ids"):
        model(ids, positions, position_ids=positions)


def test_tree_pass_and_commit_near_position_200k_match_transformers():
    """A prefix prefilled into the paged cache at positions from 199,990 (and 262,120), a branching
    tree verified after it, one path committed (kv_commit) and the next token decoded: every node's
    logits, and the decoded token's, equal transformers' full forward of prefix + path at the same
    position_ids (fp32, relative error <= 1e-4)."""
    model = make_model(52)
    twin = transformers_twin(model, k2_config_dict())
    g = torch.Generator().manual_seed(53)
    R, P = 2, 9
    prefix = torch.randint(0, VOCAB, (R, P), generator=g)
    start = torch.tensor(LONG_POSITIONS)[:, None]
    cache = KimiK2Cache.for_model(model, R, 32, page_size=4, dtype=torch.float32)
    model(prefix, cache=cache, position_ids=start + torch.arange(P), return_logits=False)
    cache.advance(P)
    logprobs = torch.randn(R, 3, 3, generator=g).log_softmax(-1).sort(dim=-1, descending=True).values
    tree = ddtree_build(logprobs, torch.randint(0, VOCAB, (R, 3, 3), generator=g), prefix[:, -1].contiguous(), 7)
    depth = tree.depths.long()
    logits = model(tree.tokens, start + P + depth, cache, tree.visible).logits

    def transformers_logits(r: int, tokens: torch.Tensor) -> torch.Tensor:
        seq = torch.cat([prefix[r], tokens])
        return twin(seq[None], position_ids=start[r] + torch.arange(len(seq))[None]).logits[0, P:]

    parents = tree.parents.tolist()

    def path_to(r: int, node: int) -> list[int]:
        path = [node]
        while parents[r][path[-1]] >= 0:
            path.append(parents[r][path[-1]])
        return path[::-1]

    for r in range(R):
        for leaf in (i for i in range(8) if i not in parents[r]):
            path = path_to(r, leaf)
            assert rel_err(logits[r, path], transformers_logits(r, tree.tokens[r, path])) <= 1e-4, (r, path)
    paths = [path_to(r, int(depth[r].argmax())) for r in range(R)]  # commit root -> each tree's deepest node
    lengths = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    indices = torch.full((R, 8), -1, dtype=torch.int32)
    for r, p in enumerate(paths):
        indices[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    cache.commit(indices, lengths)
    cache.advance(lengths)
    nxt = torch.randint(0, VOCAB, (R, 1), generator=g)
    step = model(nxt, start + P + lengths[:, None].long(), cache, torch.ones(R, 1, 1, dtype=torch.bool)).logits[:, 0]
    for r in range(R):
        want = transformers_logits(r, torch.cat([tree.tokens[r, paths[r]], nxt[r]]))[-1]
        assert rel_err(step[r], want) <= 1e-4, r


def test_transformers_generate_greedy_equals_an_argmax_loop():
    model = make_model(26)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(27))
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = ids
    for _ in range(4):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, seq)


# --------------------------------------------------------------------------------------------
# the cache: prefill, absorbed decode, tree verify
# --------------------------------------------------------------------------------------------

def test_prefill_of_ragged_prompts_equals_each_prompt_alone():
    model = make_model(5)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (7, 3, 10)]
    cache = KimiK2Cache.for_model(model, 3, 32, page_size=4, dtype=torch.float32)
    ids = torch.zeros(3, 10, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = p
    with torch.no_grad():
        batched = model(ids, cache=cache, input_lengths=torch.tensor([7, 3, 10])).logits
        for r, p in enumerate(prompts):
            alone = model(p[None]).logits[0]
            assert rel_err(batched[r, : len(p)], alone) <= 1e-5


def test_absorbed_decode_reproduces_prefill_logits_at_every_position():
    model = make_model(7)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(8))
    cache = KimiK2Cache.for_model(model, 2, 16, page_size=3, dtype=torch.float32)
    with torch.no_grad():
        full = model(ids).logits
        decoded = decode_one_by_one(model, cache, ids)
    assert rel_err(decoded, full) <= 1e-5
    assert cache.lengths.tolist() == [12, 12]


def test_prefill_continues_after_ragged_committed_prefixes():
    model = make_model(9)
    g = torch.Generator().manual_seed(10)
    heads = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 2)]
    tails = [torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 7)]
    cache = prefilled_cache(model, heads, page_size=3)
    ids = torch.zeros(2, 7, dtype=torch.long)
    for r, t in enumerate(tails):
        ids[r, : len(t)] = t
    logits = model(ids, cache=cache, input_lengths=torch.tensor([4, 7])).logits
    for r in range(2):
        alone = model(torch.cat([heads[r], tails[r]])[None]).logits[0, len(heads[r]):]
        assert rel_err(logits[r, : len(tails[r])], alone) <= 1e-5


def test_tree_pass_over_a_chain_equals_decoding_one_by_one():
    model = make_model(11)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9)]
    chain = torch.randint(0, VOCAB, (2, 6), generator=g)
    tree_cache, seq_cache = prefilled_cache(model, prompts), prefilled_cache(model, prompts)
    N = chain.shape[1]
    visible = torch.tril(torch.ones(N, N, dtype=torch.bool)).expand(2, N, N)
    positions = tree_cache.lengths.long()[:, None] + torch.arange(N)
    with torch.no_grad():
        tree = model(chain, positions, tree_cache, visible).logits
        sequential = decode_one_by_one(model, seq_cache, chain)
    assert rel_err(tree, sequential) <= 1e-5
    assert tree_cache.lengths.tolist() == [5, 9]  # a tree pass commits nothing


def test_branching_tree_equals_decoding_each_root_to_leaf_path():
    model = make_model(13)
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (6, 4)]
    R, L, K, budget = 2, 3, 3, 9
    logprobs = torch.randn(R, L, K, generator=g).log_softmax(-1).sort(dim=-1, descending=True).values
    token_ids = torch.randint(0, VOCAB, (R, L, K), generator=g)
    tree = ddtree_build(logprobs, token_ids, torch.randint(0, VOCAB, (R,), generator=g), budget)
    cache = prefilled_cache(model, prompts)
    positions = cache.lengths.long()[:, None] + tree.depths.long()
    with torch.no_grad():
        logits = model(tree.tokens, positions, cache, tree.visible).logits
    parents = tree.parents.tolist()
    for r in range(R):
        leaves = [i for i in range(budget + 1) if i not in parents[r]]
        assert len(leaves) > 1  # really a branching tree
        for leaf in leaves:
            path = [leaf]
            while parents[r][path[-1]] >= 0:
                path.append(parents[r][path[-1]])
            path.reverse()
            alone = prefilled_cache(model, [prompts[r]])
            with torch.no_grad():
                expected = decode_one_by_one(model, alone, tree.tokens[r, path][None])[0]
            assert rel_err(logits[r, path], expected) <= 1e-5, (r, path)


def test_tree_padding_nodes_leave_the_real_nodes_unchanged():
    model = make_model(28)
    g = torch.Generator().manual_seed(29)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 7)]
    logprobs = torch.randn(2, 1, 2, generator=g).log_softmax(-1).sort(dim=-1, descending=True).values
    tree = ddtree_build(logprobs, torch.randint(0, VOCAB, (2, 1, 2), generator=g), torch.tensor([3, 5]), 4)
    assert (tree.tokens[:, 3:] == -1).all()  # only root + 2 children exist: two padding rows
    padded_cache, plain_cache = prefilled_cache(model, prompts), prefilled_cache(model, prompts)
    positions = padded_cache.lengths.long()[:, None] + tree.depths.long()
    padded = model(tree.tokens, positions, padded_cache, tree.visible).logits
    plain = model(tree.tokens[:, :3], positions[:, :3], plain_cache, tree.visible[:, :3, :3].contiguous()).logits
    assert rel_err(padded[:, :3], plain) <= 1e-6


def test_kv_commit_after_a_tree_pass_continues_like_sequential_decode():
    model = make_model(30)
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 3)]
    parents = [-1, 0, 0, 1, 2, 2]  # two branches; accept 0 -> 2 -> 5 in request 0, 0 -> 1 -> 3 in request 1
    N = len(parents)
    visible = torch.zeros(N, N, dtype=torch.bool)
    depth = torch.zeros(N, dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i], depth[i] = visible[p], depth[p] + 1
        visible[i, i] = True
    tokens = torch.randint(0, VOCAB, (2, N), generator=g)
    accepted = torch.tensor([[0, 2, 5, -1, -1, -1], [0, 1, 3, -1, -1, -1]], dtype=torch.int32)  # [R, N] as tree_accept
    nxt = torch.randint(0, VOCAB, (2, 1), generator=g)
    cache = prefilled_cache(model, prompts)
    model(tokens, cache.lengths.long()[:, None] + depth, cache, visible.expand(2, N, N))
    kv_commit(cache.kv, cache.block_table, cache.lengths, accepted, torch.tensor([3, 3], dtype=torch.int32))
    cache.advance(3)
    after_commit = decode_one_by_one(model, cache, nxt)
    for r in range(2):
        alone = prefilled_cache(model, [prompts[r]])
        path = tokens[r, accepted[r, :3].long()]
        expected = decode_one_by_one(model, alone, torch.cat([path, nxt[r]])[None])[0, -1]
        assert rel_err(after_commit[r, 0], expected) <= 1e-5


def test_cache_overflow_raises_instead_of_writing_out_of_bounds():
    model = make_model(15)
    cache = KimiK2Cache.for_model(model, 2, 8, page_size=4, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 9))
    with pytest.raises(CacheOverflowError, match="capacity of 8"):
        model(ids, cache=cache)
    with torch.no_grad():
        model(ids[:, :6], cache=cache)
    cache.advance(6)
    before = cache.kv.clone()
    visible = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3)
    with pytest.raises(CacheOverflowError, match="request 0 needs 9 tokens"):
        model(ids[:, :3], cache.lengths.long()[:, None] + torch.arange(3), cache, visible)
    assert torch.equal(cache.kv, before)


# --------------------------------------------------------------------------------------------
# experts and routing
# --------------------------------------------------------------------------------------------

def _random_int4(E: int, N: int, K: int, g: torch.Generator):
    packed = torch.randint(-(2**31), 2**31, (E, N, K // 8), dtype=torch.int64, generator=g).to(torch.int32)
    scale = (torch.rand(E, N, K // 32, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    return packed, scale


def test_int4_experts_equal_the_dense_path_on_dequantised_weights():
    int4_model = make_model(16, **INT4_SIZES, quantization_config=INT4_QUANTIZATION)
    dense_model = copy.deepcopy(int4_model)
    g = torch.Generator().manual_seed(17)
    for (name, experts), dense in zip(
            [(n, m) for n, m in int4_model.named_modules() if isinstance(m, KimiK2Experts)],
            [m for m in dense_model.modules() if isinstance(m, KimiK2Experts)]):
        E, I, H = experts.gate_proj.shape
        gate, up, down = _random_int4(E, I, H, g), _random_int4(E, I, H, g), _random_int4(E, H, I, g)
        experts.set_int4(*gate, *up, *down)
        assert experts.is_int4 and "gate_proj" not in dict(experts.named_parameters())
        deq = [int4_dequantize(*w, 32) for w in (gate, up, down)]
        for mine, ref in zip(experts.dense_weights(), deq):  # repacking loses nothing
            assert torch.equal(mine, ref), name
        dense.set_dense(*deq)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        assert rel_err(int4_model(ids).logits, dense_model(ids).logits) <= 1e-5
        cache = KimiK2Cache.for_model(int4_model, 2, 8, page_size=4, dtype=torch.float32)
        assert rel_err(decode_one_by_one(int4_model, cache, ids), dense_model(ids).logits) <= 1e-5


def test_dense_expert_paths_agree():
    from torch_kdtree.models.kimi_k2 import fused

    torch.manual_seed(18)
    experts = KimiK2Experts(6, 32, 16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(10, 32)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(10)]).int()
    w = torch.rand(10, 3)
    with torch.no_grad():
        gathered, looped = experts(x, ids, w), fused.experts(experts, "looped", x, ids, w)
        row_gemv = fused.experts(experts, "row_gemv", x, ids, w)  # the compiled-decode form
        oracle = torch.zeros(10, 32, dtype=torch.float64)
        for t in range(10):
            for j in range(3):
                e = int(ids[t, j])
                h = torch.nn.functional.silu(experts.gate_proj[e].double() @ x[t].double()) * \
                    (experts.up_proj[e].double() @ x[t].double())
                oracle[t] += w[t, j].double() * (experts.down_proj[e].double() @ h)
        assert rel_err(gathered.double(), oracle) <= 1e-5 and rel_err(looped.double(), oracle) <= 1e-5
        assert rel_err(row_gemv.double(), oracle) <= 1e-5
        try:
            grouped = fused.experts(experts, "grouped_mm", x, ids, w)
        except (RuntimeError, NotImplementedError) as e:  # grouped_mm without a CPU kernel in this torch
            pytest.skip(f"grouped_mm unavailable on CPU here: {e}")
        assert rel_err(grouped.double(), oracle) <= 1e-5


def _rows(linear, lo, hi, dim=0):
    part = copy.deepcopy(linear)
    part.weight = torch.nn.Parameter(linear.weight.narrow(dim, lo, hi - lo).clone())
    return part


def test_heads_and_expert_slices_sharded_from_outside_sum_to_the_whole():
    """Tensor parallelism applied from outside: each rank holds a slice of the heads / of the
    experts' intermediate size, the modules read their sizes from the weights, and the ranks'
    partial outputs add up to the unsharded module's (the all-reduce TP would do)."""
    from torch_kdtree.models.kimi_k2.modeling import _Tree

    model = make_model(32)
    layer = model.model.layers[1]
    attn, ranks = layer.self_attn, 2
    heads, qk, kv, v = 4, 32 + 64, 32 + 32, 32
    per = heads // ranks
    shards = []
    for r in range(ranks):
        a = copy.deepcopy(attn)
        a.q_b_proj = _rows(attn.q_b_proj, r * per * qk, (r + 1) * per * qk)
        a.kv_b_proj = _rows(attn.kv_b_proj, r * per * kv, (r + 1) * per * kv)
        a.o_proj = _rows(attn.o_proj, r * per * v, (r + 1) * per * v, dim=1)
        shards.append(a)
    g = torch.Generator().manual_seed(33)
    x = torch.randn(2, 6, 64, generator=g)
    positions = torch.arange(6)[None].expand(2, -1) + 7
    cos, sin = model.model.rotary_emb(positions)
    prefill, _ = model.model._prefill_batch(torch.zeros(2, 6, dtype=torch.long), positions, None, None)
    whole = attn(x, cos, sin, prefill, 1)
    assert rel_err(sum(a(x, cos, sin, prefill, 1) for a in shards), whole) <= 1e-5
    cache = prefilled_cache(model, [torch.arange(7), torch.arange(7)])
    tree = _Tree(cache, cache.slots(6), torch.tril(torch.ones(6, 6, dtype=torch.bool)).expand(2, 6, 6).contiguous())
    whole = attn(x, cos, sin, tree, 1)
    assert rel_err(sum(a(x, cos, sin, tree, 1) for a in shards), whole) <= 1e-5

    experts = layer.mlp.experts
    tokens = torch.randn(5, 64, generator=g)
    ids, weights = layer.mlp.gate(tokens)
    I = experts.gate_proj.shape[1]
    parts = []
    for r in range(ranks):
        lo, hi = r * I // ranks, (r + 1) * I // ranks
        e = KimiK2Experts(1, 1, 1)
        e.set_dense(experts.gate_proj[:, lo:hi], experts.up_proj[:, lo:hi], experts.down_proj[:, :, lo:hi])
        parts.append(e(tokens, ids, weights))
    assert rel_err(sum(parts), experts(tokens, ids, weights)) <= 1e-5


def test_dtype_casts_spare_the_router_rope_and_int4_tensors():
    model = make_model(19, **INT4_SIZES)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    experts = model.model.layers[2].mlp.experts
    E, I, H = experts.gate_proj.shape
    g = torch.Generator().manual_seed(20)
    experts.set_int4(*_random_int4(E, I, H, g), *_random_int4(E, I, H, g), *_random_int4(E, H, I, g))
    model = model.to(torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    # The router weight follows the model (K2 ships it in bf16; logits are fp32 products of it).
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32 and torch.equal(gate.e_score_correction_bias, bias)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.model.layers[1].mlp.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    model = model.float()
    assert experts.w13_scales.dtype == torch.bfloat16 and experts.w2_qweight.dtype == torch.int32
    assert model.model.layers[1].mlp.experts.gate_proj.dtype == torch.float32


def test_eager_cpu_tree_passes_read_only_the_live_keys(monkeypatch):
    """An eager CPU tree pass's plan has ``live_keys``: the torch attention reads the cache up to the
    longest request's length + N, rounded up to a page, not the block table's whole reach (64 keys
    here); the logits equal the full read's to fp32 rounding.  Compiled and CUDA passes keep the
    fixed shape, and a prefill has no tree to trim."""
    from torch_kdtree.models.kimi_k2.plan import Target, plan_pass

    model = make_model(47)
    g = torch.Generator().manual_seed(47)
    plan = model.model.plan_pass(2, 3, tree=True)
    assert plan.live_keys and str(plan).splitlines()[0].endswith(", live keys")
    assert not plan_pass(model, tokens=3, rows=6, tree=True, target=Target("cpu", True)).live_keys
    assert not plan_pass(model, tokens=3, rows=6, tree=True, target=Target("cuda", False)).live_keys
    assert not model.model.plan_pass(2, 3, tree=False).live_keys
    reads = []
    read = KimiK2Cache.read
    monkeypatch.setattr(KimiK2Cache, "read", lambda self, layer, n: reads.append(n) or read(self, layer, n))
    tokens = torch.randint(0, VOCAB, (2, 3), generator=g)
    visible = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3).contiguous()
    logits = []
    for p in (replace(plan, live_keys=False), plan):
        prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
        cache = prefilled_cache(model, prompts)
        reads.clear()
        with torch.no_grad():
            logits.append(model(tokens, cache.lengths.long()[:, None] + torch.arange(3), cache, visible, plan=p).logits)
        assert set(reads) == ({64} if p is not plan else {16})  # 11 + 3 keys, rounded up to pages of 4
    assert rel_err(logits[1], logits[0]) <= 1e-5


# --------------------------------------------------------------------------------------------
# compile and CUDA graphs
# --------------------------------------------------------------------------------------------

def decode_step(model, cache, tokens, positions, visible, plan=None):
    """One fixed-shape decode step: the tree pass with N = 1, then commit the token."""
    logits = model(tokens, positions, cache, visible, plan=plan).logits
    cache.advance(1)
    return logits


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernel_forms"])
def test_decode_step_compiles_fullgraph_and_matches_eager(kernels):
    """The plan of a decode step traces as one graph: the reference forward, and the forms CUDA's
    plan takes (the multiply + sum linears and router, the experts' per-row GEMVs, mla_prepare,
    which writes the cache in place; the ops' reference kernels here), in fp32."""
    model = make_model(20)
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 8)]
    eager_cache, compiled_cache = prefilled_cache(model, prompts), prefilled_cache(model, prompts)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=g)
    visible = torch.ones(2, 1, 1, dtype=torch.bool)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    plan = None
    if kernels:  # fp32 here: the bf16 kernels' forms are asked for by the plan's data (mla_prepare accepts fp32)
        plan = _kernel_plan(model, 2, 1, compiled=True)
        assert plan.layers[1].experts == "row_gemv" and plan.layers[1].matvec
        plan = replace(plan, layers=tuple(replace(lp, attention="prepare") for lp in plan.layers))
    with torch.no_grad():
        for t in range(4):
            tok = tokens[:, t : t + 1]
            want = decode_step(model, eager_cache, tok, eager_cache.lengths.long()[:, None], visible)
            got = step(model, compiled_cache, tok, compiled_cache.lengths.long()[:, None], visible, plan)
            assert rel_err(got, want) <= 1e-5
    assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for every step


GPU_HEADS = {"num_attention_heads": 8, "num_key_value_heads": 8}  # the kernel's smallest head count
requires_int4_cuda = requires_cuda_kernel("kdtree::int4_moe")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_bf16_prefill_matches_cpu_fp32_and_uses_grouped_mm():
    model = make_model(34, **GPU_HEADS)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(35))
    want = model(ids).logits
    gpu = copy.deepcopy(model).to("cuda", torch.bfloat16)
    plan = gpu.model.plan_pass(2, 9, tree=False)
    for lp in plan.layers[1:]:  # both MoE layers: grouped_mm, their routers the fp32-output GEMM
        assert lp.experts == "grouped_mm" and lp.router == ("mm" if hasattr(torch.ops.aten.mm, "dtype") else "linear")
    got = gpu(ids.cuda(), plan=plan).logits
    assert rel_err(got.float().cpu(), want) <= 5e-2
    cache = KimiK2Cache.for_model(gpu, 2, 16, page_size=4, dtype=torch.bfloat16, device="cuda")
    paged = gpu(ids.cuda(), cache=cache).logits  # writes through the block table, attends over the cache
    assert rel_err(paged.float(), got.float()) <= 2e-2


@requires_int4_cuda
def test_cuda_int4_experts_match_dense_on_dequantised_weights():
    int4_model = make_model(36, **INT4_SIZES, **GPU_HEADS)
    dense_model = copy.deepcopy(int4_model)
    g = torch.Generator().manual_seed(37)
    for experts, dense in zip([m for m in int4_model.modules() if isinstance(m, KimiK2Experts)],
                              [m for m in dense_model.modules() if isinstance(m, KimiK2Experts)]):
        E, I, H = experts.gate_proj.shape
        weights = [_random_int4(E, I, H, g), _random_int4(E, I, H, g), _random_int4(E, H, I, g)]
        experts.set_int4(*(t for w in weights for t in w))
        dense.set_dense(*(int4_dequantize(*w, 32) for w in weights))
    ids = torch.randint(0, VOCAB, (2, 7), generator=g).cuda()
    int4_model.to("cuda", torch.bfloat16)
    dense_model.to("cuda", torch.bfloat16)
    assert rel_err(int4_model(ids).logits.float(), dense_model(ids).logits.float()) <= 3e-2


@requires_int4_cuda
def test_cuda_int4_decode_takes_the_shared_expert_and_residual_into_int4_moe():
    """Decode-sized INT4 passes on CUDA hand the shared expert and the residual add to
    kdtree::int4_moe (the plan says so); the logits match the plan with the shared expert apart."""
    import torch_kdtree.models.kimi_k2.moe as moe_mod
    model = make_model(38, **INT4_SIZES, **GPU_HEADS)
    g = torch.Generator().manual_seed(39)
    for experts in [m for m in model.modules() if isinstance(m, KimiK2Experts)]:
        E, I, H = experts.gate_proj.shape
        experts.set_int4(*_random_int4(E, I, H, g), *_random_int4(E, I, H, g), *_random_int4(E, H, I, g))
    model.to("cuda", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 6), generator=g).cuda()
    logits = {}
    for fused in (True, False):
        cache = KimiK2Cache.for_model(model, 2, 16, page_size=4, dtype=torch.bfloat16, device="cuda")
        plan = model.model.plan_pass(2, 1, tree=True, cache=cache)
        moe_layers = [lp for layer, lp in zip(model.model.layers, plan.layers) if isinstance(layer.mlp, moe_mod.KimiK2MoE)]
        assert moe_layers and all(lp.experts == "int4_moe" and lp.shared == "fused" for lp in moe_layers)
        if not fused:
            plan = replace(plan, layers=tuple(replace(lp, shared="torch") if lp.experts else lp for lp in plan.layers))
        visible = torch.ones(2, 1, 1, dtype=torch.bool, device="cuda")
        out = []
        with torch.no_grad():
            for t in range(ids.shape[1]):
                out.append(model(ids[:, t : t + 1], cache.lengths.long()[:, None], cache, visible, plan=plan).logits)
                cache.advance(1)
        logits[fused] = torch.cat(out, dim=1)
    assert rel_err(logits[True].float(), logits[False].float()) <= 2e-2


@requires_mla_cuda
def test_decode_step_cuda_graph_replay_matches_eager():
    model = make_model(22, **GPU_HEADS).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(23)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=g).cuda()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=g).cuda()
    caches = [KimiK2Cache.for_model(model, 2, 32, page_size=4, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    visible = torch.ones(2, 1, 1, dtype=torch.bool, device="cuda")
    with torch.no_grad():
        for c in caches:
            model(prompt, cache=c)
            c.advance(6)
        graph_cache, eager_cache = caches
        static_tok = tokens[:, :1].clone()
        static_pos = graph_cache.lengths.long()[:, None].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (lazy init, allocator)
            for _ in range(2):
                model(static_tok, static_pos, graph_cache, visible)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = decode_step(model, graph_cache, static_tok, graph_cache.lengths.long()[:, None], visible)
        # capture does not run the work: the cache is as it was; every replay is one real step
        for t in range(5):
            static_tok.copy_(tokens[:, t : t + 1])
            graph.replay()
            want = decode_step(model, eager_cache, tokens[:, t : t + 1], eager_cache.lengths.long()[:, None], visible)
            assert rel_err(static_logits.float(), want.float()) <= 1e-2, t  # the same kernels, replayed
        torch.cuda.synchronize()
        assert graph_cache.lengths.tolist() == eager_cache.lengths.tolist() == [11, 11]


@requires_mla_cuda
def test_decode_step_reduce_overhead_uses_cuda_graphs():
    model = make_model(24, **GPU_HEADS).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(25)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=g).cuda()
    tokens = torch.randint(0, VOCAB, (2, 6), generator=g).cuda()
    caches = [KimiK2Cache.for_model(model, 2, 32, page_size=4, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    visible = torch.ones(2, 1, 1, dtype=torch.bool, device="cuda")
    replays = 0
    replay = torch.cuda.CUDAGraph.replay

    def counting_replay(self):
        nonlocal replays
        replays += 1
        return replay(self)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda.CUDAGraph, "replay", counting_replay)
        for c in caches:
            model(prompt, cache=c)
            c.advance(6)
        compiled_cache, eager_cache = caches
        for t in range(6):
            tok = tokens[:, t : t + 1].clone()
            got = step(model, compiled_cache, tok, compiled_cache.lengths.long()[:, None], visible).clone()
            want = decode_step(model, eager_cache, tok, eager_cache.lengths.long()[:, None], visible)
            assert rel_err(got.float(), want.float()) <= 5e-2, t  # inductor's fusions vs eager, bf16
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert replays >= 3, f"CUDA graphs replayed {replays} times in 6 steps"
    assert compiled_cache.lengths.tolist() == [12, 12]


def test_rank_topk_equals_topk_with_lower_index_first_on_ties():
    from torch_kdtree.models.kimi_k2.moe import rank_topk

    g = torch.Generator().manual_seed(41)
    for E, k in ((64, 8), (384, 8), (16, 16), (5, 1)):
        x = torch.randn(3, E, generator=g)
        assert torch.equal(rank_topk(x, k), x.topk(k, dim=-1).indices)
    ties = torch.tensor([[0.5, 2.0, 0.5, 2.0, -float("inf"), 0.5]])
    assert rank_topk(ties, 5).tolist() == [[1, 3, 0, 2, 5]]


def test_moe_block_calls_a_hooked_router_as_a_module():
    """KimiK2MoE routes through its router's logits and route methods (to pass the logits on as
    moe_gemv's hint), but a router that a wrapper hooks (tensor parallelism) is called as a module,
    so its hooks run; the output is the same either way."""
    from torch_kdtree.models.kimi_k2 import moe

    cfg = KimiK2Config.from_dict(k2_config_dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                                                num_experts_per_tok=4))
    torch.manual_seed(31)
    block = moe.KimiK2MoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(3, 64)
    want = block(x)
    seen = []
    pre = block.gate.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    post = block.gate.register_forward_hook(lambda m, a, out: seen.append(len(out)))
    try:
        got = block(x)
    finally:
        pre.remove()
        post.remove()
    assert seen == ["pre", 2]
    assert torch.equal(got, want)


def call_maybe_compiled(fn, compiled: bool, *args):
    """fn(*args), eagerly or through torch.compile(fullgraph=True) (aot_eager: traced, no codegen)."""
    if not compiled:
        return fn(*args)
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not HAS_CUDA or not hasattr(torch.ops.aten.mm, "dtype"), reason="needs CUDA and aten::mm.dtype")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_router_mm_logits_match_the_fp32_product(compiled, dtype):
    """The plan's "mm" router logits of a verify-sized pass (17 rows of K2's hidden size,
    384 experts) come from one fp32-output GEMM of the 16-bit values: equal to the fp32 product of
    the upcast values up to the order of the fp32 sums, eager and compiled (fullgraph, inductor)."""
    from torch_kdtree.models.kimi_k2 import fused, moe

    router = moe.KimiK2Router(KimiK2Config(hidden_size=7168, n_routed_experts=384, num_experts_per_tok=8))
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,))))
    with torch.no_grad():
        router.weight.copy_(torch.randn(384, 7168, generator=g, device="cuda") / 84.7)
    router.to("cuda", dtype)
    x = torch.randn(17, 7168, generator=g, device="cuda").to(dtype)
    want = (x.double() @ router.weight.double().T).float()  # the exact products, summed in fp64
    torch._dynamo.reset()
    try:
        fn = (lambda x: fused.router_logits(router, x, "mm"))
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        got = fn(x)
    finally:
        torch._dynamo.reset()
    assert got.dtype == torch.float32 and got.shape == (17, 384)
    bound = (x.float().abs() @ router.weight.float().abs().T) * 2e-6  # fp32 summation error, 7168 terms
    assert bool(((got - want).abs() <= bound + 1e-30).all()), float(((got - want).abs() / bound).max())
    fp32 = torch.nn.functional.linear(x.float(), router.weight.float())
    assert bool(((fp32 - want).abs() <= bound + 1e-30).all())  # the oracle's bound holds for F.linear too


# --------------------------------------------------------------------------------------------
# the decode plan and the fused forms it selects
# --------------------------------------------------------------------------------------------

def _kernel_plan(model, R: int, N: int, *, compiled: bool = False, device: str = "cpu", keys: int = 64):
    """The plan of an R x N tree pass with every kdtree kernel (on the CPU their reference kernels
    run): the fused forms CUDA would take, runnable here."""
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass

    return plan_pass(model, tokens=N, rows=R * N, tree=True, target=Target(device, compiled, ALL), cache_keys=keys)


def test_plan_picks_the_decode_kernels_by_shape_and_says_why_not():
    """What the plan decides for a K2-shaped bf16 model on CUDA: the whole decode path fused at one
    token, mla_prepare for a few rows, the general forms for a tree verify; INT4 blocks keep
    inductor's router; hooks, fp32 weights, other latent sizes and long caches fall back with a note;
    the CPU runs the reference forwards."""
    from torch_kdtree.models.kimi_k2.plan import Target, plan_pass

    model = make_model(40, num_hidden_layers=2).to(torch.bfloat16)
    one = _kernel_plan(model, 1, 1, compiled=True, device="cuda")
    dense, moe_layer = one.layers
    assert (dense.attention, dense.qkv, dense.mlp, dense.matvec) == ("decode", "gemv_norm", "gemv_norm", True)
    assert (moe_layer.router, moe_layer.route, moe_layer.experts, moe_layer.shared, moe_layer.route_hint) == \
        ("gemv_norm", "moe_route", "moe_gemv", "fused", True)
    two = _kernel_plan(model, 2, 1, compiled=True, device="cuda").layers[1]
    assert (two.attention, two.qkv) == ("prepare", "gemv_norm")
    verify = _kernel_plan(model, 1, 17, compiled=True, device="cuda").layers[1]
    assert (verify.attention, verify.qkv, verify.matvec, verify.router, verify.experts, verify.shared) == \
        ("tree_op", "torch", False, "mm", "grouped_mm", "torch")
    # kdtree::gemm_rows for the linears of bf16 passes of 5 ... 16 rows, and of 17 ... 20 rows where K
    # is long (linear() asks per call), not for decode sizes or more rows
    nine = _kernel_plan(model, 1, 9, compiled=True, device="cuda").layers[1]
    assert nine.rows_gemm and nine.linear_form == "rows" and "gemm_rows" in nine.describe()
    assert not dense.rows_gemm and dense.linear_form == "matvec"
    assert verify.rows_gemm and verify.linear_form == "rows"  # 17 rows: gemm_rows where K >= 4096
    assert not _kernel_plan(model, 1, 21, compiled=True, device="cuda").layers[1].rows_gemm  # cuBLAS
    assert _kernel_plan(model, 1, 5, device="cuda").layers[0].rows_gemm  # eager passes too
    assert not _kernel_plan(make_model(42, num_hidden_layers=2), 1, 17, device="cuda").layers[1].rows_gemm  # fp32
    assert not _kernel_plan(model, 1, 17, device="cpu").layers[1].router == "mm"  # aten::mm.dtype: CUDA only
    long_cache = _kernel_plan(model, 1, 1, device="cuda", keys=2048)
    assert long_cache.layers[0].attention == "prepare_output" and "mla_decode" in str(long_cache)
    # rank_topk where the [T, E, E] comparison is small; moe_route whenever its kernel exists
    wide = make_model(40, num_hidden_layers=2, n_routed_experts=64, num_experts_per_tok=8)
    for rows, want in ((1024, "rank_topk"), (1025, "topk")):  # rows * E^2 <= 2^22
        p = plan_pass(wide, tokens=rows, rows=rows, tree=True, target=Target("cuda", True, frozenset()))
        assert p.layers[1].route == want, rows
    # INT4 experts: the shared expert inside int4_moe, the router in inductor's kernels
    int4 = make_model(41, **INT4_SIZES, num_hidden_layers=2)
    experts = int4.model.layers[1].mlp.experts
    E, I, H = experts.gate_proj.shape
    g = torch.Generator().manual_seed(41)
    experts.set_int4(*_random_int4(E, I, H, g), *_random_int4(E, I, H, g), *_random_int4(E, H, I, g))
    lp = _kernel_plan(int4.to(torch.bfloat16), 1, 1, compiled=True, device="cuda").layers[1]
    assert (lp.experts, lp.shared, lp.router) == ("int4_moe", "fused", "matvec")
    # fp32 weights: no gemv kernels
    assert _kernel_plan(make_model(42, num_hidden_layers=2), 1, 1, device="cuda").layers[0].qkv == "torch"
    # hooks: a parallelism wrapper's module calls stay module calls
    handle = model.model.layers[1].mlp.gate.register_forward_pre_hook(lambda m, a: None)
    hooked = _kernel_plan(model, 1, 1, device="cuda")
    handle.remove()
    assert hooked.layers[1].router == "module" and "hooked MoE block" in str(hooked)
    # latent sizes other than K2's: the torch tree attention, said once
    small = make_model(43, kv_lora_rank=32, qk_rope_head_dim=8, num_hidden_layers=3).to(torch.bfloat16)
    p = _kernel_plan(small, 1, 1, device="cuda")
    assert {lp.attention for lp in p.layers} == {"torch"}
    assert sum("latent 32 + rope 8" in r for r in p.reasons) == 1
    # the CPU: every layer's reference forward
    cpu = plan_pass(model, tokens=1, rows=1, tree=True, target=Target("cpu", True))
    assert all(lp.reference for lp in cpu.layers) and cpu == cpu.reference()
    assert "layer 1: attention=torch qkv=torch router=linear route=topk experts=gathered" in str(cpu)


@pytest.mark.parametrize("R,N,compiled", [(1, 1, False), (2, 1, True), (1, 4, False), (1, 9, True)])
def test_fused_forms_equal_the_reference_forward(R, N, compiled):
    """Every fused form a plan selects (run here through the kdtree ops' reference kernels, eager and
    compiled with fullgraph) gives the reference forward's logits (bf16 tolerance)."""
    model = make_model(44, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8).to(torch.bfloat16)
    plan = _kernel_plan(model, R, N, compiled=compiled)
    assert not all(lp.reference for lp in plan.layers)
    assert all(lp.rows_gemm for lp in plan.layers) == (R * N >= 5)  # N = 9: the linears through gemm_rows
    g = torch.Generator().manual_seed(45 + N)
    prompt = torch.randint(0, VOCAB, (R, 6), generator=g)
    tokens = torch.randint(0, VOCAB, (R, N), generator=g)
    visible = torch.tril(torch.ones(N, N, dtype=torch.bool)).expand(R, N, N).contiguous()
    outs = []
    for p in (plan.reference(), plan):
        cache = KimiK2Cache.for_model(model, R, 32, page_size=8, dtype=torch.bfloat16)
        model(prompt, cache=cache)
        cache.advance(6)
        positions = cache.lengths.long()[:, None] + torch.arange(N)
        fn = lambda t, pos, p=p, cache=cache: model(t, pos, cache, visible, plan=p).logits  # noqa: E731
        outs.append(call_maybe_compiled(fn, compiled and p is plan, tokens, positions))
    assert rel_err(outs[1].float(), outs[0].float()) <= 3e-2


def test_a_plan_for_another_pass_shape_is_refused():
    model = make_model(46)
    cache = KimiK2Cache.for_model(model, 1, 16, page_size=4, dtype=torch.float32)
    plan = model.model.plan_pass(1, 1, tree=True, cache=cache)
    with pytest.raises(ValueError, match="plan is for 1 rows of 1 tokens"):
        model(torch.zeros(1, 2, dtype=torch.long), cache.lengths.long()[:, None] + torch.arange(2), cache,
              torch.ones(1, 2, 2, dtype=torch.bool), plan=plan)


def test_torch_tree_attention_equals_the_mla_tree_attention_op():
    """The reference forward's tree attention (torch ops over every position the block table
    reaches) gives the kdtree::mla_tree_attention path's logits (fp32) on a tree with branches."""
    model = make_model(47, num_hidden_layers=2)
    g = torch.Generator().manual_seed(47)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=g)
    tokens = torch.randint(0, VOCAB, (2, 4), generator=g)
    parents = torch.tensor([-1, 0, 0, 1])
    visible = torch.eye(4, dtype=torch.bool)
    for i in range(4):
        j = int(parents[i])
        while j >= 0:
            visible[i, j] = True
            j = int(parents[j])
    visible = visible.expand(2, 4, 4).contiguous()
    depth = visible.sum(-1) - 1
    reference = model.model.plan_pass(2, 4, tree=True)
    op_plan = replace(reference, layers=tuple(replace(lp, attention="tree_op") for lp in reference.layers))
    outs = []
    for plan in (reference, op_plan):
        cache = KimiK2Cache.for_model(model, 2, 16, page_size=4, dtype=torch.float32)
        model(prompt, cache=cache)
        cache.advance(5)
        outs.append(model(tokens, cache.lengths.long()[:, None] + depth, cache, visible, plan=plan).logits)
    assert rel_err(outs[0], outs[1]) <= 1e-5


def test_router_choice_forms_equal_torch_topk():
    """moe_route (its reference kernel here) and rank_topk choose the experts of the router's torch
    code, eager and compiled (fullgraph), ties to the lower id; the plan's logits forms equal F.linear."""
    from torch_kdtree.models.kimi_k2 import fused, moe

    for E, n_group, topk_group, T in ((64, 4, 2, 3), (64, 1, 1, 17), (384, 1, 1, 28)):
        cfg = KimiK2Config(hidden_size=32, n_routed_experts=E, num_experts_per_tok=8, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
        router = moe.KimiK2Router(cfg)
        g = torch.Generator().manual_seed(E + T)
        router.weight.copy_(torch.randn(E, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
        x = torch.randn(T, 32, generator=g)
        want_ids, want_w = router(x)
        logits = router.logits(x)
        torch.testing.assert_close(fused.router_logits(router, x, "matvec"), logits, rtol=1e-5, atol=1e-5)
        for how in ("moe_route", "rank_topk"):
            for compiled in (False, True):
                ids, w = call_maybe_compiled(lambda lg: fused.route(router, lg, how), compiled, logits)
                assert torch.equal(ids, want_ids), (E, how, compiled)
                torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("shared", [1, 0], ids=["shared", "no_shared"])
def test_moe_block_forms_equal_its_reference(shared):
    """fused.moe under each form the plan can give a decode-sized bf16 block (the norm and logits in
    one gemv, moe_route, moe_gemv with the shared expert and the residual inside, and the unfused
    forms) equals h + block(norm(h)) (bf16 tolerance), eager and compiled."""
    from torch_kdtree.models.kimi_k2 import fused

    model = make_model(48, num_hidden_layers=2, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                       topk_group=2, n_shared_experts=shared).to(torch.bfloat16)
    layer = model.model.layers[1]
    block, norm = layer.mlp, layer.post_attention_layernorm
    h = (torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(48)) * 2).to(torch.bfloat16)
    want = h + block(norm(h))
    lp = _kernel_plan(model, 3, 1, compiled=True).layers[1]
    assert (lp.router, lp.experts, lp.shared) == ("gemv_norm", "moe_gemv", "fused" if shared else "none")
    forms = [lp, replace(lp, router="linear", route="topk", shared="torch" if shared else "none", route_hint=False),
             replace(lp, experts="row_gemv", shared="torch" if shared else "none", route_hint=False),
             replace(lp, experts="looped", router="matvec", shared="torch" if shared else "none", route_hint=False)]
    for form in forms:
        for compiled in (False, True) if form.experts != "looped" else (False,):
            got = call_maybe_compiled(lambda h: fused.moe(block, form, h, norm), compiled, h)
            assert rel_err(got.float(), want.float()) <= 2e-2, (form, compiled)


def test_decode_moe_plan_follows_moe_gemv_slots():
    """bf16 experts go to kdtree::moe_gemv up to 32 token-slots (decode of up to 4 requests at top-8),
    and fused.experts("moe_gemv") gives the gathered reference."""
    from torch_kdtree.models.kimi_k2 import fused

    model = make_model(49, num_hidden_layers=2, num_experts_per_tok=8).to(torch.bfloat16)
    for R, want in ((4, "moe_gemv"), (5, "grouped_mm")):
        assert _kernel_plan(model, R, 1, device="cuda").layers[1].experts == want
    experts = KimiK2Experts(16, 64, 32)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    experts.to(torch.bfloat16)
    x = torch.randn(4, 64).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16)[:8] for _ in range(4)]).int()
    w = torch.rand(4, 8)
    for compiled in (False, True):
        got = call_maybe_compiled(lambda x: fused.experts(experts, "moe_gemv", x, ids, w), compiled, x)
        assert rel_err(got.float(), experts(x, ids, w).float()) <= 1e-2


def test_compiled_gemv_form_equals_the_linear_layers():
    """The decode-sized multiply + sum form (gemv.py; compiled CUDA passes) computes the same
    projections as the module calls, and huge weights keep the GEMM."""
    from torch_kdtree.models.kimi_k2 import fused, gemv

    torch.manual_seed(31)
    mlp = KimiK2MLP(32, 48)
    x = torch.randn(2, 1, 32)
    got = call_maybe_compiled(lambda x: fused.mlp(mlp, x, True), True, x)
    assert rel_err(got, mlp(x)) <= 1e-6
    assert gemv.products_as_matvec(True, mlp.gate_proj.weight)
    assert not gemv.products_as_matvec(True, torch.empty(gemv.GEMV_MAX_WEIGHT + 1, 1))
    assert not gemv.products_as_matvec(False, mlp.gate_proj.weight)
