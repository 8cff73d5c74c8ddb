"""Stop strings on streamed text: emit only what no stop string can still claim, and cut at a match.

A stop string may arrive split over several deltas, so the matcher holds back the longest tail that
is the start of some stop string; text is never emitted and then retracted. The match that counts is
the one completed first (smallest end in the text), as if the text came one character at a time, so
the result does not depend on how the text was cut into deltas; of matches ending at the same place
the longest wins, so the output is cut at the earliest point.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        # Non-empty strings, as SamplingParams checks: an empty one would match before any text.
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped = False
        self.matched_stop: str | None = None
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has matched).

        After a match the request is over: later calls return ("", True).
        """
        if self.stopped:
            return "", True
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, end = match
            self.stopped, self.matched_stop, self._held = True, text[start:end], ""
            return text[:end] if self.include_stop_str_in_output else text[:start], True
        cut = len(text) - self._partial_match_len(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """Releases the held-back tail, for a request that ended for another reason."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, int] | None:
        # The held tail holds no complete match, so any match found ends in the new delta.
        best: tuple[int, int] | None = None  # (end, -length) to minimise
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best):
                best = (i + len(s), -len(s))
        return None if best is None else (best[0] + best[1], best[0])

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            # Candidate starts: occurrences of s[0] among the last len(s) - 1 characters, left of
            # the longest tail found so far; the earliest that fits gives the longest tail.
            lo, hi = max(len(text) - len(s) + 1, 0), len(text) - longest
            j = text.find(s[0], lo, hi)
            while j != -1:
                if s.startswith(text[j:]):
                    longest = len(text) - j
                    break
                j = text.find(s[0], j + 1, hi)
        return longest
