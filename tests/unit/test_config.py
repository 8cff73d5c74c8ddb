"""The configuration: validation, flags that round-trip through every parser, the KV sizing rule, the doc."""
from __future__ import annotations

import dataclasses
import os
import types
from pathlib import Path

import pytest
import torch

import executor_svc.__main__
import frontend.__main__
import kvcache_svc.__main__
import scheduler_svc.__main__
from executor_svc import kv_cache
from pagedserve import config as cfg
from pagedserve.config import CacheConfig, ModelConfig, PagedServeConfig, SchedulerConfig, ServingConfig
from pagedserve.entrypoints import cli

ROOT = Path(__file__).resolve().parents[2]
SERVICES = [executor_svc.__main__, kvcache_svc.__main__, scheduler_svc.__main__, frontend.__main__]

# The file options only need an existing file here: the config checks that it is one, not what it holds.
A_FILE = __file__
# Every option set away from its default, so that a flag that is dropped or renamed shows.
CHANGED = PagedServeConfig(
    ModelConfig(model="m", tokenizer="t", device="cpu", dtype="bfloat16", max_model_len=77, seed=3,
                attention_backend="torch", cpu_threads=3, enforce_eager=True, cuda_graph_batch_sizes=(1, 3),
                benchmark_sleep_ms=2.5, chat_template="{{ messages[0].content }}", generation_config="vllm"),
    CacheConfig(block_size=8, kv_cache_dtype="bfloat16", kv_cache_memory=12345, kv_cache_fraction=0.5, enable_prefix_caching=False,
                offload="redis", offload_host_bytes=99, redis_url="redis://r:1/0", redis_ttl=5, offload_all=True,
                redis_namespace="tenant-7", preemption_mode="swap", swap_host_bytes=77, routing="round_robin"),
    SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=99, enable_chunked_prefill=False, max_waiting=3,
                    scheduling_policy="priority", long_prefill_token_threshold=64, max_num_partial_prefills=2,
                    async_scheduling=False, stream_interval=4),
    ServingConfig(host="0.0.0.0", port=1234, executor="e:1", kvcache="k:2", scheduler="s:3", log_level="DEBUG",
                  startup_timeout=5.5, max_streams=9, restart_backoff=0.25, max_restarts=2,
                  http_address="0.0.0.0:8080", served_model_name=("my-model", "alias"),
                  max_message_bytes=1 << 20, max_prompt_chars=999, enable_auto_tool_choice=True,
                  tool_call_parser="hermes", reasoning_parser="qwen3", responses_store_size=7,
                  tls_cert=A_FILE, tls_key=A_FILE, tls_ca=A_FILE, tls_client_ca=A_FILE, api_key_file=A_FILE,
                  internal_token_file=A_FILE, drain_timeout_s=2.5, frontends=3, executors=2,
                  advertise_address="x:4", heartbeat_ttl=1.5, cpus="0-3", control_plane_cpus="1", nice=3,
                  frontend_nice=7),
)


def _bad_values(f: dataclasses.Field):
    meta = f.metadata
    if meta["choices"]:
        yield "nonsense"
    if meta["min"] is not None:
        yield meta["min"] - 1 if isinstance(meta["min"], int) else meta["min"] / 2
    if meta["max"] is not None:
        yield meta["max"] + 1
    yield object()  # a wrong type


@pytest.mark.parametrize("field", [(cls, f) for cls in cfg.CONFIG_CLASSES for f in dataclasses.fields(cls)],
                         ids=lambda p: f"{p[0].__name__}.{p[1].name}")
def test_a_refused_value_names_its_field(field):
    cls, f = field
    for bad in _bad_values(f):
        value = (bad,) if "tuple" in str(f.type) and not isinstance(bad, str) else bad
        with pytest.raises(ValueError, match=f"^{f.name} "):
            cls(**{f.name: value})


