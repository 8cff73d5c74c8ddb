"""deploy/k8s: every manifest is valid against the Kubernetes schemas (kubernetes-validate ships them: no
cluster, no network), and every container that runs a service runs a command its service accepts (flags and
values from the ConfigMap, variables it reads), with probes, ports, Services and peers that line up."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.deployment import check_peers, check_service

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# gRPC probes are GA from 1.27; the newest schemas the package ships are checked too.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SECRET_PLACEHOLDER = "from-the-secret"


def manifests() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def config_data() -> dict[str, str]:
    [config_map] = of_kind("ConfigMap")
    return config_map["data"]


# What the downward API gives a pod, as the command check sees it.
FIELD_PLACEHOLDERS = {"status.podIP": "10.0.0.7"}


def container_env(container: dict) -> dict[str, str]:
    """The container's variables, with the ConfigMap's values, and a placeholder for a Secret's or a pod field's."""
    env = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "configMapKeyRef" in source:
            env[entry["name"]] = config_data()[source["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in source:
            env[entry["name"]] = SECRET_PLACEHOLDER
        elif "fieldRef" in source:
            env[entry["name"]] = FIELD_PLACEHOLDERS[source["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = entry["value"]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes; an undefined one stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def probe_ports(container: dict) -> set[int]:
    return {container[probe]["grpc"]["port"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")
            if "grpc" in container.get(probe, {})}


def selected(service: dict) -> list[dict]:
    """The containers of the Deployments a Service selects."""
    selector = service["spec"]["selector"]
    return [c for d in of_kind("Deployment")
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for c in d["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(version):
    found = manifests()
    assert {doc["kind"] for _, doc in found} >= {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                                                  "PersistentVolumeClaim"}
    for name, doc in found:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {error.message} at "
                        f"{'.'.join(map(str, error.path))}")


def test_the_validation_catches_a_misspelt_field():
    [deployment] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "frontend"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def service_containers() -> list[tuple[str, dict]]:
    return [(f"{d['metadata']['name']}/{c['name']}", c) for d in of_kind("Deployment")
            for c in d["spec"]["template"]["spec"]["containers"] if c["command"] == ["python"]]


def test_every_container_runs_a_command_its_service_accepts_and_its_peers_exist():
    containers = service_containers()
    assert {where.split("/")[0] for where, _ in containers} == {"executor", "kvcache", "scheduler", "frontend"}
    # What each Service name answers on: its ports, each leading to a port its pods listen on.
    listening = {}
    for service in of_kind("Service"):
        name = service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            targets = [p["containerPort"] for c in selected(service) for p in c.get("ports", [])]
            assert port["targetPort"] in targets, f"Service {name}: port {port['targetPort']} has no container"
        listening[name] = {port["port"] for port in service["spec"]["ports"]}
    for where, container in containers:
        env = container_env(container)
        raw = (*container["command"], *container["args"])
        argv = [expand(part, env) for part in raw]
        # A variable the arguments consume is the ConfigMap's way to a flag; any other the service must read.
        given = tuple(name for name in env if not any(f"$({name})" in part for part in raw))
        command = check_service(where, argv, given, {p["containerPort"] for p in container["ports"]},
                                probe_ports(container))
        check_peers(where, command, listening)
        for probe in ("livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["grpc"].get("service") == "liveness", \
                    f"{where}: a {probe} on the overall health would restart it for a neighbour's outage"


def test_the_command_check_catches_a_flag_the_service_lacks():
    where, container = service_containers()[0]
    env = container_env(container)
    argv = [expand(part, env) for part in (*container["command"], *container["args"], "--no-such-flag")]
    with pytest.raises(AssertionError, match="unrecognized arguments: --no-such-flag"):
        check_service(where, argv, tuple(env), set(), set())


def test_executors_request_a_gpu_and_a_disruption_budget_covers_them():
    [executor] = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "executor"]
    resources = executor["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
    [budget] = of_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == executor["spec"]["selector"]["matchLabels"]


def test_every_container_has_requests_and_limits_and_runs_unprivileged():
    for deployment in of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, deployment["metadata"]["name"]
        for container in pod["containers"]:
            assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), container["name"]
            assert {"cpu", "memory"} <= container["resources"]["limits"].keys(), container["name"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, container["name"]


def test_draining_services_get_longer_than_their_drain_to_stop():
    drain = float(config_data()["PAGEDSERVE_DRAIN_TIMEOUT_S"])
    for deployment in of_kind("Deployment"):
        args = " ".join(deployment["spec"]["template"]["spec"]["containers"][0].get("args", []))
        if "--drain-timeout-s" in args:
            assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def test_no_secret_is_written_in_the_manifests():
    for name, doc in manifests():
        assert doc["kind"] != "Secret", f"{name}: a Secret belongs in the cluster, not in the repository"
    for _, container in service_containers():
        for entry in container.get("env", []):
            if re.search(r"_(TOKEN|PASSWORD|KEY)$", entry["name"]):
                assert "secretKeyRef" in entry.get("valueFrom", {}), entry["name"]
