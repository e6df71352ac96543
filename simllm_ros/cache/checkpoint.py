"""Background checkpoints of the KV pool: a SIGKILL loses at most the last `persist_interval_s`.

Why it exists: the pool is saved at cleanup, but a process can die without one (SIGKILL after a
launch file's escalation timeout, OOM killer, power loss). A daemon thread saves the pool every
interval when it changed (the pool counts its mutations), through the same atomic save as
cleanup: the pool lock is held only while the tensors are copied, and the file is written and
fsynced off the lock, so generation is not held up by the write. `checkpoint()` saves at once (the
node calls it when a stop begins, before waiting for the answers in flight). Saves into one folder
are serialised by persistence, so a checkpoint and the final save never interleave.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

TICK_S = 1.0  # the thread re-reads the interval at least this often (it changes live)


class Checkpointer:
    """save(only_if_changed) -> path or None; interval_s() -> seconds (0 disables the background saves)."""

    def __init__(self, save: Callable[[bool], str | None], interval_s: Callable[[], float],
                 log: logging.Logger | None = None):
        self._save = save
        self._interval_s = interval_s
        self.log = log or logging.getLogger("simllm_ros.checkpoint")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = time.monotonic()
        self._last_error = ""
        self.saves = 0  # checkpoints written (not counting skipped, unchanged ones)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="simllm-checkpoint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread; a save in progress finishes first."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

    def checkpoint(self, why: str) -> str | None:
        """Save now if the pool changed since the last save; never raises (a failure is logged)."""
        try:
            path = self._save(True)
        except Exception as e:
            msg = f"{why}: pool checkpoint failed: {type(e).__name__}: {e}"
            if msg != self._last_error:  # the same failure every interval is logged once
                self.log.error(msg)
                self._last_error = msg
            return None
        self._last = time.monotonic()
        self._last_error = ""
        if path:
            self.saves += 1
        return path

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                interval = float(self._interval_s())
            except Exception:
                interval = 0.0
            if interval > 0 and time.monotonic() - self._last >= interval:
                t0 = time.monotonic()
                path = self.checkpoint("background")
                if path:
                    self.log.info(f"pool checkpointed to {path} in {time.monotonic() - t0:.2f} s")
