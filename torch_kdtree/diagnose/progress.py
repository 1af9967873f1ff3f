"""A progress bar on stderr: tqdm when it is installed, else a plain one."""
from __future__ import annotations

import sys
import time


class Progress:
    """``update(n)`` / ``close()``; silent with ``enabled=False``."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, unit: str = "it"):
        self.total, self.desc, self.unit, self.done = max(1, total), desc, unit, 0
        self._bar = None
        self._enabled = enabled
        self._last = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._draw()
            return
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._enabled and (time.monotonic() - self._last > 0.2 or self.done >= self.total):
            self._draw()

    def _draw(self) -> None:
        self._last = time.monotonic()
        share = min(1.0, self.done / self.total)
        bar = "#" * int(30 * share)
        print(f"\r{self.desc}: [{bar:30s}] {self.done}/{self.total} {self.unit}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            self._draw()
            print(file=sys.stderr)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Progress"]
