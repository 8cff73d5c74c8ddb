"""Fewer, bigger updates to the frontends (`--stream-interval`, as vLLM's): a request's tokens are held until
it has gathered that many, so that the frontend detokenizes and sends one message per N tokens instead of one
per step. Its first tokens (time to first token) and its last (with the finish) always go at once.

Requests that start together would flush together, every Nth step, the frontend and its clients idle in
between and swamped then; so each request flushes at a phase of its own (from its id), and a step's messages
stay spread evenly over the steps.
"""
from __future__ import annotations

import functools
import zlib

from pagedserve.step import RequestOutput, join_run


class StreamInterval:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        # Per request: outputs not yet sent, oldest first, and how many tokens they hold.
        self.held: dict[str, tuple[list[RequestOutput], int]] = {}

    def release(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to send now (a request's held ones joined with its new one); holds back the rest."""
        if self.interval == 1:
            return outputs
        ready, held_by_id, interval = [], self.held, self.interval
        for output in outputs:
            entry = held_by_id.get(output.request_id)
            if entry is None:
                held, num_unsent = [output], len(output.new_token_ids)
            else:
                held, num_unsent = entry[0], entry[1] + len(output.new_token_ids)
                held.append(output)
            # Prompt logprobs go out with the first tokens; so do errors and refusals, which carry none.
            first = output.num_output_tokens == num_unsent
            if (output.finish_reason is not None or first or num_unsent >= interval
                    or (output.num_output_tokens + _phase(output.request_id, interval)) % interval == 0):
                if entry is not None:
                    del held_by_id[output.request_id]
                ready.append(join_run(held))
            else:
                held_by_id[output.request_id] = (held, num_unsent)
        return ready


@functools.lru_cache(maxsize=1 << 14)
def _phase(request_id: str, interval: int) -> int:
    """Kept: every step asks it of every request it holds."""
    return zlib.crc32(request_id.encode()) % interval
