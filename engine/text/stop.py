"""Stop strings over streamed text: hold back what might start one, cut at the first.

Torch-free, pure Python.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces.

    Generation ends where the first stop string *completes* (the earliest end, and of
    those the earliest start), so the result does not depend on how the text was
    split into pieces. The output is the text before that stop string; the stop string
    and anything after it are never emitted.

    Args:
        stops: the stop strings (OpenAI's ``stop``); may be empty.
    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, stops: list[str]) -> None:
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))
        # A held tail is always shorter than the longest stop string.
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        """Whether a stop string has completed (:attr:`matched` names it)."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Take the next piece of text.

        Returns:
            ``(safe_text, stopped)``: the text that can be emitted now, and whether a
            stop string completed (then nothing more will be emitted; later calls
            return ``("", True)``).
        """
        if self._stopped:
            return "", True
        buf = self._held + text
        cut = self._first_stop(buf)
        if cut is not None:
            self._held = ""
            self._stopped = True
            return buf[:cut], True
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Return the held-back text when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buf: str) -> int | None:
        """Start index of the stop string that completes first in ``buf`` (kept in
        :attr:`matched`), or None."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is None:
            return None
        self.matched = best[2]
        return best[1]

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that some stop string starts with."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0
