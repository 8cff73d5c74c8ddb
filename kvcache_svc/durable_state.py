"""kvcache_svc's state in Redis, so that a restarted service goes on where it stopped.

Every step is journaled before its answer leaves (the step as it arrived, and the offload tier's answers
it got), and every so many steps the whole state is written as a snapshot that replaces the journal. On
start, the snapshot is loaded and the journal replayed through the same manager code, which gives the
state exactly. A step that was served but never journaled was never answered either, so the scheduler
sends it again (see BlockStepRequest.planned_step_id); a journal that missed steps (Redis failed for a
while) is detected at the first call after the restart, and the state is dropped rather than trusted.
"""
from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable

from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve.step import BlockStepRequest

logger = logging.getLogger(__name__)

SNAPSHOT_EVERY_STEPS = 512


class DurableState:
    def __init__(self, client, namespace: str, snapshot_every: int = SNAPSHOT_EVERY_STEPS) -> None:
        self.client = client
        self.snapshot_key = f"{namespace}:kvcache:snapshot"
        self.journal_key = f"{namespace}:kvcache:journal"
        self.snapshot_every = snapshot_every
        self.journal_length = 0
        self.failed = False

    def restore(self, manager: KVCacheManager, decode: Callable[[bytes], BlockStepRequest]) -> int:
        """Loads the saved state into manager; returns the number of journaled steps replayed (-1: none)."""
        snapshot, entries = self.client.get(self.snapshot_key), self.client.lrange(self.journal_key, 0, -1)
        if snapshot is None and not entries:
            return -1
        try:
            if snapshot is not None:
                manager.import_state(json.loads(snapshot))
            for entry in entries:
                record = json.loads(entry)
                manager.step(decode(base64.b64decode(record["step"])), tier_answers=record["tier"])
        except (ValueError, KeyError) as error:
            logger.warning("saved block-manager state not usable (%s): starting empty", error)
            self.client.delete(self.snapshot_key, self.journal_key)
            return -1
        manager.restored()
        self.journal_length = len(entries)
        return len(entries)

    def record(self, manager: KVCacheManager, step: bytes) -> None:
        """Journals the step just served (before its answer is sent); snapshots when the journal is long."""
        if self.failed:
            return
        entry = json.dumps({"step": base64.b64encode(step).decode(), "tier": manager.tier_answers})
        try:
            if self.journal_length + 1 >= self.snapshot_every:
                pipe = self.client.pipeline(transaction=True)
                pipe.set(self.snapshot_key, json.dumps(manager.export_state()))
                pipe.delete(self.journal_key)
                pipe.execute()
                self.journal_length = 0
            else:
                self.client.rpush(self.journal_key, entry)
                self.journal_length += 1
        except Exception as error:  # any Redis failure: serve on, but the saved state can no longer be trusted
            self.failed = True
            logger.warning("block-manager state no longer saved to Redis (%s); a restart will start empty", error)
