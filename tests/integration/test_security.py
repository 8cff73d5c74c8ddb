"""Transport security and credentials through a real stack: TLS with client certificates on the public port,
mutual TLS and the shared secret between services, API keys; and no port shared with another server."""
from __future__ import annotations

import grpc
import pytest
import trustme

from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig, model_name
from pagedserve.entrypoints.launcher import Stack
from pagedserve.service import INTERNAL_TOKEN_ENV, Security, Service, channel, client_channel
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.support.tiny_stack import write_tiny_model_with_tokenizer

API_KEY = "sk-test-0123456789"


def _write_pair(cert: trustme.LeafCert, directory, name: str) -> tuple[str, str]:
    chain, key = directory / f"{name}.pem", directory / f"{name}.key"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key))
    return str(chain), str(key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The services' CA and certificate, the clients' CA and a client certificate, and a stranger's."""
    directory = tmp_path_factory.mktemp("pki")
    services_ca, clients_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    paths = {}
    for name, ca in (("services_ca", services_ca), ("clients_ca", clients_ca)):
        paths[name] = str(directory / f"{name}.pem")
        ca.cert_pem.write_to_path(paths[name])
    paths["service"] = _write_pair(services_ca.issue_cert("127.0.0.1", "localhost"), directory, "service")
    paths["client"] = _write_pair(clients_ca.issue_cert("client.example"), directory, "client")
    paths["stranger"] = _write_pair(stranger_ca.issue_cert("client.example"), directory, "stranger")
    return paths


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pki):
    model = write_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-secure"))
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"sk-other-key\n{API_KEY}\n")
    config = PagedServeConfig.from_kwargs(
        model=str(model), device="cpu", port=0, log_level="WARNING", kv_cache_memory=16 << 20,
        tls_cert=pki["service"][0], tls_key=pki["service"][1], tls_ca=pki["services_ca"],
        tls_client_ca=pki["clients_ca"], api_key_file=str(keys),
    )
    with Stack(config) as running:
        yield running


def _generate(stack, pki, **client_kwargs):
    with GenerateClient(stack.address, **client_kwargs) as client:
        return client.generate(build_request(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0), timeout=20)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_a_client_with_a_certificate_of_the_client_ca_and_an_api_key_is_served(stack, pki):
    cert, key = pki["client"]
    completion = _generate(stack, pki, api_key=API_KEY, tls_ca=pki["services_ca"], tls_cert=cert, tls_key=key)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 2


