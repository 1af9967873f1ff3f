"""The TP-8 projection's arithmetic (bench/tp_projection.py) and the one-GPU rank program it is fed
by (bench/tp_rank.py), on the CPU.

- The projection: depth scaling, collectives per step and tokens/s pinned to hand-computed numbers.
- The collective counts equal what the compiled steps hold: a tiny tensor-parallel pair over a fake
  world of 8 (each step compiled fullgraph by a counting backend, and once by inductor, whose
  wrapper code the CUDA test of tests/test_tensor_parallel_cuda.py reads the same way).
- The rank program: the global K2 config of bench/bench_tensor_parallel.py parallelised on the meta
  device over a fake world of 8, rank 0, holds the k2_slice shapes (heads / 8, expert width / 8,
  vocabulary / 8); at tiny sizes it materialises with random INT4 experts and generates (AR and
  DDTree) with the fake collectives.
"""
import re

import pytest
import torch

import tp_worker
from bench.tp_projection import (ASSUMED_ACCEPT, DRAFTER_LAYERS, K2_LAYERS, LINKS, collectives_per_step, project,
                                 scale_to_layers)

_CALL = re.compile(r"torch\.ops\._c10d_functional\.(all_reduce_?|all_gather_into_tensor(?:_out)?)\.default\(")


def collective_calls(codes) -> tuple[int, int]:
    """(all-reduces, all-gathers) that inductor's wrapper code ``codes`` (run_and_get_code) calls:
    ``torch.ops._c10d_functional.*.default(`` outside comments (its metadata asserts name the op in
    a string, not as a call)."""
    reduces = gathers = 0
    for code in codes:
        for line in code.splitlines():
            if line.lstrip().startswith("#"):
                continue
            for m in _CALL.finditer(line):
                if m.group(1).startswith("all_reduce"):
                    reduces += 1
                else:
                    gathers += 1
    return reduces, gathers


@pytest.fixture
def fake8():
    import torch.distributed as dist

    from bench.tp_rank import fake_world

    yield fake_world(8)
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# the arithmetic
# --------------------------------------------------------------------------------------------

def test_depth_scaling_is_the_long_step_plus_the_per_layer_difference():
    # per layer (0.30 - 0.20) / 2 = 0.05 ms; 61 layers: 0.30 + 57 x 0.05 = 3.15 ms
    assert scale_to_layers(0.20e-3, 0.30e-3, 2, 4, 61) == pytest.approx(3.15e-3, rel=1e-12)
    assert scale_to_layers(0.9e-3, 1.1e-3, 2, 4, 61) == pytest.approx(6.8e-3, rel=1e-12)
    assert scale_to_layers(0.9e-3, 1.1e-3, 2, 4, 4) == pytest.approx(1.1e-3, rel=1e-12)
    with pytest.raises(ValueError):
        scale_to_layers(1.0, 2.0, 4, 4, 61)


def test_collectives_per_step_pinned():
    assert collectives_per_step(K2_LAYERS, 0) == (122, 2)  # AR: 2 per layer; each shard's best value, id
    assert collectives_per_step(K2_LAYERS, 0, DRAFTER_LAYERS) == (122, 2)  # the AR step only stores its taps (the flush runs fc)
    assert collectives_per_step(K2_LAYERS, 16, DRAFTER_LAYERS) == (135, 5)  # + 2 per drafter layer; top-K 3
    assert collectives_per_step(2, 8, 1, world=1) == (7, 3)  # world 1: the vocabulary is whole, the top-K still gathers
    assert collectives_per_step(2, 0, world=1) == (4, 0)
    with pytest.raises(ValueError, match="tree step"):
        collectives_per_step(61, 16)


def test_projection_pinned_to_hand_computed_numbers():
    # AR over NVLink at 6 us + 4 us of world-1 overhead: 124 collectives x 10 us = 1.24 ms on 3.15 ms
    ar = project(3.15e-3, *collectives_per_step(61, 0), latency_us=6.0, overhead_us=4.0)
    assert ar.collectives == 124
    assert ar.communication_s == pytest.approx(1.24e-3, rel=1e-12)
    assert ar.step_s == pytest.approx(4.39e-3, rel=1e-12)
    assert ar.tokens_per_s == pytest.approx(227.7904328, rel=1e-9)  # 1 / 4.39 ms
    assert ar.communication_share == pytest.approx(0.2824601367, rel=1e-9)  # 1.24 / 4.39
    # DDTree B = 16 at 9 + 1 us, 2.74 tokens a step: 140 x 10 us = 1.4 ms on 6.8 ms -> 2.74 / 8.2 ms
    dd = project(6.8e-3, *collectives_per_step(61, 16, 6), latency_us=9.0, overhead_us=1.0, tokens_per_step=2.74)
    assert dd.collectives == 140
    assert dd.step_s == pytest.approx(8.2e-3, rel=1e-12)
    assert dd.tokens_per_s == pytest.approx(334.1463415, rel=1e-9)
    # PCIe's high end: 124 x 30 us = 3.72 ms -> 1 / 6.87 ms; a negative measured overhead counts as none
    assert project(3.15e-3, 122, 2, 26.0, 4.0).tokens_per_s == pytest.approx(145.5604076, rel=1e-9)
    assert project(3.15e-3, 122, 2, 6.0, -0.5).step_s == pytest.approx(3.15e-3 + 124 * 6e-6, rel=1e-12)


