"""The rank program of tests/test_tensor_parallel.py: spawned once per world size (gloo, CPU).

Every rank builds the same tiny models from the same seeds, runs the single-process reference
itself, then the tensor-parallel version (parallelised in memory, and loaded from a checkpoint
reading only its slices), and writes what it saw to ``<out>/rank<r>.json``; the test compares the
ranks' files.  Failures inside a scenario are recorded, not raised, so that one rank's assertion
cannot leave the others waiting in a collective.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import traceback

import torch
import torch.distributed as dist

HEADS = {"num_attention_heads": 8, "num_key_value_heads": 8}
# INT4 experts at world 8: expert width 512 (64 a rank: int4_moe's tiles), hidden 128
INT4_TARGET = {"hidden_size": 128, "moe_intermediate_size": 512, "intermediate_size": 128, "vocab_size": 128,
               "q_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_hidden_layers": 3,
               "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "bos_token_id": 1, "eos_token_id": 2, **HEADS}


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def tiny_pair(seed: int):
    from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target

    target = tiny_target(seed, **HEADS, intermediate_size=96, moe_intermediate_size=32)
    drafter = tiny_drafter(target, seed=seed, block_size=4)
    return target, drafter


def drafter_for(target, seed: int):
    from torch_kdtree.models.dflash import random_drafter

    c = target.config
    return random_drafter(seed=seed, hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=8,
                          num_key_value_heads=8, head_dim=16, intermediate_size=64, vocab_size=c.vocab_size,
                          mask_token_id=c.vocab_size - 1, num_target_layers=c.num_hidden_layers, block_size=4,
                          target_layer_ids=list(range(c.num_hidden_layers)))


def prompts(vocab: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, vocab, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def gathered_logits(model, tp, ids, **kw):
    out = model(ids, **kw)
    return tp.all_gather(out.logits, -1), out


def scenario_forward(report, mesh, tp_cls):
    """Logits of a prefill and of a tree pass equal the single-process model's; hidden states are
    bitwise equal on every rank; a compiled step holds the expected all-reduces."""
    from torch_kdtree.models import KimiK2Cache
    from torch_kdtree.models.parallel import parallelize

    target, _ = tiny_pair(3)
    ids, _ = prompts(target.config.vocab_size)
    want = target(ids).logits
    tp_model = parallelize(copy.deepcopy(target), mesh)
    tp = tp_model.tp
    got, out = gathered_logits(tp_model, tp, ids)
    report["prefill_rel_err"] = rel_err(got, want)
    report["hidden_digest"] = digest(out.last_hidden_state)
    # the recorded placements rebuild the global tensors (DTensor.from_local, then gathered)
    whole, local = target.state_dict(), tp_model.state_dict()
    names = ["lm_head.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.q_b_proj.weight",
             "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.gate.weight"]
    report["dtensor_placements"] = [str(tp.placement(n)) for n in names]
    report["dtensor_equal"] = all(torch.equal(tp.dtensor(n, local[n]).full_tensor(), whole[n]) for n in names)
    # a tree pass (N = 4, branching) over a prefilled cache
    N = 4
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    visible = visible.expand(2, N, N).contiguous()
    depth = visible.sum(-1) - 1
    tokens = torch.randint(3, target.config.vocab_size, (2, N), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (target, tp_model):
        cache = KimiK2Cache.for_model(model.config, 2, 32, page_size=8, dtype=torch.float32)
        model(ids, cache=cache)
        cache.advance(ids.shape[1])
        logits = model(tokens, cache.lengths.long()[:, None] + depth, cache, visible).logits
        results.append(logits if model is target else tp.all_gather(logits, -1))
    report["tree_rel_err"] = rel_err(results[1], results[0])
    # compiled (aot_eager, fullgraph): the all-reduces in the graph, one per attention and MLP block
    counts = []

    def counting_backend(gm, example_inputs):
        counts.append(sum(1 for n in gm.graph.nodes if "all_reduce" in str(n.target)))
        return gm.forward

    cache = KimiK2Cache.for_model(tp_model.config, 2, 32, page_size=8, dtype=torch.float32)
    tp_model(ids, cache=cache)
    cache.advance(ids.shape[1])
    ones = torch.ones(2, 1, 1, dtype=torch.bool)
    step = torch.compile(lambda t, pos: tp_model(t, pos, cache, ones).logits, backend=counting_backend,
                         fullgraph=True)
    torch._dynamo.reset()
    step(tokens[:, :1], cache.lengths.long()[:, None])
    torch._dynamo.reset()
    report["compiled_all_reduces"] = counts
    report["layers"] = len(tp_model.model.layers)
    report["plan"] = str(tp_model.model.plan_pass(2, 1, tree=True, cache=cache))


def scenario_generate(report, mesh, tp_cls, drafter_dir: str):
    """Greedy AR and DDTree (a DFlash drafter, sharded too) equal the single-process tokens; the
    auto budget planner's choices are rank 0's on every rank."""
    from torch_kdtree.models import DFlashDraftModel
    from torch_kdtree.models.parallel import parallelize

    target, _ = tiny_pair(4)
    drafter = drafter_for(target, 4)
    if dist.get_rank() == 0:
        drafter.save_pretrained(drafter_dir)
    dist.barrier()
    ids, mask = prompts(target.config.vocab_size)
    want_ar = target.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    want_dd = target.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None,
                              drafter=copy.deepcopy(drafter), tree_budget=6)
    tp_target = parallelize(copy.deepcopy(target), mesh)
    tp_drafter = parallelize(copy.deepcopy(drafter), mesh)
    # the drafter loaded from its checkpoint with device_mesh: the same shard as parallelize's
    loaded = DFlashDraftModel.from_pretrained(drafter_dir, device_mesh=mesh)
    report["drafter_load_equal"] = sorted(loaded.state_dict()) == sorted(tp_drafter.state_dict()) and all(
        torch.equal(v, tp_drafter.state_dict()[k]) for k, v in loaded.state_dict().items())
    ar = tp_target.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    dd = tp_target.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, drafter=tp_drafter,
                            tree_budget=6)
    auto = tp_target.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, drafter=tp_drafter,
                              tree_budget="auto", return_dict_in_generate=True)
    # the whole SPMD step (sharded token choice, gathered draft top-K) traced with fullgraph=True
    torch._dynamo.reset()
    compiled = tp_target.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, drafter=tp_drafter,
                                  tree_budget=6, compile_step="aot_eager")
    torch._dynamo.reset()
    report["compiled_dd_equal"] = bool(torch.equal(compiled, want_dd))
    report["ar_equal"] = bool(torch.equal(ar, want_ar))
    report["dd_equal"] = bool(torch.equal(dd, want_dd))
    report["dd_equals_ar"] = bool(torch.equal(want_dd, want_ar))
    want_auto = target.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
    report["auto_equal"] = bool(torch.equal(auto.sequences, want_auto))
    # an fp8 latent cache (replicated like the bf16 one): the single-process fp8 tokens
    fp8 = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=None, kv_cache_dtype="fp8")
    want_fp8 = target.generate(ids, drafter=copy.deepcopy(drafter), tree_budget=6, **fp8)
    report["fp8_equal"] = bool(torch.equal(tp_target.generate(ids, drafter=tp_drafter, tree_budget=6, **fp8),
                                           want_fp8))
    report["auto_budgets"] = list(auto.budgets)
    # min_new_tokens with two end-of-sequence ids, one request 0's third greedy token, one in the
    # last vocabulary shard: held back for 6 tokens on each rank's columns, as in one process
    eos = [int(want_ar[0, ids.shape[1] + 2]), target.config.vocab_size - 1]
    mn = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0, min_new_tokens=6)
    want_mn = target.generate(ids, **mn)
    report["min_new_equal"] = bool(torch.equal(tp_target.generate(ids, drafter=tp_drafter, tree_budget=6, **mn),
                                               want_mn)) and not bool((want_mn[:, ids.shape[1]:][:, :6] == eos[0]).any())
    # repetition_penalty: each rank penalises its own columns of the prompt, the output and the paths
    rp = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=None, repetition_penalty=1.4)
    want_rp = target.generate(ids, **rp)
    report["penalty_equal"] = bool(torch.equal(tp_target.generate(ids, drafter=tp_drafter, tree_budget=6, **rp),
                                               want_rp)) and not bool(torch.equal(want_rp, want_ar))
    # the chain prefill (what a CUDA session captures for short prompts), forced on the CPU: each rank's
    # tree pass over the prompts' chains, then greedy DDTree, gives the single-process tokens
    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.budget import FixedBudget
    from torch_kdtree.models.generation.generate import _prompts

    right, lengths = _prompts(ids, mask)
    session = GenerationSession(tp_target, tp_drafter, batch_size=ids.shape[0], max_prompt=ids.shape[1], max_new=10,
                                budgets=(6,), chain_prefill=64)
    session.prefill(right, lengths, max_new=10, eos=[])
    session.run(FixedBudget(6))
    report["chain_prefill_equal"] = bool(session.prefill_plans) and \
        session.tokens()[0][:, :10].tolist() == want_dd[:, ids.shape[1]:].tolist()


def scenario_int4_load(report, mesh, tp_cls, checkpoint: str):
    """from_pretrained(device_mesh=...) of an INT4 checkpoint reads only this rank's slices; its
    greedy DDTree and AR tokens equal the single-process model's."""
    from safetensors import safe_open

    from torch_kdtree.models import KimiK2ForCausalLM
    from torch_kdtree.models.kimi_k2 import checkpoint as ckpt_module
    from torch_kdtree.models.parallel import parallelize

    single = KimiK2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, progress=False)
    read = {"elements": 0, "whole": []}

    class Recording:
        def __init__(self, *a, **kw):
            self.f = safe_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            read["elements"] += t.numel()
            read["whole"].append(name)
            return t

        def get_slice(self, name):
            f = self.f

            class Slice:
                def __getitem__(self, index):
                    t = f.get_slice(name)[index]
                    read["elements"] += t.numel()
                    return t
            return Slice()

    real = ckpt_module.safe_open
    ckpt_module.safe_open = Recording
    try:
        model = KimiK2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device_mesh=mesh, progress=False)
    finally:
        ckpt_module.safe_open = real
    tp = model.tp
    report["elements_read"] = read["elements"]
    report["whole_tensors"] = sorted(read["whole"])
    report["int4"] = all(m.experts.is_int4 for m in (layer.mlp for layer in model.model.layers)
                         if hasattr(m, "experts"))
    ids, mask = prompts(model.config.vocab_size)
    want = single.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    drafter = drafter_for(single, 7)
    report["ar_equal"] = bool(torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=8,
                                                         eos_token_id=None), want))
    tp_drafter = parallelize(copy.deepcopy(drafter), mesh)
    dd = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, drafter=tp_drafter,
                        tree_budget=5)
    report["dd_equal"] = bool(torch.equal(dd, want))
    report["logits_rel_err"] = rel_err(tp.all_gather(model(ids).logits, -1), single(ids).logits)


