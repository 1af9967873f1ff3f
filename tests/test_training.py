"""The training pipeline (training/, issue 48) at toy scale on the CPU, and the pieces it relies on.

The end-to-end test runs ``training.run`` with the TOY recipe (a standard-library subset, a
512-token BPE, a 2-layer K2-architecture target, a 1-layer DFlash drafter, a few dozen steps):
the losses fall, the written directories load through the real loaders (KimiK2ForCausalLM and
DFlashDraftModel ``from_pretrained``, ``AutoTokenizer``, ``load_default_pair``), and greedy DDTree
equals greedy autoregressive decoding on the loaded pair in fp32.  The unit tests pin the pieces
the numbers depend on: the many-block drafter forward equals the drafter's own draft call, the
fake quantiser equals what the exported checkpoint dequantises to, the held-out split is fixed
by path, bits per byte count every byte once, and the FULL recipe fits the 25 MB the issue allows.
"""
import json
import re

import pytest
import torch

from conftest import devices, one_thread, rel_err

from training import corpus, recipe as recipes
from training.drafter import block_logits, build_drafter, sample_anchors
from training.quant import compressed_tensors, fake_quantize, quantize_int4
from training.target import build_target, expert_form, target_config, train, training_plan

from torch_kdtree.models import DFlashDraftModel, KimiK2ForCausalLM, load_default_pair
from torch_kdtree.ops import int4_dequantize


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One CPU thread: the toy matrices are small and the machine may be shared."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def toy_run(toy_pipeline):
    return toy_pipeline


def test_toy_pipeline_runs_under_a_minute_and_losses_fall(toy_run):
    out, metrics, seconds, lines = toy_run
    assert seconds < 60, f"toy pipeline took {seconds:.1f} s:\n" + "\n".join(lines)
    for phase in ("pretrain", "drafter_training"):
        curve = metrics[phase]["loss_curve"]
        assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.3, (phase, curve)
    assert metrics["pretrain"]["steps"] == recipes.TOY.steps
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "drafter", "manifest.json", "metrics.json",
                                                             "prompts.json", "target"])
    assert not any(p.name.endswith(".partial") for p in out.parent.iterdir())
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["heldout"]["int4"]["bits_per_byte"] == pytest.approx(metrics["heldout"]["int4"]["bits_per_byte"])
    card = (out / "README.md").read_text()
    assert "Toy run" in card and "bits per byte" in card and "Limits" in card


