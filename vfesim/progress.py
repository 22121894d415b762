"""Progress and logging: one switchable mechanism, the ``vfesim`` logger.

On a terminal, :class:`Progress` redraws one status line on stderr (steps/s, F, ETA); elsewhere it
sends a line to the ``vfesim`` logger every ``log_every_s`` seconds. ``enabled=False`` silences both.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

__all__ = ["Progress", "configure_logging", "log"]

log = logging.getLogger("vfesim")


def configure_logging(quiet: bool = False, verbose: bool = False, stream: TextIO | None = None) -> None:
    """Send ``vfesim`` log records to stderr (WARNING and up with ``quiet``, DEBUG with ``verbose``)."""
    log.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("vfesim: %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def _hms(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "--:--"
    s = int(round(seconds))
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Steps done out of ``total``, with rate, current free energy and ETA.

    enabled: None -> on when ``stream`` is a TTY (a bar) or the logger shows INFO (log lines).
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        width: int = 24,
        log_every_s: float = 10.0,
    ):
        self.total, self.initial, self.done = total, initial, initial
        self.stream = stream or sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled is None:
            enabled = tty or log.isEnabledFor(logging.INFO)
        self.enabled = enabled
        self.bar = enabled and tty
        self.width = width
        self.log_every_s = log_every_s
        self.t0 = self._last = time.perf_counter()
        self._drawn = 0.0
        self.F = float("nan")

    def text(self) -> str:
        elapsed = time.perf_counter() - self.t0
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else float("nan")
        eta = (self.total - self.done) / rate if rate and rate == rate else float("nan")
        frac = self.done / self.total if self.total else 1.0
        return (
            f"step {self.done}/{self.total} ({100 * frac:3.0f}%) {rate:8.1f} steps/s "
            f"F={self.F:.6g} ETA {_hms(eta)}"
        )

    def update(self, step: int, F: float | None = None) -> None:
        self.done = step
        if F is not None:
            self.F = F
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.bar:
            if now - self._drawn >= 0.1 or step >= self.total:
                self._drawn = now
                n = int(self.width * (self.done / self.total if self.total else 1))
                bar = "#" * n + "-" * (self.width - n)
                self.stream.write(f"\r[{bar}] {self.text()}\x1b[K")
                self.stream.flush()
        elif now - self._last >= self.log_every_s:
            self._last = now
            log.info(self.text())

    def close(self) -> None:
        if self.enabled and self.bar:
            self.stream.write("\n")
            self.stream.flush()
        elif self.enabled and self.done > self.initial:
            log.info(self.text())
