"""ops/k8s against a pinned subset of the Kubernetes schema (tests/k8s_schema.json), and against the pods themselves:
probes on paths and ports a pod really serves, a termination grace above the preStop sleep plus the pod's drain
grace, a rollout that never lowers capacity, a disruption budget on the Deployment's pods that lets a node drain,
and an autoscaler on a metric the pods export."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.app import create_app
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings
from tests.k8sschema import manifest_errors
from tests.paths import ROOT

K8S = ROOT / "ops" / "k8s"
SHAPES = [K8S, K8S / "llama-server"]  # kvstash serve; kvstash sidecar beside llama-server (shares K8S's ConfigMap)
KVSTASH_IMAGES = ("kvstash:", "kvstash-sidecar:")  # the pod's image (Dockerfile), the sidecar's (ops/sidecar/)


def docs(folder: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                found[doc["kind"]] = doc
    return found


def config() -> dict[str, str]:
    return dict(docs(K8S)["ConfigMap"]["data"])


def containers(deploy: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deploy["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def kvstash_container(deploy: dict[str, Any]) -> dict[str, Any]:
    (found,) = [c for c in containers(deploy) if c["image"].startswith(KVSTASH_IMAGES)]
    return found


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def prestop_s(container: dict[str, Any]) -> int:
    """The preStop hook's sleep, in seconds (the sleep action, or an exec of python's time.sleep)."""
    hook = container["lifecycle"]["preStop"]
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    found = re.search(r"time\.sleep\((\d+)\)", " ".join(hook["exec"]["command"]))
    assert found, hook
    return int(found.group(1))


@pytest.mark.parametrize("folder", SHAPES, ids=["serve", "sidecar"])
def test_manifests_conform_to_the_pinned_schema(folder: Path) -> None:
    found = docs(folder)
    assert found
    for kind, doc in found.items():
        assert manifest_errors(doc) == [], kind


def test_the_schema_check_catches_what_kubectl_would_refuse() -> None:
    deploy = docs(K8S)["Deployment"]
    typo = copy.deepcopy(deploy)
    spec = typo["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    assert any("terminationGracePeriodSecond'" in e for e in manifest_errors(typo))
    missing = copy.deepcopy(deploy)
    del missing["spec"]["template"]["spec"]["containers"][0]["image"]
    assert any("'image' is required" in e for e in manifest_errors(missing))
    wrong = copy.deepcopy(docs(K8S)["HorizontalPodAutoscaler"])
    wrong["spec"]["metrics"][0]["pods"]["target"]["type"] = "Average"
    assert any("is not one of" in e for e in manifest_errors(wrong))


@pytest.mark.parametrize("folder", SHAPES, ids=["serve", "sidecar"])
def test_probes_ask_what_the_pod_serves(folder: Path) -> None:
    deploy = docs(folder)["Deployment"]
    served = {route.path for route in create_app(PodSettings()).routes}  # the pod's routes (nothing loads here)
    env = {**config(), **{e["name"]: e["value"] for e in kvstash_container(deploy).get("env", []) if "value" in e}}
    for container in containers(deploy):
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        own = container["image"].startswith(KVSTASH_IMAGES)
        args = container.get("command", []) + container.get("args", [])
        # the port the process listens on: KVSTASH_PORT or --port (kvstash), --port (llama-server)
        listens = int(option(args, "--port") or env.get("KVSTASH_PORT") or PodSettings().port)
        assert listens in ports.values(), (container["name"], listens, ports)
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind not in container:
                continue
            get = container[kind]["httpGet"]
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert port == listens, (container["name"], kind)
            assert get["path"] in (served if own else {"/health"}), (container["name"], kind, get["path"])
        if own:
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 while draining
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"  # alive while draining
            scraped = deploy["spec"]["template"]["metadata"]["annotations"]
            assert int(scraped["prometheus.io/port"]) == listens and scraped["prometheus.io/path"] in served


@pytest.mark.parametrize("folder", SHAPES, ids=["serve", "sidecar"])
def test_termination_grace_covers_prestop_and_the_drain(folder: Path) -> None:
    deploy = docs(folder)["Deployment"]
    pod = kvstash_container(deploy)
    drain_s = float(config().get("KVSTASH_DRAIN_GRACE_S", PodSettings().drain_grace_s))
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # the kubelet counts the grace from the preStop hook on: the drain must end (exit 0) before it SIGKILLs
    assert prestop_s(pod) + drain_s < grace, (prestop_s(pod), drain_s, grace)
    assert prestop_s(pod) >= 2  # long enough for the endpoints to drop the pod before its listener closes
    for other in containers(deploy):
        if other is not pod:  # llama-server: a native sidecar, stopped only once kvstash has exited
            assert other.get("restartPolicy") == "Always" and other in deploy["spec"]["template"]["spec"][
                "initContainers"], other["name"]


@pytest.mark.parametrize("folder", SHAPES, ids=["serve", "sidecar"])
def test_rollout_budget_and_autoscaler_agree(folder: Path) -> None:
    found = docs(folder)
    deploy, pdb, hpa = found["Deployment"], found["PodDisruptionBudget"], found["HorizontalPodAutoscaler"]
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["selector"] == deploy["spec"]["selector"]  # the budget covers exactly these pods
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment",
                                                                    deploy["metadata"]["name"])
    low, high = hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]
    assert 2 <= low <= deploy["spec"]["replicas"] <= high
    # at the fewest replicas a node drain can still evict one pod, and one pod still serves
    allowed = pdb["spec"]["maxUnavailable"] if "maxUnavailable" in pdb["spec"] else low - pdb["spec"]["minAvailable"]
    assert 1 <= allowed < low
    exported = {family.name for family in PodMetrics().registry.collect()}
    pods_metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metrics and set(pods_metrics) <= exported, (pods_metrics, sorted(exported))