def test_cross_field_rules():
    with pytest.raises(ValueError, match="^max_num_batched_tokens must be at least max_model_len"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=200)
    with pytest.raises(ValueError, match="^offload 'redis' needs redis_url"):
        CacheConfig(offload="redis")
    assert CacheConfig().offload_kind == "host" and CacheConfig(redis_url="redis://r").offload_kind == "redis"
    with pytest.raises(ValueError, match="^redis_namespace must be"):
        CacheConfig(redis_namespace="a:b")
    with pytest.raises(ValueError, match="^tls_cert and tls_key must be given together"):
        ServingConfig(tls_cert=A_FILE)
    with pytest.raises(ValueError, match="^tls_ca and tls_client_ca need tls_cert"):
        ServingConfig(tls_ca=A_FILE)
    with pytest.raises(ValueError, match="^api_key_file must name a readable file"):
        ServingConfig(api_key_file="/nonexistent/keys")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        ModelConfig(chat_template="/nonexistent/template.jinja")
    with pytest.raises(ValueError, match="^enable_auto_tool_choice needs tool_call_parser"):
        ServingConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="^tool_call_parser must be one of"):
        ServingConfig(tool_call_parser="xml")


def test_unknown_keyword_is_refused_by_name():
    from pagedserve import LLM

    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'kv_cache_memry'"):
        LLM(kv_cache_memry=1 << 20)
    with pytest.raises(TypeError, match="'port'"):  # a serving option: the offline engine serves nothing
        LLM(port=1)
    parts = PagedServeConfig.from_kwargs(max_num_seqs=3, block_size=8, log_level="ERROR", dtype="float16")
    assert (parts.scheduler_config.max_num_seqs, parts.cache_config.block_size, parts.serving_config.log_level,
            parts.model_config.dtype) == (3, 8, "ERROR", "float16")


def test_every_option_differs_from_its_default_in_the_round_trip_config():
    for part in (getattr(CHANGED, f.name) for f in dataclasses.fields(CHANGED)):
        for f in cfg.option_fields(type(part)):
            assert getattr(part, f.name) != f.default, f.name


def _expected(config: PagedServeConfig, sections: dict) -> dict:
    parts = {type(p): p for p in (getattr(config, f.name) for f in dataclasses.fields(config))}
    return {cls: cls(**{f.name: getattr(parts[cls], f.name) for f in cfg.option_fields(cls, names)})
            for cls, names in sections.items()}


@pytest.mark.parametrize("service", SERVICES, ids=lambda m: m.__name__)
def test_each_service_parses_its_flags_back_to_the_same_config(service):
    assert service.parse_args(cfg.to_argv(CHANGED, service.SECTIONS)) == _expected(CHANGED, service.SECTIONS)


def test_every_option_reaches_a_service_or_the_launcher():
    taken = {(cls, f.name) for sections in [cli.UP_SECTIONS, *(s.SECTIONS for s in SERVICES)]
             for cls, names in sections.items() for f in cfg.option_fields(cls, names)}
    assert taken == {(cls, f.name) for cls in cfg.CONFIG_CLASSES for f in cfg.option_fields(cls)}


def test_the_launchers_argv_parses_with_each_services_parser():
    from pagedserve.entrypoints.launcher import SERVICES as LAUNCHED, Stack

    # One executor: this build's scheduler and KV-cache service drive one (see the next test).
    changed = dataclasses.replace(CHANGED, serving_config=dataclasses.replace(CHANGED.serving_config, executors=1))
    stack = Stack(changed)
    assert list(LAUNCHED.values()) == SERVICES
    for name, service in LAUNCHED.items():
        host, port = stack.addresses[name].rsplit(":", 1)
        # Only the public API listens where it is told; the internal services stay on the loopback.
        assert host == ("0.0.0.0" if name == "frontend" else "127.0.0.1"), name
        serving = dataclasses.replace(
            changed.serving_config, host=host, port=int(port),
            executor=stack.executor_address, scheduler=stack.scheduler_address,
            kvcache=None if name == "executor_svc" else stack.kvcache_address, advertise_address=None,
            cpus="1" if name in ("kvcache_svc", "scheduler_svc") else "0,2,3",
            nice=7 if name == "frontend" else 3,
        )
        expected = _expected(dataclasses.replace(changed, serving_config=serving), service.SECTIONS)
        assert service.parse_args(stack.service_argv(name)) == expected, name
    assert stack.address == "0.0.0.0:1234"


