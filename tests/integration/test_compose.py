"""docker-compose.yml is tested, not trusted: every command, variable, port, health check and peer in it is
one its service accepts, and `pagedserve up --compose` runs its topology (Redis with its password, the
services in depends_on order, two executors registering with the KV-cache service, two frontends) as local
processes, which serve greedy requests whose outputs equal the offline LLM's."""
from __future__ import annotations

import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import INTERNAL_TOKEN_ENV
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.compose import ComposeStack, active, load, parse_duration, services
from pagedserve.entrypoints.launcher import free_ports
from pagedserve.service import Security, channel
from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.support.deployment import check_peers, check_service
from tests.support.probes import wait_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROFILES = ("cpu", "cuda")
# What `docker compose` needs set; everything else has a default in the file.
REQUIRED = {"PAGEDSERVE_REDIS_PASSWORD": "not-a-secret"}


def problems(path: Path, profile: str) -> list[str]:
    """Everything in the compose file that a service would refuse, or that points nowhere, for a profile."""
    enabled = active(services(load(path, REQUIRED)), (profile,))
    names = {alias: service.name for service in enabled.values() for alias in (service.name, *service.aliases)}
    found, commands, listening = [], {}, {}
    for service in enabled.values():
        where = f"{path.name}: {service.name}"
        probe = [int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", " ".join(service.healthcheck or []))]
        if not service.healthcheck:
            found.append(f"{where}: no health check")
        if service.command[:1] == ["redis-server"]:
            port = int(service.command[service.command.index("--port") + 1])
            listening[service.name] = {port}
            if probe != [port]:
                found.append(f"{where}: the health check asks {probe}, Redis listens on {port}")
            if "--requirepass" not in service.command:
                found.append(f"{where}: Redis without a password")
            continue
        try:
            command = check_service(where, service.command, tuple(service.environment),
                                    {port.container for port in service.ports}, set(probe))
        except AssertionError as error:
            found.append(str(error))
            continue
        if service.healthcheck[:3] != ["python", "-m", "pagedserve.healthcheck"]:
            found.append(f"{where}: the health check is not the gRPC health protocol")
        drain = command.serving.drain_timeout_s
        if command.module in ("frontend", "scheduler_svc") and service.stop_grace_s <= drain:
            found.append(f"{where}: stop_grace_period {service.stop_grace_s:g} s cuts the {drain:g} s drain short")
        commands[service.name], listening[service.name] = command, command.listen_ports()
    for name, command in commands.items():
        try:
            check_peers(f"{path.name}: {name}", command, {alias: listening.get(target, set()) for alias, target in names.items()})
        except AssertionError as error:
            found.append(str(error))
        for host, _port in command.peers():
            if enabled[name].depends_on.get(names.get(host), {}).get("condition") != "service_healthy":
                found.append(f"{path.name}: {name} calls {host} without depends_on {host}: service_healthy")
    return found


@pytest.mark.parametrize("profile", PROFILES)
def test_every_flag_variable_port_and_peer_in_the_compose_file_is_accepted(profile):
    assert problems(COMPOSE, profile) == []


@pytest.mark.parametrize("change,complaint", [
    (("--drain-timeout-s ${PAGEDSERVE_DRAIN_TIMEOUT_S:-30}\n    depends_on:\n      scheduler",
      "--drain-timeout-s ${PAGEDSERVE_DRAIN_TIMEOUT_S:-30} --max-num-seq 4\n    depends_on:\n      scheduler"),
     "frontend: python -m frontend: error: unrecognized arguments: --max-num-seq 4"),
    (("--port 50053", "--port 50059"), "kvcache: health checks ask ports [50053] it does not listen on"),
    (("      kvcache: {condition: service_healthy}\n", ""), "scheduler calls kvcache without depends_on"),
    (("--dtype ${PAGEDSERVE_DTYPE:-auto} --kvcache kvcache:50053", "--dtype ${PAGEDSERVE_DTYPE:-auto} --kvcache kvcache:50055"),
     "executor: calls kvcache:50055, but kvcache listens on [50053]"),
    (("PAGEDSERVE_API_KEY:", "PAGEDSERVE_APIKEY:"), "frontend does not read the environment variable PAGEDSERVE_APIKEY"),
    (('"127.0.0.1:${PAGEDSERVE_HTTP_PORTS:-8000-8007}:8000"', '"127.0.0.1:${PAGEDSERVE_HTTP_PORTS:-8000-8007}:8080"'),
     "frontend: declares ports [8080] it does not listen on"),
    (('"127.0.0.1:50052"]', '"127.0.0.1:50051"]'), "scheduler: health checks ask ports [50051]"),
    (("--dtype ${PAGEDSERVE_DTYPE:-auto}", "--dtype ${PAGEDSERVE_DTYPE:-fp8}"), "argument --dtype: invalid choice: 'fp8'"),
    (("stop_grace_period: 45s\n\n  frontend", "stop_grace_period: 20s\n\n  frontend"),
     "scheduler: stop_grace_period 20 s cuts the 30 s drain short"),
])
def test_the_compose_check_fails_on_what_a_service_would_refuse(tmp_path, change, complaint):
    old, new = change
    text = COMPOSE.read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    assert any(complaint in problem for problem in problems(broken, "cpu")), problems(broken, "cpu")


def test_the_gpu_reservation_is_in_the_cuda_profile_only():
    document = load(COMPOSE, REQUIRED)
    reservations = {name: (spec.get("deploy") or {}).get("resources", {}).get("reservations", {})
                    for name, spec in document["services"].items()}
    assert reservations["executor-cuda"]["devices"] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert [name for name, reservation in reservations.items() if reservation] == ["executor-cuda"]
    assert document["services"]["executor-cuda"]["profiles"] == ["cuda"]
    assert document["services"]["executor"]["profiles"] == ["cpu"]
    assert "--device cpu" in document["services"]["executor"]["command"]
    assert "--device cuda" in document["services"]["executor-cuda"]["command"]


def test_every_variable_of_the_compose_file_is_documented():
    documented = (ROOT / "docs" / "deployment.md").read_text()
    variables = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE.read_text()))
    assert variables and {v for v in variables if f"`{v}`" not in documented} == set()


