"""The measurements, on one :class:`GenerationSession` holding the autoregressive step (budget 0)
and the tree step (budget B), batch 1, generation never stopped by EOS:

- burst: per context, ``prefill + run`` for ``burst_short`` and ``burst_long`` new tokens from the
  same prompt, ``repeats`` times, as ``generate`` runs them (graph replays in segments of
  ``sync_every`` steps); the time is the session's own (inside the steps: no prefill, no oracle
  look-ahead), and the wall clock is kept beside it;
- step timing: per context, the mean AR and tree step over ``timing_steps`` steps right after a
  prefill (the fit of step time against context), then ``profile_steps`` eager steps of each
  with per-phase times;
- sustained: one generation of ``sustained_tokens`` from a ``prompt_length`` prompt, timed in
  windows of ``window_steps`` steps, with every step's accept length.

Numbers only; :mod:`.report` turns them into rates, splits and fits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .progress import Progress


@dataclass
class Settings:
    contexts: list[int]
    prompt_length: int
    burst_short: int = 8
    burst_long: int = 264
    repeats: int = 5
    sustained_tokens: int = 4096
    window_steps: int = 32
    timing_steps: int = 32
    profile_steps: int = 4
    tree_budget: int = 16
    oracle_accuracy: float | None = None
    oracle_accuracy_end: float | None = None
    cuda_graphs: bool = True
    compile_step: bool | str = False


class _Fixed:
    """One budget for :meth:`GenerationSession.run` (no planning)."""

    segment_steps = None

    def __init__(self, budget: int):
        self.current = budget

    def observe(self, *args, **kwargs) -> None:
        pass


def _bucket(n: int, step: int = 64) -> int:
    return -(-n // step) * step


class Measurer:
    def __init__(self, target, drafter, prompt: torch.Tensor, settings: Settings):
        from torch_kdtree.models.generation import GenerationSession

        self.s = settings
        self.target, self.drafter, self.prompt = target, drafter, prompt
        self.device = target.device
        self.L = drafter.block_size - 1
        self.B = settings.tree_budget
        # enough new tokens for the timing and profiled steps: every step may emit L + 1
        self.timing_new = (2 * settings.timing_steps + 2 * settings.profile_steps + 2) * (self.L + 1) + 2
        max_new = max(settings.burst_long, settings.sustained_tokens, self.timing_new)
        self.session = GenerationSession(target, drafter, batch_size=1,
                                         max_prompt=_bucket(max(max(settings.contexts), settings.prompt_length)),
                                         max_new=_bucket(max_new), budgets=(0, self.B),
                                         cuda_graphs=settings.cuda_graphs, compile_step=settings.compile_step)

    # ---------------------------------------------------------------------------- helpers
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill(self, context: int, max_new: int) -> None:
        ids = self.prompt[:context][None]
        self.session.prefill(ids, torch.tensor([context]), max_new=max_new, eos=[])

    def _set_accuracy(self, accuracy: float | None) -> None:
        if accuracy is not None:
            self.drafter.set_accuracy(accuracy)

    # ---------------------------------------------------------------------------- burst
    def burst_once(self, context: int, new_tokens: int) -> dict:
        """prefill + decode ``new_tokens`` from the first ``context`` prompt tokens."""
        self._sync()
        start = time.perf_counter()
        self._prefill(context, new_tokens)
        run = self.session.run(_Fixed(self.B))
        self._sync()
        wall = time.perf_counter() - start
        return {"new_tokens": new_tokens, "steps": len(run["budgets"]), "seconds": run["step_seconds"],
                "wall_seconds": wall}

    def burst(self, context: int, progress: Progress) -> list[dict]:
        """``repeats`` pairs (short, long), alternating so that drift hits both alike."""
        self._set_accuracy(self.s.oracle_accuracy)
        pairs = []
        for _ in range(self.s.repeats):
            short = self.burst_once(context, self.s.burst_short)
            progress.update()
            long = self.burst_once(context, self.s.burst_long)
            progress.update()
            pairs.append({"short": short, "long": long})
        return pairs

    # ---------------------------------------------------------------------------- step timing
    def step_timing(self, context: int) -> dict:
        """Mean AR and tree step (s) after a prefill of ``context`` tokens, the tree steps' accept
        lengths, and per-phase times (ms) of eager steps of each."""
        self._set_accuracy(self.s.oracle_accuracy)
        session, k = self.session, self.s.timing_steps
        self._prefill(context, self.timing_new)
        session.step(0)  # first step after a prefill off the clock
        ar = session.time_steps(0, k)
        session.step(self.B)
        first = int(session.step_no)
        tree = session.time_steps(self.B, k)
        accepts = session.accept_log[first : first + k, 0].tolist()
        tree_phases = [session.profile_step(self.B) for _ in range(self.s.profile_steps)]
        ar_phases = [session.profile_step(0) for _ in range(self.s.profile_steps)]
        return {"context": context, "ar_seconds": ar, "tree_seconds": tree, "tree_accepts": accepts,
                "tree_phases": _mean_phases(tree_phases), "ar_phases": _mean_phases(ar_phases)}

    # ---------------------------------------------------------------------------- sustained
    def accuracy_at(self, position: int) -> float | None:
        """The oracle's accuracy at a response position: ``oracle_accuracy`` drifting linearly to
        ``oracle_accuracy_end`` over the sustained generation (a synthetic "harder text")."""
        a, b = self.s.oracle_accuracy, self.s.oracle_accuracy_end
        if a is None or b is None:
            return a
        # position 1 is the first token after the prefill's
        return a + (b - a) * min(1.0, max(0, position - 1) / max(1, self.s.sustained_tokens - 1))

    def sustained(self, progress: Progress) -> dict:
        """One generation of ``sustained_tokens`` tokens, timed per window; every window's steps,
        seconds, tokens, contexts and accept lengths."""
        session, N = self.session, self.s.sustained_tokens
        self._set_accuracy(self.s.oracle_accuracy)
        self._prefill(self.s.prompt_length, N)
        windows = []
        while (remaining := session.remaining()) > 0:
            position = min(int(session.out_len[0]), N)
            accuracy = self.accuracy_at(position)
            if self.s.oracle_accuracy_end is not None:
                self._set_accuracy(accuracy)
            # never more steps than tokens left: each step emits >= 1, so no step runs idle but the last few
            steps = min(self.s.window_steps, remaining)
            first, context = int(session.step_no), int(session.cache.lengths[0])
            seconds = session.time_steps(self.B, steps)
            accepts = session.accept_log[first : first + steps, 0].tolist()
            end = min(int(session.out_len[0]), N)
            windows.append({"position_start": position, "position_end": end, "context_start": context,
                            "context_end": int(session.cache.lengths[0]), "steps": steps,
                            "seconds": seconds * steps, "tokens": end - position, "accepts": accepts,
                            "oracle_accuracy": accuracy})
            progress.update(end - position)
        return {"prompt_length": self.s.prompt_length, "new_tokens": N, "windows": windows}


def _mean_phases(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k.endswith("_ms")] if rows else []
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


__all__ = ["Settings", "Measurer"]
