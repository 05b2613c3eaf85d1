"""A cap on the UI thread's busy time, so that drawing streamed text takes little from the engine.

The engine's loop runs Python between its kernels, in this process: whatever time the UI thread spends holding the
GIL (or a core) is time the loop may wait. Each batch of text costs the UI a layout and a repaint of the screen,
whatever its length, so the panes collect text and draw it in larger batches once the UI has spent its share. The
share is a bucket of UI thread time: it fills at `share` seconds a second (holding at most `burst_s`), all the
thread's busy time drains it, and text is drawn while it holds some, or at the latest after `max_wait_s`.
Keystrokes are never held back: only the drawing of streamed text waits.
"""

from __future__ import annotations

import time


class RenderBudget:
    def __init__(self, share: float, burst_s: float = 0.25, max_wait_s: float = 5.0):
        self.share, self.burst_s, self.max_wait_s = share, burst_s, max_wait_s
        self.credit = burst_s  # seconds of UI thread time still to spend
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self._allowed = self._wall

    def allows(self) -> bool:
        """Call from the UI thread once per tick: whether to draw this tick."""
        wall, cpu = time.perf_counter(), time.thread_time()
        self.credit = min(self.burst_s, self.credit + self.share * (wall - self._wall) - (cpu - self._cpu))
        self._wall, self._cpu = wall, cpu
        if self.credit >= 0 or wall - self._allowed >= self.max_wait_s:
            self._allowed = wall
            return True
        return False