def test_the_compose_file_needs_the_redis_password():
    with pytest.raises(ValueError, match="PAGEDSERVE_REDIS_PASSWORD must be set"):
        load(COMPOSE, {})
    with pytest.raises(ValueError, match=r"but no enabled service runs executor_svc \(does a profile enable one\? "
                                         r"--profile\)"):
        ComposeStack(COMPOSE, environ=REQUIRED)


def test_pagedserve_up_refuses_what_the_compose_run_would_ignore(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REDIS_PASSWORD", "x")
    for argv, message in [
        (["--scale", "frontend=2"], "--scale and --profile need --compose"),
        (["--compose", str(COMPOSE), "--profile", "cpu", "--max-num-seqs", "4"], "these flags would be ignored: "
                                                                                  "--max-num-seqs"),
        (["--compose", str(COMPOSE), "--profile", "cpu", "--scale", "frontend=0"], "N at least 1"),
        (["--compose", str(COMPOSE), "--profile", "cpu", "--scale", "nobody=2"], "--scale nobody: no such service"),
    ]:
        with pytest.raises(SystemExit):
            cli.main(["up", *argv])
        assert message in capsys.readouterr().err, argv


def test_stop_grace_periods_are_read_as_compose_writes_them():
    assert [parse_duration(v, 10.0) for v in ("45s", "1m30s", "500ms", 3, None)] == [45.0, 90.0, 0.5, 3.0, 10.0]


# ---------------------------------------------------------------------------------------------- running it
@pytest.fixture(scope="module")
def compose_stack(tiny_model_with_tokenizer, redis_binary):
    ports, http_ports = free_ports(2), free_ports(2)
    environ = {
        **os.environ,
        "PAGEDSERVE_MODEL": str(tiny_model_with_tokenizer), "PAGEDSERVE_DTYPE": "float32",
        "PAGEDSERVE_REDIS_PASSWORD": secrets.token_hex(16),
        "PAGEDSERVE_PORTS": f"{ports}-{ports + 1}", "PAGEDSERVE_HTTP_PORTS": f"{http_ports}-{http_ports + 1}",
    }
    with ComposeStack(COMPOSE, {"frontend": 2, "executor": 2}, ("cpu",), environ=environ,
                      startup_timeout=300) as stack:
        stack.ports = (ports, http_ports)
        assert wait_for(lambda: len(kv_stats(stack).executors) == 2, timeout=60), "the executors did not register"
        yield stack


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with channel(stack.address("kvcache", 50053), Security(internal_token=stack.environ[INTERNAL_TOKEN_ENV])) as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest(), timeout=10)


@pytest.fixture(scope="module")
def redis_binary():
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make test installs it: apt-get install redis-server)")


def test_the_compose_topology_serves_greedy_requests_on_every_frontend(compose_stack, tiny_model_with_tokenizer):
    ports, http_ports = compose_stack.ports
    assert set(compose_stack.processes) == {"redis", "executor", "executor-1", "kvcache", "scheduler", "frontend",
                                            "frontend-1"}
    assert [compose_stack.address(name, 50051) for name in ("frontend", "frontend-1")] == [
        f"127.0.0.1:{ports}", f"127.0.0.1:{ports + 1}"]
    assert compose_stack.address("frontend-1", 8000) == f"127.0.0.1:{http_ports + 1}"
    prompts = [[7, 8, 9, 10, 11], [20, 21, 22], [100, 3, 5, 8, 13, 21, 34]]
    reference = LLM(str(tiny_model_with_tokenizer), device="cpu", dtype="float32", kv_cache_memory=16 << 20)
    expected = [r.token_ids for r in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                ignore_eos=True))]
    before = kv_stats(compose_stack)

    def generate(frontend: str, prompt: list[int]) -> list[int]:
        with GenerateClient(compose_stack.address(frontend, 50051)) as client:
            return client.generate(build_request(prompt_token_ids=prompt, temperature=0.0, max_tokens=24,
                                                 ignore_eos=True), timeout=120).token_ids

    # At once, so that the requests are spread over both executors (each admitted on the less loaded).
    frontends = ("frontend", "frontend-1")
    with ThreadPoolExecutor(len(frontends) * len(prompts)) as pool:
        got = {name: list(pool.map(lambda p, name=name: generate(name, p), prompts)) for name in frontends}
    for name in frontends:
        assert got[name] == expected, name
    after = kv_stats(compose_stack)
    served = {a: after.executors[a].prefix_cache_queries - before.executors[a].prefix_cache_queries
              for a in after.executors}
    assert len(served) == 2 and all(served.values()), served


def test_the_compose_redis_requires_its_password(compose_stack):
    address = compose_stack.address("redis", 6379)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://{address}/0").ping()
    password = compose_stack.environ["PAGEDSERVE_REDIS_PASSWORD"]
    assert redis.Redis.from_url(f"redis://default:{password}@{address}/0").ping()
    assert compose_stack.environ[INTERNAL_TOKEN_ENV], "a local compose run gives its services an internal token"