def test_a_plaintext_client_is_refused_by_the_tls_server(stack, pki):
    assert _code(lambda: _generate(stack, pki, api_key=API_KEY)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_wrong_client_certificate_and_none(stack, pki):
    cert, key = pki["stranger"]
    wrong = lambda: _generate(stack, pki, api_key=API_KEY, tls_ca=pki["services_ca"], tls_cert=cert, tls_key=key)
    assert _code(wrong) == grpc.StatusCode.UNAVAILABLE
    assert _code(lambda: _generate(stack, pki, api_key=API_KEY, tls_ca=pki["services_ca"])) == grpc.StatusCode.UNAVAILABLE


def test_the_api_key_is_required_but_health_stays_open(stack, pki):
    cert, key = pki["client"]
    tls = dict(tls_ca=pki["services_ca"], tls_cert=cert, tls_key=key)
    assert _code(lambda: _generate(stack, pki, **tls)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: _generate(stack, pki, api_key=API_KEY + "x", **tls)) == grpc.StatusCode.UNAUTHENTICATED
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with client_channel(stack.address, **tls) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_http_api_serves_tls_and_requires_the_api_key_but_health_and_metrics_stay_open(stack, pki):
    import ssl

    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    verify = ssl.create_default_context(cafile=pki["services_ca"])
    verify.load_cert_chain(*pki["client"])
    with httpx.Client(base_url=stack.http_url.replace("http://", "https://"), verify=verify,
                      timeout=30) as https:
        assert https.get("/health").status_code == 200
        refused = https.get("/v1/models", headers={"authorization": "Bearer sk-wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert https.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 401
        client = openai.OpenAI(base_url=f"{https.base_url}/v1", api_key=API_KEY, http_client=https, max_retries=0)
        completion = client.completions.create(model=model_name(stack.config.model_config.model), prompt=[1, 2, 3],
                                               max_tokens=2, temperature=0)
        assert completion.usage.completion_tokens == 2
        # The scrape reads the scheduler's and the KV-cache service's stats over the internal mTLS and secret.
        scrape = https.get("/metrics")
        assert scrape.status_code == 200
        metrics = {(sample.name, sample.labels.get("finished_reason")): sample.value
                   for family in text_string_to_metric_families(scrape.text) for sample in family.samples}
        assert metrics[("pagedserve:generation_tokens_total", None)] >= 2
        assert metrics[("pagedserve:request_success_total", "length")] >= 1
        assert 0 <= metrics[("pagedserve:kv_cache_usage_perc", None)] <= 1
        assert metrics[("pagedserve:prefix_cache_queries_total", None)] > 0
    with pytest.raises(httpx.TransportError):  # no plain HTTP beside TLS
        httpx.get(f"{stack.http_url}/health", timeout=5)


def test_an_internal_rpc_without_the_secret_is_refused(stack, pki):
    request = kvcache_pb2.KVCacheStatsRequest()
    no_token = Security(cert=stack.security.cert, key=stack.security.key, ca=stack.security.ca)
    with channel(stack.kvcache_address, no_token) as ch:
        code = _code(lambda: kvcache_pb2_grpc.KVCacheStub(ch).GetStats(request, timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    wrong_token = Security(cert=no_token.cert, key=no_token.key, ca=no_token.ca, internal_token="guess")
    with channel(stack.kvcache_address, wrong_token) as ch:
        code = _code(lambda: kvcache_pb2_grpc.KVCacheStub(ch).GetStats(request, timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext, or TLS without a certificate of the services' CA, does not even get to ask.
    with channel(stack.kvcache_address, Security(internal_token=stack.security.internal_token)) as ch:
        code = _code(lambda: kvcache_pb2_grpc.KVCacheStub(ch).GetStats(request, timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE
    with stack.channel("kvcache_svc") as ch:
        assert kvcache_pb2_grpc.KVCacheStub(ch).GetStats(request, timeout=10).num_blocks > 0


def test_the_internal_secret_travels_in_the_environment_not_on_the_command_line(stack):
    token = stack.env[INTERNAL_TOKEN_ENV]
    assert len(token) >= 32 and stack.security.internal_token == token
    for module, process in stack.processes.items():
        with open(f"/proc/{process.pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read(), module


def test_a_second_server_cannot_bind_a_port_in_use():
    first = Service("first", "127.0.0.1", 0)
    first.start()
    try:
        with pytest.raises(RuntimeError, match="cannot listen on"):
            Service("second", "127.0.0.1", first.port)
    finally:
        first.stop(0)


def test_services_listen_on_the_loopback_by_default():
    from pagedserve.config import ServingConfig

    assert ServingConfig().host == "127.0.0.1"


def test_compose_publishes_only_the_frontend_and_only_on_the_loopback():
    from pathlib import Path

    from pagedserve.entrypoints.compose import load, parse_ports

    compose = load(Path(__file__).resolve().parents[2] / "docker-compose.yml", {"PAGEDSERVE_REDIS_PASSWORD": "x"})
    published = {name: parse_ports(service["ports"]) for name, service in compose["services"].items()
                 if service.get("ports")}
    assert list(published) == ["frontend"]
    # gRPC and HTTP, a host port per replica, all on the loopback.
    assert [(p.host_ip, p.first, p.container) for p in published["frontend"]] == [
        ("127.0.0.1", 50051, 50051), ("127.0.0.1", 8000, 8000)]
