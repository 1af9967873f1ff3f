"""Tensor parallelism on one GPU (issue 46): an NCCL world of size 1, in this process.

A bf16 tiny target (8 heads: the MLA kernels' smallest head count) and a bf16 DFlash drafter are
parallelised over ``init_device_mesh("cuda", (1,))`` and generate with CUDA graphs and steps
compiled by inductor (generate's CUDA default).  At world 1 nothing is split, but the plan still
reduces (plan.py: the collectives stay in the graph), so what this shows is what TP-N needs on every
rank: the NCCL collectives compile into the fullgraph step (counted in inductor's wrapper code:
bench/tp_projection.collectives_per_step), are captured in the CUDA graphs and replay; the plan
keeps every fused kernel of the single-device plan; and the output is the single-device model's bit
for bit: the prefill logits, and the greedy autoregressive tokens through the compiled, captured
decode steps (the fused epilogues add the residual on the first rank and the all-reduce sums it in,
so at world 1 they are one device's launches).  DDTree's tokens equal the single-device AR tokens
under tests/test_generate.py's bf16-tie rule, as the sacred tests define (the draft's vocabulary-
parallel top-K may round its log-probabilities differently, and the tree with them).

NCCL is initialised (``device_id``: eagerly) before any capture; the group is destroyed at the end,
after the sessions holding the captured graphs are gone.
"""
import gc

import pytest
import torch
import torch.distributed as dist

from conftest import requires_cuda_kernel
from test_generate import GPU_HEADS, _greedy, assert_equal_up_to_bf16_ties, prompts
from test_tp_projection import collective_calls

requires_mla_cuda = requires_cuda_kernel("kdtree::mla_tree_attention")

SEED, NEW, BUDGET, BLOCK = 96, 32, 8, 6


@requires_mla_cuda
def test_nccl_world_of_one_keeps_the_collectives_in_the_captured_steps_and_the_tokens(tmp_path):
    from torch._inductor import utils as inductor_utils
    from torch.distributed.device_mesh import init_device_mesh

    from bench.tp_projection import collectives_per_step
    from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
    from torch_kdtree.models.parallel import parallelize

    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1),
                            device_id=torch.device("cuda", 0))
    models = []  # whose sessions (captured graphs) go before the group does
    try:
        base = tiny_target(SEED, **GPU_HEADS).to("cuda", torch.bfloat16)
        models.append(base)
        ids, mask = prompts(3, SEED)
        ids, mask = ids.cuda(), mask.cuda()
        want = base.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        (base_session,) = base.__dict__["_ddtree_sessions"].values()

        mesh = init_device_mesh("cuda", (1,))
        target = parallelize(tiny_target(SEED, **GPU_HEADS).to("cuda", torch.bfloat16), mesh)
        models.append(target)
        drafter = parallelize(tiny_drafter(base, seed=SEED + 1, block_size=BLOCK).to("cuda", torch.bfloat16), mesh)
        fresh = getattr(inductor_utils, "fresh_cache", None) or inductor_utils.fresh_inductor_cache
        with fresh():
            ar, ar_codes = inductor_utils.run_and_get_code(
                lambda: target.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None))
            dd, dd_codes = inductor_utils.run_and_get_code(
                lambda: target.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None,
                                        drafter=drafter, tree_budget=BUDGET))

        # the collectives are in the compiled steps: two all-reduces per layer; the tree step adds the
        # drafter's (2 per layer, 1 for its fc) and the draft top-K's three all-gathers
        layers = target.config.num_hidden_layers
        got = {"ar": collective_calls(ar_codes), "tree": collective_calls(dd_codes),
               "graphs": (len(ar_codes), len(dd_codes))}
        assert got["ar"] == collectives_per_step(layers, 0, world=1), got
        assert got["tree"] == collectives_per_step(layers, BUDGET, len(drafter.layers), world=1), got
        # ... and those steps are CUDA graphs, captured and replayed
        sessions = list(target.__dict__["_ddtree_sessions"].values())
        assert sorted(s.budgets for s in sessions) == [(0,), (BUDGET,)]
        for s in sessions:
            # a graph per budget, and the short prompts' prefill (GenerationSession._chain_prefill)
            prefills = {("prefill", tokens) for tokens in s.prefill_plans}
            assert s.use_graphs and prefills and set(s.graphs) == set(s.budgets) | prefills, set(s.graphs)
            assert all(lp.reduce for plan in s.plan.values() for lp in plan.layers), str(s.plan)
            assert "all_reduce" in str(s.plan)
        # the plan keeps the single-device plan's fused kernels: only the reductions differ
        (ar_session,) = [s for s in sessions if s.budgets == (0,)]
        assert str(ar_session.plan).replace(" all_reduce", "") == str(base_session.plan), \
            f"TP plan:\n{ar_session.plan}\nsingle-device plan:\n{base_session.plan}"

        # the output bit for bit: prefill logits (right-padded rows with their lengths: the forward's
        # form for a batch of prompts), and the greedy AR tokens of the captured steps
        rids, rmask = prompts(3, SEED, left=False)
        rids, lengths = rids.cuda(), rmask.sum(1).cuda()
        with torch.no_grad():
            keep = rmask.cuda().bool()  # the rows' own positions (the padding's logits are not defined)
            tp_logits = target(rids, input_lengths=lengths).logits[keep]
            base_logits = base(rids, input_lengths=lengths).logits[keep]
        assert torch.equal(tp_logits, base_logits), (tp_logits.float() - base_logits.float()).abs().max()
        assert torch.equal(ar, want), (ar, want)
        # DDTree: the sacred rule (ties allowed, then checked on from their other side)
        resume = _greedy(base, "auto")
        assert_equal_up_to_bf16_ties(base, ids, mask, dd, want, resume=resume)
    finally:
        for m in models:
            m.__dict__.pop("_ddtree_sessions", None)
            m.__dict__.pop("_ddtree_step_seconds", None)
        models.clear()
        gc.collect()
        torch.cuda.synchronize()
        dist.destroy_process_group()
