"""StopStringMatcher: cuts streamed text just before the first stop string."""

from __future__ import annotations


class StopStringMatcher:
    """Fed text deltas, emits the text that can no longer be part of a stop string.

    Text that might still begin a stop string is held back, so a stop string spanning many deltas is
    never emitted even in part; the emitted text ends right before the earliest stop string.
    """

    def __init__(self, stops: list[str]):
        # An empty stop string would match everywhere; the API treats it as absent.
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.stop: str | None = None  # the stop string that ended the text
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to emit now, whether a stop string has completed)."""
        if self.stopped:
            return "", True
        text = self._held + delta
        # Every earlier stop candidate was held back, so any match lies inside `text`.
        matches = [(i + len(s), i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if matches:
            # The stop that completes first wins, so the result does not depend on how text was split.
            _, start, self.stop = min(matches, key=lambda m: (m[0], m[1]))
            self.stopped, self._held = True, ""
            return text[:start], True
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of generation, return the held text (nothing if a stop string matched)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
