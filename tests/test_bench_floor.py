"""bench/floor.py on the CPU: the routed experts a step touches, counted on the device by router
hooks, against a Python loop over the routers' choices; the step's bytes against a hand sum."""
import pytest
import torch

from bench.floor import RoutedExperts, expert_bytes, moe_blocks, routed_experts_of_step, step_bytes
from torch_kdtree.models.generation import GenerationSession
from torch_kdtree.models.generation.session import DEFER_ROWS
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
from torch_kdtree.models.kimi_k2.moe import KimiK2Router

E, K = 32, 2  # enough experts that a 4-token tree cannot touch them all
PROMPT = 6


def _target():
    return tiny_target(5, n_routed_experts=E, num_experts_per_tok=K, num_hidden_layers=3)


def _session(target, drafter, R: int, budget: int) -> GenerationSession:
    s = GenerationSession(target, drafter, batch_size=R, max_prompt=PROMPT, max_new=16, budgets=(0, budget))
    g = torch.Generator().manual_seed(R)
    s.prefill(torch.randint(3, 120, (R, PROMPT), generator=g), torch.full((R,), PROMPT), max_new=16, eos=[])
    return s


def _chosen_by_loop(monkeypatch, target) -> list[set]:
    """Per MoE layer, a set the routers' chosen ids are added to one by one in Python."""
    index = {id(b.gate): i for i, b in enumerate(moe_blocks(target))}
    chosen = [set() for _ in index]
    real = KimiK2Router.route

    def route(self, logits, **kwargs):  # the plan's forms pass topk= (fused.route)
        ids, weights = real(self, logits, **kwargs)
        for row in ids.tolist():
            for e in row:
                chosen[index[id(self)]].add(e)
        return ids, weights

    monkeypatch.setattr(KimiK2Router, "route", route)
    return chosen


@pytest.mark.parametrize("R,budget", [(1, 3), (2, 3), (2, 8)])
def test_routed_experts_of_a_tree_step_equal_a_loop_over_the_routers_choices(monkeypatch, R, budget):
    target = _target()
    session = _session(target, tiny_drafter(target, seed=1), R, budget)
    chosen = _chosen_by_loop(monkeypatch, target)
    counts = routed_experts_of_step(session, budget)
    assert counts == [len(c) for c in chosen]
    assert len(counts) == 2  # layers 1 and 2 are MoE
    assert all(K <= n <= min(E, R * (budget + 1) * K) for n in counts)
    if R * (budget + 1) * K < E:
        assert all(n < E for n in counts)


def test_routed_experts_of_an_autoregressive_step_are_k_per_layer():
    target = _target()
    session = _session(target, None, 1, 0)
    assert routed_experts_of_step(session, 0) == [K, K]


def test_counting_nothing_raises():
    target = _target()
    with RoutedExperts(target) as routed:
        pass
    with pytest.raises(RuntimeError, match="nothing was counted"):
        routed.counts()


def _hand_sums(c, d):
    """The tiny configuration's bytes, written out (fp32 everywhere: 4 bytes an element)."""
    H, heads = c.hidden_size, c.num_attention_heads
    attn = (c.q_lora_rank * H + c.q_lora_rank + heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) * c.q_lora_rank
            + (c.kv_lora_rank + c.qk_rope_head_dim) * H + c.kv_lora_rank
            + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + H * heads * c.v_head_dim + 2 * H)
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    weights = (c.num_hidden_layers * attn + c.first_k_dense_replace * 3 * H * c.intermediate_size
               + moe_layers * (E * H + E)  # router weight and its score-correction bias
               + H + c.vocab_size * H + c.qk_rope_head_dim // 2)  # final norm, lm_head, RoPE inv_freq
    shared = moe_layers * 3 * H * c.moe_intermediate_size
    expert = 3 * H * c.moe_intermediate_size
    dh, dkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    d_layer = 2 * H + dh * H + 2 * dkv * H + H * dh + 2 * d.head_dim + 3 * H * d.intermediate_size
    drafter = d.num_taps * H * H + H + d.num_hidden_layers * d_layer + H
    append = d.num_taps * H * H + H + d.num_hidden_layers * (2 * dkv * H + d.head_dim)
    return {k: 4 * v for k, v in dict(weights=weights, shared=shared, expert=expert, drafter=drafter,
                                       append=append, lm_head=c.vocab_size * H).items()}


def test_step_bytes_equal_a_hand_sum():
    target = _target()
    drafter = tiny_drafter(target, seed=1)
    c, d = target.config, drafter.config
    hand = _hand_sums(c, d)
    assert expert_bytes(moe_blocks(target)[0].experts) == hand["expert"]
    contexts, budget, routed = [7, 9], 3, [5, 6]
    T, kv_row = budget + 1, (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    got = step_bytes(target, routed, contexts, budget, drafter)
    assert got.weights == hand["weights"]
    assert got.shared_experts == hand["shared"]
    assert got.routed_experts == 11 * hand["expert"]
    assert got.kv == (7 + T + 9 + T) * c.num_hidden_layers * kv_row
    assert got.drafter_weights == hand["drafter"]
    assert got.drafter_lm_head == hand["lm_head"]
    assert got.drafter_kv == (7 + 9 + 2 * d.block_size) * d.num_hidden_layers * 2 * d.num_key_value_heads * d.head_dim * 4
    assert got.total == sum(got)
    # the autoregressive step: one token, k experts a layer; with a drafter its share of the batched context append
    ar = step_bytes(target, [K, K], [12], 0)
    assert ar.total == hand["weights"] + hand["shared"] + 2 * K * hand["expert"] + (12 + 1) * c.num_hidden_layers * kv_row
    assert step_bytes(target, [K, K], [12], 0, drafter).total == ar.total + hand["append"] // DEFER_ROWS
    with pytest.raises(ValueError, match="MoE layers"):
        step_bytes(target, [K], [12], 0)
    with pytest.raises(ValueError, match="routed experts"):
        step_bytes(target, [E + 1, K], [12], 0)


def test_int4_expert_bytes_are_nibbles_and_group_scales():
    target = tiny_target(0, hidden_size=128, moe_intermediate_size=64)
    experts = moe_blocks(target)[0].experts
    n, H, I = experts.gate_proj.shape[0], 128, 64
    g = torch.Generator().manual_seed(0)

    def compressed(out, inp):
        packed = torch.randint(-2**31, 2**31 - 1, (n, out, inp // 8), generator=g, dtype=torch.int32)
        return packed, torch.full((n, out, inp // 32), 0.01, dtype=torch.bfloat16)

    experts.set_int4(*compressed(I, H), *compressed(I, H), *compressed(H, I))
    assert expert_bytes(experts) == 3 * H * I // 2 + 2 * (3 * H * I // 32)


def test_routed_experts_are_counted_when_the_session_planned_fused_routing(monkeypatch):
    """A session whose step plan routes through the fused forms (moe_route, not the router module, as
    on CUDA; the ops' reference kernels here) still has its step's experts counted: the step is
    planned again while the hooks exist, and the session's plan is put back."""
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass

    target = _target()
    session = _session(target, tiny_drafter(target, seed=1), 1, 3)
    fused = plan_pass(target, tokens=4, rows=4, tree=True, target=Target("cpu", False, ALL))
    assert {lp.route for lp in fused.layers if lp.experts} == {"moe_route"}
    session.plan[3] = fused
    chosen = _chosen_by_loop(monkeypatch, target)
    assert routed_experts_of_step(session, 3) == [len(c) for c in chosen]
    assert session.plan[3] is fused