def test_the_assumptions_are_the_stated_ones():
    assert LINKS == {"nvlink": (6.0, 9.0), "pcie_gen5": (16.0, 26.0)}  # docs/parallel.md
    assert ASSUMED_ACCEPT == {"oracle_80": 2.74, "oracle_95": 4.83}  # bench/STATUS.md, issue 44, k2_slice


# --------------------------------------------------------------------------------------------
# the eight-GPU half (bench/tp8_run.py): measured TP-8 steps scaled in depth and to another card
# --------------------------------------------------------------------------------------------

def test_the_eight_gpu_assumptions_are_the_stated_ones():
    from bench.tp_projection import ACCEPTANCES, BLOCK_SIZE, H200_SPEC_GBS, PCIE_BUS_GBS, RTX_PRO_6000_GBS, cases

    assert RTX_PRO_6000_GBS == (1600.0, 1792.0) and H200_SPEC_GBS == 4800.0 and PCIE_BUS_GBS == (22.0, 41.0)
    assert ACCEPTANCES == (3.0, 5.0, 8.0) and BLOCK_SIZE == 8
    # low = the slow end of every assumption, high = the fast end
    assert cases("8x H200") == [("8x H200", "measured", None), ("8x RTX PRO 6000", "low", (1600.0, 26.0, 22.0)),
                                ("8x RTX PRO 6000", "high", (1792.0, 16.0, 41.0))]


def test_max_accept_is_the_path_of_drafts_plus_the_bonus_token():
    from bench.tp_projection import max_accept

    assert [max_accept(b) for b in (0, 1, 4, 7, 8, 16, 64)] == [1, 2, 5, 8, 8, 8, 8]  # L = 7
    assert max_accept(2, block_size=4) == 3 and max_accept(8, block_size=4) == 4
    with pytest.raises(ValueError):
        max_accept(-1)


def test_collective_messages_size_every_collective_of_the_step():
    from bench.tp_projection import collective_messages

    row = 7168 * 2  # one token of hidden 7168 in bf16: 14 KB
    assert collective_messages(61, 0) == [(122, row), (2, 0)]
    # B = 16: 17 tree nodes through the target; the drafter's fc over 8 appended nodes, its 6 layers over the
    # block of 8; five gathers (argmax value and id, the draft top-K's values, ids, log-sum-exps)
    assert collective_messages(61, 16, 6) == [(122, 17 * row), (1, 8 * row), (12, 8 * row), (5, 0)]
    assert collective_messages(61, 0, 6) == [(122, row), (2, 0)]  # AR with a drafter: taps stored, no fc (the flush)
    assert collective_messages(2, 0, world=1) == [(4, row)]  # world 1: the vocabulary is whole, nothing gathers
    for args in ((61, 0), (61, 16, 6), (3, 64, 2)):
        assert sum(c for c, _ in collective_messages(*args)) == sum(collectives_per_step(*args))


def test_ring_all_reduce_and_step_communication_pinned():
    from bench.tp_projection import ring_all_reduce_us, step_communication_s

    # 20 us + 2 x 7 / 8 x 14336 B at 40 GB/s = 20 + 0.6272 us
    assert ring_all_reduce_us(14336, 8, 20.0, 40.0) == pytest.approx(20.6272, rel=1e-12)
    assert ring_all_reduce_us(0, 8, 16.0, 41.0) == 16.0  # a gather: latency only
    assert ring_all_reduce_us(1 << 20, 1, 5.0, 1.0) == 5.0  # world 1 moves nothing
    # 122 x 20.6272 + 2 x 20 us = 2556.5184 us
    assert step_communication_s([(122, 14336), (2, 0)], 8, 20.0, 40.0) == pytest.approx(2.5565184e-3, rel=1e-12)
    with pytest.raises(ValueError):
        ring_all_reduce_us(100, 8, 20.0, 0.0)


