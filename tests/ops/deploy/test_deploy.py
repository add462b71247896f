"""Deployment files without a Docker engine: compose, Dockerfile, Redis configs, Kubernetes, Prometheus, Grafana."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from cachestore.errors import ConfigError
from ops.redisproc import RedisProcess, free_port, redis_binary
from service.settings import _ENV_CASTS, PLACEHOLDER, SECRET_VARS, settings_from_env
from tests.paths import ROOT

OPS = ROOT / "ops"
KNOWN_ENV = {f"KVSTASH_{n.upper()}" for n in _ENV_CASTS} | {"KVSTASH_NO_CACHE", "KVSTASH_API_KEYS",
                                                            "KVSTASH_REDIS_URL", "KVSTASH_CACHE_DIR"}
KNOWN_ENV |= {f"KVSTASH_{n}_FILE" for n in SECRET_VARS}


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def substitute(value: str) -> str:
    """${VAR:-default} -> default, as compose does with VAR unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def local_sources(service: dict[str, Any]) -> list[str]:
    sources = [v.split(":", 1)[0] for v in service.get("volumes", []) if isinstance(v, str)]
    return [s for s in sources if s.startswith(".")]


def test_compose_parses_and_references_existing_files() -> None:
    compose = load(ROOT / "docker-compose.yml")
    services = compose["services"]
    assert {"redis", "pod1", "pod2", "pod3", "nginx", "prometheus", "grafana", "redis-exporter"} <= set(services)
    for name, service in services.items():
        for source in local_sources(service):
            assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    assert (ROOT / services["pod1"]["build"] / "Dockerfile").is_file()
    assert "redis.conf" in " ".join(services["redis"]["command"])
    assert services["redis"]["healthcheck"]["test"][-1] == "ping"


def test_compose_pods_are_alike_and_their_settings_load(tmp_path: Path) -> None:
    compose = load(ROOT / "docker-compose.yml")
    services = compose["services"]
    envs = [services[f"pod{i}"]["environment"] for i in (1, 2, 3)]
    assert [e.pop("KVSTASH_POD_NAME") for e in envs] == ["pod1", "pod2", "pod3"]
    assert envs[0] == envs[1] == envs[2]
    assert set(envs[0]) <= KNOWN_ENV
    # signed out of the box: the frame key is a compose secret, from the file `make secrets` writes
    (secret,) = services["pod1"]["secrets"]
    assert envs[0]["KVSTASH_FRAME_KEY_FILE"] == f"/run/secrets/{secret}"
    assert compose["secrets"][secret]["file"] == "./.secrets/frame_key"
    assert ".secrets/frame_key:" in (ROOT / "Makefile").read_text()
    key = tmp_path / "frame_key"
    key.write_text("0123456789abcdef" * 4 + "\n")
    env = {k: substitute(str(v)) for k, v in envs[0].items()} | {"KVSTASH_FRAME_KEY_FILE": str(key)}
    settings = settings_from_env(env)
    assert settings.frame_key == "0123456789abcdef" * 4
    assert settings.redis_url == "redis://redis:6379/0" and settings.codec == "exact"
    maxmemory = re.search(r"^maxmemory (\d+)gb$", (OPS / "redis" / "redis.conf").read_text(), re.M)
    assert maxmemory is not None
    assert settings.budget_bytes <= 0.8 * int(maxmemory.group(1)) * (1 << 30)  # room for sessions and overshoot
    assert services["pod1"]["stop_grace_period"] == "30s"


def test_cluster_override() -> None:
    override = load(ROOT / "docker-compose.cluster.yml")["services"]
    assert {"redis", "redis-2", "redis-3", "redis-cluster-init"} <= set(override)
    for name, service in override.items():
        for source in local_sources(service):
            assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    for pod in ("pod1", "pod2", "pod3"):
        assert override[pod]["environment"]["KVSTASH_REDIS_URL"].startswith("redis+cluster://redis:")
        assert override[pod]["depends_on"]["redis-cluster-init"]["condition"] == "service_completed_successfully"
    assert "--cluster create" in override["redis-cluster-init"]["command"][0]


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="neither docker-compose nor the docker compose plugin is installed "
                                                    "(`docker compose config` needs no engine, only the CLI)")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cluster.yml"]])
