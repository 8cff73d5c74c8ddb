"""--control-plane-cpus: the scheduler and the KV-cache service on those CPUs, every thread of theirs, and the
other processes on the rest; --frontend-nice: the frontend's threads at that nice, the others' as they started.
The stack serves as it does without them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig, parse_cpu_list
from pagedserve.entrypoints.launcher import Stack


def threads_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of a process's threads, as the kernel holds them."""
    sets = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                sets.add(parse_cpu_list(line.split(":", 1)[1].strip()))
    return sets


def threads_nice(pid: int) -> set[int]:
    return {int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in Path(f"/proc/{pid}/task").iterdir()}


def test_the_control_plane_gets_its_cpus_the_others_the_rest_and_the_frontend_its_nice(model):
    cpus = sorted(os.sched_getaffinity(0))
    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    frontend_nice = min(started_at + 5, 19)
    config = PagedServeConfig.from_kwargs(model=model, device="cpu", port=0, http_address="", log_level="WARNING",
                                          kv_cache_memory=8 << 20, control_plane_cpus=str(cpus[-1]),
                                          frontend_nice=frontend_nice)
    if len(cpus) == 1:
        with pytest.raises(ValueError, match="takes every CPU the stack may use"):
            Stack(config)
        return
    control, rest = frozenset(cpus[-1:]), frozenset(cpus[:-1])
    with Stack(config) as stack:
        with GenerateClient(stack.address) as client:
            result = client.generate(build_request(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True,
                                                   temperature=0.0))
        assert len(result.token_ids) == 4
        for name, process in stack.processes.items():
            expected = control if name in ("scheduler_svc", "kvcache_svc") else rest
            # Threads started before the pin (gRPC's, torch's) as well as after it.
            assert threads_cpus(process.pid) == {expected}, name
            assert threads_nice(process.pid) == {frontend_nice if name == "frontend" else started_at}, name