def test_toy_pair_loads_through_the_real_loaders(toy_run):
    from transformers import AutoTokenizer

    out, metrics, _, _ = toy_run
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["quantization_config"]["format"] == "pack-quantized"
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64 and config["num_attention_heads"] >= 8
    assert config["rope_scaling"]["type"] == "yarn" and config["topk_method"] == "noaux_tc"
    target = KimiK2ForCausalLM.from_pretrained(out / "target", dtype=torch.float32, progress=False)
    moe = target.model.layers[1].mlp
    assert moe.experts.is_int4 and moe.shared_experts is not None
    assert moe.gate.e_score_correction_bias.abs().sum() > 0  # the aux-free update moved it
    drafter = DFlashDraftModel.from_pretrained(out / "drafter", dtype=torch.float32)
    assert drafter.block_size == 8 and drafter.config.num_hidden_layers in (1, 2)
    assert json.loads((out / "drafter" / "config.json").read_text())["dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert drafter.mask_token_id == tokenizer.mask_token_id == metrics["tokenizer"]["special_ids"]["mask"]
    t2, d2, tok2 = load_default_pair(path=out)
    assert t2.dtype == torch.float32 and d2.dtype == torch.float32 and len(tok2) == len(tokenizer)


def test_greedy_ddtree_equals_autoregressive_on_the_trained_toy_pair(toy_run):
    out, metrics, _, _ = toy_run
    assert metrics["ddtree_check"]["equal"]
    target, drafter, tokenizer = load_default_pair(path=out)
    ids = tokenizer(["import os\n\ndef ", "class Parser:\n    "], return_tensors="pt", padding=True,
                    padding_side="left")
    ar = target.generate(ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=24)
    for budget in (4, 16):
        tree = target.generate(ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=24, drafter=drafter,
                               tree_budget=budget)
        assert torch.equal(tree, ar), budget


def test_a_new_drafter_for_a_trained_target_keeps_the_target_and_its_numbers(toy_run, tmp_path, capsys):
    """``training.run --drafter-only``: the drafter phases alone against a pair's INT4 target (a
    longer drafter schedule without re-training the target).  The target, tokenizer, manifest and
    prompts stay byte for byte, the target's numbers are carried over, the drafter and its numbers
    are new, the card says so, and greedy DDTree with the new drafter equals AR."""
    import hashlib
    import shutil

    from training.run import PairError, main, retrain_drafter

    src, old, _, _ = toy_run
    pair = tmp_path / "pair"
    shutil.copytree(src, pair)

    def digest(path):
        return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(path.rglob("*")) if p.is_file()}

    kept = {name: digest(pair / name) if (pair / name).is_dir() else hashlib.sha256((pair / name).read_bytes()).hexdigest()
            for name in ("target", "manifest.json", "prompts.json")}
    drafter_before = digest(pair / "drafter")
    recipe = recipes.TOY.replace(drafter_steps=2 * recipes.TOY.drafter_steps)
    with one_thread():
        metrics = retrain_drafter(recipe, pair, device="cpu", log=lambda line: None)
    for name, want in kept.items():
        assert (digest(pair / name) if (pair / name).is_dir()
                else hashlib.sha256((pair / name).read_bytes()).hexdigest()) == want, name
    assert digest(pair / "drafter") != drafter_before
    assert metrics["drafter_training"]["steps"] == recipe.drafter_steps != old["drafter_training"]["steps"]
    assert metrics["heldout"] == json.loads((src / "metrics.json").read_text())["heldout"]
    assert metrics["drafter_only"]["target_from"] == str(pair)
    assert json.loads((pair / "metrics.json").read_text())["drafter_only"]["seed"] == 0
    assert "trained alone (`python -m training.run --drafter-only`)" in (pair / "README.md").read_text()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    target, drafter, tokenizer = load_default_pair(path=pair)
    ids = tokenizer(["import os\n\ndef ", "class Parser:\n    "], return_tensors="pt", padding=True,
                    padding_side="left")
    ar = target.generate(ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=16)
    assert torch.equal(target.generate(ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=16,
                                       drafter=drafter, tree_budget=8), ar)

    # another corpus (another Python or package version) than the target's: refused, nothing written
    manifest = json.loads((pair / "manifest.json").read_text())
    (pair / "manifest.json").write_text(json.dumps({**manifest, "checksum": "0" * 64}))
    with pytest.raises(PairError, match="is not the one .* was trained on"):
        retrain_drafter(recipe, pair, device="cpu", log=lambda line: None)
    assert digest(pair / "target") == kept["target"] and not (tmp_path / ".pair.partial").exists()
    with pytest.raises(PairError, match="lacks drafter"):
        shutil.rmtree(pair / "drafter")
        retrain_drafter(recipe, pair, device="cpu", log=lambda line: None)
    for argv, message in ((["--toy", "--drafter-only", str(pair), "--steps", "3"], "--steps do not apply"),
                          (["--toy", "--drafter-only", str(tmp_path / "none")], "is not a directory"),
                          (["--toy", "--drafter-only", str(pair)], "lacks drafter"),
                          (["--toy", "--drafter-minutes", "0"], "must be > 0")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err, argv


def test_metrics_hold_the_acceptance_sweep_and_the_quantisation_cost(toy_run):
    out, metrics, _, _ = toy_run
    sweep = json.loads((out / "metrics.json").read_text())["acceptance"]
    assert sweep["budgets"] == list(recipes.TOY.sweep_budgets)
    assert sorted(int(b) for b in sweep["greedy_mean_accept_length"]) == sorted(recipes.TOY.sweep_budgets)
    for a in [*sweep["greedy_mean_accept_length"].values(), sweep["sampled_mean_accept_length"]]:
        assert 1.0 <= a <= recipes.TOY.drafter["block_size"]
    assert 0.0 < sweep["greedy_distinct_4gram_ratio"] <= 1.0 and 0.0 < sweep["sampled_distinct_4gram_ratio"] <= 1.0
    held = metrics["heldout"]
    # the INT4 change is measured against the same (QAT) weights unquantised, the other against pre-QAT bf16
    want = held["int4"]["perplexity"] / held["bf16_after_qat"]["perplexity"] - 1
    assert held["int4_perplexity_change"] == pytest.approx(want)
    assert held["int4_vs_pretrain_perplexity_change"] == pytest.approx(
        held["int4"]["perplexity"] / held["bf16"]["perplexity"] - 1)
    card = (out / "README.md").read_text()
    assert "greedy mean acceptance length, B = 4" in card and "sampled (T = 1)" in card


def test_distinct_ngram_ratio_counts_repeats():
    from training.evaluate import distinct_ngram_ratio

    # 1 2 3 4 1 2 3 4: 5 four-grams, (1234) twice -> 4 distinct; a row of one repeated token: 1 distinct of 3
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4], [7, 7, 7, 7, 7, 7, 8, 9]])
    assert distinct_ngram_ratio(tokens[:1]) == pytest.approx(4 / 5)
    assert distinct_ngram_ratio(tokens[1:]) == pytest.approx(3 / 5)  # 7777 x3, 7778, 7789
    assert distinct_ngram_ratio(tokens) == pytest.approx((4 / 5 + 3 / 5) / 2)
    assert distinct_ngram_ratio(torch.arange(10)[None]) == 1.0


