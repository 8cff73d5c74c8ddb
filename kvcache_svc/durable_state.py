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
    def __init__(self, client, namespace: str, snapshot_every: int = SNAPSHOT_EVERY_STEPS, pool: str = "") -> None:
        """pool: whose state (an executor's address, with several); one executor's keys name none."""
        self.client = client
        prefix = f"{namespace}:kvcache:{pool}:" if pool else f"{namespace}:kvcache:"
        self.snapshot_key = f"{prefix}snapshot"
        self.journal_key = f"{prefix}journal"
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

    def discard(self) -> None:
        """Forgets the saved state: the pool it described is gone (a new executor instance starts empty)."""
        try:
            self.client.delete(self.snapshot_key, self.journal_key)
        except Exception as error:
            self.failed = True
            logger.warning("block-manager state no longer saved to Redis (%s); a restart will start empty", error)
        self.journal_length = 0

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


class RegistrationStore:
    """The executors' registrations in Redis, each a key that expires unless renewed by a heartbeat, so that a
    restarted KV-cache service knows, before they beat again, which executors it served (and restores their
    pools before the scheduler's next call, rather than report their requests lost)."""

    def __init__(self, client, namespace: str, ttl_s: float) -> None:
        self.client = client
        self.prefix = f"{namespace}:kvcache:executor:"
        self.ttl_ms = max(int(ttl_s * 1000), 1)

    def save(self, address: str, registration: bytes) -> None:
        try:
            self.client.set(self.prefix + address, registration, px=self.ttl_ms)
        except Exception as error:  # the registry in memory goes on; only a restart would miss this one
            logger.warning("executor registration not saved to Redis (%s)", error)

    def drop(self, address: str) -> None:
        try:
            self.client.delete(self.prefix + address)
        except Exception as error:
            logger.warning("executor registration not removed from Redis (%s)", error)

    def load(self) -> list[bytes]:
        """The registrations still live."""
        found = []
        for key in self.client.scan_iter(match=self.prefix + "*"):
            value = self.client.get(key)
            if value is not None:
                found.append(value)
        return found