def scenario_token_choice(report, mesh, tp_cls):
    """Vocabulary-parallel argmax, Gumbel-max sampling and the draft top-K equal the unsharded
    results, ties across shard boundaries included."""
    from torch_kdtree.models.generation.sampling import SamplingMode, SamplingParams, select_tokens
    from torch_kdtree.models.parallel import TensorParallel
    from torch_kdtree.ops import draft_topk, draft_topk_merge, draft_topk_partial

    tp = TensorParallel(mesh)
    V = 16 * tp.world
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(3, 5, V, generator=g).round(decimals=1)  # coarse values: many ties
    logits[0, 0] = 0.0
    logits[0, 0, [V // tp.world - 1, V // tp.world, V - 1]] = 2.0  # a tie across the first shard boundary
    local = logits.chunk(tp.world, -1)[tp.rank].contiguous()
    report["argmax_equal"] = bool(torch.equal(select_tokens(local, SamplingMode(), None, tp), logits.argmax(-1)))
    params = SamplingParams(3, V, "cpu")
    for name, top_k, min_p in (("plain", None, None), ("filtered", 5, None), ("min_p", None, 0.2)):
        mode = params.set(0.8, top_k, None, min_p)
        torch.manual_seed(99)
        want = select_tokens(logits, mode, params)
        torch.manual_seed(99)
        got = select_tokens(local, mode, params, tp)
        report[f"sample_equal_{name}"] = bool(torch.equal(got, want))
    k = 6
    part = draft_topk_partial(local, k, tp.rank * local.shape[-1])
    merged = draft_topk_merge(tp.stack(part.values), tp.stack(part.token_ids), tp.stack(part.lse), k)
    whole = draft_topk(logits, k)
    report["topk_ids_equal"] = bool(torch.equal(merged.token_ids, whole.token_ids))
    report["topk_lp_err"] = float((merged.logprobs - whole.logprobs).abs().max())


def scenario_oracle(report, mesh, tp_cls):
    """Greedy DDTree with an OracleDrafter (accuracy 0.8 and 1.0, alone and around a DFlash drafter
    parallelised over the same mesh) on the tensor-parallel target: the single-process oracle's
    tokens and accept lengths (the same drafts every step; the single-process runs are rank 0's,
    broadcast).  Each rank's draft is its shard of the single-process draft, also traced with
    fullgraph=True (the look-ahead's target pass and sharded argmax are the step's own, compiled in
    scenario_generate)."""
    from torch_kdtree.models.generation import OracleDrafter
    from torch_kdtree.models.parallel import parallelize

    lead, rank = dist.get_rank() == 0, mesh.get_local_rank()
    target, _ = tiny_pair(4)
    drafter = drafter_for(target, 4)
    ids, mask = prompts(target.config.vocab_size)
    tp_target = parallelize(copy.deepcopy(target), mesh)
    tp_drafter = parallelize(copy.deepcopy(drafter), mesh)
    common = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, tree_budget=6,
                  return_dict_in_generate=True)

    def from_lead(fn):
        box = [fn() if lead else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    want_ar = from_lead(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None))
    for accuracy in (0.8, 1.0):
        for inner in (False, True):
            name = f"acc{accuracy}{'/inner' if inner else ''}"
            single = OracleDrafter(target, 4, accuracy, seed=3, inner=copy.deepcopy(drafter) if inner else None)
            want = from_lead(lambda: target.generate(ids, drafter=single, **common))
            oracle = OracleDrafter(tp_target, 4, accuracy, seed=3, inner=tp_drafter if inner else None)
            got = tp_target.generate(ids, drafter=oracle, **common)
            entry = report[name] = {"tokens_equal": bool(torch.equal(got.sequences, want.sequences)),
                                    "equals_ar": bool(torch.equal(want.sequences, want_ar)),
                                    "accepts_equal": bool(torch.equal(got.accept_lengths, want.accept_lengths)),
                                    "accepts": want.accept_lengths.tolist()}
            # the draft from the state the last step left: this rank's shard of the single-process
            # one (with ``inner``, the ids the oracle does not set hold the inner's logits: fp32 TP rounding)
            def single_draft(single=single):
                (session,) = [s for s in target.__dict__["_ddtree_sessions"].values() if s.drafter is single]
                return single(session.root), single.continuation

            whole, continuation = from_lead(single_draft)
            (session,) = [s for s in tp_target.__dict__["_ddtree_sessions"].values() if s.drafter is oracle]
            shard = oracle(session.root)
            local = shard.shape[-1]
            entry["same_continuation"] = bool(torch.equal(continuation, oracle.continuation))
            entry["shard_max_diff"] = float((shard - whole[..., rank * local : (rank + 1) * local]).abs().max())
            if (accuracy, inner) == (0.8, False):
                torch._dynamo.reset()
                traced = torch.compile(oracle, backend="aot_eager", fullgraph=True)(session.root)
                torch._dynamo.reset()
                entry["compiled_equal"] = bool(torch.equal(traced, shard))
    # an oracle built on another model than the one generating is refused, saying so
    try:
        tp_target.generate(ids, drafter=OracleDrafter(target, 4), **common)
        report["other_target_error"] = None
    except ValueError as e:
        report["other_target_error"] = str(e)


# The fused forms' passes, grouped by prefilled cache: (R, cache positions per request, tree passes
# (N, compiled plan, also in bf16)).  Each group's prefill runs the prefill plan (moe_gemv / int4_moe
# with the shared expert fused at R * 6 rows).  R = 1, N = 1 is a decode (mla_decode; mla_prepare +
# mla_tree_attention_output over a cache beyond DECODE_MAX_KEYS); R = 2, N = 1 mla_prepare; N = 5 and
# 17 branching trees (tree_op; moe_gemv with the shared expert fused at 10 slots, the gathered experts
# at 34); a compiled plan's multiply + sum forms (run eagerly).
FUSED_PASSES = ((1, 64, ((1, False, True), (5, False, True), (17, False, False), (1, True, False))),
                (2, 64, ((1, False, False),)),
                (1, 1088, ((1, False, False),)))
PLAN_FIELDS = ("attention", "qkv", "mlp", "router", "route", "experts", "shared", "matvec", "route_hint", "reduce")


def fixed_routes(model):
    """``model`` with each MoE layer's routing bias 3 on two experts, 0 elsewhere: the sigmoid scores
    (in (0, 1)) cannot change the choice, so rounding differences cannot flip it (a flipped expert
    moves the logits by O(1), which no rounding bound describes)."""
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            bias = torch.zeros_like(gate.e_score_correction_bias)
            bias[[(2 * i) % bias.numel(), (2 * i + 3) % bias.numel()]] = 3.0
            gate.e_score_correction_bias.copy_(bias)
    return model


def branching_tree(R: int, N: int, g):
    """visible [R, N, N] of a random tree (node i's parent drawn from 0 .. i - 1) and the depths [R, N]."""
    visible = torch.eye(N, dtype=torch.bool)
    for i in range(1, N):
        visible[i] |= visible[int(torch.randint(0, i, (1,), generator=g))]
    return visible.expand(R, N, N).contiguous(), (visible.sum(-1) - 1).expand(R, N)


def scenario_fused(report, mesh, tp_cls, checkpoint: str):
    """The fused forms a GPU rank's plan selects (gemv_norm projections without the residual epilogue,
    mla_decode / mla_prepare / mla_tree_attention(_output) over the local heads, moe_gemv / int4_moe
    over the rank's expert width with the shared expert fused, the all-reduce after them), run on the
    CPU through the ops' reference kernels with plans made for Target("cpu", kernels=ALL), for a
    bf16-expert and an INT4-expert target (INT4_TARGET's shapes): prefills and tree passes.

    Those forms are planned for bf16 weights only.  fp32: each model runs the plans made on a bf16
    copy of itself (the same forms; the op references take fp32), the tensor-parallel model against
    the single-process one.  bf16: the plans as made, with routing fixed (fixed_routes), against the
    single-process bf16 run, and the reference forms likewise for scale.  The single-process runs
    are rank 0's (the other ranks wait in their first collective)."""
    from torch_kdtree.models import KimiK2Cache, KimiK2ForCausalLM
    from torch_kdtree.models.generation.tiny import tiny_target
    from torch_kdtree.models.kimi_k2.plan import ALL, Target, plan_pass
    from torch_kdtree.models.parallel import parallelize

    def fields(plan):
        return [{f: getattr(lp, f) for f in PLAN_FIELDS} for lp in plan.layers]

    lead = dist.get_rank() == 0
    targets = {"bf16_experts": tiny_target(6, **INT4_TARGET),
               "int4_experts": KimiK2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, progress=False)}
    for kind, base in targets.items():
        V = base.config.vocab_size
        for dtype in (torch.float32, torch.bfloat16):
            fp32 = dtype == torch.float32
            single = copy.deepcopy(base) if fp32 else fixed_routes(copy.deepcopy(base)).to(dtype)
            tp_model = parallelize(copy.deepcopy(single), mesh)
            # the models the plans are made on: bf16 copies for fp32 (parallelised alike)
            plan_on = {"single": copy.deepcopy(single).to(torch.bfloat16) if fp32 else single,
                       "tp": parallelize(copy.deepcopy(single).to(torch.bfloat16), mesh) if fp32 else tp_model}
            forms = ("fused",) if fp32 else ("fused", "reference")
            g = torch.Generator().manual_seed(31)
            for R, keys, passes in FUSED_PASSES:
                passes = [p for p in passes if fp32 or p[2]]
                if not passes:
                    continue
                prompt = torch.randint(3, V, (R, 6), generator=g)
                trees = [(N, compiled, torch.randint(3, V, (R, N), generator=g), *branching_tree(R, N, g))
                         for N, compiled, _ in passes]
                group = f"{kind}/{str(dtype)[6:]}/R{R}{'/long' if keys > 1024 else ''}"
                names = [f"{group}/N{N}{'/compiled' if compiled else ''}" for N, compiled, *_ in trees]
                logits = {}
                for who, model in (("single", single), ("tp", tp_model)):
                    if who == "single" and not lead:
                        continue

                    def run(key, *args, plan, **kw):
                        out = model(*args, plan=plan, **kw)
                        logits[who, key] = tp_model.tp.all_gather(out.logits, -1) if who == "tp" else out.logits
                        return out

                    cache = KimiK2Cache.for_model(model.config, R, keys, page_size=8, dtype=dtype)
                    reach = cache.block_table.shape[1] * cache.page_size
                    prefill = plan_pass(plan_on[who], tokens=6, rows=R * 6, tree=False, target=Target("cpu", False, ALL),
                                        cache_keys=reach)
                    report.setdefault(f"{group}/prefill", {})[f"{who}_layers"] = fields(prefill)
                    if not fp32:  # the reference forms, for scale (no cache)
                        run("prefill/reference", prompt, plan=prefill.reference())
                    out = run("prefill/fused", prompt, cache=cache, plan=prefill)
                    if who == "tp":
                        report[f"{group}/prefill"]["hidden_digest"] = digest(out.last_hidden_state)
                    cache.advance(6)
                    for name, (N, compiled, tokens, visible, depth) in zip(names, trees):
                        entry = report.setdefault(name, {})
                        plan = plan_pass(plan_on[who], tokens=N, rows=R * N, tree=True,
                                         target=Target("cpu", compiled, ALL), cache_keys=reach)
                        entry[f"{who}_layers"] = fields(plan)
                        positions = cache.lengths.long()[:, None] + depth
                        for form in forms:  # tree passes write rows past the prefix, read only their own
                            out = run(f"{name}/{form}", tokens, positions, cache, visible,
                                      plan=plan if form == "fused" else plan.reference())
                            if who == "tp" and form == "fused":
                                entry["hidden_digest"] = digest(out.last_hidden_state)
                                entry["plan"] = str(plan)
                if lead:
                    for name in [f"{group}/prefill", *names]:
                        entry = report[name]
                        key = "prefill/" if name.endswith("prefill") else f"{name}/"
                        entry["rel_err"] = rel_err(logits["tp", key + "fused"], logits["single", key + "fused"])
                        if not fp32:
                            entry["reference_rel_err"] = rel_err(logits["tp", key + "reference"],
                                                                 logits["single", key + "reference"])


SCENARIOS = {"forward": scenario_forward, "generate": scenario_generate, "int4_load": scenario_int4_load,
             "token_choice": scenario_token_choice, "fused": scenario_fused, "oracle": scenario_oracle}


def run(rank: int, world: int, port: int, out: str, names: list, checkpoint: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # a loaded 2-core CI machine
    try:
        import torch_kdtree  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh

        from torch_kdtree.models.parallel import TensorParallel

        mesh = init_device_mesh("cpu", (world,))
        reports = {}
        for name in names:
            report = reports[name] = {}
            try:
                with torch.no_grad():
                    args = {"int4_load": (checkpoint,), "fused": (checkpoint,), "generate": (os.path.join(out, "drafter"),)}.get(name, ())
                    SCENARIOS[name](report, mesh, TensorParallel, *args)
            except Exception:  # recorded; the test fails on it
                report["error"] = traceback.format_exc()
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(reports, f)
    finally:
        dist.destroy_process_group()