def test_smoke_recipe_keeps_every_full_size_and_cuts_the_steps():
    from training.run import main, smoke

    s, full = smoke(recipes.FULL), recipes.FULL
    assert s.target == full.target and s.drafter == full.drafter and s.vocab_size == full.vocab_size
    assert (s.seq_len, s.batch_size, s.generate_batch, s.corpus_bytes) == \
        (full.seq_len, full.batch_size, full.generate_batch, full.corpus_bytes)
    assert s.continuations == full.generate_batch  # one generate call of the full batch
    assert s.steps + s.qat_steps + s.drafter_steps < 10
    with pytest.raises(SystemExit):
        main(["--toy", "--smoke"])


def test_load_default_pair_names_the_command_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m training.run --out models/default_pair"):
        load_default_pair(path=tmp_path / "nowhere")


def test_block_forward_equals_the_drafters_own_draft_call():
    vocab = 96
    target = build_target(recipes.TOY, vocab, seed=1, device="cpu").eval()
    drafter = build_drafter(recipes.TOY, vocab, mask_token_id=3, seed=2, device="cpu")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (2, 24), generator=g)
    with torch.no_grad():
        taps = target(ids, tap_layers=drafter.target_layer_ids, return_logits=False).taps
        anchors = torch.cat([torch.tensor([[0], [23]]), sample_anchors(2, 3, 1, 22, g)], dim=1)
        many = block_logits(drafter, target.model.embed_tokens, target.lm_head, taps, ids, anchors)
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    for r in range(2):
        for n, p in enumerate(anchors[r].tolist()):
            drafter.setup_cache(1, 32)
            with torch.no_grad():
                if p:
                    drafter.append_context(taps[r: r + 1, :p])
                one = drafter(ids[r: r + 1, p])[0]
            torch.testing.assert_close(many[r, n], one, rtol=1e-4, atol=1e-5)


def test_fake_quantised_weights_are_what_the_checkpoint_dequantises_to():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.linspace(0.01, 3, 96)
    w[3, :32] = 0  # an all-zero group
    q, scale = quantize_int4(w)
    assert q.min() >= -8 and q.max() <= 7 and scale.dtype == torch.bfloat16
    stored = compressed_tensors(w)
    assert stored["weight_shape"].tolist() == [48, 96]
    assert torch.equal(int4_dequantize(stored["weight_packed"], stored["weight_scale"], 32), fake_quantize(w))
    assert (fake_quantize(w) - w).abs().max() <= scale.float().max() / 2 + 1e-6


