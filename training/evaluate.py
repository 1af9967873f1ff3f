"""Held-out numbers: bits per byte, expert load, the DDTree-against-autoregressive check and the
acceptance sweep (mean acceptance length by tree budget, greedy and sampled, with the
distinct-4-gram ratio of the text it was measured on: a drafter that agrees with a target stuck in
a loop would show high acceptance and a low ratio).

Bits per byte: the summed next-token negative log-likelihood (nats) of every held-out text
token, divided by ln 2 and by the bytes those tokens stand for (byte-level BPE: each token is a
fixed byte string; the specials count no bytes and are not scored).  The model runs as it
would be used — its own plan for the pass, INT4 experts through ``int4_moe`` — not the
training plan.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .data import heldout_windows
from .target import ExpertLoad


@torch.no_grad()
def bits_per_byte(model, stream: torch.Tensor, byte_lengths: list[int], seq_len: int, batch: int) -> dict:
    """Bits per byte, nats per token and the expert load of ``model`` over the held-out ``stream``."""
    device = model.device
    inputs, targets = heldout_windows(stream, seq_len)
    nbytes = torch.tensor(byte_lengths, dtype=torch.float64, device=device)
    load = ExpertLoad(model)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens, total_bytes = torch.zeros_like(nll), torch.zeros_like(nll)
    try:
        for lo in range(0, inputs.shape[0], batch):
            x, y = inputs[lo: lo + batch].to(device), targets[lo: lo + batch].to(device)
            logits = model(x).logits.float()
            scored = (y >= 0) & (nbytes[y.clamp(min=0)] > 0)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.clamp(min=0).reshape(-1), reduction="none")
            nll += (ce.double() * scored.reshape(-1)).sum()
            tokens += scored.sum()
            total_bytes += (nbytes[y.clamp(min=0)] * scored).sum()
    finally:
        load.remove()
    counts = load.step.clone()
    nll, tokens, total_bytes = float(nll), int(tokens), float(total_bytes)
    return {"bits_per_byte": nll / math.log(2) / max(total_bytes, 1), "nats_per_token": nll / max(tokens, 1),
            "perplexity": math.exp(nll / max(tokens, 1)), "tokens": tokens, "bytes": int(total_bytes),
            "load": ExpertLoad.balance(counts), "load_counts": counts.cpu().tolist(), "dtype": str(model.dtype)}


def bf16_copy(model):
    """The dense model as shipped weights would be: bf16 on CUDA; on the CPU its weights rounded to
    bf16 and computed in fp32."""
    import copy

    out = copy.deepcopy(model).eval()
    out.to(torch.bfloat16)
    if model.device.type != "cuda":
        out.float()
    return out


@torch.no_grad()
def ddtree_check(target, drafter, prompts: torch.Tensor, new_tokens: int, budget: int) -> dict:
    """Greedy DDTree (budget ``budget``) against greedy autoregressive decoding on ``prompts``
    [R, P]: whether the outputs are equal, where they first differ, the mean acceptance length,
    and both runs' wall-clock tokens/s (after a warm-up call that builds the sessions).  The steps
    run eagerly (CUDA graphs on a GPU, no inductor compile): this is a check, the timings that
    count come from bench/ and the demo."""
    ids = prompts.to(target.device)
    kwargs = {"max_new_tokens": new_tokens, "eos_token_id": None, "compile_step": False}

    def timed(fn):
        fn()
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    ar, t_ar = timed(lambda: target.generate(ids, **kwargs))
    tree, t_tree = timed(lambda: target.generate(ids, drafter=drafter, tree_budget=budget,
                                                return_dict_in_generate=True, **kwargs))
    same = ar.eq(tree.sequences)
    differs = (~same).any(0).nonzero()
    generated = ids.shape[0] * new_tokens
    return {"equal": bool(same.all()), "first_difference": int(differs[0]) - ids.shape[1] if differs.numel() else None,
            "mean_accept_length": tree.mean_accept_length, "budget": budget, "prompts": ids.shape[0],
            "new_tokens": new_tokens, "ar_tokens_per_second": generated / t_ar,
            "ddtree_tokens_per_second": generated / t_tree, "speedup_wall": t_ar / t_tree,
            "device": str(target.device), "dtype": str(target.dtype)}


def distinct_ngram_ratio(tokens: torch.Tensor, n: int = 4) -> float:
    """Mean over rows of ``tokens`` [R, T] of distinct n-grams / n-grams (1.0: no n-gram repeats)."""
    ratios = []
    for row in tokens.tolist():
        grams = [tuple(row[i: i + n]) for i in range(len(row) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else float("nan")


@torch.no_grad()
def acceptance_sweep(target, drafter, prompts: torch.Tensor, new_tokens: int, budgets, *, sampled_budget: int,
                     seed: int) -> dict:
    """Mean acceptance length of DDTree on ``prompts`` [R, P] for ``new_tokens`` new tokens: greedy at
    each of ``budgets``, and sampled at temperature 1 (no top-k / top-p) at ``sampled_budget``; with
    the distinct-4-gram ratio of the greedy and of the sampled continuations.  Eager steps (CUDA
    graphs on a GPU, no inductor compile), as :func:`ddtree_check`."""
    ids = prompts.to(target.device)
    kwargs = {"max_new_tokens": new_tokens, "eos_token_id": None, "compile_step": False,
              "return_dict_in_generate": True, "drafter": drafter}
    greedy, text = {}, None
    for b in budgets:
        out = target.generate(ids, tree_budget=int(b), **kwargs)
        greedy[int(b)] = out.mean_accept_length
        if text is None:
            text = out.sequences[:, ids.shape[1]:]
    torch.manual_seed(seed)
    sampled = target.generate(ids, tree_budget=int(sampled_budget), do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, **kwargs)
    return {"budgets": [int(b) for b in budgets], "greedy_mean_accept_length": greedy,
            "greedy_distinct_4gram_ratio": distinct_ngram_ratio(text.cpu()),
            "sampled_budget": int(sampled_budget), "sampled_mean_accept_length": sampled.mean_accept_length,
            "sampled_distinct_4gram_ratio": distinct_ngram_ratio(sampled.sequences[:, ids.shape[1]:].cpu()),
            "prompts": ids.shape[0], "new_tokens": new_tokens}


__all__ = ["bits_per_byte", "bf16_copy", "ddtree_check", "acceptance_sweep", "distinct_ngram_ratio"]
