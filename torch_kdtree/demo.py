"""The main job: DDTree generation on the embedded default model, against autoregressive decoding.

The default pair is built deterministically on the fly (models/generation/tiny.py): a tiny
random Kimi K2 target (K2's MLA latent row, one dense and one MoE layer) and a random DFlash
drafter tapping its layers — random tiny models until a trained pair exists.  A random drafter
is rarely right, so its mean acceptance is close to 1 and DDTree is slower than autoregressive
decoding here; the point is that the outputs are identical.  ``--drafter oracle`` shows the
other end: a drafter that knows the target's greedy continuation with ``--accuracy``.

Runs on CUDA (bf16, CUDA graphs) when a GPU and the kernels are present, else on the CPU (fp32).
"""
from __future__ import annotations

import argparse
import time

import torch

import torch_kdtree


def _device() -> str:
    info = torch_kdtree.build_info()
    mla = info["cuda_available"] and torch._C._dispatch_has_kernel_for_dispatch_key(
        "kdtree::mla_tree_attention", "CUDA")
    return "cuda" if info["cuda_kernels"] and mla else "cpu"


def _timed(fn):
    fn()  # the first call builds the session (and captures the graphs on CUDA)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _in_range(kind, lo, hi):
    """An argparse type: ``kind(text)`` within [lo, hi], else an argparse error naming the range."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in [{lo}, {hi}], got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected a number in [{lo}, {hi}], got {text!r}")
        return value
    return parse


def _budget(text: str):
    if text == "auto":
        return text
    try:
        return _in_range(int, 1, 1024)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int in [1, 1024], got {text!r}") from None


def main(argv=None) -> None:
    from torch_kdtree.models.generation import OracleDrafter  # the models import transformers: on use only
    from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-new-tokens", type=_in_range(int, 1, 4096), default=32, help="1..4096")
    ap.add_argument("--batch", type=_in_range(int, 1, 64), default=2, help="requests (prompts of different lengths)")
    ap.add_argument("--budget", type=_budget, default="16", help="tree budget B in 1..1024, or 'auto'")
    ap.add_argument("--block-size", type=_in_range(int, 2, 16), default=4,
                    help="drafter block size (L = block size - 1), 2..16")
    ap.add_argument("--drafter", choices=("dflash", "oracle"), default="dflash")
    ap.add_argument("--accuracy", type=_in_range(float, 0.0, 1.0), default=0.8, help="oracle per-token accuracy, 0..1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    budget = args.budget

    device = _device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.set_num_threads(1)  # tiny matrices: more threads only add overhead
    print(f"torch_kdtree {torch_kdtree.__version__} on {device}: {torch_kdtree.build_info()}")
    heads = {"num_attention_heads": 8, "num_key_value_heads": 8} if device == "cuda" else {}
    target = tiny_target(args.seed, **heads).to(device, dtype)
    if args.drafter == "oracle":
        drafter = OracleDrafter(target, args.block_size, accuracy=args.accuracy, seed=args.seed)
    else:
        drafter = tiny_drafter(target, seed=args.seed + 1, block_size=args.block_size).to(device, dtype)
    c = target.config
    print(f"target: Kimi K2 architecture, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"{c.n_routed_experts} experts top-{c.num_experts_per_tok}, vocab {c.vocab_size}, "
          f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters (random)")
    print(f"drafter: {type(drafter).__name__}, block size {drafter.block_size}; tree budget {budget}")

    g = torch.Generator().manual_seed(args.seed)
    lengths = [5 + 3 * r for r in range(args.batch)]
    ids = torch.zeros(args.batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):  # left padding, as transformers users batch prompts
        ids[r, -n:] = torch.randint(3, c.vocab_size, (n,), generator=g)
        mask[r, -n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    common = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, eos_token_id=None)

    ar, ar_s = _timed(lambda: target.generate(ids, return_dict_in_generate=True, **common))
    dd, dd_s = _timed(lambda: target.generate(ids, drafter=drafter, tree_budget=budget,
                                              return_dict_in_generate=True, **common))
    tokens = args.batch * args.max_new_tokens
    T = ids.shape[1]
    for r in range(args.batch):
        print(f"request {r}: prompt {ids[r, -lengths[r]:].tolist()}")
        print(f"  completion {dd.sequences[r, T:].tolist()}")
    print(f"mean acceptance length: {dd.mean_accept_length:.2f} tokens per step "
          f"({dd.accept_lengths.shape[1]} DDTree steps for {args.max_new_tokens} tokens per request)")
    print(f"tokens/s, wall clock: DDTree {tokens / dd_s:.1f}, autoregressive {tokens / ar_s:.1f} "
          f"(batch {args.batch}, {args.max_new_tokens} new tokens each)")
    print(f"tokens/s inside the decoding steps (no prefill, no oracle look-ahead): "
          f"DDTree {tokens / dd.step_seconds:.1f}, autoregressive {tokens / ar.step_seconds:.1f}")
    same = torch.equal(dd.sequences, ar.sequences)
    print(f"DDTree output == autoregressive output: {same}")
    if not same:
        raise SystemExit("DDTree and autoregressive outputs differ")


if __name__ == "__main__":
    main()