def test_depth_scaling_of_measured_steps_and_their_collectives():
    from bench.tp_projection import project_depth

    measured = {4: {0: (2e-3, 0.5e-3), 16: (5e-3, 1e-3), 32: (6e-3, 1e-3)}, 8: {0: (3e-3, 0.9e-3), 16: (7e-3, 1.8e-3)}}
    steps = project_depth(measured)
    assert sorted(steps) == [0, 16]  # budgets measured at both depths only
    # AR: per layer (3 - 2) / 4 = 0.25 ms -> 3 + 53 x 0.25 = 16.25 ms; collectives 0.9 + 53 x 0.1 = 6.2 ms
    assert steps[0] == pytest.approx((16.25e-3, 6.2e-3), rel=1e-12)
    # B = 16: 7 + 53 x 0.5 = 33.5 ms; 1.8 + 53 x 0.2 = 12.4 ms
    assert steps[16] == pytest.approx((33.5e-3, 12.4e-3), rel=1e-12)
    # collectives that would scale past the step are kept within it
    assert project_depth({1: {0: (1e-3, 0.1e-3)}, 2: {0: (1.1e-3, 1e-3)}}, 4)[0] == pytest.approx((1.3e-3, 1.3e-3))
    with pytest.raises(ValueError, match="two depths"):
        project_depth({8: {0: (1e-3, 0.0)}})


def test_scaling_to_another_card_and_mixing_budgets_pinned():
    from bench.tp_projection import mix_tokens_per_s, scale_to_card

    # 2 ms of non-collective work x 2.5 + 2 ms of the other card's collectives
    assert scale_to_card(3e-3, 1e-3, 2.5, 2e-3) == pytest.approx(7e-3, rel=1e-12)
    with pytest.raises(ValueError):
        scale_to_card(1e-3, 2e-3, 2.0, 0.0)  # collectives longer than the step
    # 256 tokens in 10 AR steps of 16.25 ms and 50 B = 16 steps of 33.5 ms: 256 / 1.8375 s
    assert mix_tokens_per_s(256, {0: 10, 16: 50}, {0: 16.25e-3, 16: 33.5e-3}) == pytest.approx(139.3197279, rel=1e-9)


def test_card_rows_pinned_to_hand_computed_numbers():
    from bench.tp_projection import card_rows

    rows = card_rows({0: (16.25e-3, 6.2e-3), 16: (33.5e-3, 12.4e-3)}, h200_gbs=4200.0)
    by = {(r["case"], r["budget"]): r for r in rows}
    assert [(r["card"], r["case"], r["budget"]) for r in rows] == [
        ("8x H200", "measured", 0), ("8x H200", "measured", 16), ("8x RTX PRO 6000", "low", 0),
        ("8x RTX PRO 6000", "low", 16), ("8x RTX PRO 6000", "high", 0), ("8x RTX PRO 6000", "high", 16)]
    # measured: as given; 3 / 5 / 8 tokens a step over 33.5 ms, against 1 over 16.25 ms
    m = by[("measured", 16)]
    assert m["step_ms"] == pytest.approx(33.5) and m["comm_share"] == pytest.approx(12.4 / 33.5)
    assert m["tokens_per_s"] == pytest.approx({3.0: 89.55223881, 5.0: 149.2537313, 8.0: 238.8059701})
    assert m["speedup_vs_ar"][8.0] == pytest.approx(8 * 16.25 / 33.5)
    assert by[("measured", 0)]["tokens_per_s"] == pytest.approx({1.0: 61.53846154})
    # RTX low, AR: (16.25 - 6.2) ms x 4200 / 1600 = 26.38125 ms, + 122 x (26 + 1.75 x 14336 B / 22 GB/s) + 2 x 26 us
    # = 122 x 27.14036364 + 52 = 3363.124364 us
    low = by[("low", 0)]
    assert low["comm_ms"] == pytest.approx(3.363124364, rel=1e-9)
    assert low["step_ms"] == pytest.approx(26.38125 + 3.363124364, rel=1e-9)
    # RTX low, B = 16: 21.1 ms x 2.625 = 55.3875 ms; 122 x (26 + 1.75 x 243712 / 22e3) + 13 x (26 + 1.75 x 114688 /
    # 22e3) + 5 x 26 us = 5537.116 + 456.598 + 130 = 6123.714 us
    assert by[("low", 16)]["step_ms"] == pytest.approx(55.3875 + 6.123712, rel=1e-9)
    # RTX high, AR: 10.05 ms x 4200 / 1792 + 122 x (16 + 1.75 x 14336 / 41e3) + 2 x 16 us
    assert by[("high", 0)]["step_ms"] == pytest.approx(10.05 * 4200 / 1792 + 2.058652098, rel=1e-9)
    # a step of B = 4 emits at most 5 tokens: 8 is left out
    short = card_rows({0: (1e-3, 0.0), 4: (2e-3, 0.0)})
    assert short[1]["tokens_per_s"][8.0] is None and short[1]["tokens_per_s"][5.0] == pytest.approx(2500.0)