def test_training_plan_runs_every_layer_in_torch_and_trains_the_router():
    model = build_target(recipes.TOY, 64, seed=0, device="cpu")
    plan = training_plan(model, 2, 16)
    moe = [lp for lp in plan.layers if lp.experts]
    assert plan.layers[0].attention == "expanded" and not plan.layers[0].experts
    assert moe and all((lp.router, lp.route, lp.experts) == ("linear", "topk", "looped") for lp in moe)
    ids = torch.randint(0, 64, (2, 17))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1], plan=plan).logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_a_loss_that_turns_non_finite_names_its_step_though_losses_are_read_back_late():
    """The training loops read their losses back at the progress lines only (a read waits for the
    GPU); a loss that turned NaN in between still stops training with the step it happened at."""
    from training.drafter import train_drafter

    model = build_target(recipes.TOY, 64, seed=0, device="cpu")
    data = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))

    class Poisoned:  # the second batch arrives with a NaN weight: steps 2 and 3 have NaN losses
        calls = 0

        def __next__(self):
            self.calls += 1
            if self.calls == 2:
                with torch.no_grad():
                    model.lm_head.weight[0, 0] = float("nan")
            return data[:, :-1], data[:, 1:]

    with pytest.raises(FloatingPointError, match="target: loss is nan at step 2$"):
        train(model, Poisoned(), steps=3, minutes=5.0, lr=1e-3, warmup_steps=1, weight_decay=0.0,
              bias_update_speed=0.0, log=lambda line: None, log_every=50)

    target = build_target(recipes.TOY, 64, seed=0, device="cpu")
    recipe = recipes.TOY.replace(drafter_steps=4, log_every=50, drafter_batch=2, anchors=2)
    drafter = build_drafter(recipe, 64, 63, seed=0, device=torch.device("cpu"))
    seqs = torch.randint(0, 63, (3, recipe.prompt_len + 8), generator=torch.Generator().manual_seed(1))
    taps = torch.randn(3, seqs.shape[1], len(drafter.target_layer_ids) * recipes.TOY.target["hidden_size"])
    taps[2] = float("nan")  # any step that draws sequence 2 has a NaN loss
    rows = torch.randint(0, 3, (4, 2), generator=torch.Generator().manual_seed(0))
    first_bad = next(i + 1 for i, r in enumerate(rows) if (r == 2).any())
    with pytest.raises(FloatingPointError, match=f"drafter: loss is nan at step {first_bad}$"):
        train_drafter(drafter, target, taps, seqs, recipe, seed=0, log=lambda line: None)


