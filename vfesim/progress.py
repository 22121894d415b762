"""Progress and logging: one switchable mechanism, the ``vfesim`` logger.

:class:`Progress` shows a tqdm bar (``tqdm.auto``: a terminal bar, a widget in Jupyter) with
steps/s, F and ETA. Where no bar can be drawn (output piped to a file) it sends a line to the
``vfesim`` logger every ``log_every_s`` seconds instead. ``enabled=False`` silences both.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "configure_logging", "log"]

log = logging.getLogger("vfesim")

# The widest a terminal bar may be: it must not wrap on an 80-column terminal.
MAX_COLUMNS = 80


def configure_logging(quiet: bool = False, verbose: bool = False, stream: TextIO | None = None) -> None:
    """Send ``vfesim`` log records to stderr (WARNING and up with ``quiet``, DEBUG with ``verbose``)."""
    log.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("vfesim: %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where ``tqdm.auto`` draws a widget); the test tqdm.auto uses."""
    ipython = sys.modules.get("IPython")
    try:
        return "IPKernelApp" in ipython.get_ipython().config
    except Exception:  # no IPython, or a plain IPython console
        return False


def _hms(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "--:--"
    s = int(round(seconds))
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Steps done out of ``total``, with rate, current free energy and ETA.

    enabled: None -> a bar on a terminal or in Jupyter, else log lines when the logger shows INFO;
    True -> a bar on ``stream`` always; False -> nothing.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        log_every_s: float = 10.0,
    ):
        self.total, self.initial, self.done = total, initial, initial
        self.stream = stream or sys.stderr
        notebook = in_notebook() and stream is None
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled is None:
            bar = tty or notebook
            enabled = bar or log.isEnabledFor(logging.INFO)
        else:
            bar = enabled
        self.enabled = enabled
        self.log_every_s = log_every_s
        self.t0 = self._last = time.perf_counter()
        self.F = float("nan")
        self.bar = None
        if bar:
            self.bar = self._tqdm(notebook)

    def _tqdm(self, notebook: bool):
        if notebook:
            from tqdm.auto import tqdm

            return tqdm(total=self.total, initial=self.initial, unit="step")
        from tqdm import tqdm

        # shutil falls back to 80 x 24 where the terminal reports no size (tqdm would draw nothing).
        size = shutil.get_terminal_size((MAX_COLUMNS, 24))
        return tqdm(
            total=self.total,
            initial=self.initial,
            unit="step",
            file=self.stream,
            ncols=min(MAX_COLUMNS, size.columns),
            nrows=size.lines,
        )

    def text(self) -> str:
        """One log line: steps done, rate, F, ETA."""
        elapsed = time.perf_counter() - self.t0
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else float("nan")
        eta = (self.total - self.done) / rate if rate and rate == rate else float("nan")
        frac = self.done / self.total if self.total else 1.0
        return (
            f"step {self.done}/{self.total} ({100 * frac:3.0f}%) {rate:.1f} steps/s "
            f"F={self.F:.6g} ETA {_hms(eta)}"
        )

    def update(self, step: int, F: float | None = None) -> None:
        if F is not None:
            self.F = F
        if self.bar is not None:
            self.bar.set_postfix_str(f"F={self.F:.6g}", refresh=False)
            self.bar.update(step - self.done)
        self.done = step
        if not self.enabled or self.bar is not None:
            return
        now = time.perf_counter()
        if now - self._last >= self.log_every_s:
            self._last = now
            log.info(self.text())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.done > self.initial:
            log.info(self.text())
