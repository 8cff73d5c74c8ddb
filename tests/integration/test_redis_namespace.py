"""The Redis offload tier as a shared service: a password in the URL, and a key namespace per deployment so
that two deployments on one Redis never find (or serve) each other's blocks."""
from __future__ import annotations

import pytest

from executor_svc.offload import RedisTier
from kvcache_svc.offload_index import RedisTierIndex
from tests.support.local_redis import LocalRedis

BLOCK = bytes(range(32))


@pytest.fixture
def locked_redis():
    with LocalRedis(password="s3cret-pass") as server:
        yield server


def test_blocks_live_under_their_deployments_namespace(locked_redis):
    import redis

    tier = RedisTier(locked_redis.url, namespace="deployment-a")
    tier.save([(BLOCK, b"kv bytes")])
    assert tier.errors == 0
    assert locked_redis.client.keys("*") == [f"deployment-a:kv:v1:{BLOCK.hex()}".encode()]
    client = redis.Redis.from_url(locked_redis.url)
    assert RedisTierIndex(client, 16, namespace="deployment-a").leading_count([BLOCK]) == 1
    assert RedisTierIndex(client, 16, namespace="deployment-b").leading_count([BLOCK]) == 0
    assert RedisTier(locked_redis.url, namespace="deployment-b").load([BLOCK]) == [None]
    assert tier.load([BLOCK]) == [b"kv bytes"]


def test_without_the_password_the_tier_is_refused_and_switched_off(locked_redis):
    anonymous = locked_redis.url.replace(":s3cret-pass@", "")
    tier = RedisTier(anonymous, namespace="deployment-a")
    tier.save([(BLOCK, b"kv bytes")])
    assert tier.disabled and tier.errors == 1
    assert locked_redis.client.keys("*") == []
