"""The block manager's state in Redis: a restarted manager replays the journal (and snapshot) to exactly the
state it had, serves on with outputs unchanged, and drops a state that missed steps instead of trusting it."""
from __future__ import annotations

import pytest

from kvcache_svc.durable_state import DurableState
from kvcache_svc.kv_cache_manager import KVCacheManager
from pagedserve import convert
from pagedserve.v1 import kvcache_pb2
from tests.unit.test_step_failures import BLOCK_SIZE, Engine, prompt


def decode(data: bytes):
    return convert.block_step_request_from_proto(kvcache_pb2.BlockStepRequest.FromString(data))


class DurableEngine(Engine):
    """The in-process engine, with every block-manager call journaled as kvcache_svc journals it."""

    def __init__(self, client, snapshot_every: int) -> None:
        super().__init__(num_blocks=24)
        self.durable = DurableState(client, "test", snapshot_every=snapshot_every)
        self.journaling = True

    def allocate(self, request):
        result = super().allocate(request)
        if self.journaling:
            self.durable.record(self.manager, convert.block_step_request_to_proto(request).SerializeToString())
        return result

    def restart_block_manager(self, client) -> int:
        fresh = KVCacheManager(24, BLOCK_SIZE, model_id="test")
        self.durable = DurableState(client, "test", snapshot_every=self.durable.snapshot_every)
        replayed = self.durable.restore(fresh, decode)
        self.manager = self.executor.manager = self.executor.inner.block_manager = fresh
        return replayed


def load(engine: DurableEngine, count: int = 6) -> list[str]:
    shared = prompt(99, 12)
    ids = [f"r{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        engine.add(request_id, shared + prompt(i, 5 + i))
    return ids


@pytest.mark.parametrize("snapshot_every", [1000, 5])
def test_a_restarted_block_manager_resumes_exactly_where_it_stopped(redis_server, snapshot_every):
    engine = DurableEngine(redis_server.client, snapshot_every)
    ids = load(engine)
    for _ in range(9):
        engine.step()
    before = engine.manager.export_state()
    replayed = engine.restart_block_manager(redis_server.client)
    assert replayed >= 0
    assert engine.manager.export_state() == before
    preemptions = engine.scheduler.num_preemptions
    engine.run()
    # Nothing was recomputed for the restart: the restored tables were good.
    assert engine.scheduler.num_preemptions == preemptions
    engine.assert_fault_free_outputs(*ids)
    engine.assert_index_truthful()


def test_a_state_that_missed_steps_is_dropped_not_trusted(redis_server):
    engine = DurableEngine(redis_server.client, snapshot_every=1000)
    ids = load(engine)
    for _ in range(4):
        engine.step()
    engine.journaling = False  # Redis was away for two steps
    for _ in range(2):
        engine.step()
    engine.restart_block_manager(redis_server.client)
    assert engine.manager.num_requests > 0  # restored, but behind the scheduler
    engine.run()
    engine.assert_fault_free_outputs(*ids)
    engine.assert_index_truthful()


def test_an_unusable_saved_state_is_discarded(redis_server):
    redis_server.client.set("test:kvcache:snapshot", b'{"pool": [1, 2, "x"]}')
    manager = KVCacheManager(24, BLOCK_SIZE, model_id="test")
    assert DurableState(redis_server.client, "test").restore(manager, decode) == -1
    assert manager.num_requests == 0 and not redis_server.client.exists("test:kvcache:snapshot")
