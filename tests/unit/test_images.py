"""The Dockerfiles, read as text (no container engine runs here): two stages, the last one running as an
unprivileged user with the model cache as a volume, nothing secret in the image, every file copied in one
that exists and is not ignored, and every image the compose file builds has its Dockerfile."""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY)", re.I)


def instructions(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def final_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    last = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last:]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_two_stages_and_the_last_runs_unprivileged_with_the_cache_volume(name):
    assert sum(op == "FROM" for op, _ in instructions(name)) == 2
    stage = final_stage(name)
    users = [arg for op, arg in stage if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert ("VOLUME", "/cache") in stage
    assert any(op == "ENV" and "PAGEDSERVE_CACHE=/cache" in arg for op, arg in stage)
    assert not any(op == "RUN" and ("g++" in arg or "pip install" in arg) for op, arg in stage), \
        "the build tools stay in the first stage"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_secret_is_baked_into_the_image(name):
    for op, arg in instructions(name):
        if op in ("ENV", "ARG"):
            assert not SECRET_NAME.search(arg), f"{name}: {op} {arg}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_file_copied_in_exists_and_is_not_ignored(name):
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for op, arg in instructions(name):
        if op == "COPY" and "--from=" not in arg:
            *sources, _destination = arg.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{name}: COPY {source}"
                assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), f"{name}: {source} is ignored"
    assert {".env", "*.pem", "*.key"} <= set(ignored), "secrets must never enter the build context"


def test_every_image_the_compose_file_builds_has_its_dockerfile():
    document = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    built = {spec["build"]["dockerfile"] for spec in document["services"].values() if "build" in spec}
    assert built == set(DOCKERFILES)