def test_compose_config_validates(files: list[str]) -> None:
    cli = _compose_cli()
    assert cli is not None
    args = [*cli, *(a for f in files for a in ("-f", f)), "config", "--quiet"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # torch from the CPU index unless a build names another one (compose-check does, where it is out of reach)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert 'pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0' in text
    assert text.index("torch==2.13.0") < text.index("pip install '.[hf,llamacpp]'")  # the image runs both engines
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/healthz", text, re.M)
    # COPY sources, the modules it imports, its commands: tests/ops/deploy/test_deploy_refs.py
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def start_redis_with(conf: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], redis.Redis]:
    port = free_port(max_port=55535)
    proc = subprocess.Popen([redis_binary(), str(conf), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = RedisProcess(port=port)
    server.proc = proc
    try:
        server.wait_ready()
    except Exception:  # noqa: BLE001 - any failure to start: show redis-server's own output
        proc.kill()
        raise AssertionError(proc.stdout.read().decode() if proc.stdout else "redis-server failed") from None
    return proc, redis.Redis(port=port)


def test_redis_conf_is_accepted(tmp_path: Path) -> None:
    proc, client = start_redis_with(OPS / "redis" / "redis.conf", tmp_path)
    try:
        config = client.config_get("*")
        assert config["maxmemory-policy"] == "allkeys-lru" and int(config["maxmemory"]) == 2 << 30
        assert config["save"] == "" and config["appendonly"] == "no" and config["lazyfree-lazy-eviction"] == "yes"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_cluster_conf_is_accepted(tmp_path: Path) -> None:
    conf = tmp_path / "cluster.conf"  # the include points where compose mounts redis.conf; point it here
    conf.write_text((OPS / "redis" / "redis-cluster.conf").read_text().replace(
        "/usr/local/etc/redis/base.conf", str(OPS / "redis" / "redis.conf")))
    proc, client = start_redis_with(conf, tmp_path)
    try:
        assert client.info("cluster")["cluster_enabled"] == 1
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def k8s_docs() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted((OPS / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None or doc.get("kind") == "Kustomization":
                continue
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            assert doc["metadata"]["name"]
            docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests() -> None:
    docs = k8s_docs()
    kinds = {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "Secret", "PodDisruptionBudget"}
    assert kinds <= set(docs)
    kustomize = load(OPS / "k8s" / "kustomization.yaml")
    assert sorted(kustomize["resources"]) == sorted(p.name for p in (OPS / "k8s").glob("*.yaml")
                                                    if p.name != "kustomization.yaml")
    deploy = docs["Deployment"]
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert "preStop" in container["lifecycle"]
    # the grace against preStop and the drain, probes, budget and autoscaler: tests/ops/deploy/test_k8s_schema.py
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    refs = {next(iter(r.values()))["name"] for r in container["envFrom"]}
    assert refs == {docs["ConfigMap"]["metadata"]["name"], docs["Secret"]["metadata"]["name"]}
    env = set(docs["ConfigMap"]["data"]) | set(docs["Secret"]["stringData"]) | {e["name"] for e in container["env"]}
    assert env <= KNOWN_ENV
    # signed by default: the Secret holds a frame key, a placeholder pods refuse until an operator makes one
    assert docs["Secret"]["stringData"]["KVSTASH_FRAME_KEY"] == PLACEHOLDER
    with pytest.raises(ConfigError, match="placeholder"):
        settings_from_env({"KVSTASH_FRAME_KEY": PLACEHOLDER})
    assert all(isinstance(v, str) for v in docs["ConfigMap"]["data"].values())  # ConfigMap values are strings
    service = docs["Service"]
    assert service["spec"].get("sessionAffinity", "None") == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    port_names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                            "name": deploy["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_prometheus_scrapes_every_pod() -> None:
    prom = load(OPS / "prometheus" / "prometheus.yml")
    services = load(ROOT / "docker-compose.yml")["services"]
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"pod1:8000", "pod2:8000", "pod3:8000"} <= targets
    assert all(t.split(":")[0] in services for t in targets)
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert set(prom["rule_files"]) <= mounted
    rules = load(OPS / "prometheus" / "alerts.yml")
    assert all(r["alert"] and r["expr"] for g in rules["groups"] for r in g["rules"])


def exposed_metrics(redis_url: str, tiny_model: Any) -> str:
    """What a real pod's /metrics shows after one request (so labelled series exist)."""
    from starlette.testclient import TestClient  # noqa: PLC0415 - the other deployment tests need no service

    from service.app import create_app  # noqa: PLC0415
    from service.settings import PodSettings  # noqa: PLC0415

    settings = PodSettings(model="tiny-random", redis_url=redis_url, codec="exact", block_tokens=16)
    with TestClient(create_app(settings, engine=tiny_model)) as client:
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        return client.get("/metrics").text


def test_dashboards_and_alerts_use_real_metric_names(redis_server: RedisProcess, tiny_model: Any) -> None:
    dashboard = json.loads((OPS / "grafana" / "dashboards" / "kvstash.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = load(OPS / "prometheus" / "alerts.yml")
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(kvstash_[a-z_]+)\b", e)}
    text = exposed_metrics(redis_server.url, tiny_model)
    exposed = set(re.findall(r"^(kvstash_[a-z_]+)", text, re.M))  # series with samples, and declared ones:
    suffixes = {"histogram": ("_bucket", "_sum", "_count")}  # counters are declared with their _total
    for name, kind in re.findall(r"^# TYPE (kvstash_[a-z_]+) (\w+)", text, re.M):
        exposed.update(name + s for s in suffixes.get(kind, ("",)))
    assert used and used <= exposed, used - exposed
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit rate", "cached vs computed", "time to first token", "bytes vs budget", "evictions",
                  "errors", "breaker"):
        assert topic in titles
    # redis_exporter's names (https://github.com/oliver006/redis_exporter), scraped as job "redis"
    exporter = {m for e in exprs for m in re.findall(r"\b(redis_[a-z_]+)\b", e)}
    assert exporter <= {"redis_key_value", "redis_memory_used_bytes", "redis_memory_max_bytes",
                        "redis_evicted_keys_total", "redis_expired_keys_total"}


def test_grafana_provisioning_matches_compose() -> None:
    services = load(ROOT / "docker-compose.yml")["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = load(OPS / "grafana" / "provisioning" / "dashboards" / "kvstash.yml")["providers"][0]
    assert mounts["./ops/grafana/dashboards"] == provider["options"]["path"]
    datasource = load(OPS / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["uid"] == "prometheus"
    dashboard = json.loads((OPS / "grafana" / "dashboards" / "kvstash.json").read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"prometheus"}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