# --------------------------------------------------------------------------------------------
# the counts against the compiled steps
# --------------------------------------------------------------------------------------------

def _tiny_tp_pair(mesh):
    """A tiny target and drafter parallelised over ``mesh``, and how their vocabulary gathers run
    (bench/tp_rank.fake_gathers: the fake group's, in the graph; or emulated by a concatenation
    where this torch's fake group leaves them unwritten, out of the graph)."""
    from bench.tp_rank import fake_gathers
    from torch_kdtree.models.generation.tiny import tiny_target
    from torch_kdtree.models.parallel import parallelize

    target = tiny_target(3, **tp_worker.HEADS, intermediate_size=96, moe_intermediate_size=32)
    drafter = tp_worker.drafter_for(target, 3)  # 1 layer, 8 / 8 heads
    parallelize(target, mesh)
    parallelize(drafter, mesh)
    return target, drafter, fake_gathers(target.tp, "cpu")


def _expected(layers, budget, drafter_layers, gathers_mode):
    reduces, gathers = collectives_per_step(layers, budget, drafter_layers)
    return reduces, gathers if gathers_mode == "fake_pg" else 0


def _prefilled(target, drafter, budgets, compile_step):
    from torch_kdtree.models.generation import GenerationSession

    s = GenerationSession(target, drafter, batch_size=2, max_prompt=8, max_new=8, budgets=budgets,
                          compile_step=compile_step)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    s.prefill(ids, torch.full((2,), 6), max_new=8, eos=[])
    return s


def test_collectives_per_step_are_the_compiled_steps_collectives(fake8):
    """Each step compiled fullgraph holds collectives_per_step's all-reduces and all-gathers
    (budget 4: the draft top-K takes the partial + gather + merge path, K <= the 16-token shard)."""
    target, drafter, mode = _tiny_tp_pair(fake8)
    seen = []

    def counting(gm, example_inputs):
        targets = [str(n.target) for n in gm.graph.nodes]
        seen.append((sum("all_reduce" in t for t in targets), sum("all_gather" in t for t in targets)))
        return gm.forward

    layers = target.config.num_hidden_layers
    for d, budgets in ((None, (0,)), (drafter, (0, 4))):
        session = _prefilled(target, d, budgets, counting)
        for b in budgets:
            before = len(seen)
            session.step(b)
            # one graph per step (fullgraph); a tree step after AR steps first runs the flush of their
            # stored taps, its own graph: the drafter's fc, one all-reduce
            flushed = [(1, 0)] if b and d is not None else []
            assert seen[before:-1] == flushed, (b, seen[before:])
            want = _expected(layers, b, None if d is None else len(drafter.layers), mode)
            assert seen[-1] == want, (b, d is not None, mode, seen[-1], want)


def test_inductor_wrapper_code_shows_each_collective_once(fake8):
    """collective_calls (the CUDA test's count) on inductor's wrapper code of a compiled AR step."""
    from torch._inductor import utils as inductor_utils

    target, _, mode = _tiny_tp_pair(fake8)
    session = _prefilled(target, None, (0,), True)
    fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
    with fresh():
        _, codes = inductor_utils.run_and_get_code(lambda: session.step(0))
    assert collective_calls(codes) == _expected(target.config.num_hidden_layers, 0, None, mode)


# --------------------------------------------------------------------------------------------
# the rank program
# --------------------------------------------------------------------------------------------

