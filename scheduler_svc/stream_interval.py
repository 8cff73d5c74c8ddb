"""Fewer, bigger updates to the frontends (`--stream-interval`, as vLLM's): a request's tokens are held until
it has gathered that many, so that the frontend detokenizes and sends one message per N tokens instead of one
per step. Its first tokens (time to first token) and its last (with the finish) always go at once.

Requests that start together would flush together, every Nth step, the frontend and its clients idle in
between and swamped then; so each request flushes at a phase of its own (from its id), and a step's messages
stay spread evenly over the steps.
"""
from __future__ import annotations

import zlib

from pagedserve.step import RequestOutput, join_outputs


class StreamInterval:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.held: dict[str, list[RequestOutput]] = {}  # per request: outputs not yet sent, oldest first

    def release(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to send now (a request's held ones joined with its new one); holds back the rest."""
        if self.interval == 1:
            return outputs
        ready = []
        for output in outputs:
            held = self.held.pop(output.request_id, [])
            held.append(output)
            num_unsent = sum(len(o.new_token_ids) for o in held)
            # Prompt logprobs go out with the first tokens; so do errors and refusals, which carry none.
            first = output.num_output_tokens == num_unsent
            if (output.finished or first or num_unsent >= self.interval
                    or (output.num_output_tokens + self._phase(output.request_id)) % self.interval == 0):
                ready.extend(join_outputs(held))
            else:
                self.held[output.request_id] = held
        return ready

    def _phase(self, request_id: str) -> int:
        return zlib.crc32(request_id.encode()) % self.interval
