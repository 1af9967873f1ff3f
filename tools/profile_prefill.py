"""The prefill of a generate call on a GPU: its time on CUDA events, its kernels and GPU time, and
the host's synchronisations, for the captured chain prefill and the eager one.

    python tools/profile_prefill.py [--pair DIR | --config k2_slice|2p2b] [--batch 2] [--budget 8]
                                    [--lengths 256,512,1024]

Runs ``generate(max_new_tokens=1)`` on the shipped pair (bf16, CUDA graphs), autoregressive and
DDTree, each with the chain prefill (a CUDA session's default for prompts of at most
``PREFILL_GRAPH_TOKENS`` tokens: one graph replay) and with the eager prefill (``PREFILL_GRAPH_TOKENS``
set to 0 for new sessions), and prints per case: wall ms of the call, the prefill's ms (CUDA
events), the CUDA kernels, their GPU ms and the runtime calls that launch or synchronise (one
call under torch.profiler).  bench/RESULTS.md run 210 is the eager prefill's row before the chain.
``--lengths``: also prompts of these many tokens (the held-out prompts' tokens repeated), DDTree only,
the chain prefill allowed up to each length: where the chain's absorbed attention over the prompt
starts to cost more than the eager prefill's host time (what ``PREFILL_GRAPH_TOKENS`` should be).
``--config``: instead of the pair, one of bench/bench_generate.py's random targets (k2_slice: one
TP-8 rank of K2's layer shapes, INT4 experts) with its random DFlash drafter and random prompts
(run from the repository root with ``PYTHONPATH=$PWD``): where the GPU work of a larger model, not
the host, sets the eager prefill's time.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch


def _pair(path, device: str):
    from torch_kdtree.models.pair import load_default_pair

    return load_default_pair(device, torch.bfloat16, path=path)


def _config(name: str):
    """bench/bench_generate.py's random target and drafter of ``name`` (no tokenizer)."""
    from bench import bench_generate

    return bench_generate.target(name), bench_generate.drafter(name), None


def _prompts(path, tokenizer, batch: int, device: str, length: int | None = None, vocab: int | None = None):
    """Left-padded held-out prompts (ids, mask) and their lengths; ``length``: each prompt's tokens
    repeated to exactly that many.  Without a tokenizer, random prompts of ``vocab`` tokens (60 and
    78 tokens, as the pair's first two, or ``length``)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, vocab - 1, (length or (60, 78)[r % 2],), generator=g) for r in range(batch)]
    else:
        from torch_kdtree.models.pair import default_prompts, prompt_ids

        texts = default_prompts(path)
        prompts = [torch.tensor(prompt_ids(tokenizer, texts[r % len(texts)])) for r in range(batch)]
    if length is not None:
        prompts = [p.repeat(-(-length // p.numel()))[:length] for p in prompts]
    lengths = [p.numel() for p in prompts]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, -p.numel():] = p
        mask[r, -p.numel():] = 1
    return ids.to(device), mask.to(device), lengths


def _case(target, kw: dict, repeats: int = 5, profile: bool = True) -> dict:
    from torch.profiler import ProfilerActivity, profile as profiler

    for _ in range(2):  # builds the session, captures its graphs
        target.generate(**kw)
    walls, prefills = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = target.generate(**kw)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        prefills.append(out.prefill_seconds)
    row = {"wall_ms": statistics.median(walls) * 1e3, "prefill_ms": statistics.median(prefills) * 1e3}
    if not profile:
        return row
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target.generate(**kw)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    runtime = collections.Counter(e.name for e in events if e.name.startswith(("cuda", "cuLaunch")))
    wanted = ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
              "cudaStreamSynchronize", "cudaMemcpyAsync")
    return {**row, "kernels": len(kernels), "gpu_ms": sum(e.device_time for e in kernels) / 1e3,
            "runtime": {name: runtime[name] for name in wanted if runtime[name]}}


def _fresh(target) -> None:
    target.__dict__.pop("_ddtree_sessions", None)  # new sessions: PREFILL_GRAPH_TOKENS is read when one is built


def main(argv=None) -> None:
    from torch_kdtree.models.generation import session as session_mod

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=None, help="a pair directory (default: the shipped pair)")
    ap.add_argument("--config", default=None, choices=("k2_slice", "2p2b"),
                    help="bench_generate's random target and drafter instead of a pair")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--lengths", default="", help="comma-separated prompt lengths to time as well (e.g. 256,512,1024)")
    args = ap.parse_args(argv)
    if args.config and args.pair:
        ap.error("--pair and --config: give one")
    if args.batch < 1 or args.budget < 1:
        ap.error("--batch and --budget must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill: needs a CUDA device")
    target, drafter, tokenizer = _config(args.config) if args.config else _pair(args.pair, "cuda")
    vocab = target.config.vocab_size
    ids, mask, lengths = _prompts(args.pair, tokenizer, args.batch, "cuda", vocab=vocab)
    default = session_mod.PREFILL_GRAPH_TOKENS
    print(f"{torch.cuda.get_device_name()}: {args.config or 'the pair'}, batch {args.batch}, prompts of {lengths} tokens, "
          f"PREFILL_GRAPH_TOKENS {default}")
    base = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None, return_dict_in_generate=True)
    try:
        for prefill, tokens in (("chain (captured)", default), ("eager", 0)):
            session_mod.PREFILL_GRAPH_TOKENS = tokens
            _fresh(target)
            for name, extra in (("AR", {}), ("DDTree", {"drafter": drafter, "tree_budget": args.budget})):
                row = _case(target, {**base, **extra})
                print(f"{prefill:17s} {name:6s} wall {row['wall_ms']:.2f} ms, prefill {row['prefill_ms']:.2f} ms, "
                      f"{row['kernels']} kernels, GPU {row['gpu_ms']:.3f} ms, {row['runtime']}")
        for length in [int(x) for x in args.lengths.split(",") if x]:
            ids, mask, _ = _prompts(args.pair, tokenizer, args.batch, "cuda", length, vocab=vocab)
            kw = dict(base, input_ids=ids, attention_mask=mask, drafter=drafter, tree_budget=args.budget)
            times = {}
            for prefill, tokens in (("chain", length), ("eager", 0)):
                session_mod.PREFILL_GRAPH_TOKENS = tokens
                _fresh(target)
                times[prefill] = _case(target, kw, profile=False)["prefill_ms"]
            print(f"prompts of {length} tokens (batch {args.batch}), DDTree: prefill chain {times['chain']:.2f} ms, "
                  f"eager {times['eager']:.2f} ms: chain / eager {times['chain'] / times['eager']:.2f}")
    finally:
        session_mod.PREFILL_GRAPH_TOKENS = default
        _fresh(target)


if __name__ == "__main__":
    main()
