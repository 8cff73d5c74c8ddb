"""The import contracts of pyproject.toml ([tool.importlinter]): the tree keeps them, and a copy of the tree
with one stray import breaks the contract it should, and only that one."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pagedserve", "frontend", "scheduler_svc", "kvcache_svc", "executor_svc")

INDEPENDENT = "The services are independent"
FOUNDATION = "The foundation imports no service"
NO_GRPC = "Logic modules import no gRPC"


def lint_imports(cwd: Path) -> tuple[int, str, dict[str, str]]:
    """Exit status, output and {contract name: KEPT or BROKEN} of lint-imports run in cwd, which it analyses."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache"],
        cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "1000"},  # one line per contract in the summary
    )
    output = proc.stdout + proc.stderr
    results = dict(re.findall(r"^(.+?) (KEPT|BROKEN)\b", output, flags=re.MULTILINE))
    return proc.returncode, output, results


def status_of(results: dict[str, str], contract: str) -> str:
    (status,) = [status for name, status in results.items() if name.startswith(contract)]
    return status


def test_the_tree_keeps_every_contract():
    rc, output, results = lint_imports(ROOT)
    assert rc == 0, output
    assert [status_of(results, c) for c in (INDEPENDENT, FOUNDATION, NO_GRPC)] == ["KEPT"] * 3, output


@pytest.mark.parametrize("path, line, broken, importer", [
    ("scheduler_svc/scheduler.py", "import grpc", {NO_GRPC}, "scheduler_svc.scheduler"),
    ("kvcache_svc/kv_cache_manager.py", "from google.protobuf import message", {NO_GRPC},
     "kvcache_svc.kv_cache_manager"),
    # gRPC reached through a module that may import it
    ("executor_svc/sampler.py", "import pagedserve.service", {NO_GRPC}, "executor_svc.sampler"),
    ("frontend/validation.py", "from pagedserve.convert import sampling_to_proto", {NO_GRPC}, "frontend.validation"),
    # A service importing another also imports a module only the entry points may import.
    ("kvcache_svc/block_pool.py", "import executor_svc", {INDEPENDENT, FOUNDATION}, "kvcache_svc.block_pool"),
    # The services import the foundation, so through it they now import each other as well.
    ("pagedserve/step.py", "import scheduler_svc.request", {INDEPENDENT, FOUNDATION}, "pagedserve.step"),
    ("pagedserve/sampling_params.py", "import pagedserve.entrypoints.offline", {INDEPENDENT, FOUNDATION},
     "pagedserve.sampling_params"),
    # The package's lazy import of the offline engine is the one allowed edge from the foundation up.
    ("frontend/validation.py", "import pagedserve", set(), None),
])
def test_an_added_import_breaks_exactly_its_contracts(tmp_path, path, line, broken, importer):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / path, "a") as source:
        source.write(f"\n{line}\n")
    rc, output, results = lint_imports(tmp_path)
    assert (rc != 0) == bool(broken), output
    assert {c for c in (INDEPENDENT, FOUNDATION, NO_GRPC) if status_of(results, c) == "BROKEN"} == broken, output
    if importer is not None:
        assert f"- {importer} " in output, output
