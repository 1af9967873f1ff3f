"""Diagnostics, not benchmarks: profilers, tracers, an A/B driver and compute-sanitizer drivers.

Run from the repository root (``python -m tools.profile_decode``, ``python tools/<script>.py``);
the decode tools reuse bench/bench_generate.py's configurations and random models.
"""
