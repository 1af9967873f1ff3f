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
    for filtered, top_k in ((False, None), (True, 5)):
        mode = params.set(0.8, top_k, None)
        torch.manual_seed(99)
        want = select_tokens(logits, mode, params)
        torch.manual_seed(99)
        got = select_tokens(local, mode, params, tp)
        report[f"sample_equal_{'filtered' if filtered else 'plain'}"] = bool(torch.equal(got, want))
    k = 6
    part = draft_topk_partial(local, k, tp.rank * local.shape[-1])
    merged = draft_topk_merge(tp.stack(part.values), tp.stack(part.token_ids), tp.stack(part.lse), k)
    whole = draft_topk(logits, k)
    report["topk_ids_equal"] = bool(torch.equal(merged.token_ids, whole.token_ids))
    report["topk_lp_err"] = float((merged.logprobs - whole.logprobs).abs().max())


SCENARIOS = {"forward": scenario_forward, "generate": scenario_generate, "int4_load": scenario_int4_load,
             "token_choice": scenario_token_choice}


def run(rank: int, world: int, port: int, out: str, names: list, checkpoint: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
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
                    args = {"int4_load": (checkpoint,), "generate": (os.path.join(out, "drafter"),)}.get(name, ())
                    SCENARIOS[name](report, mesh, TensorParallel, *args)
            except Exception:  # recorded; the test fails on it
                report["error"] = traceback.format_exc()
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(reports, f)
    finally:
        dist.destroy_process_group()