def test_the_global_k2_rank_on_the_meta_device_has_the_k2_slice_shapes(fake8):
    """bench_tensor_parallel's global K2 (4 layers, INT4 config) at TP-8, rank 0, on the meta device:
    the shapes bench_generate's k2_slice was written to stand for, and the K2.6 drafter's rank."""
    from bench.tp_rank import K26_DFLASH, k2_global_config, rank_drafter, rank_target

    target = rank_target(k2_global_config(4), fake8, "meta")
    layer0, layer1 = target.model.layers[0], target.model.layers[1]
    a = layer1.self_attn
    shapes = {
        "embed": (163840, 7168), "lm_head": (20480, 7168),
        "q_a": (1536, 7168), "q_b": (8 * 192, 1536), "kv_a": (576, 7168), "kv_b": (8 * 256, 512),
        "o": (7168, 8 * 128), "dense_gate": (2304, 7168), "dense_down": (7168, 2304),
        "router": (384, 7168), "experts_gate": (384, 256, 7168), "experts_down": (384, 7168, 256),
        "shared_gate": (256, 7168), "shared_down": (7168, 256),
    }
    got = {
        "embed": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight,
        "q_a": a.q_a_proj.weight, "q_b": a.q_b_proj.weight, "kv_a": a.kv_a_proj_with_mqa.weight,
        "kv_b": a.kv_b_proj.weight, "o": a.o_proj.weight, "dense_gate": layer0.mlp.gate_proj.weight,
        "dense_down": layer0.mlp.down_proj.weight, "router": layer1.mlp.gate.weight,
        "experts_gate": layer1.mlp.experts.gate_proj, "experts_down": layer1.mlp.experts.down_proj,
        "shared_gate": layer1.mlp.shared_experts.gate_proj.weight,
        "shared_down": layer1.mlp.shared_experts.down_proj.weight,
    }
    assert {k: tuple(t.shape) for k, t in got.items()} == shapes
    assert all(t.is_meta for t in got.values())
    assert len(target.model.layers) == 4 and target.tp.world == 8 and target.tp.rank == 0
    drafter = rank_drafter(target, fake8, "meta", **K26_DFLASH, target_layer_ids=[0, 1])
    d = drafter.layers[0]
    assert len(drafter.layers) == 6
    assert (d.self_attn.num_heads, d.self_attn.num_kv_heads) == (8, 1)
    assert tuple(d.self_attn.q_proj.weight.shape) == (1024, 7168)
    assert tuple(d.self_attn.k_proj.weight.shape) == tuple(d.self_attn.v_proj.weight.shape) == (128, 7168)
    assert tuple(d.self_attn.o_proj.weight.shape) == (7168, 1024)
    assert tuple(d.mlp.gate_proj.weight.shape) == (2304, 7168) and tuple(d.mlp.down_proj.weight.shape) == (7168, 2304)
    assert tuple(drafter.fc.weight.shape) == (7168, 2 * 7168 // 8)


def test_the_tiny_rank_program_materialises_with_int4_experts_and_generates(fake8):
    """At tiny sizes (tests/tp_worker.INT4_TARGET: expert width 512, 64 a rank) the rank program is
    built on the CPU with random INT4 experts and runs AR and DDTree generation over the fake
    collectives (the tokens mean nothing; they are valid ids)."""
    from bench.tp_rank import fake_gathers, rank_drafter, rank_target
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    config = k2_config_dict(dict(tp_worker.INT4_TARGET), int4=True, small=False)
    target = rank_target(config, fake8, "cpu")
    experts = [m.mlp.experts for m in target.model.layers if hasattr(m.mlp, "experts")]
    assert experts and all(e.is_int4 and e.int4_weights().intermediate_size == 64 for e in experts)
    assert not any(t.is_meta for t in (*target.parameters(), *target.buffers()))
    assert target.dtype == torch.bfloat16
    assert tuple(target.lm_head.weight.shape) == (16, 128)
    assert target.model.layers[0].self_attn.kv_b_proj.weight.shape[0] == 1 * (16 + 16)  # 8 heads / 8
    drafter = rank_drafter(target, fake8, "cpu", num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                           head_dim=16, intermediate_size=64, block_size=4, target_layer_ids=[0, 1])
    assert not any(t.is_meta for t in drafter.parameters()) and drafter.dtype == torch.bfloat16
    assert fake_gathers(target.tp, "cpu") in ("fake_pg", "emulated")
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    for kw in ({}, {"drafter": drafter, "tree_budget": 4}):
        out = target.generate(ids, max_new_tokens=5, eos_token_id=None, **kw)
        assert out.shape == (1, 12) and int(out.min()) >= 0 and int(out.max()) < 128


def test_fake_gathers_emulates_a_group_that_leaves_gathers_unwritten(fake8):
    from bench.tp_rank import fake_gathers
    from torch_kdtree.models.parallel import TensorParallel

    tp = TensorParallel(fake8)
    tp.all_gather = lambda x, dim=0: torch.full((x.shape[0] * tp.world, *x.shape[1:]), -7, dtype=x.dtype)
    assert fake_gathers(tp, "cpu") == "emulated"
    x = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(tp.stack(x), x.expand(8, 2, 2))
    assert torch.equal(tp.all_gather(x, -1), torch.cat([x] * 8, -1))
