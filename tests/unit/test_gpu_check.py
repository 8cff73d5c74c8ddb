"""tools/gpu_check.sh --dry-run on the CPU: every step starts, finishes inside its cap and leaves its result
file with a status, and the caps add up to under the 8 minutes the GPU run is given."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["wheels", "smoke", "kernels-check", "tests-kernels", "tests-model", "kernel-bench"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the no-CUDA rehearsal")
def test_gpu_check_dry_run_starts_every_step_and_leaves_results(tmp_path):
    env = dict(os.environ, RESULTS_DIR=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    log = (tmp_path / "gpu_check.log").read_text()
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] is True
    assert [s["name"] for s in summary["steps"]] == STEPS
    for s in summary["steps"]:
        assert f"=== {s['name']} (cap {s['cap_s']}s" in log
        assert s["seconds"] <= s["cap_s"], s

    # The caps, a kill grace after each, stay under 8 minutes; the script's total is the sum of its caps.
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    caps = [int(v) for v in re.findall(r"^CAP_\w+=(\d+)$", script, re.M)]
    grace = int(re.search(r"^KILL_GRACE=(\d+)$", script, re.M).group(1))
    assert len(caps) == len(STEPS) and summary["total_caps_s"] == sum(caps) + len(STEPS) * grace < 480

    exits = {s["name"]: s["exit"] for s in summary["steps"]}
    assert (tmp_path / "wheels.log").read_text().count(": importable") == 3 and exits["wheels"] == 0
    assert json.loads((tmp_path / "smoke.json").read_text())["status"] == "dry-run" and exits["smoke"] == 0
    check = json.loads((tmp_path / "kernels_check.json").read_text())
    assert exits["kernels-check"] == {"passed": 0, "unchecked": 2}[check["status"]]
    for name, xml in (("tests-kernels", "tests_kernels.xml"), ("tests-model", "tests_model.xml")):
        suite = ET.parse(tmp_path / xml).getroot().find("testsuite")
        assert int(suite.get("tests")) > 0 and int(suite.get("tests")) == int(suite.get("skipped")), name
        assert exits[name] == 0
    bench = json.loads((tmp_path / "kernel.json").read_text())
    assert bench["metrics"]["status"] == "dry-run" and exits["kernel-bench"] == 0
    assert bench["metrics"]["skipped"][0] == {"decode": ["qwen2.5-0.5b-like", 64, 2048]}  # the headline first
    assert summary["status"] == ("passed" if check["status"] == "passed" else "failed")
    assert proc.returncode == (0 if summary["status"] == "passed" else 1), proc.stdout[-2000:]
