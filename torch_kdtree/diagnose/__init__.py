"""Decode-throughput diagnostics for DDTree speculative decoding (issue 49):
``python -m torch_kdtree.diagnose --help``, or ``diagnose([...argv])`` for the result object.

Why is sustained decoding slower than a short benchmark says?  The two-point burst method (time
for 8 vs 264 new tokens from the same prompt) sees only the first 256 tokens; over a long
generation acceptance can fall and the step grows with the context.  This measures both methods
against context length, and splits any change of tokens/s exactly into its two factors,
Δlog(tokens/s) = Δlog(acceptance) − Δlog(step time).

- ``analysis``: the arithmetic on plain numbers (rates, the split, fits, acceptance statistics);
- ``pair``: the target and drafter (``default_pair()``: the shipped pair once it exists, issue 48;
  the tiny random pair until then), the oracle drafter, the prompt;
- ``measure``: bursts, step timings, profiled steps and the sustained run on one
  ``GenerationSession``;
- ``report`` / ``plots`` / ``compare`` / ``cli``: the JSON object and CSV files (keys in
  ``report``'s docstring), the summary, the PNG plots, ``--compare``, the command line.
"""
from .analysis import Rate, by_depth, by_position, fit_line, histogram, split, step_fit
from .cli import diagnose, main
from .compare import compare
from .pair import default_pair

__all__ = ["diagnose", "main", "compare", "default_pair", "Rate", "split", "fit_line", "step_fit", "histogram",
           "by_depth", "by_position"]