def test_cpu_lists_read_as_taskset_writes_them():
    assert cfg.parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6} and cfg.parse_cpu_list(" 2 ") == {2}
    assert cfg.format_cpu_list({6, 0, 1}) == "0,1,6"
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(ValueError, match="^control_plane_cpus must be a CPU list"):
            ServingConfig(control_plane_cpus=bad)


def test_control_plane_cpus_must_leave_cpus_for_the_rest_and_stay_within_the_stacks():
    from pagedserve.entrypoints.launcher import Stack

    unpinned = Stack(PagedServeConfig.from_kwargs(port=7100, cpus="2-3"))
    assert set(unpinned.cpus.values()) == {"2-3"}  # each process is told the stack's own list
    with pytest.raises(ValueError, match="takes every CPU the stack may use \\(2,3\\)"):
        Stack(PagedServeConfig.from_kwargs(port=7100, cpus="2-3", control_plane_cpus="2-3"))
    with pytest.raises(ValueError, match="names CPUs 1 that the stack may not use \\(it may use 2,3\\)"):
        Stack(PagedServeConfig.from_kwargs(port=7100, cpus="2-3", control_plane_cpus="1-2"))


def test_a_service_told_cpus_it_cannot_have_refuses_to_start():
    import subprocess
    import sys

    outside, inside = os.cpu_count() + 1000, min(os.sched_getaffinity(0))
    for cpus, error in ((f"{outside}", "none of these CPUs is available to this process"),
                        (f"{inside},{outside}", f"CPUs {outside} are not available to this process")):
        run = subprocess.run([sys.executable, "-c", f"from pagedserve.service import pin_to_cpus; pin_to_cpus('{cpus}')"],
                             capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 1 and error in run.stderr, (cpus, run.stderr)


def test_a_service_told_a_nice_sets_every_thread_and_its_later_ones_to_it():
    import subprocess
    import sys

    script = """
import os, threading
from pagedserve.service import set_nice

def nice_of_threads():
    return {int(open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[16]) for t in os.listdir("/proc/self/task")}

hold = threading.Event()
before = threading.Thread(target=hold.wait)
before.start()
set_nice(None)
unchanged = nice_of_threads()
set_nice(min(os.getpriority(os.PRIO_PROCESS, 0) + 5, 19))
after = threading.Thread(target=hold.wait)
after.start()
print(sorted(unchanged), sorted(nice_of_threads()), threading.active_count())
hold.set()
"""
    start = os.getpriority(os.PRIO_PROCESS, 0)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("] ")[0] == f"[{start}"
    # The main thread, the one started before, the one after.
    assert run.stdout.strip().endswith(f"[{min(start + 5, 19)}] 3")


def test_frontend_k_listens_on_the_public_and_http_ports_plus_k():
    from pagedserve.entrypoints.launcher import Stack

    stack = Stack(PagedServeConfig.from_kwargs(port=7100, http_address="127.0.0.1:7200", frontends=3))
    assert stack.stages[-1] == ["frontend", "frontend-1", "frontend-2"]
    for k, name in enumerate(stack.stages[-1]):
        argv = stack.service_argv(name)
        assert argv[argv.index("--port") + 1] == str(7100 + k)
        assert argv[argv.index("--http-address") + 1] == f"127.0.0.1:{7200 + k}"
    assert stack.address == "127.0.0.1:7100" and stack.http_url == "http://127.0.0.1:7200"
    assert [line.split(":")[0] for line in stack.listing()] == [
        "executor_svc", "kvcache_svc", "scheduler_svc", "frontend", "frontend-1", "frontend-2"]


def test_several_executors_register_with_the_kvcache_service_where_the_scheduler_finds_them():
    from pagedserve.entrypoints.launcher import Stack

    stack = Stack(PagedServeConfig.from_kwargs(executors=2, port=7100))
    assert stack.stages[0] == ["executor_svc", "executor_svc-1"]
    for name in stack.stages[0]:
        serving = executor_svc.__main__.parse_args(stack.service_argv(name))[ServingConfig]
        assert (serving.kvcache, serving.advertise_address) == (stack.kvcache_address, stack.addresses[name])
    for name, module in (("kvcache_svc", kvcache_svc.__main__), ("scheduler_svc", scheduler_svc.__main__)):
        assert module.parse_args(stack.service_argv(name))[ServingConfig].executor is None, name
    # One executor: followed through --executor, and it does not register.
    stack = Stack(PagedServeConfig.from_kwargs(port=7100))
    assert kvcache_svc.__main__.parse_args(stack.service_argv("kvcache_svc"))[ServingConfig].executor == \
        stack.executor_address
    assert executor_svc.__main__.parse_args(stack.service_argv("executor_svc"))[ServingConfig].kvcache is None


def test_pagedserve_up_builds_the_config_from_its_flags(up_config, capsys):
    config = up_config(cfg.to_argv(CHANGED, cli.UP_SECTIONS))
    expected = _expected(CHANGED, cli.UP_SECTIONS)
    assert (config.model_config, config.cache_config, config.scheduler_config) == (
        expected[ModelConfig], expected[CacheConfig], expected[SchedulerConfig])
    assert config.serving_config == expected[ServingConfig]
    with pytest.raises(SystemExit):
        cli.main(["up", "--max-num-seqs", "0"])
    assert "max_num_seqs must be at least 1" in capsys.readouterr().err


def test_the_try_hint_names_a_non_default_address(monkeypatch, capsys):
    import pagedserve.entrypoints.launcher

    class FakeStack:
        def __init__(self, config):
            self.address = f"{config.serving_config.host}:{config.serving_config.port or 50051}"
            self.http_url = f"http://{config.serving_config.http_address}" if config.serving_config.http_address else ""

        def listing(self):
            return [f"frontend: {self.address}"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(pagedserve.entrypoints.launcher, "Stack", FakeStack)
    monkeypatch.setattr(cli.threading.Event, "wait", lambda self, timeout=None: True)
    cli.main(["up", "--device", "cpu"])
    assert "try: pagedserve generate --chat" in capsys.readouterr().out
    cli.main(["up", "--device", "cpu", "--port", "6000"])
    assert "try: pagedserve generate --address 127.0.0.1:6000 --chat" in capsys.readouterr().out
    cli.main(["up", "--device", "cpu"])
    assert "OpenAI-compatible HTTP API on http://127.0.0.1:8000/v1" in capsys.readouterr().out
    cli.main(["up", "--device", "cpu", "--http-address", ""])
    assert "HTTP API" not in capsys.readouterr().out


def test_cpu_kv_cache_is_sized_from_the_workload_and_capped(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(kv_cache, "host_memory_total", lambda: 64 << 30)
    budget = kv_cache.kv_cache_budget
    assert budget(CacheConfig(), cpu, bytes_per_token=1000, max_model_len=100, max_num_seqs=10) == 1_000_000
    # SmolLM2-135M in float32: 46080 bytes per token, 8192 tokens, 256 requests would be 96 GB.
    assert budget(CacheConfig(), cpu, 46080, 8192, 256) == cfg.CPU_KV_CACHE_CAP == 4 << 30
    monkeypatch.setattr(kv_cache, "host_memory_total", lambda: 8 << 30)
    assert budget(CacheConfig(), cpu, 46080, 8192, 256) == int((8 << 30) * 0.3)
    assert budget(CacheConfig(kv_cache_memory=5), cpu, 46080, 8192, 256) == 5


def test_the_cpu_kv_pool_is_one_zeroed_buffer_on_huge_pages_where_linux_offers_them():
    arch = types.SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)  # what the pool's shape takes
    caches = kv_cache.allocate_kv_caches(arch, num_blocks=1000, block_size=16, dtype=torch.bfloat16,
                                         device=torch.device("cpu"))
    tensors = [t for pair in caches for t in pair]
    layer_bytes = 1000 * 2 * 16 * 16 * 2
    assert all(t.shape == (1000, 2, 16, 16) and t.is_contiguous() and not t.any() for t in tensors)
    # Back to back in one buffer that starts on a 2 MB boundary: the layers do not overlap.
    assert [t.data_ptr() - tensors[0].data_ptr() for t in tensors] == [i * layer_bytes for i in range(6)]
    assert tensors[0].data_ptr() % kv_cache.HUGE_PAGE == 0
    tensors[-1][-1] = 1
    assert tensors[-1].sum() == 16 * 16 * 2 and not tensors[-2].any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        start = tensors[0].data_ptr()
        huge_kb = 0
        for line in Path("/proc/self/smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and len(fields) > 4:  # a mapping's header: does it hold the pool's start?
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= start < high
            elif inside and fields[0] == "AnonHugePages:":
                huge_kb += int(fields[1])
        assert huge_kb >= 2048


def test_runner_without_a_budget_holds_max_num_seqs_full_contexts(tiny_llama_dir):
    from executor_svc.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(block_size=16),
                         SchedulerConfig(max_num_seqs=3))
    assert runner.max_model_len == 512  # the tiny model's context
    assert runner.num_blocks == 3 * 512 // 16


def test_llm_builds_its_cores_with_the_services_builders(tiny_llama_dir):
    from pagedserve import LLM
    from pagedserve.entrypoints import offline

    # The same functions the services call (the executor imports its builder when it starts serving).
    assert offline.build_block_manager is kvcache_svc.__main__.build_block_manager
    assert offline.build_scheduler is scheduler_svc.__main__.build_scheduler
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=1 << 20, enable_chunked_prefill=False,
              max_num_batched_tokens=16, enable_prefix_caching=False, max_num_seqs=5)
    config = llm.scheduler.config
    # build_scheduler's rule: without chunked prefill the budget grows to the executor's context length.
    assert (config.max_model_len, config.max_num_batched_tokens, config.max_num_seqs) == (512, 512, 5)
    assert config.block_size == llm.runner.block_size == 16
    assert not llm.block_manager.enable_prefix_caching
    assert llm.block_manager.num_blocks == llm.runner.num_blocks


def test_configuration_doc_is_rendered_from_the_dataclasses():
    doc = ROOT / "docs" / "configuration.md"
    text = doc.read_text()
    assert cfg.render_doc(text) == text, "docs/configuration.md is stale: run python -m pagedserve.config"
    assert "| `max_num_seqs` | `--max-num-seqs` | `256` |" in text


def test_auto_dtype_follows_the_cpus_bfloat16_support(tmp_path, monkeypatch):
    import pagedserve.config as config

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma amx_bf16 amx_tile\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f\n")
    assert config.cpu_bf16_flags(str(amx)) == ("amx_bf16",)
    assert config.cpu_bf16_flags(str(avx2)) == ()
    assert config.cpu_bf16_flags(str(tmp_path / "missing")) == ()  # unreadable: never assumed
    monkeypatch.setattr(config, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setattr(config, "cpu_bf16_speedup", lambda: 3.5)
    assert ModelConfig(device="cpu").resolved().dtype == "bfloat16"
    assert ModelConfig(device="cpu", dtype="float32").resolved().dtype == "float32"
    # The flags, but bfloat16 products measured slower than float32's: float32.
    monkeypatch.setattr(config, "cpu_bf16_speedup", lambda: 0.6)
    assert ModelConfig(device="cpu").resolved().dtype == "float32"
    assert "0.60x as fast as float32, under 1.3x" in config.cpu_bf16_choice()[1]
    assert config.dtype_reason("auto", "cpu") == "auto: " + config.cpu_bf16_choice()[1]
    monkeypatch.setattr(config, "cpu_bf16_flags", lambda: ())
    assert ModelConfig(device="cpu").resolved().dtype == "float32"
    assert ModelConfig(device="cuda").resolved().dtype == "bfloat16"
    assert config.dtype_reason("auto", "cpu") == "auto: the CPU has no native bfloat16 matrix support"
    assert config.dtype_reason("auto", "cuda:0") == "auto: CUDA"
    assert config.dtype_reason("float32", "cpu") == "requested"
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        ModelConfig(cpu_threads=0)


def test_the_bfloat16_speedup_is_measured_on_this_cpu():
    import pagedserve.config as config

    speedup = config.cpu_bf16_speedup()
    assert 0.05 < speedup < 50  # a real ratio of two timed products, whichever way this CPU leans
    assert config.cpu_bf16_speedup() == speedup  # measured once per process