def _looped_reference(experts, x, ids, weights):
    """An independent oracle for the routed experts: each (token, slot) through its expert's SwiGLU
    MLP on its own, in fp64, weighted and summed."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    g, u, d = (w.double() for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(g[e] @ x[t].double()) * (u[e] @ x[t].double())
            out[t] += weights[t, j].double() * (d[e] @ h)
    return out


@pytest.mark.parametrize("device", devices())
def test_grouped_padded_experts_match_the_oracle_with_gradients(fresh_seed, device):
    """The CUDA training form of the routed experts (rows sorted by expert into 8-aligned groups, three
    bf16 grouped GEMMs; run here through grouped_mm's CPU kernel): the output and the gradients of x,
    the slot weights and every expert weight within bf16 rounding of the fp64 oracle, on groups of
    every size (unused experts included, whose gradients are zero) and on a buffer that is nearly
    all padding (one token); on CUDA through its grouped GEMM kernels."""
    from models.kimi_k2.fused import grouped_padded
    from models.kimi_k2.moe import KimiK2Experts
    gen = torch.Generator().manual_seed(fresh_seed)
    for T in (1, 37):
        experts = KimiK2Experts(9, 64, 32)
        with torch.no_grad():
            for w in (experts.gate_proj, experts.up_proj, experts.down_proj):
                w.copy_(torch.randn(w.shape, generator=gen) * 0.2)
        ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(T)]).int()  # experts 7, 8 unused
        x = torch.randn(T, 64, generator=gen).requires_grad_()
        weights = torch.rand(T, 3, generator=gen).requires_grad_()
        grad = torch.randn(T, 64, generator=gen)
        on_device = experts.to(device)
        xd, wd = x.detach().to(device).requires_grad_(), weights.detach().to(device).requires_grad_()
        y = grouped_padded(on_device, xd, ids.to(device), wd)
        assert y.dtype == torch.float32 and y.shape == (T, 64) and y.device.type == device
        (y * grad.to(device)).sum().backward()
        got = [t.grad.cpu() for t in (xd, wd, on_device.gate_proj, on_device.up_proj, on_device.down_proj)]
        experts = on_device.cpu()
        for t in (experts.gate_proj, experts.up_proj, experts.down_proj):
            t.grad = None
        ref = _looped_reference(experts, x, ids, weights)
        (ref * grad.double()).sum().backward()
        want = [t.grad for t in (x, weights, experts.gate_proj, experts.up_proj, experts.down_proj)]
        assert rel_err(y, ref) < 2e-2
        for name, a, b in zip(("x", "weights", "gate", "up", "down"), got, want):
            assert rel_err(a, b) < 3e-2, name
        assert all(g[7:].abs().max() == 0 for g in got[2:]), "unused experts got gradients"


def test_training_steps_through_grouped_padded_experts_lower_the_loss():
    """A few pre-training steps of the toy target with the CUDA default's expert form (on the CPU
    here): the loss falls and every parameter, the routers included, receives a gradient; and the
    plan and the default form say what runs."""
    assert expert_form("auto", "cuda") == "grouped_padded" and expert_form("auto", "cpu") == "looped"
    with pytest.raises(ValueError, match="experts must be one of"):
        expert_form("grouped", "cpu")
    model = build_target(recipes.TOY, 64, seed=0, device="cpu")
    plan = training_plan(model, 4, 32, experts="grouped_padded")
    assert {lp.experts for lp in plan.layers if lp.experts} == {"grouped_padded"}
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (4, 33), generator=gen)
    batches = iter([(data[:, :-1], data[:, 1:])] * 30)
    lines = []
    result = train(model, batches, steps=30, minutes=5.0, lr=3e-3, warmup_steps=2, weight_decay=0.0,
                   bias_update_speed=1e-3, experts="grouped_padded", log=lines.append, profile_step=5)
    assert result["experts"] == "grouped_padded" and result["steps"] == 30
    assert result["loss_last"] < 0.8 * result["loss_first"]
    # steps 6-8 ran under the profiler: its summary, then the 15 operators with the most self time
    profile = [line for line in lines if "target profile of 3 steps" in line]
    assert len(profile) == 1 and "ms per step (wall)" in profile[0]
    at = lines.index(profile[0])
    rows = lines[at + 1 : at + 16]
    assert len(rows) == 15 and all(re.fullmatch(r"  target +[0-9.]+ ms +[0-9]+ x  \S.*", r) for r in rows), rows
    assert at + 16 == len(lines) or "target step" in lines[at + 16]  # no more rows than that


def test_pretraining_split_over_calls_resumes_where_it_stopped(tmp_path):
    """The toy pipeline's pre-training in two calls (a lent GPU's ten-minute calls): the first stops
    early, writes no pair and leaves a checkpoint (safetensors and JSON) whose optimizer has taken as
    many steps as the schedule; the second resumes it -- no corpus or tokenizer phase, the schedule's
    remaining steps only -- and finishes the pipeline with a pair that loads."""
    from training import checkpoint
    from training.run import run

    ck, out, lines = tmp_path / "ck", tmp_path / "pair", []
    first = run(recipes.TOY, out, "cpu", checkpoint=ck, call_minutes=1e-9, log=lines.append)  # one step
    assert first["finished"] is False and not out.exists()
    assert sorted(p.name for p in ck.iterdir()) == sorted(checkpoint.FILES)
    meta = json.loads((ck / "state.json").read_text())
    assert meta["steps"] == 1 and meta["calls"] == 1 and len(meta["losses"]) == 1
    moments = checkpoint.load(ck)["state"]["optimizer"]["state"]
    assert moments and all(int(per["step"]) == meta["steps"] for per in moments.values())
    lines.clear()
    metrics = run(recipes.TOY, out, "cpu", checkpoint=ck, resume=True, log=lines.append)
    text = "\n".join(lines)
    assert "resume from the checkpoint" in text and "] corpus" not in text and "] tokenizer" not in text
    assert metrics["pretrain"]["steps"] == recipes.TOY.steps and metrics["pretrain"]["calls"] == 2
    assert metrics["pretrain"]["finished"] and metrics["pretrain"]["loss_curve"][0] == pytest.approx(meta["losses"][0], abs=1e-4)
    assert sum(1 for line in lines if "target step" in line) >= 1
    assert KimiK2ForCausalLM.from_pretrained(out / "target", dtype=torch.float32).config.vocab_size == \
        json.loads((out / "target" / "config.json").read_text())["vocab_size"]
    assert json.loads((out / "manifest.json").read_text()) == json.loads(checkpoint.load(ck)["manifest"])
    assert "over 2 calls resumed from a checkpoint" in (out / "README.md").read_text()


def test_training_cli_refuses_a_resume_without_a_checkpoint(tmp_path, capsys):
    from training.run import main

    for argv, message in ((["--toy", "--resume"], "need --checkpoint"),
                          (["--toy", "--call-minutes", "1"], "need --checkpoint"),
                          (["--toy", "--resume", "--checkpoint", str(tmp_path / "none")], "is not a pre-training checkpoint"),
                          (["--toy", "--call-minutes", "0", "--checkpoint", str(tmp_path)], "--call-minutes must be > 0"),
                          (["--toy", "--profile-step", "-1"], "--profile-step must be >= 0")):
        with pytest.raises(SystemExit):
            main(argv + ["--out", str(tmp_path / "pair")])
        assert message in capsys.readouterr().err, argv


def test_learning_rate_warms_up_then_decays_and_never_exceeds_its_peak():
    from training.recipe import lr_at

    assert lr_at(0.0, 1.0, 0.1) == pytest.approx(0.01) and lr_at(0.05, 1.0, 0.1) == pytest.approx(0.5)
    assert lr_at(0.1, 1.0, 0.1) == pytest.approx(1.0) and lr_at(1.0, 1.0, 0.1) == pytest.approx(0.1)
    curve = [lr_at(i / 100, 1.0, 0.1) for i in range(101)]
    assert all(a >= b for a, b in zip(curve[10:], curve[11:]))  # cosine: non-increasing after the warm-up
    # a schedule of a million steps with a 50-step warm-up (a time cap with a step count far beyond it)
    assert max(lr_at(p, 2e-3, 50 / 1e6) for p in (0.0, 1e-5, 4e-5, 1e-3)) <= 2e-3


def test_heldout_split_is_a_fixed_function_of_the_path():
    files = [corpus.SourceFile(f"pkg/mod{i}.py", f"x = {i}\n") for i in range(400)]
    train, held = corpus.split(files, 0.1)
    assert {f.path for f in train}.isdisjoint(f.path for f in held) and len(train) + len(held) == 400
    assert 20 <= len(held) <= 60
    assert sorted(f.path for f in corpus.split(list(reversed(files)), 0.1)[1]) == sorted(f.path for f in held)
    assert corpus.is_heldout("test/test_typing.py", 0.03) == corpus.is_heldout("test/test_typing.py", 0.03)
    m = corpus.manifest(train, held, 0.1)
    assert m["checksum"] == corpus.checksum(files) and m["heldout_files"] == len(held)


def test_stdlib_corpus_leaves_out_generated_tables():
    paths = {f.path for f in corpus.stdlib_files(limit_bytes=None)}
    assert "os.py" in paths and any(p.startswith("test/") for p in paths)
    assert not any(p.startswith(("encodings/", "pydoc_data/")) or "site-packages" in p for p in paths)
    assert "token.py" not in paths and "html/entities.py" not in paths


def test_token_bytes_cover_the_text_exactly():
    from training import tokenizer as tk

    files = corpus.stdlib_files(limit_bytes=60_000)
    raw = tk.train_tokenizer((f.text for f in files), 300)
    tok = tk.as_transformers(raw, 4096)
    lengths = tk.token_byte_lengths(tok)
    assert [lengths[tok.convert_tokens_to_ids(s)] for s in tk.SPECIALS.values()] == [0, 0, 0, 0]
    text = files[0].text + "é ü → 𝔘\n"
    ids = raw.encode(text, add_special_tokens=False).ids
    pieces = tk.token_bytes(tok)
    assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")


def test_full_recipe_is_k2_shaped_and_fits_25_mb():
    full = recipes.FULL
    t = full.target
    assert t["kv_lora_rank"] == 512 and t["qk_rope_head_dim"] == 64 and t["num_attention_heads"] >= 8
    assert t["first_k_dense_replace"] == 1 and t["n_shared_experts"] == 1 and t["rope_scaling"]["type"] == "yarn"
    assert t["hidden_size"] % 128 == 0 and t["moe_intermediate_size"] % 64 == 0  # int4_moe's tiles
    assert 1 <= full.drafter["num_hidden_layers"] <= 2 and full.drafter["block_size"] == 8
    assert all(0 <= i < t["num_hidden_layers"] for i in full.drafter["target_layer_ids"])
    assert recipes.checkpoint_bytes(full)["total"] < 25e6 - 1e6  # room for the tokenizer and headers
    with torch.device("meta"):
        model = KimiK2ForCausalLM(target_config(full, full.vocab_size))
    counts = recipes.parameter_counts(full)
    assert sum(p.numel() for p in model.parameters()) == counts["routed_experts"] + counts["target_other"]


def test_demo_prompts_start_at_a_def_and_end_at_a_line_end():
    from training.corpus import SourceFile, demo_prompts

    body = "".join(f"    x{i} = {i}\n" for i in range(30))
    files = [SourceFile("b.py", "import os\n\ndef f(a):\n" + body),
             SourceFile("a.py", "class C:\n    def m(self):\n" + body + "        def deep():\n"),
             SourceFile("c.py", "def short():\n    pass\n")]  # too short for a prompt
    got = demo_prompts(files, count=5, chars=100)
    assert [(p["file"], p["line"]) for p in got] == [("a.py", 2), ("b.py", 3)]  # path order
    for p in got:
        assert p["text"].lstrip().startswith("def ") and p["text"].endswith("\n") and len(p["text"]) >= 100
        assert len(p["text"]) < 100 + 20  # cut at the first line end past 100 characters


def test_package_licences_must_all_be_permissive():
    v = corpus.license_verdict
    assert v("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-3-Clause AND MIT", [], "")[1] == ""
    assert v("Apache-2.0 OR BSD-2-Clause", [], "")[1] == ""
    assert "MPL-2.0" in v("MPL-2.0 AND MIT", [], "")[1]
    assert v("", ["BSD License"], "")[1] == "" and v("", [], "MIT\nPermission is hereby granted")[1] == ""
    assert "GNU" in v("", ["GNU General Public License v3 (GPLv3)"], "")[1]
    assert v("", [], "") == (None, "no licence in its metadata")
    assert corpus.package_license("no_such_package_here")[1] == "not installed"


def test_package_sources_are_named_by_package_and_leave_out_vendored_code():
    files, records = corpus.package_files(["torch", "no_such_package_here"], limit_bytes=300_000)
    assert files and all(f.path.startswith("site/torch/") for f in files)
    assert not any(part in corpus.PACKAGE_EXCLUDED_DIRS for f in files for part in f.path.split("/")[:-1])
    total = sum(len(f.text.encode()) for f in files)
    assert 300_000 <= total < 300_000 + corpus.PACKAGE_MAX_FILE_BYTES
    torch_rec, missing = records
    assert torch_rec["package"] == "torch" and torch_rec["version"] in torch.__version__
    assert torch_rec["files_used"] == len(files) <= torch_rec["files"] and torch_rec["license"]
    assert missing == {"package": "no_such_package_here", "skipped": "not installed"}
    # the same subset on every call, and held-out membership by path as for the standard library
    again, _ = corpus.package_files(["torch"], limit_bytes=300_000)
    assert [f.path for f in again] == [f.path for f in files]
    train, held = corpus.split(files, 0.5)
    assert {f.path for f in held} == ({f.path for f in files if corpus.is_heldout(f.path, 0.5)} or {held[0].path})
