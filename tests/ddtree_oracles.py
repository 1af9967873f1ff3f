"""Independent oracles for the DDTree ops, written without the references' data structures.

- build: enumerate every prefix of the rank space, then select B times the best prefix whose
  parent is already selected (no heap, no incremental candidates).
- accept: a plain Python walk over child lists.
- commit: a sequential copy, one row at a time, in path order.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch


def f32_prefix_scores(lp_row: np.ndarray, ranks: tuple) -> list:
    """Scores of every prefix of `ranks`, accumulated in float32 from depth 1."""
    acc = np.float32(0.0)
    out = []
    for d, r in enumerate(ranks):
        acc = np.float32(acc + np.float32(lp_row[d, r]))
        out.append(acc)
    return out


def build_oracle(lp: np.ndarray, ids: np.ndarray, root: int, budget: int):
    """One request: returns (tokens, parents, depths, scores) lists of the selected nodes in pop order."""
    L, K = lp.shape
    prefixes = []
    for d in range(1, L + 1):
        prefixes.extend(itertools.product(range(K), repeat=d))
    score = {p: f32_prefix_scores(lp, p)[-1] for p in prefixes}
    index = {(): 0}
    order = [()]
    remaining = set(prefixes)
    while len(order) - 1 < budget:
        ready = [p for p in remaining if p[:-1] in index]
        if not ready:
            break
        best = min(ready, key=lambda p: (-float(score[p]), index[p[:-1]], p[-1]))
        index[best] = len(order)
        order.append(best)
        remaining.discard(best)
    tokens = [root] + [int(ids[len(p) - 1, p[-1]]) for p in order[1:]]
    parents = [-1] + [index[p[:-1]] for p in order[1:]]
    depths = [len(p) for p in order]
    scores = [0.0] + [float(score[p]) for p in order[1:]]
    return tokens, parents, depths, scores, sorted((float(s) for s in score.values()), reverse=True)


def accept_oracle(tokens: list, parents: list, post: list):
    children = {}
    for i, p in enumerate(parents):
        if i > 0 and p >= 0:
            children.setdefault(p, []).append(i)
    acc = [0]
    cur = 0
    while True:
        nxt = [c for c in children.get(cur, []) if tokens[c] == post[cur]]
        if not nxt:
            break
        cur = min(nxt)
        acc.append(cur)
    return acc, post[cur]


def commit_oracle(kv: torch.Tensor, block_table: torch.Tensor, cache_lens: torch.Tensor,
                  indices: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    kv = kv.clone()
    S = kv.shape[2]
    for r in range(block_table.shape[0]):
        base = int(cache_lens[r])
        for j in range(int(lengths[r])):
            src = base + int(indices[r, j])
            dst = base + j
            for layer in range(kv.shape[0]):
                row = kv[layer, int(block_table[r, src // S]), src % S].clone()
                kv[layer, int(block_table[r, dst // S]), dst % S] = row
    return kv


def random_logprobs(R: int, L: int, K: int, generator: torch.Generator, *, ties: bool = False,
                    vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted-descending top-K log-probs and distinct token ids per row."""
    if ties:
        # few distinct values, so equal scores (and equal sums) are common
        lp = -torch.randint(0, 4, (R, L, K), generator=generator).float() * 0.5
    else:
        lp = torch.log_softmax(torch.randn(R, L, 4 * K, generator=generator) * 3, -1)[..., :K]
    lp = lp.sort(-1, descending=True).values.contiguous()
    vocab = vocab or max(2 * K, 1024)
    ids = torch.argsort(torch.rand(R, L, vocab, generator=generator), -1)[..., :K].contiguous()
    return lp, ids


DRAFT_KINDS = ("bench", "flat", "peaked", "ties", "zeros", "positive")


def draft_logprobs(kind: str, R: int, L: int, K: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts of one shape that drive the build down different paths: "bench" (the benchmark's
    log_softmax(randn * 2)), "flat" (wide trees, long sibling runs), "peaked" (chains, with
    lp = 0 at rank 0 so children tie their parents), "ties" (few distinct values), "zeros"
    (every score ties; every other request holds -0.0), "positive" (some lp > 0: scores grow
    along a path, which the select path cannot take)."""
    if kind == "ties":
        return random_logprobs(R, L, K, generator, ties=True)
    if kind == "zeros":
        lp = torch.zeros(R, L, K)
        lp[1::2] = -lp[1::2]
        return lp, torch.arange(L * K).reshape(1, L, K).repeat(R, 1, 1)
    scale = {"flat": 0.3, "bench": 2.0, "peaked": 30.0, "positive": 2.0}[kind]
    lp = torch.log_softmax(torch.randn(R, L, 4 * K, generator=generator) * scale, -1)[..., :K]
    lp = lp.sort(-1, descending=True).values
    if kind == "peaked":
        lp[..., 0] = 0.0
    if kind == "positive":
        lp = lp + 4.0
    ids = torch.argsort(torch.rand(R, L, 4 * K, generator=generator), -1)[..., :K]
    return lp.contiguous(), ids.contiguous()
