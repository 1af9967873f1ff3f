"""An oracle drafter for tests and benchmarks: it knows the target's own greedy continuation.

Each draft call first decodes the target greedily for L = block_size - 1 tokens after the root,
in place on the generation's paged cache (at the positions the tree will overwrite next, with
the committed lengths restored afterwards), so the continuation always follows the actual
prefix, whatever was generated before.  Its per-depth marginals then put, at depth d:

- with probability ``accuracy``: the true token first (probability ``accuracy``), a wrong token
  second;
- otherwise a wrong token first; the true token second with probability ``second_choice``
  (the tree can still recover it through a sibling), else nowhere near the top.

The coin flips come from tables drawn once from ``seed`` and indexed by (request, position of
the root, depth), so a run is reproducible and each step's draws are fresh.  Everything has a
fixed shape and stays on the device: the oracle sits inside the same captured step as a real
drafter.  With ``inner`` (a DFlash drafter) the inner drafter also runs and its logits fill the
ranks the oracle does not set, so a benchmark pays a real drafter's cost.

With ``accuracy=1`` every step accepts the full depth (the greedy chain is the tree's spine)
whenever the budget covers it: B >= L accepts L + 1 tokens, B < L accepts B + 1.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class OracleDrafter(nn.Module):
    """Drafter protocol of :class:`~torch_kdtree.models.DFlashDraftModel` (``block_size``,
    ``target_layer_ids``, ``setup_cache``, ``append_context``, ``reset_context``, ``forward``)
    plus :meth:`attach`, which the generation session calls with its target and cache.

    Args:
        target: the :class:`KimiK2ForCausalLM` being decoded (its greedy continuation is drafted).
        block_size: bs; L = bs - 1 draft depths (ignored with ``inner``: the inner's is used).
        accuracy: probability that a depth's top choice is the target's greedy token.
        second_choice: probability that a wrong top choice has the true token second.
        seed: seeds the coin-flip tables.
        inner: optional drafter run alongside (cost realism); its taps and context are kept.
    """

    def __init__(self, target, block_size: int = 8, accuracy: float = 1.0, *, second_choice: float = 0.5,
                 seed: int = 0, inner: nn.Module | None = None):
        super().__init__()
        if not 0.0 <= accuracy <= 1.0 or not 0.0 <= second_choice <= 1.0:
            raise ValueError(f"OracleDrafter: accuracy and second_choice must be in [0, 1], got {accuracy}, "
                             f"{second_choice}")
        self._target = [target]  # a list: not a submodule (no parameters, no .to() of the target)
        self.inner = inner
        self._block_size = inner.block_size if inner is not None else int(block_size)
        if self._block_size < 2:
            raise ValueError(f"OracleDrafter: block_size must be >= 2 (one draft depth), got {self._block_size}")
        self.accuracy, self.second_choice, self.seed = float(accuracy), float(second_choice), int(seed)
        self.vocab_size = target.config.vocab_size
        self._cache = None
        self.register_buffer("context_lengths", None, persistent=False)

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
            raise ValueError("OracleDrafter: attached to a different target than it was built for")
        self._cache = cache

    def bind_target(self, embed_tokens, lm_head) -> "OracleDrafter":
        if self.inner is not None:
            self.inner.bind_target(embed_tokens, lm_head)
        return self

    def setup_cache(self, num_requests: int, capacity: int, *, device=None) -> None:
        """Context length counters and the coin-flip tables for ``capacity`` root positions."""
        if self.inner is not None:
            self.inner.setup_cache(num_requests, capacity, device=device)
        device = torch.device(device) if device is not None else self._target[0].device
        L, V = self._block_size - 1, self.vocab_size
        g = torch.Generator().manual_seed(self.seed)
        shape = (num_requests, capacity + 1, L)
        correct = torch.rand(shape, generator=g) < self.accuracy
        second = torch.rand(shape, generator=g) < self.second_choice
        # wrong tokens as offsets 1..V-1 from the true token, so they never equal it
        self.wrong_offset = torch.randint(1, max(V, 2), shape, generator=g).to(device)
        self.correct, self.second = correct.to(device), second.to(device)
        self.context_lengths = torch.zeros(num_requests, dtype=torch.int64, device=device)
        self._ones = torch.ones(num_requests, 1, 1, dtype=torch.bool, device=device)
        # The oracle's beliefs, calibrated to its coin flips where the rank order allows it:
        # P(first is right) = accuracy, P(second is right) = (1 - accuracy) * second_choice, the
        # rest spread over V - 2 tokens, kept far below both (e^-8), so that what the oracle
        # drops stays out of the tree; the first choice always stays on top (a log-softmax
        # follows, so these need not be normalised).
        eps = 1e-6
        self._lp_second = math.log(max((1 - self.accuracy) * self.second_choice, eps))
        self._lp_first = max(math.log(max(self.accuracy, eps)), self._lp_second + 0.01)
        rest = max((1 - self.accuracy) * (1 - self.second_choice), eps) / max(V - 2, 1)
        self._lp_rest = min(math.log(rest), self._lp_second - 8)

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

    @torch.no_grad()
    def greedy_continuation(self, root: torch.Tensor) -> torch.Tensor:
        """int64 [R, L]: the target's greedy tokens after the root, decoded one at a time at the
        cache positions lengths .. lengths + L - 1 (overwritten by the next tree), lengths restored."""
        if self._cache is None:
            raise RuntimeError("OracleDrafter: attach(target, cache) first (the generation session does)")
        target, cache, L = self._target[0], self._cache, self._block_size - 1
        x, out = root, []
        for _ in range(L):
            logits = target(x[:, None], cache.lengths.long()[:, None], cache, self._ones).logits[:, 0]
            x = logits.argmax(-1)
            out.append(x)
            cache.lengths.add_(1)
        cache.lengths.sub_(L)
        return torch.stack(out, 1)

    def forward(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits [R, L, V] (log-probabilities up to a constant) of the oracle's marginals."""
        R, L, V = root_tokens.shape[0], self._block_size - 1, self.vocab_size
        true = self.greedy_continuation(root_tokens)  # [R, L]
        pos = self.context_lengths.clamp(max=self.correct.shape[1] - 1)
        rows = torch.arange(R, device=root_tokens.device)
        correct, second, offset = self.correct[rows, pos], self.second[rows, pos], self.wrong_offset[rows, pos]
        wrong = (true + offset) % V
        other_wrong = (true + offset % max(V - 1, 1) + 1) % V  # differs from wrong (and true) when V > 2
        first = torch.where(correct, true, wrong)
        runner_up = torch.where(correct, wrong, torch.where(second, true, other_wrong))
        if self.inner is not None:  # the inner drafter's logits, squashed below the ranks set here
            logits = torch.sigmoid(self.inner(root_tokens).float()) + (self._lp_rest - 1)
        else:
            logits = torch.full((R, L, V), self._lp_rest, dtype=torch.float32, device=root_tokens.device)
        logits = logits.scatter(-1, runner_up[..., None], self._lp_second)
        return logits.scatter(-1, first[..., None], self._lp_first)


__all__ = ["OracleDrafter"]
