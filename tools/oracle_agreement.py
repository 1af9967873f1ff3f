"""Does the target's tree pass agree with its autoregressive pass at benchmark scale?  (GPU)

bench_generate's oracle rows on 2p2b (run 178) accepted ~1.01 tokens a step at 60-95 % oracle
accuracy while k2_slice's accepted 2.7-4.8; on the CPU (bf16) the 2p2b configuration accepts 5.8 of 8
with a perfect oracle through torch ops and 3.8-4.4 through the GPU plan's forms (the ops' CPU references).  A perfect oracle (accuracy 1, fixed B = 16) drafts the
autoregressive pass's own greedy continuation, so its acceptance measured how often the tree pass's
argmax equals the AR pass's: 8 when they always agree (L + 1), ~1 when they disagree at once.  Since
session 48 the oracle decodes that continuation through the step's own verify pass (oracle.py), so
its acceptance here should be 8 every step (a lower one: the verify's rows depend on the tree around
them), and the AR / tree disagreement shows only in where greedy DDTree first leaves greedy AR;
bench_generate's ``perfect_oracle`` rows time both look-aheads (``one_token`` is the old one).  For
each configuration and step form (compiled CUDA-graph steps as generate() runs them, and eager
ops), this prints the mean acceptance, the accept-length histogram, and where greedy DDTree first
leaves greedy AR with the logit gap there (bf16 ulps of the largest logit): a gap of a few ulps is a
tie the two kinds of pass may break differently; a large gap is a disagreement to hunt down.

Run (GPU, ~2-4 min): PYTHONPATH=. python3 tools/oracle_agreement.py [2p2b] [k2_slice] [--tokens 64]
"""
import argparse

import torch

from bench.bench_generate import prompt, target
from torch_kdtree.models.generation import OracleDrafter


def ulp(x: torch.Tensor) -> float:
    """One bf16 ulp at the largest |value| of x."""
    return float(2.0 ** (torch.frexp(x.abs().max().float()).exponent.item() - 8))


def check(name: str, tokens: int, compile_step) -> None:
    model = target(name)
    ids = prompt(name)
    T = ids.shape[1]
    oracle = OracleDrafter(model, block_size=8, accuracy=1.0, seed=3)
    common = dict(max_new_tokens=tokens, eos_token_id=None, compile_step=compile_step)
    ar = model.generate(ids, **common)
    dd = model.generate(ids, drafter=oracle, tree_budget=16, return_dict_in_generate=True, **common)
    lengths = dd.accept_lengths[0][dd.accept_lengths[0] > 0]
    hist = torch.bincount(lengths.long().cpu(), minlength=9)[1:].tolist()
    diff = (dd.sequences[0, T:] != ar[0, T:]).nonzero()
    where = "none"
    if diff.numel():
        t = int(diff[0, 0])
        prefix = torch.cat([ids[0], ar[0, T:T + t]])
        with torch.no_grad():
            logits = model(prefix[None]).logits[0, -1].float()
        a, b = int(ar[0, T + t]), int(dd.sequences[0, T + t])
        where = (f"token {t}: AR {a} / DDTree {b}, prefill logit gap {abs(logits[a] - logits[b]).item():.4g} = "
                 f"{abs(logits[a] - logits[b]).item() / ulp(logits):.1f} ulps; top-2 gap "
                 f"{(logits.topk(2).values[0] - logits.topk(2).values[1]).item():.4g}")
    print(f"{name} compile_step={compile_step}: mean accept {float(dd.mean_accept_length):.2f} over "
          f"{lengths.numel()} steps, accept lengths 1..8 {hist}; first DDTree != AR at {where}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=["2p2b", "k2_slice"])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    for name in args.configs:
        for compile_step in ("auto", False):
            check(name, args.tokens, compile_step)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
