"""What every benchmark shares: workload W of the design notes and the result-file format."""
from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(os.environ.get("RESULTS_DIR") or Path(__file__).parent / "results")


def workload_w(num_requests: int = 64, min_prompt: int = 64, max_prompt: int = 512, vocab_size: int = 49152,
               seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids with lengths uniform in [min_prompt, max_prompt], seeded."""
    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(num_requests)
    ]


def machine() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent)
        # Result files written by earlier benchmarks do not make the code under test dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results"], capture_output=True, text=True,
                               cwd=Path(__file__).parent.parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(name: str, ratios: dict, metrics: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    record = {
        "benchmark": name,
        "commit": commit(),
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ratios": ratios,
        "metrics": metrics,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
