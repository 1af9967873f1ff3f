"""The one command that trains the default pair: a small Kimi-K2-architecture target and its DFlash
drafter, on the Python standard library, written in the formats real checkpoints use.

    python -m training.run --out models/default_pair --device cuda      # the full recipe, one H200
    python -m training.run --toy --out build/toy_pair                    # the toy recipe, CPU, < 1 min
    python -m training.run --device cuda --minutes 12.5 --call-minutes 8 --checkpoint /tmp/ck   # then, in
    python -m training.run --device cuda --resume --checkpoint /tmp/ck       # later calls (checkpoint.py)
    python -m training.run --drafter-only models/default_pair --device cuda --drafter-minutes 7
                           # a new drafter for that pair's target (the corpus must match its manifest)

Phases (each prints its progress): corpus and held-out split (manifest.json) -> byte-level BPE
tokenizer -> target pre-training (dense experts, aux-free balancing) -> QAT of the routed experts
(fake INT4, straight-through) -> INT4 export, reloaded through ``from_pretrained`` -> the INT4
target's continuations of training prompts and their taps -> drafter training (random anchors,
depth-decayed loss) -> DFlash export, reloaded -> held-out numbers (bits per byte of the bf16 and
INT4 targets, expert load, drafter agreement, greedy DDTree against autoregressive decoding) ->
metrics.json and the model card (README.md).  ``--out`` receives ``target/``, ``drafter/``,
``README.md``, ``metrics.json``, ``manifest.json`` and ``prompts.json`` (the main job's held-out
prompts) only once everything has succeeded.

Time on one H200 (run 195, bench/RESULTS.md; metrics.json records each run's phases), with
pre-training run to 8,000 steps: corpus 2.5 s (4,117 files, 70 MB: the stdlib without its test
package plus ten packages' sources), tokenizer 10 s (21.3 M training tokens), pre-training 448 s (8,000
steps of 32,768 tokens, 585 k tokens/s with the routed experts as ``grouped_padded``: three bf16
grouped GEMMs a layer, no host sync), held-out scoring 14 s, QAT 16 s (300 steps), export 1 s,
continuations 6 s (2,048 x 448 tokens), drafter 27 s (1,500 steps), checks 5 s: 517 s in all.  That
target scored 0.83 bits/byte held out, but its drafter, still learning fast when its 1,500 steps
ended, agreed with the target's next token only 65 % of the time; the FULL recipe now stops
pre-training at 4,600 steps (~260 s there) and gives the drafter 9,000 steps or 2.75 min on 8,192
continuations with 64 anchors each: run 201 (an H100) took 396 s -- pre-training 217 s (4,600
steps, 700 k tokens/s), continuations 23 s (8,192), drafter 127 s (9,000 steps), checks 4 s.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from . import corpus
from .recipe import RECIPES, checkpoint_bytes, describe

OUTPUTS = ("target", "drafter", "README.md", "metrics.json", "manifest.json", "prompts.json")


class _Clock:
    def __init__(self, log):
        self.log, self.start, self.phases, self._last = log, time.perf_counter(), {}, None

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.phases[self._last[0]] = round(now - self._last[1], 2)
        self._last = (name, now)
        if name:
            self.log(f"[{now - self.start:7.1f} s] {name}")

    def done(self) -> dict:
        self.phase("")
        return {**self.phases, "total": round(time.perf_counter() - self.start, 2)}


def _print(line: str) -> None:
    print(line, flush=True)


def _corpus_and_tokenizer(recipe, clock, log, raw=None):
    """The corpus split, the main job's held-out prompts, the byte-level BPE and the encoded
    training and held-out streams: (raw tokenizer, transformers tokenizer, train stream, held-out
    stream, manifest.json's text, prompts.json's text).  ``raw``: an existing tokenizer (a trained
    pair's) to encode with instead of training one."""
    from . import tokenizer as tk
    from .data import encode_files

    clock.phase("corpus")
    files = corpus.stdlib_files(limit_bytes=recipe.corpus_bytes)
    packages = None
    if recipe.packages:
        extra, packages = corpus.package_files(recipe.packages, limit_bytes=recipe.package_bytes)
        files = sorted(files + extra, key=lambda f: f.path)
        for rec in packages:
            log(f"  package {rec['package']}: " + (f"skipped ({rec['skipped']})" if "skipped" in rec else
                f"{rec['version']}, {rec['license']}, {rec['files_used']} of {rec['files']} files used"))
    train_files, heldout_files = corpus.split(files, recipe.heldout_fraction)
    manifest = corpus.manifest(train_files, heldout_files, recipe.heldout_fraction, packages=packages)
    # held-out code prompts for the main job (python -m torch_kdtree.demo)
    stdlib_heldout = [f for f in heldout_files if not f.path.startswith(corpus.PACKAGE_PREFIX)]
    prompts_doc = {"source": "held-out files of the standard library (manifest.json); each prompt is a def and the "
                             "lines after it", "prompts": corpus.demo_prompts(stdlib_heldout or heldout_files)}
    log(f"  {manifest['train_files']} training files ({manifest['train_bytes'] / 1e6:.2f} MB), "
        f"{manifest['heldout_files']} held out ({manifest['heldout_bytes'] / 1e6:.2f} MB), Python "
        f"{manifest['python_version']}, checksum {manifest['checksum'][:16]}")

    clock.phase("tokenizer")
    if raw is None:
        raw = tk.train_tokenizer((f.text for f in train_files), recipe.vocab_size)
    tokenizer = tk.as_transformers(raw, recipe.target["max_position_embeddings"])
    special = tk.special_ids(tokenizer)
    train_stream = encode_files(raw, [f.text for f in train_files], special["bos"], special["eos"])
    heldout_stream = encode_files(raw, [f.text for f in heldout_files], special["bos"], special["eos"])
    log(f"  {len(tokenizer)} tokens; {train_stream.numel():,} training tokens "
        f"({manifest['train_bytes'] / train_stream.numel():.2f} bytes/token), {heldout_stream.numel():,} held out")
    return (raw, tokenizer, train_stream, heldout_stream, json.dumps(manifest, indent=2) + "\n",
            json.dumps(prompts_doc, indent=2) + "\n")


def _drafter_phases(recipe, target, tokenizer, special, train_stream, heldout_stream, work: Path, clock, log, seed: int,
                    device, dtype) -> dict:
    """The drafter's phases against the INT4 ``target``: continuations of training prompts and their
    taps, training, the DFlash export to ``work / "drafter"`` (reloaded), held-out agreement, the
    greedy DDTree check and the acceptance sweep."""
    from torch_kdtree.models.dflash import DFlashDraftModel

    from .data import prompt_windows
    from .drafter import agreement, build_drafter, continuations, target_taps, train_drafter
    from .evaluate import acceptance_sweep, ddtree_check
    from .export import write_drafter

    clock.phase("continuations for the drafter")
    prompts = prompt_windows(train_stream, recipe.prompt_len, recipe.continuations, seed)
    seqs = continuations(target, prompts, recipe.continuation_len, batch=recipe.generate_batch,
                         greedy_fraction=recipe.greedy_fraction, seed=seed, log=log)
    drafter = build_drafter(recipe, len(tokenizer), special["mask"], seed, device)
    taps = target_taps(target, seqs, drafter.target_layer_ids, recipe.eval_batch)

    clock.phase("drafter training")
    drafter_log = train_drafter(drafter, target, taps, seqs, recipe, seed=seed, log=log)
    write_drafter(drafter, work / "drafter")
    del drafter, taps

    clock.phase("held-out drafter agreement and DDTree check")
    loaded = DFlashDraftModel.from_pretrained(work / "drafter", dtype=dtype, device=device)
    heldout_prompts = prompt_windows(heldout_stream, recipe.prompt_len, recipe.eval_continuations, seed + 1)
    heldout_seqs = continuations(target, heldout_prompts, recipe.continuation_len, batch=recipe.generate_batch,
                                 greedy_fraction=1.0, seed=seed + 1, log=log)
    heldout_taps = target_taps(target, heldout_seqs, loaded.target_layer_ids, recipe.eval_batch)
    agree = agreement(loaded, target, heldout_taps, heldout_seqs, recipe.prompt_len, recipe.eval_batch)
    log(f"  depth-1 agreement {agree['depth1_agreement']:.3f}, teacher-forced chain acceptance "
        f"{agree['chain_acceptance_teacher_forced']:.2f}")
    check_prompts = prompt_windows(heldout_stream, recipe.prompt_len, recipe.check_prompts, seed + 2)
    check = ddtree_check(target, loaded, check_prompts, recipe.check_new_tokens, recipe.check_budget)
    log(f"  greedy DDTree (B = {check['budget']}) == AR: {check['equal']}, mean acceptance "
        f"{check['mean_accept_length']:.2f}, wall-clock speed-up {check['speedup_wall']:.2f}x")
    sweep = acceptance_sweep(target, loaded, check_prompts, recipe.check_new_tokens, recipe.sweep_budgets,
                             sampled_budget=recipe.check_budget, seed=seed + 3)
    log("  mean acceptance, greedy: " + ", ".join(f"B = {b}: {a:.2f}" for b, a in
                                                   sweep["greedy_mean_accept_length"].items())
        + f" (distinct 4-grams {sweep['greedy_distinct_4gram_ratio']:.3f}); sampled at T = 1, B = "
        f"{sweep['sampled_budget']}: {sweep['sampled_mean_accept_length']:.2f} (distinct 4-grams "
        f"{sweep['sampled_distinct_4gram_ratio']:.3f})")

    return {"drafter_log": drafter_log, "agree": agree, "check": check, "sweep": sweep}


def run(recipe, out: str | Path, device: str | torch.device = "cpu", *, seed: int = 0, experts: str = "auto",
        log=_print, checkpoint: str | Path | None = None, resume: bool = False,
        call_minutes: float | None = None, profile_step: int | None = None) -> dict:
    """Run the whole pipeline with ``recipe`` on ``device``; write the pair to ``out``; return the metrics.

    Pre-training over several calls (training/checkpoint.py): ``call_minutes`` ends this call's
    pre-training early; if its schedule is then unfinished, the state goes to ``checkpoint`` and the
    call returns ``{"finished": False, ...}`` without writing ``out``.  ``resume`` starts from
    ``checkpoint`` instead of the corpus (its corpus split, tokenizer, weights and optimizer)."""
    from . import checkpoint as ckpt
    from torch_kdtree.models.kimi_k2 import KimiK2ForCausalLM

    from . import tokenizer as tk
    from .card import write_card
    from .data import WindowSampler
    from .evaluate import bf16_copy, bits_per_byte
    from .export import directory_bytes, write_target
    from .target import build_target, train

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(out)
    work = _fresh_work(out)
    clock = _Clock(log)
    log(describe(recipe))

    if resume:
        clock.phase("resume from the checkpoint")
        restored = ckpt.load(checkpoint)
        raw, train_stream, heldout_stream = restored["raw_tokenizer"], restored["train_stream"], restored["heldout_stream"]
        manifest_text, prompts_text, state = restored["manifest"], restored["prompts"], restored["state"]
        tokenizer = tk.as_transformers(raw, recipe.target["max_position_embeddings"])
        log(f"  {checkpoint}: call {state['calls'] + 1}, {state['steps']} steps, {state['tokens']:,} tokens, "
            f"{state['seconds']:.1f} s of pre-training so far")
    else:
        state = None
        raw, tokenizer, train_stream, heldout_stream, manifest_text, prompts_text = \
            _corpus_and_tokenizer(recipe, clock, log)
    (work / "manifest.json").write_text(manifest_text, encoding="utf-8")
    (work / "prompts.json").write_text(prompts_text, encoding="utf-8")
    manifest = json.loads(manifest_text)
    special = tk.special_ids(tokenizer)
    byte_lengths = tk.token_byte_lengths(tokenizer)
    scored_stream = heldout_stream[: recipe.eval_tokens + 1] if recipe.eval_tokens else heldout_stream

    clock.phase("target pre-training")
    model = build_target(recipe, len(tokenizer), seed, device)
    if resume:
        ckpt.load_weights(checkpoint, model, device)
    # a resumed call draws other windows than the calls before it (a seed offset by the steps so far)
    batches = WindowSampler(train_stream, recipe.seq_len, recipe.batch_size, seed + (state["steps"] if state else 0),
                            device)
    pretrain = train(model, batches, steps=recipe.steps, minutes=recipe.minutes, lr=recipe.lr,
                     warmup_steps=recipe.warmup_steps, weight_decay=recipe.weight_decay,
                     bias_update_speed=recipe.bias_update_speed, experts=experts, log=log,
                     log_every=recipe.log_every, label="target", call_minutes=call_minutes, resume=state,
                     profile_step=profile_step)
    if not pretrain["finished"]:  # this call's time is up before the schedule's: leave the state for the next
        if checkpoint is None:
            raise ValueError("run: call_minutes ended pre-training before its schedule, and no checkpoint was given")
        ckpt.save(checkpoint, raw_tokenizer=raw, train_stream=train_stream, heldout_stream=heldout_stream,
                  manifest=manifest_text, prompts=prompts_text, model=model, state=pretrain["state"], recipe=recipe)
        shutil.rmtree(work, ignore_errors=True)
        log(f"  pre-training continues in the next call: {pretrain['steps']} steps, {pretrain['tokens']:,} tokens, "
            f"{pretrain['seconds']:.1f} s of {60 * recipe.minutes:.0f} so far, saved in {checkpoint}")
        return {"finished": False, "checkpoint": str(checkpoint), "pretrain": _summary(pretrain),
                "phase_seconds": clock.done()}
    held = {"bf16": bits_per_byte(bf16_copy(model), scored_stream, byte_lengths, recipe.seq_len, recipe.eval_batch)}
    log(f"  held-out bf16: {held['bf16']['bits_per_byte']:.4f} bits/byte")

    clock.phase("QAT (routed experts fake-quantised to INT4)")
    qat = train(model, batches, steps=recipe.qat_steps, minutes=recipe.qat_minutes, lr=recipe.qat_lr, warmup_steps=0,
                weight_decay=recipe.weight_decay, bias_update_speed=recipe.bias_update_speed, experts=experts,
                qat=True, log=log, log_every=recipe.log_every, label="qat")

    # the same (QAT) weights unquantised: the INT4 export is judged against these, so its perplexity
    # change is the quantisation's cost alone, not that plus QAT's extra training
    held["bf16_after_qat"] = bits_per_byte(bf16_copy(model), scored_stream, byte_lengths, recipe.seq_len,
                                           recipe.eval_batch)
    log(f"  held-out bf16 after QAT (unquantised): {held['bf16_after_qat']['bits_per_byte']:.4f} bits/byte")

    clock.phase("INT4 export and reload")
    write_target(model, recipe, tokenizer, work / "target")
    del model, batches
    target = KimiK2ForCausalLM.from_pretrained(work / "target", dtype=dtype, device=device, progress=False)
    target.requires_grad_(False)
    held["int4"] = bits_per_byte(target, scored_stream, byte_lengths, recipe.seq_len, recipe.eval_batch)
    ratio = held["int4"]["perplexity"] / held["bf16_after_qat"]["perplexity"] - 1
    ratio_pre = held["int4"]["perplexity"] / held["bf16"]["perplexity"] - 1
    log(f"  held-out INT4: {held['int4']['bits_per_byte']:.4f} bits/byte (perplexity {100 * ratio:+.2f} % against "
        f"the same weights in bf16, {100 * ratio_pre:+.2f} % against bf16 before QAT), expert load min/mean "
        f"{held['int4']['load']['worst_min_over_mean']:.3f}")

    drafted = _drafter_phases(recipe, target, tokenizer, special, train_stream, heldout_stream, work, clock, log,
                              seed, device, dtype)
    drafter_log, agree, check, sweep = (drafted[k] for k in ("drafter_log", "agree", "check", "sweep"))

    phases = clock.done()
    metrics = {
        "recipe": recipe.name, "device": str(device), "device_name": _device_name(device), "dtype": str(dtype),
        "torch": torch.__version__, "python": sys.version.split()[0], "seed": seed,
        "tokenizer": {"vocab_size": len(tokenizer), "special_ids": special,
                      "train_tokens": int(train_stream.numel()), "heldout_tokens": int(heldout_stream.numel())},
        "pretrain": _summary(pretrain), "qat": _summary(qat), "drafter_training": _summary(drafter_log),
        "heldout": {**held, "int4_perplexity_change": ratio, "int4_vs_pretrain_perplexity_change": ratio_pre},
        "drafter": agree, "ddtree_check": check, "acceptance": sweep,
        "checkpoint_bytes": {"target": directory_bytes(work / "target"), "drafter": directory_bytes(work / "drafter"),
                             "estimated_tensors": checkpoint_bytes(recipe)},
        "phase_seconds": phases,
    }
    (work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    write_card(work / "README.md", recipe, metrics, manifest)
    _publish(work, out)
    log(f"[{phases['total']:7.1f} s] wrote {out}/ ({', '.join(OUTPUTS)})")
    return metrics


class PairError(ValueError):
    """A directory that :func:`retrain_drafter` cannot build on (not a pair, another recipe, another corpus)."""


def retrain_drafter(recipe, pair: str | Path, out: str | Path | None = None, device: str | torch.device = "cpu", *,
                    seed: int = 0, log=_print) -> dict:
    """Train a new drafter for the INT4 target of ``pair`` (a directory this pipeline wrote) and
    write the pair to ``out`` (default: ``pair`` itself): the target, its tokenizer, manifest and
    prompts unchanged, the drafter, metrics and model card new.  The corpus is rebuilt on this
    machine and must be the one the target was trained on (the manifest's checksum: the same Python
    and package versions), so that the drafter's prompts come from the target's training split and
    its held-out numbers from the held-out one.  The target's own numbers are carried over from the
    pair's metrics.json; ``metrics["drafter_only"]`` says where they came from."""
    from tokenizers import Tokenizer
    from torch_kdtree.models.kimi_k2 import KimiK2ForCausalLM

    from . import tokenizer as tk
    from .card import write_card
    from .export import directory_bytes

    pair = Path(pair)
    missing = [name for name in OUTPUTS if not (pair / name).exists()]
    if missing:
        raise PairError(f"retrain_drafter: {pair} lacks {', '.join(missing)}: not a pair written by "
                                f"python -m training.run")
    old = json.loads((pair / "metrics.json").read_text(encoding="utf-8"))
    if old.get("recipe") != recipe.name:
        raise PairError(f"retrain_drafter: {pair} was trained with the {old.get('recipe')!r} recipe, not {recipe.name!r}")
    saved_manifest = json.loads((pair / "manifest.json").read_text(encoding="utf-8"))
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(out) if out is not None else pair
    work = _fresh_work(out)
    clock = _Clock(log)
    log(f"a new drafter for the target of {pair}")
    raw = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    _, tokenizer, train_stream, heldout_stream, manifest_text, _ = _corpus_and_tokenizer(recipe, clock, log, raw=raw)
    manifest = json.loads(manifest_text)
    if manifest["checksum"] != saved_manifest["checksum"]:
        shutil.rmtree(work, ignore_errors=True)
        raise PairError(
            f"retrain_drafter: this machine's corpus (checksum {manifest['checksum'][:16]}, Python "
            f"{manifest['python_version']}) is not the one {pair} was trained on (checksum "
            f"{saved_manifest['checksum'][:16]}, Python {saved_manifest['python_version']}): another Python or "
            f"package version; the drafter's prompts would not be the target's training split")
    special = tk.special_ids(tokenizer)
    target = KimiK2ForCausalLM.from_pretrained(pair / "target", dtype=dtype, device=device, progress=False)
    target.requires_grad_(False)
    drafted = _drafter_phases(recipe, target, tokenizer, special, train_stream, heldout_stream, work, clock, log,
                              seed, device, dtype)
    for name in ("target", "manifest.json", "prompts.json"):
        (shutil.copytree if (pair / name).is_dir() else shutil.copy2)(pair / name, work / name)
    phases = clock.done()
    metrics = {**old,
               "drafter_training": _summary(drafted["drafter_log"]), "drafter": drafted["agree"],
               "ddtree_check": drafted["check"], "acceptance": drafted["sweep"],
               "checkpoint_bytes": {**old.get("checkpoint_bytes", {}), "drafter": directory_bytes(work / "drafter")},
               "drafter_only": {"target_from": str(pair), "device": str(device), "device_name": _device_name(device),
                                "dtype": str(dtype), "torch": torch.__version__, "seed": seed,
                                "phase_seconds": phases}}
    (work / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    write_card(work / "README.md", recipe, metrics, manifest)
    _publish(work, out)
    log(f"[{phases['total']:7.1f} s] wrote {out}/ (a new drafter; the target of {pair})")
    return metrics


def smoke(recipe):
    """``recipe``'s sizes with a few steps per phase (``--smoke``): every shape of a real run (the
    models, the whole corpus and tokenizer, one generate call of the full batch), not its length."""
    return recipe.replace(name=f"{recipe.name}-smoke", steps=3, minutes=5.0, warmup_steps=1, qat_steps=2,
                          qat_minutes=5.0, continuations=recipe.generate_batch, drafter_steps=3, drafter_minutes=5.0,
                          eval_tokens=16 * recipe.seq_len, eval_continuations=8, check_prompts=1, check_new_tokens=32,
                          log_every=1)


def _summary(log: dict) -> dict:
    losses = log.get("losses", [])
    keep = {k: v for k, v in log.items() if k not in ("losses", "state")}
    stride = max(1, len(losses) // 50)
    return {**keep, "loss_curve": [round(x, 4) for x in losses[::stride]]}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def _fresh_work(out: Path) -> Path:
    """An empty directory beside ``out`` where a run writes its outputs until :func:`_publish`."""
    work = out.parent / f".{out.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


def _publish(work: Path, out: Path) -> None:
    """Move the finished outputs into ``out``, replacing only the entries this pipeline writes."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        dest = out / name
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()
        shutil.move(str(work / name), str(dest))
    shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> dict:
    from . import target
    ap = argparse.ArgumentParser(prog="python -m training.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default: models/default_pair, or build/toy_pair "
                                                "with --toy, so a toy run never replaces the shipped pair)")
    ap.add_argument("--device", default="auto", help="cuda, cpu, cuda:N or auto (cuda when available)")
    ap.add_argument("--toy", action="store_true", help="the toy recipe: a corpus subset, tiny models, a few steps")
    ap.add_argument("--smoke", action="store_true",
                    help="the full recipe's sizes (models, corpus, tokenizer, generate batch) with a few steps per "
                         "phase: the whole pipeline end to end in minutes, to check it before a GPU run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", choices=target.EXPERT_FORMS, default="auto",
                    help="training form of the routed experts (target.training_plan; auto: grouped_padded on "
                         "CUDA, looped on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's target pre-training steps")
    ap.add_argument("--minutes", type=float, default=None, help="override the recipe's pre-training time cap")
    ap.add_argument("--call-minutes", type=float, default=None,
                    help="this call's share of pre-training (a GPU lent in ten-minute calls): when the schedule "
                         "(--minutes in all) is not over by then, its state goes to --checkpoint and the call ends")
    ap.add_argument("--checkpoint", default=None, help="the pre-training checkpoint directory (training/checkpoint.py)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the pre-training saved in --checkpoint (its corpus, tokenizer, weights, "
                         "optimizer and schedule); the call that ends the schedule finishes the pipeline")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="profile pre-training steps after this many of this call (3 steps; the summary -- device "
                         "kernel time against wall time, the top kernels -- goes to the log)")
    ap.add_argument("--drafter-only", metavar="PAIR", default=None,
                    help="train a new drafter for the target of PAIR (a directory this pipeline wrote) and write "
                         "the pair to --out (default: PAIR); the corpus must match PAIR's manifest")
    ap.add_argument("--drafter-minutes", type=float, default=None, help="override the recipe's drafter time cap")
    ap.add_argument("--drafter-steps", type=int, default=None, help="override the recipe's drafter steps")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: 1 with --toy, whose matrices are too small for more; else torch's)")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.profile_step is not None and args.profile_step < 0:
        ap.error("--profile-step must be >= 0")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.minutes is not None and args.minutes <= 0:
        ap.error("--minutes must be > 0")
    if args.call_minutes is not None and args.call_minutes <= 0:
        ap.error("--call-minutes must be > 0")
    if (args.call_minutes is not None or args.resume) and args.checkpoint is None:
        ap.error("--call-minutes and --resume need --checkpoint DIR")
    if args.drafter_minutes is not None and args.drafter_minutes <= 0:
        ap.error("--drafter-minutes must be > 0")
    if args.drafter_steps is not None and args.drafter_steps < 1:
        ap.error("--drafter-steps must be >= 1")
    if args.drafter_only is not None:
        clash = [flag for flag, given in (("--resume", args.resume), ("--checkpoint", args.checkpoint),
                                          ("--call-minutes", args.call_minutes), ("--steps", args.steps),
                                          ("--minutes", args.minutes), ("--profile-step", args.profile_step))
                 if given not in (None, False)]
        if clash:
            ap.error(f"--drafter-only trains the drafter alone: {', '.join(clash)} do not apply")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu)")
    if args.threads is not None or args.toy:
        torch.set_num_threads(args.threads or 1)
    if args.toy and args.smoke:
        ap.error("--toy and --smoke are exclusive")
    recipe = RECIPES["toy" if args.toy else "full"]
    if args.smoke:
        recipe = smoke(recipe)
    if args.steps is not None:
        recipe = recipe.replace(steps=args.steps)
    if args.minutes is not None:
        recipe = recipe.replace(minutes=args.minutes)
    if args.resume:  # the schedule is the checkpoint's: the learning rate follows it across calls
        from .checkpoint import schedule
        try:
            saved = schedule(args.checkpoint)
        except FileNotFoundError as e:
            ap.error(str(e))
        if saved["recipe"] != recipe.name:
            ap.error(f"--resume: {args.checkpoint} holds the {saved['recipe']!r} recipe's pre-training, not {recipe.name!r}")
        for name, given in (("steps", args.steps), ("minutes", args.minutes)):
            if given is not None and given != saved[name]:
                ap.error(f"--resume: --{name} {given} differs from the checkpoint's schedule ({saved[name]})")
        recipe = recipe.replace(steps=saved["steps"], minutes=saved["minutes"])
    if args.drafter_minutes is not None:
        recipe = recipe.replace(drafter_minutes=args.drafter_minutes)
    if args.drafter_steps is not None:
        recipe = recipe.replace(drafter_steps=args.drafter_steps)
    if args.drafter_only is not None:
        if not Path(args.drafter_only).is_dir():
            ap.error(f"--drafter-only: {args.drafter_only} is not a directory")
        try:
            return retrain_drafter(recipe, args.drafter_only, args.out, device, seed=args.seed)
        except PairError as e:
            ap.error(str(e))
    out = args.out or ("build/toy_pair" if args.toy else "build/smoke_pair" if args.smoke else "models/default_pair")
    return run(recipe, out, device, seed=args.seed, experts=args.experts, checkpoint=args.checkpoint,
               resume=args.resume, call_minutes=args.call_minutes, profile_step=args.profile_step)


if __name__ == "__main__":
    main()
