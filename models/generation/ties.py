"""Greedy equality up to bf16 ties: the sacred tests' rule, as a library check.

Greedy DDTree output must equal greedy autoregressive output token for token.  In fp32 it does,
exactly.  In bf16 the tree pass and the single-token pass are different kernels that round a
position's hidden state differently, so where that position is at a tie -- two tokens' logits
within a few bf16 ulps, or a MoE layer's k-th and (k + 1)-th expert scores that close -- the two
decodings may pick different tokens, and from there on each is the other's valid continuation.
:func:`check_equal_up_to_bf16_ties` accepts exactly those divergences and explains each one; any
other divergence is reported as one.  tests/test_generate.py asserts with it (the sacred tests on
CUDA); ``python -m torch_kdtree.demo`` prints its verdict on a GPU, where the comparison is bf16.

Every check runs extra eager passes of the model (a prefill of the common prefix, single-token
decoding of it, one prefill per near-tied expert choice): a diagnostic, not something to call per
step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def first_difference(a: torch.Tensor, b: torch.Tensor):
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else tuple(diff[0].tolist())


def prefill_routed(model, prefix: torch.Tensor, hook) -> torch.Tensor:
    """The fp32 logits of a prefill of ``prefix`` [L] whose routers' choices go through
    ``hook(layer, router, logits) -> logits`` first (layer: the MoE layer's index in call order;
    logits: that router's fp32 logits [L, E]).

    Each router gets a (no-op) forward pre-hook for the pass: the plan then calls hooked MoE blocks'
    routers as modules, so their choice goes through ``KimiK2Router.route`` on every device.  Without
    it a plan with ``kdtree::moe_route`` (CUDA) launches the op directly, the patched ``route`` never
    runs, and the sacred tests' tie diagnostics saw no router at all (run 175: "nearest expert-choice
    ties: []")."""
    from torch_kdtree.models.kimi_k2.moe import KimiK2Router

    real = KimiK2Router.route
    calls = iter(range(len(model.model.layers)))

    def hooked(self, logits, **kwargs):  # the plan's forms pass topk= (fused.route)
        return real(self, hook(next(calls), self, logits), **kwargs)

    handles = [m.register_forward_pre_hook(lambda module, args: None)
               for m in model.modules() if isinstance(m, KimiK2Router)]
    KimiK2Router.route = hooked
    try:
        with torch.no_grad():
            return model(prefix[None]).logits[0].float()
    finally:
        KimiK2Router.route = real
        for h in handles:
            h.remove()


def routing_margins(model, prefix: torch.Tensor, start: int) -> list[tuple[float, int, int]]:
    """Diagnostics for a divergence: a prefill pass over ``prefix`` [L] recording, per MoE layer,
    the smallest gap between the k-th and (k + 1)-th largest biased router scores (sigmoid(logit) +
    e_score_correction_bias, group limits ignored) over positions ``start`` .. L - 1, as
    (gap, layer, position), smallest first.  A gap near fp32 rounding says an expert choice there
    was a near-tie, which a tree pass and a single-token pass may break differently."""
    found = []

    def recording(layer, router, logits):
        rows = logits[start:].float()
        if rows.shape[0]:
            top = (rows.sigmoid() + router.e_score_correction_bias.float()).topk(router.top_k + 1, dim=-1).values
            gaps = top[:, -2] - top[:, -1]
            i = int(gaps.argmin())
            found.append((float(gaps[i]), layer, start + i))
        else:
            found.append((float("inf"), layer, -1))
        return logits

    prefill_routed(model, prefix, recording)
    return sorted(found)


SCORE_TIE = 4 * 2.0 ** -8  # 4 bf16 ulps of a biased router score (sigmoid + bias, about 1)


def last_position(model, prefix: torch.Tensor, knock: tuple[int, int] | None = None):
    """A prefill of ``prefix`` [L]: the fp32 logits of its last position, and per MoE layer (in call
    order) that position's fp32 router logits and the router.  ``knock`` = (layer, expert): that
    layer's router logit of ``expert`` at the last position is set to -1e4 before the choice, so
    the next expert in line takes its place."""
    rows = []

    def recording(layer, router, logits):
        rows.append((logits[-1].float().clone(), router))
        if knock is not None and knock[0] == layer:
            logits = logits.clone()
            logits[-1, knock[1]] = -1e4
        return logits

    return prefill_routed(model, prefix, recording)[-1], rows


def expert_tie_flip(model, prefix: torch.Tensor, a: int, b: int, ulp: float) -> tuple[float, int] | None:
    """Whether an expert-choice tie at the last position of ``prefix`` explains tokens ``a`` and
    ``b`` there: a MoE layer whose k-th and (k + 1)-th biased router scores (group limits ignored)
    are within SCORE_TIE, where one side of the tie (the prefill's choice, or the (k + 1)-th expert
    instead of the k-th) makes ``a`` the argmax and the other side ``b``, each up to 4 bf16 ulps
    (``ulp``).  Returns (score gap, layer) of the first such layer, else None."""
    base, rows = last_position(model, prefix)

    def leads(logits, token):
        return bool(logits[token] >= logits.max() - 4 * ulp)

    for layer, (row, router) in enumerate(rows):
        top = (row.sigmoid() + router.e_score_correction_bias.float()).topk(router.top_k + 1)
        gap = float(top.values[-2] - top.values[-1])
        if gap > SCORE_TIE:
            continue
        flipped, _ = last_position(model, prefix, (layer, int(top.indices[-2])))
        if (leads(base, a) and leads(flipped, b)) or (leads(base, b) and leads(flipped, a)):
            return gap, layer
    return None


def decoded_logits(model, prompt: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor | None:
    """The fp32 logits of ``prefix``'s last position [V] the way autoregressive decoding computes
    them: ``prompt`` (a prefix of ``prefix``) prefilled into a fresh latent cache, then the rest of
    ``prefix`` one token per pass through it (eager).  None when nothing follows the prompt (the
    first generated token comes from the prompt's prefill)."""
    from torch_kdtree.models.kimi_k2.cache import KimiK2Cache

    P, L = len(prompt), len(prefix)
    if L == P:
        return None
    cache = KimiK2Cache.for_model(model, 1, L + 1, dtype=model.dtype, device=prefix.device)
    visible = torch.ones(1, 1, 1, dtype=torch.bool, device=prefix.device)
    with torch.no_grad():
        model(prompt[None], cache=cache, return_logits=False)
        cache.advance(P)
        for i in range(P, L):
            out = model(prefix[None, i:i + 1], cache.lengths.long()[:, None], cache, visible)
            cache.advance(1)
    return out.logits[0, -1].float()


def bf16_ulp(logits: torch.Tensor) -> float:
    """The bf16 ulp of the largest logit's magnitude."""
    return 2.0 ** (math.floor(math.log2(logits.abs().max().item())) - 7)


def greedy_resume(model, compile_step=False):
    """``resume`` for :func:`check_equal_up_to_bf16_ties`: ``resume(prefix [L], n)`` -> the n greedy
    autoregressive tokens ``model.generate`` makes after ``prefix`` (batch 1; ``compile_step`` as
    generate takes it: none by default, a one-off session)."""
    def resume(prefix: torch.Tensor, n: int) -> torch.Tensor:
        out = model.generate(prefix[None], attention_mask=torch.ones_like(prefix)[None], max_new_tokens=n,
                             eos_token_id=None, compile_step=compile_step)
        return out[0, prefix.numel():]
    return resume


@dataclass
class TieCheck:
    """The verdict of :func:`check_equal_up_to_bf16_ties`: ``equal`` when every request matched up
    to explained ties; ``lines`` says, per request, where each accepted tie was (and why), and
    ``divergence`` names the first unexplained divergence (checking stops there)."""
    equal: bool = True
    ties: int = 0
    lines: list[str] = field(default_factory=list)
    divergence: str | None = None


def check_equal_up_to_bf16_ties(model, ids, mask, got, want, resume=None, max_resumes: int = 8,
                                log=None) -> TieCheck:
    """Whether got == want token for token, except that a request may diverge where its bf16
    computation is at a tie, which tree and single-token passes (different kernels) break
    differently.  ``ids`` [R, T] / ``mask`` [R, T]: the left-padded prompts; ``got`` / ``want``
    [R, T + N]: the two decodings' sequences.  At a differing position (a bf16 prefill of the common
    prefix):

    - the two tokens' logits tie within 4 bf16 ulps; or
    - in single-token decoding of the same prefix (decoded_logits: the autoregressive step's kind of
      pass), both tokens lie within 4 bf16 ulps of the top logit: the kinds of pass compute a
      position's hidden state with different roundings, which can move a near-tie by more than a
      few ulps, or flip a near-tied expert choice (bench/RESULTS.md run 161: a 46-ulp gap in the
      prefill was 2 ulps in decoding, whose router chose another expert); or
    - an expert choice of that position ties (expert_tie_flip): a MoE layer's k-th and (k + 1)-th
      biased router scores lie within 4 bf16 ulps, and one side of that tie makes want's token the
      argmax, the other side got's (each up to 4 ulps; either pass may be the one that the
      prefill's bf16 rounding sides with).  Router inputs are bf16 residuals that the two kinds of pass
      round differently, so scores that close are a coin toss, and an expert swap moves logits far
      more than an ulp.

    ``resume(prefix [L'], n) -> [n]`` (greedy autoregressive decoding of n tokens after a prompt):
    after an accepted tie, got's later tokens are checked too, against autoregressive decoding
    resumed from got's side of the tie (the same rules at each further divergence, up to
    ``max_resumes`` per request).  Without it, checking stops at the first accepted tie.

    Each finding is appended to the result's ``lines`` (and passed to ``log``, e.g. ``print``, as it
    is found); an unexplained divergence names the nearest expert-choice ties among the generated
    positions (routing_margins)."""
    result = TieCheck()

    def say(line: str) -> None:
        result.lines.append(line)
        if log is not None:
            log(line)

    T = ids.shape[1]
    for r in range(ids.shape[0]):
        prompt = ids[r][mask[r].bool()]
        want_r = want[r]
        for resumed in range(max_resumes + 1):
            where = first_difference(got[r], want_r)
            if where is None:
                if resumed:
                    say(f"request {r}: equal to the resumed decoding to the end")
                break
            t = where[0]
            prefix = torch.cat([prompt, got[r, T:t]])
            with torch.no_grad():
                logits = model(prefix[None]).logits[0, -1].float()
            gap = (logits[want_r[t]] - logits[got[r, t]]).abs().item()
            ulp = bf16_ulp(logits)
            if gap <= 4 * ulp:
                say(f"request {r}: equal for {t - T} tokens, then a bf16 tie (gap {gap:.3g}, ulp {ulp:.3g})")
            elif (decoded := decoded_logits(model, prompt, prefix)) is not None and all(
                    decoded[tok] >= decoded.max() - 4 * bf16_ulp(decoded) for tok in (want_r[t], got[r, t])):
                say(f"request {r}: equal for {t - T} tokens, then a bf16 tie in single-token decoding (gap "
                    f"{(decoded[want_r[t]] - decoded[got[r, t]]).abs().item():.3g}, ulp {bf16_ulp(decoded):.3g}; "
                    f"prefill gap {gap:.3g})")
            else:
                tie = expert_tie_flip(model, prefix, int(want_r[t]), int(got[r, t]), ulp)
                if tie is None:
                    near = routing_margins(model, prefix, int(mask[r].sum()))[:3]
                    result.equal = False
                    result.divergence = (f"request {r} diverges at token {t - T} with a logit gap {gap} (bf16 ulp "
                                         f"{ulp}); nearest expert-choice ties (gap, MoE layer, position): {near}")
                    return result
                say(f"request {r}: equal for {t - T} tokens, then an expert-choice tie (MoE layer {tie[1]}, score "
                    f"gap {tie[0]:.3g}; logit gap {gap:.3g}): one choice gives each token")
            result.ties += 1
            if resume is None or t + 1 == got.shape[1]:
                break
            if resumed == max_resumes:
                say(f"request {r}: not checked after token {t - T} ({max_resumes} resumed decodings)")
                break
            # from here on, got's side of the tie is the history: decode on from it
            more = resume(torch.cat([prompt, got[r, T:t + 1]]), got.shape[1] - t - 1)
            want_r = torch.cat([got[r, :t + 1], more.to(got.device, got.dtype)])
    return result


__all__ = ["TieCheck", "check_equal_up_to_bf16_ties", "greedy_resume", "routing_margins", "expert_tie_flip", "decoded_logits",
           "last_position", "prefill_routed", "first_difference", "bf16_ulp", "SCORE_TIE"]
