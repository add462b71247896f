"""The sidecar pod shape in the deployment files: llama-server and kvstash share a slot directory in memory, and
the sidecar's command line is one `kvstash sidecar` accepts."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cachestore.errors import ConfigError
from ops.cli import build_parser
from ops.sidecar_cmd import start_engine
from tests.paths import ROOT

K8S = ROOT / "ops" / "k8s" / "llama-server"


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _sidecar_args(command: list[str]) -> Any:
    assert command[:2] == ["kvstash", "sidecar"]
    return build_parser().parse_args(command[1:])


def test_k8s_pod_runs_llama_server_and_the_sidecar_on_one_memory_volume() -> None:
    docs = {d["kind"]: d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d and d.get("kind") != "Kustomization"}
    kustomize = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomize["resources"]) == files
    pod = docs["Deployment"]["spec"]["template"]
    # llama-server is a native sidecar (an init container that keeps running): it stops only after kvstash drained
    containers = {c["name"]: c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}
    server, sidecar = containers["llama-server"], containers["kvstash"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["llama-server"]
    assert server["restartPolicy"] == "Always"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["slots"]["emptyDir"]["medium"] == "Memory"
    mount = {c: {m["name"]: m["mountPath"] for m in containers[c]["volumeMounts"]}["slots"] for c in containers}
    assert _option(server["args"], "--slot-save-path").rstrip("/") == mount["llama-server"]
    args = _sidecar_args(sidecar["command"])
    assert args.slot_dir == mount["kvstash"] and args.upstream.endswith(":" + _option(server["args"], "--port"))
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    service = docs["Service"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in sidecar["ports"]}


def test_compose_profile_shares_a_tmpfs_slot_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    server, sidecar = compose["services"]["llama-server"], compose["services"]["sidecar"]
    assert server["profiles"] == sidecar["profiles"] == ["llama-server"]
    assert (ROOT / server["build"]["dockerfile"]).is_file()
    volume = compose["volumes"]["llama-slots"]
    assert volume["driver_opts"]["type"] == "tmpfs"
    slot_mount = {v.split(":")[0]: v.split(":")[1] for v in server["volumes"]}["llama-slots"]
    assert _option(server["command"], "--slot-save-path").rstrip("/") == slot_mount
    args = _sidecar_args(sidecar["command"])
    assert {v.split(":")[0]: v.split(":")[1] for v in sidecar["volumes"]}["llama-slots"] == args.slot_dir
    assert args.upstream == f"http://llama-server:{_option(server['command'], '--port')}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "either --upstream URL --slot-dir DIR"),
        (["--spawn", "--upstream", "http://127.0.0.1:1"], "either --upstream"),
        (["--upstream", "http://127.0.0.1:1"], "needs --slot-dir"),
        (["--upstream", "http://127.0.0.1:1", "--slot-dir", "/tmp", "--", "-fa", "on"], "go to a spawned"),
        (["--upstream", "http://127.0.0.1:1", "--slot-dir", "/tmp"], "does not answer /props"),
    ],
)
def test_sidecar_command_line_mistakes_are_one_line(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["sidecar", *argv])
    with pytest.raises(ConfigError, match=message):
        start_engine(args)
