"""An oracle drafter for tests and benchmarks: it knows the target's own greedy continuation.

Before each draft, :meth:`OracleDrafter.prepare` decodes the target greedily for
L = block_size - 1 tokens after the root, in place on the generation's paged cache (at the
positions the tree overwrites next; the committed lengths are restored), so the continuation
always follows the actual prefix, whatever was generated before.  In a generation session it
decodes them through the coming step's own verify pass (a chain of B + 1 nodes, one pass per
token): "the true token" is then exactly the token the verify will choose, on any GPU and even
where a random target's logits are nearly flat (one-token passes round differently there).  The
session runs ``prepare`` as its own graph just before each step, outside the step's timing: the
look-ahead is the oracle's knowledge, not a drafter's cost.  :meth:`forward` (inside the step) then emits
per-depth marginals that put, at depth d:

- with probability ``accuracy``: the true token first, a wrong token second;
- otherwise a wrong token first, and second either the true token (probability
  ``second_choice``: the tree can recover it through a sibling) or another wrong token, the
  true one then far down (out of any tree).

The coin flips come from tables drawn from ``seed`` and indexed by (request, position of the
root, depth): a run is reproducible and each step's draws are fresh.  Everything has a fixed
shape and stays on the device, so the oracle runs inside the same captured step as a real
drafter.  With ``inner`` (a DFlash drafter) the inner drafter runs too (a real drafter's cost
and context) and its logits fill the ranks the oracle does not set.

With ``accuracy=1`` the greedy chain is the tree's spine: a step accepts L + 1 tokens when
B >= L, B + 1 when B < L.

Under tensor parallelism (a target parallelised by ``models/parallel.py``, whose logits are
vocabulary shards) the look-ahead chooses each greedy token with the session's sharded argmax
(``select_tokens_sharded``: ties to the lower global id, as ``argmax``), and :meth:`forward`
returns this rank's shard [R, L, V / world] of the same marginals, which the session's draft
top-K merges across ranks as a DFlash drafter's; ``inner`` must then be parallelised over the
same mesh (its logits are shards too).  The coin-flip tables come from ``seed`` on every rank
alike, so every rank drafts the same tree.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel import vocab_shard
from .sampling import SamplingMode, select_tokens


class OracleDrafter(nn.Module):
    """A drafter with the protocol of :class:`~torch_kdtree.models.DFlashDraftModel`
    (``block_size``, ``target_layer_ids``, ``setup_cache``, ``append_context``,
    ``reset_context``, ``forward(root) -> logits [R, L, V]``) plus ``prepare(root)`` and
    ``attach(target, cache)``, which the generation session calls.

    Args:
        target: the :class:`KimiK2ForCausalLM` being decoded (its greedy continuation is drafted).
        block_size: bs; L = bs - 1 draft depths (with ``inner``, the inner's block size).
        accuracy: probability that a depth's top choice is the target's greedy token.
        second_choice: probability that a wrong top choice has the true token second.
        seed: seeds the coin-flip tables.
        inner: optional drafter run alongside (cost realism); it receives the taps and context.
    """

    def __init__(self, target, block_size: int = 8, accuracy: float = 1.0, *, second_choice: float = 0.5,
                 seed: int = 0, inner: nn.Module | None = None):
        super().__init__()
        self._target = [target]  # a list: not a submodule (no parameters, no .to() of the target)
        self.inner = inner
        self._block_size = inner.block_size if inner is not None else int(block_size)
        if self._block_size < 2:
            raise ValueError(f"OracleDrafter: block_size must be >= 2 (one draft depth), got {self._block_size}")
        self.vocab_size = target.config.vocab_size
        self.seed = int(seed)
        self._check(accuracy, second_choice)
        self.accuracy, self.second_choice = float(accuracy), float(second_choice)
        self._cache = None
        self.context_lengths = None

    @staticmethod
    def _check(accuracy, second_choice) -> None:
        if not 0.0 <= accuracy <= 1.0 or not 0.0 <= second_choice <= 1.0:
            raise ValueError(f"OracleDrafter: accuracy and second_choice must be in [0, 1], got {accuracy}, "
                             f"{second_choice}")

    # ---- drafter protocol ----
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.inner.target_layer_ids) if self.inner is not None else []

    def attach(self, target, cache) -> None:
        """The session's target and paged cache, where the greedy continuation is decoded."""
        if target is not self._target[0]:
            raise ValueError("OracleDrafter: the session's target is not the model this oracle was built for "
                             "(build the oracle on the model that generates: under tensor parallelism, this "
                             "rank's parallelised target)")
        self._cache = cache

    def bind_target(self, embed_tokens, lm_head) -> "OracleDrafter":
        if self.inner is not None:
            self.inner.bind_target(embed_tokens, lm_head)
        return self

    def setup_cache(self, num_requests: int, capacity: int, *, device=None) -> None:
        """Context counters, the continuation buffer and coin-flip tables for ``capacity`` root
        positions (fixed addresses, so a captured step stays valid across :meth:`set_accuracy`)."""
        if self.inner is not None:
            self.inner.setup_cache(num_requests, capacity, device=device)
        device = torch.device(device) if device is not None else self._target[0].device
        shape = (num_requests, capacity + 1, self._block_size - 1)
        self.correct = torch.zeros(shape, dtype=torch.bool, device=device)
        self.second = torch.zeros(shape, dtype=torch.bool, device=device)
        self.wrong_offset = torch.ones(shape, dtype=torch.int64, device=device)
        self.log_beliefs = torch.zeros(3, dtype=torch.float32, device=device)  # first, second, rest
        self.continuation = torch.zeros(num_requests, self._block_size - 1, dtype=torch.int64, device=device)
        self.context_lengths = torch.zeros(num_requests, dtype=torch.int64, device=device)
        self._ones = torch.ones(num_requests, 1, 1, dtype=torch.bool, device=device)
        self.set_accuracy(self.accuracy, self.second_choice)

    def set_accuracy(self, accuracy: float, second_choice: float | None = None) -> None:
        """Redraw the coin-flip tables (from ``seed``) for new probabilities, in place."""
        second_choice = self.second_choice if second_choice is None else second_choice
        self._check(accuracy, second_choice)
        self.accuracy, self.second_choice = float(accuracy), float(second_choice)
        if self.context_lengths is None:
            return  # setup_cache draws them
        shape, V = self.correct.shape, self.vocab_size
        g = torch.Generator().manual_seed(self.seed)
        self.correct.copy_(torch.rand(shape, generator=g) < self.accuracy)
        self.second.copy_(torch.rand(shape, generator=g) < self.second_choice)
        # wrong tokens as offsets 1..V-1 from the true token, so they never equal it
        self.wrong_offset.copy_(torch.randint(1, max(V, 2), shape, generator=g))
        # The oracle's beliefs, calibrated to its coin flips where the rank order allows:
        # P(first right) = accuracy, P(second right) = (1 - accuracy) * second_choice, the rest
        # spread over V - 2 tokens but kept e^-8 below the second (what the oracle drops stays
        # out of the tree); the first always on top.  A log-softmax follows: no normalisation.
        eps = 1e-6
        second = math.log(max((1 - self.accuracy) * self.second_choice, eps))
        first = max(math.log(max(self.accuracy, eps)), second + 0.01)
        rest = min(math.log(max((1 - self.accuracy) * (1 - self.second_choice), eps) / max(V - 2, 1)), second - 8)
        self.log_beliefs.copy_(torch.tensor([first, second, rest]))

    def reset_context(self, requests: torch.Tensor | None = None) -> None:
        if self.inner is not None:
            self.inner.reset_context(requests)
        if requests is None:
            self.context_lengths.zero_()
        else:
            self.context_lengths.masked_fill_(requests.to(self.context_lengths.device, torch.bool), 0)

    def append_context(self, taps, lengths=None, *, valid=None, indices=None) -> None:
        if self.inner is not None:
            self.inner.append_context(taps, lengths, valid=valid, indices=indices)
        if lengths is not None:
            counts = lengths
        elif valid is not None:
            counts = valid.sum(1)
        elif indices is not None:
            counts = (indices >= 0).sum(1)
        else:
            counts = taps.shape[1]
        if isinstance(counts, torch.Tensor):
            counts = counts.to(self.context_lengths.device, torch.int64)
        self.context_lengths.add_(counts)

    # ---- the look-ahead and the draft ----
    @torch.no_grad()
    def prepare(self, root_tokens: torch.Tensor, tree_pass=None, nodes: int = 0) -> None:
        """Decode the target's greedy tokens after each root into :attr:`continuation` [R, L].

        With ``tree_pass`` (the session's verify pass for the coming step's budget, ``nodes`` =
        budget + 1 rows; ``tree_pass(tokens [R, nodes], positions, visible [R, nodes, nodes]) ->
        (logits, taps)``): ``min(L, nodes - 1)`` passes over the chain root, t1, t2, ... (node i
        at position lengths + i, seeing nodes 0..i; the nodes past the chain's end repeat the
        root and are seen by none), token d + 1 the argmax at node d.  These are the verify's own
        greedy tokens: the same kernels, plan and row count, and node d sees what the tree's node
        on that path sees.  A greedy continuation decoded one token at a time rounds differently
        (other kernels); on a random target's flat logits the two part within a few tokens, and
        "accuracy" would then mean less against the verify, by an amount that depends on the GPU.
        A tree of ``nodes - 1`` drafts reaches no deeper than that: the deeper depths repeat the
        last token.  Without it: one-token passes, as a user calling ``prepare(root)`` gets.
        Either way the cache rows at lengths .. are overwritten by the next tree; the lengths
        stay as they were."""
        if self._cache is None:
            raise RuntimeError("OracleDrafter: attach(target, cache) first (the generation session does)")
        target, cache = self._target[0], self._cache
        tp = getattr(target, "tp", None)  # logits are this rank's vocabulary shard: the sharded argmax
        x = root_tokens
        tokens = []
        if tree_pass is not None and nodes >= 2:
            R, L = root_tokens.shape[0], self._block_size - 1
            t = torch.arange(nodes, device=root_tokens.device)
            visible = (t[:, None] >= t[None, :]).expand(R, nodes, nodes)
            positions = cache.lengths.long()[:, None] + t[None, :]
            ids = root_tokens[:, None].expand(R, nodes)
            for depth in range(min(L, nodes - 1)):
                logits = tree_pass(ids, positions, visible)[0]
                x = select_tokens(logits[:, depth : depth + 1], SamplingMode(), None, tp)[:, 0]
                tokens.append(x)
                ids = torch.where(t[None, :] == depth + 1, x[:, None], ids)
            tokens += [x] * (L - len(tokens))
            self.continuation.copy_(torch.stack(tokens, dim=1))
            return
        for depth in range(self._block_size - 1):
            logits = target(x[:, None], cache.lengths.long()[:, None], cache, self._ones).logits
            x = select_tokens(logits, SamplingMode(), None, tp)[:, 0]
            tokens.append(x)
            cache.lengths.add_(1)
        cache.lengths.sub_(self._block_size - 1)
        # one copy, not a column write per depth: inductor's C++ backend fails to compile those
        # (KeyError 'bufN' in its outer-loop fusion, pytorch/pytorch#196570, torch 2.14)
        self.continuation.copy_(torch.stack(tokens, dim=1))

    def forward(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, L, V] of the oracle's marginals around :attr:`continuation`
        (call :meth:`prepare` with the same roots first); under tensor parallelism this rank's
        vocabulary shard [R, L, V / world] of them."""
        R, L, V = root_tokens.shape[0], self._block_size - 1, self.vocab_size
        start, local = vocab_shard(getattr(self._target[0], "tp", None), self.vocab_size)
        true = self.continuation
        pos = self.context_lengths.clamp(max=self.correct.shape[1] - 1)
        rows = torch.arange(R, device=root_tokens.device)
        correct, second, offset = self.correct[rows, pos], self.second[rows, pos], self.wrong_offset[rows, pos]
        wrong = (true + offset) % V
        other_wrong = (true + offset % max(V - 1, 1) + 1) % V  # differs from wrong (and true) when V > 2
        first = torch.where(correct, true, wrong)
        runner_up = torch.where(correct, wrong, torch.where(second, true, other_wrong))
        lp_first, lp_second, lp_rest = self.log_beliefs.unbind()
        if self.inner is not None:  # the inner drafter's logits, squashed below the ranks set here
            logits = torch.sigmoid(self.inner(root_tokens).float()) + (lp_rest - 1)
            if logits.shape[-1] != local:
                raise ValueError(f"OracleDrafter: the inner drafter's logits cover {logits.shape[-1]} ids, this rank's "
                                 f"vocabulary shard {local}: parallelise the inner drafter over the target's mesh")
        else:
            logits = lp_rest.expand(R, L, local)
        # this rank's columns of the two ids set per depth (ids in other shards match no column)
        cols = torch.arange(start, start + local, device=logits.device)
        logits = torch.where(cols == runner_up[..., None], lp_second, logits)
        return torch.where(cols == first[..., None], lp_first, logits)


__all__ = ["OracleDrafter"]
