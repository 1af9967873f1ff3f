"""``python -m torch_kdtree.diagnose``: the command line, and :func:`diagnose`, the same as one call."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import torch

from .analysis import log_spaced
from .measure import Measurer, Settings
from .pair import InputError
from .progress import Progress

COMPILE_CHOICES = ("auto", "off", "combo", "tuned", "inductor")
MAX_CONTEXT = 8192       # --max-context when it fits the target's positions
SUSTAINED_TOKENS = 4096  # --sustained-tokens likewise


def _number(kind, low, high=None):
    def parse(text: str):
        try:
            value = kind(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is not in [{low}, {high if high is not None else 'inf'}]")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_kdtree.diagnose",
        description="Decode-throughput diagnostics for DDTree speculative decoding: throughput against context by "
                    "the two-point burst method and by sustained generation, where they disagree, and the sustained "
                    "slowdown split between acceptance and step time (Δlog tokens/s = Δlog acceptance − Δlog step "
                    "time); acceptance by depth and over the response, step-time phases, step time = a + b·context "
                    "for the AR and the tree step.  Writes PNG plots, diagnose.json, contexts.csv and windows.csv.",
        epilog="examples:  python -m torch_kdtree.diagnose --oracle 0.8 --max-context 1024 --sustained-tokens 1024\n"
               "           python -m torch_kdtree.diagnose --target K2_DIR --drafter DFLASH_DIR --out run-a\n"
               "           python -m torch_kdtree.diagnose --compare run-a/diagnose.json run-b/diagnose.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    pair = p.add_argument_group("the pair (default: the shipped pair; until it exists, the tiny random pair)")
    pair.add_argument("--target", metavar="DIR", help="a K2.x checkpoint directory (KimiK2ForCausalLM.from_pretrained)")
    pair.add_argument("--drafter", metavar="DIR", help="its DFlash drafter directory (DFlashDraftModel.from_pretrained)")
    pair.add_argument("--tiny-pair", action="store_true",
                      help="the tiny random pair of models/generation/tiny.py even where the shipped pair exists "
                           "(a quick check of the tool)")
    pair.add_argument("--oracle", type=_number(float, 0.0, 1.0), metavar="ACCURACY",
                      help="draft with an oracle that knows the target's greedy continuation, right at each depth "
                           "with this probability (the drafter, if any, still runs inside it)")
    pair.add_argument("--oracle-accuracy-end", type=_number(float, 0.0, 1.0), metavar="ACCURACY",
                      help="with --oracle: the accuracy drifts linearly to this over the sustained run (synthetic "
                           "'harder text')")
    pair.add_argument("--block-size", type=_number(int, 2, 33), default=8,
                      help="draft block size of the tiny pair, or of --oracle with --target alone (default 8)")
    pair.add_argument("--tree-budget", type=_number(int, 1, 1024), default=16, help="tree budget B (default 16)")
    pair.add_argument("--device", help="default cuda when available, else cpu")
    pair.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                      help="auto: bf16 on CUDA, fp32 on the CPU")
    pair.add_argument("--seed", type=_number(int, 0), default=0, help="random prompt and oracle seed (default 0)")
    pair.add_argument("--prompt", metavar="FILE",
                      help="prompt: a .json list of token ids, or text for the target's tokenizer (default: the "
                           "shipped pair's held-out code prompts, else random token ids); repeated to the longest "
                           "context")

    burst = p.add_argument_group("throughput against context")
    burst.add_argument("--min-context", type=_number(int, 1), default=64, help="shortest context (default 64)")
    burst.add_argument("--max-context", type=_number(int, 1),
                       help=f"longest context (default {MAX_CONTEXT}, or what fits the target's positions beside the "
                            f"sustained run)")
    burst.add_argument("--points", type=_number(int, 1), default=8, help="log-spaced contexts (default 8)")
    burst.add_argument("--burst-short", type=_number(int, 1), default=8, help="the burst's short run (default 8)")
    burst.add_argument("--burst-long", type=_number(int, 2), default=264, help="the burst's long run (default 264)")
    burst.add_argument("--repeats", type=_number(int, 1), default=5, help="burst pairs per context (default 5)")
    burst.add_argument("--timing-steps", type=_number(int, 1), default=32,
                       help="AR and tree steps timed per context for the step-time fit (default 32)")
    burst.add_argument("--profile-steps", type=_number(int, 1), default=4,
                       help="eager steps per context with per-phase timers (default 4)")
    burst.add_argument("--tolerance", type=_number(float, 0.0), default=0.1,
                       help="burst and sustained disagree when they differ by more than this share (default 0.1)")

    sus = p.add_argument_group("sustained generation")
    sus.add_argument("--sustained-tokens", type=_number(int, 2),
                     help=f"new tokens (default {SUSTAINED_TOKENS}, or half the target's positions if fewer)")
    sus.add_argument("--prompt-length", type=_number(int, 1), help="its prompt (default --min-context)")
    sus.add_argument("--window-steps", type=_number(int, 1), default=32, help="steps per window (default 32)")
    sus.add_argument("--position-bins", type=_number(int, 1), default=8,
                     help="bins of acceptance over the response (default 8)")

    run = p.add_argument_group("running and output")
    run.add_argument("--threads", type=_number(int, 1), metavar="N",
                     help="CPU threads for torch while it runs (default: torch's; 1 suits the tiny pair on a busy CPU)")
    run.add_argument("--no-cuda-graphs", action="store_true", help="run the steps eagerly on CUDA")
    run.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                     help="torch.compile of the steps (auto: combo on CUDA with graphs, as generate(); off on the CPU)")
    run.add_argument("--out", default="diagnose-out", metavar="DIR", help="output directory (default diagnose-out)")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument("--json", action="store_true", help="print the JSON object (or the comparison) instead of text")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two runs and exit")
    return p


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.max_context is not None and args.max_context < args.min_context:
        parser.error(f"--max-context {args.max_context} is below --min-context {args.min_context}")
    if args.burst_long <= args.burst_short:
        parser.error(f"--burst-long {args.burst_long} must exceed --burst-short {args.burst_short}")
    if args.tiny_pair and args.target:
        parser.error("--tiny-pair and --target are two different pairs: give one")
    if args.drafter and not args.target:
        parser.error("--drafter needs --target (a drafter belongs to its target)")
    if args.target and not args.drafter and args.oracle is None:
        parser.error("--target without --drafter needs --oracle ACCURACY (the tree step needs a drafter)")
    if args.oracle_accuracy_end is not None and args.oracle is None:
        parser.error("--oracle-accuracy-end needs --oracle")
    for flag in ("target", "drafter"):
        path = getattr(args, flag)
        if path and not os.path.isdir(path):
            parser.error(f"--{flag} {path}: not a directory")
    if args.prompt and not os.path.isfile(args.prompt):
        parser.error(f"--prompt {args.prompt}: no such file")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here")


def diagnose(argv: list[str] | None = None, *, progress: bool = True) -> dict:
    """Run the diagnostics with the command line's arguments (``argv``; defaults otherwise) and
    return the result object; the files are written as by the command line."""
    parser = build_parser()
    args = parser.parse_args(argv or [])
    _check(args, parser)
    try:
        return run(args, progress=progress and not args.quiet)
    except InputError as e:
        parser.error(str(e))


def run(args: argparse.Namespace, *, progress: bool = True) -> dict:
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, progress=progress)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, *, progress: bool) -> dict:
    from .pair import check_pair, checkpoint_pair, default_pair, prompt_ids, special_ids, tiny_pair, with_oracle
    from .report import build, summary, write_csv

    started, clock = datetime.now(timezone.utc), time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or \
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cuda_graphs = device.type == "cuda" and not args.no_cuda_graphs
    compile_step = {"auto": "combo" if cuda_graphs else False, "off": False, "inductor": True}.get(args.compile,
                                                                                                 args.compile)
    if args.target:
        pair = checkpoint_pair(args.target, args.drafter, device, dtype)
    elif args.tiny_pair:
        pair = tiny_pair(device, dtype, block_size=args.block_size)
    else:
        pair = default_pair(device, dtype, block_size=args.block_size)
    if args.oracle is not None:
        pair = with_oracle(pair, args.oracle, block_size=args.block_size, seed=args.seed)
    target, drafter = pair.target, pair.drafter
    check_pair(target, drafter)
    _fit_to_positions(args, getattr(target.config, "max_position_embeddings", None), drafter.block_size)
    prompt_length = args.prompt_length or args.min_context
    contexts = sorted(set(log_spaced(args.min_context, args.max_context, args.points)) | {prompt_length})
    prompt, prompt_source = prompt_ids(args.prompt, pair.tokenizer, target.config.vocab_size, max(contexts),
                                       special_ids(target, drafter), args.seed, pair.texts)
    settings = Settings(contexts=contexts, prompt_length=prompt_length, burst_short=args.burst_short,
                        burst_long=args.burst_long, repeats=args.repeats, sustained_tokens=args.sustained_tokens,
                        window_steps=args.window_steps, timing_steps=args.timing_steps,
                        profile_steps=args.profile_steps, tree_budget=args.tree_budget,
                        oracle_accuracy=args.oracle, oracle_accuracy_end=args.oracle_accuracy_end,
                        cuda_graphs=cuda_graphs, compile_step=compile_step)
    if progress:
        print(f"diagnose: building the session ({pair.name}, {device}, "
              f"{'CUDA graphs' if cuda_graphs else 'eager'}, compile {compile_step or 'off'})", file=sys.stderr)
    m = Measurer(target, drafter, prompt.to(device), settings)
    m.burst_once(contexts[0], args.burst_short)  # warm-up, discarded
    bursts, timings = {}, {}
    with Progress(len(contexts) * (2 * args.repeats + 1), "contexts", enabled=progress, unit="run") as bar:
        for context in contexts:
            bursts[context] = m.burst(context, bar)
            timings[context] = m.step_timing(context)
            bar.update()
    with Progress(args.sustained_tokens - 1, "sustained", enabled=progress, unit="tok") as bar:
        sustained = m.sustained(bar)

    notes = list(pair.notes) + [
        "Times are the session's own, inside the decoding steps (CUDA events on a GPU): no prefill, no host gaps, no "
        "oracle look-ahead; burst_wall_tokens_per_s is the same burst on the wall clock.",
        "Acceptance = tokens emitted per step run, so tokens/s = acceptance / step time exactly.",
        "Generation ignores EOS: every run decodes exactly the tokens asked for.",
        "Phases come from eager steps with a timer between phases (no CUDA graphs, no compile): use their shares, "
        "not their sum.",
    ]
    if device.type == "cpu":
        notes.append("CPU run: a check of the tool and of acceptance; its step times say nothing about a GPU.")
    if args.oracle_accuracy_end is not None:
        notes.append(f"The oracle's accuracy drifts from {args.oracle} to {args.oracle_accuracy_end} over the "
                     "sustained run (a synthetic acceptance decline).")
    meta = {
        "pair": pair.name, "drafter": type(drafter).__name__, "device": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "tree_budget": args.tree_budget,
        "block_size": drafter.block_size, "batch_size": 1, "cuda_graphs": cuda_graphs,
        "compile": compile_step or "off", "prompt": prompt_source,
        "settings": {"contexts": contexts, "prompt_length": prompt_length, "burst_short": args.burst_short,
                     "burst_long": args.burst_long, "repeats": args.repeats, "timing_steps": args.timing_steps,
                     "profile_steps": args.profile_steps, "sustained_tokens": args.sustained_tokens,
                     "window_steps": args.window_steps, "position_bins": args.position_bins,
                     "tolerance": args.tolerance, "oracle_accuracy": args.oracle,
                     "oracle_accuracy_end": args.oracle_accuracy_end, "seed": args.seed},
        "started": started.isoformat(timespec="seconds"), "notes": notes,
    }
    result = build(meta, settings, bursts, timings, sustained, depths=drafter.block_size - 1,
                   tolerance=args.tolerance, position_bins=args.position_bins)

    os.makedirs(args.out, exist_ok=True)
    files = [os.path.join(args.out, n) for n in ("diagnose.json", "contexts.csv", "windows.csv")]
    write_csv(result, files[1], files[2])
    if not args.no_plots:
        from .plots import have_matplotlib, write_plots

        if have_matplotlib():
            files += write_plots(result, args.out)
        else:
            print("note: plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    result["files"] = files
    result["meta"]["seconds"] = time.perf_counter() - clock
    with open(files[0], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1) if args.json else summary(result) + "\n\nwrote " + ", ".join(files))
    return result


def _fit_to_positions(args: argparse.Namespace, limit: int | None, block_size: int) -> None:
    """Fill in --sustained-tokens and --max-context where they were not given: SUSTAINED_TOKENS and
    MAX_CONTEXT, or what fits the target's ``limit`` positions (half of them for the sustained run,
    the rest less a tree's slack for the longest context: the shipped pair's 2,048 give 1,024 and
    1,008).  Raise InputError when the given (or fitted) sizes still exceed ``limit``."""
    slack = 2 * block_size
    if args.sustained_tokens is None:
        args.sustained_tokens = SUSTAINED_TOKENS if not limit else max(2, min(SUSTAINED_TOKENS, limit // 2))
    if args.max_context is None:
        room = limit - max(args.sustained_tokens, args.burst_long) - slack if limit else MAX_CONTEXT
        args.max_context = max(args.min_context, min(MAX_CONTEXT, room))
    longest = max(args.max_context, args.prompt_length or args.min_context)
    new = max(args.sustained_tokens, args.burst_long)
    if limit and longest + new + slack > limit:
        raise InputError(f"contexts up to {longest} plus {new} new tokens exceed the target's {limit} positions "
                         f"(left out, --max-context and --sustained-tokens default to sizes that fit)")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        from .compare import compare, load, text

        try:
            a, b = (load(path) for path in args.compare)
        except ValueError as e:
            parser.error(str(e))
        c = compare(a, b, tuple(args.compare))
        print(json.dumps(c, indent=1) if args.json else text(c))
        return 0
    _check(args, parser)
    try:
        run(args, progress=not args.quiet)
    except InputError as e:
        parser.error(str(e))
    return 0


__all__ = ["build_parser", "diagnose", "run", "main"]
