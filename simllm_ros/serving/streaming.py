"""Follows an answer as the decode loop commits tokens: stop strings, throttled progress, cancellation.

The engine hands `on_token` and `should_stop` of one AnswerWatcher to the decode loop
(decoding.generate polls should_stop after every committed token, so a cancel or a stop
string ends the answer within one decode pass). Progress goes to a streaming transport
(the action's feedback) at most once per `interval_s`, always with the whole text so far.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ..request import CacheResult, Progress

FEEDBACK_INTERVAL_S = 0.05  # at most one progress message per 50 ms


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string begins in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _visible(text: str) -> str:
    """Text so far without a trailing half character (a multi-byte character split across tokens)."""
    return text.rstrip("\ufffd")


class AnswerWatcher:
    def __init__(self, detokenize: Callable[[list[int]], str], *, stop: Sequence[str] = (),
                 on_progress: Callable[[Progress], None] | None = None,
                 cancelled: Callable[[], bool] | None = None, cache_result: CacheResult = CacheResult.MISS,
                 interval_s: float = FEEDBACK_INTERVAL_S):
        self._detokenize = detokenize
        self.stop = [s for s in stop if s]
        self._on_progress = on_progress
        self._cancelled = cancelled
        self.cache_result = cache_result
        self.interval_s = interval_s
        self.stop_hit = False  # a stop string appeared in the answer
        self.cancelled = False  # the caller cancelled
        self._last_emit = -1.0
        self.progress_sent = 0

    def on_token(self, tokens: list[int]) -> None:
        text = None
        if self.stop:
            text = self._detokenize(tokens)
            if find_stop(text, self.stop) is not None:
                self.stop_hit = True
        if self._on_progress is not None:
            now = time.monotonic()
            if self._last_emit < 0 or now - self._last_emit >= self.interval_s:
                self._last_emit = now
                self.progress(self._detokenize(tokens) if text is None else text, len(tokens))

    def progress(self, text: str, n_tokens: int) -> None:
        """Send the answer so far (cut at a stop string) to the transport; never raises into the decoder."""
        if self._on_progress is None:
            return
        try:
            self._on_progress(Progress(_visible(self.final_text(text)), n_tokens, self.cache_result))
            self.progress_sent += 1
        except Exception:
            pass

    def should_stop(self) -> bool:
        if self.stop_hit:
            return True
        if self._cancelled is not None and self._cancelled():
            self.cancelled = True
            return True
        return False

    def final_text(self, text: str) -> str:
        """The answer as returned: cut before the first stop string."""
        if self.stop:
            i = find_stop(text, self.stop)
            if i is not None:
                return text[:i].rstrip()
        return text
