"""Everything the Dockerfiles, the compose files, ops/k8s and the Makefile name exists, without a container engine:
COPY sources (and not dockerignored), the modules and names `python -c` / `python -m` import, every `kvstash ...`
command line (parsed by the real CLI), the files llama-server is pointed at, the images manifests run."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ops.cli import build_parser
from tests.paths import ROOT

OWN = ("cachestore", "service", "ops")  # the packages of this tree
COMPOSE = ["docker-compose.yml", "docker-compose.cluster.yml"]


def dockerfiles() -> list[Path]:
    return sorted([ROOT / "Dockerfile", *(ROOT / "ops").rglob("Dockerfile")])


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def services() -> Iterator[tuple[str, dict[str, Any]]]:
    for name in COMPOSE:
        yield from yaml.safe_load((ROOT / name).read_text())["services"].items()


def k8s_containers() -> Iterator[dict[str, Any]]:
    for path in sorted((ROOT / "ops" / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            yield from [*spec.get("initContainers", []), *spec.get("containers", [])]


def argvs() -> Iterator[tuple[str, list[str]]]:
    """Every command line the deployment files run: (where, argv)."""
    for dockerfile in dockerfiles():
        for op, rest in instructions(dockerfile):
            if op in ("CMD", "ENTRYPOINT") and rest.startswith("["):
                yield f"{dockerfile.relative_to(ROOT)} {op}", json.loads(rest)
            elif op in ("RUN", "CMD", "HEALTHCHECK"):
                yield f"{dockerfile.relative_to(ROOT)} {op}", shlex.split(rest.replace("CMD ", "", 1))
    for name, service in services():
        if isinstance(service.get("command"), list):
            yield f"compose {name}", service["command"]
        test = service.get("healthcheck", {}).get("test", [])
        if test[:1] == ["CMD"]:
            yield f"compose {name} healthcheck", test[1:]
    for container in k8s_containers():
        yield f"k8s {container['name']}", container.get("command", []) + container.get("args", [])
        for hook in container.get("lifecycle", {}).values():
            yield f"k8s {container['name']} hook", hook.get("exec", {}).get("command", [])


def python_snippets() -> Iterator[tuple[str, str]]:
    """The code of every `python -c CODE` in those command lines."""
    for where, argv in argvs():
        for i, word in enumerate(argv[:-1]):
            if word in ("python", "python3") and argv[i + 1] == "-c":
                yield where, argv[i + 2]


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def defines(path: Path, name: str) -> bool:
    """`name` is defined at the top of the module (or is a submodule of the package)."""
    package = path.parent.relative_to(ROOT).as_posix().replace("/", ".")
    if path.name == "__init__.py" and module_file(f"{package}.{name}"):
        return True
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.Import | ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def resolves(module: str) -> bool:
    if module.split(".")[0] in OWN:
        return module_file(module) is not None
    return importlib.util.find_spec(module.split(".")[0]) is not None  # stdlib, or a dependency the image installs


def dockerignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) or
               (pat.startswith("**/") and fnmatch.fnmatch(Path(p).name, pat[3:]))
               for p in prefixes for pat in patterns)


def test_every_dockerfile_is_built_by_compose_under_the_tag_it_documents() -> None:
    built: dict[str, str] = {}
    for _, service in services():
        if "build" in service:
            build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
            dockerfile = Path(build.get("context", ".")) / build.get("dockerfile", "Dockerfile")
            built[dockerfile.as_posix()] = service["image"]
    assert set(built) == {p.relative_to(ROOT).as_posix() for p in dockerfiles()}
    for dockerfile, image in built.items():
        documented = re.findall(r"^#\s+docker build .*-t (\S+)", (ROOT / dockerfile).read_text(), re.M)
        assert image in documented, (dockerfile, image, documented)


@pytest.mark.parametrize("dockerfile", dockerfiles(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_copy_sources_exist_in_the_build_context(dockerfile: Path) -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copies = [rest.split() for op, rest in instructions(dockerfile) if op in ("COPY", "ADD")]
    assert copies
    for words in copies:
        if any(w.startswith("--from=") for w in words):
            continue
        for source in (w for w in words[:-1] if not w.startswith("--")):
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert not dockerignored(source.rstrip("/"), ignored), f"{dockerfile.name}: COPY {source} is dockerignored"


def test_python_snippets_import_what_exists() -> None:
    snippets = list(python_snippets())
    for where, code in snippets:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert resolves(alias.name), f"{where}: import {alias.name}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert resolves(node.module), f"{where}: from {node.module}"
                path = module_file(node.module)
                for alias in node.names:
                    assert path is None or defines(path, alias.name), f"{where}: {node.module} has no {alias.name}"
    assert any("load_model" in code for _, code in snippets)  # the pod image's model conversion was seen


def test_python_modules_run_with_m_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    named = re.findall(r"\$\(PY\) -m ([\w.]+)", makefile)
    named += [argv[argv.index("-m") + 1] for _, argv in argvs() if argv[:1] in (["python"], ["python3"])
              and "-m" in argv]
    assert "ops.composecheck" in named
    for module in named:
        assert resolves(module), module
        if module.split(".")[0] in OWN:
            path = module_file(module)
            assert path is not None and '__name__ == "__main__"' in path.read_text(), f"{module} cannot be run"


def test_kvstash_command_lines_parse() -> None:
    parser = build_parser()
    seen = []
    for where, argv in argvs():
        if argv[:1] == ["kvstash"]:
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{where}: `{shlex.join(argv)}` is not a kvstash command line")
            seen.append(argv[1])
    assert {"serve", "sidecar"} <= set(seen)  # the pod image's CMD; the sidecar's in compose, its image and k8s
    makefile = (ROOT / "Makefile").read_text()
    for line in re.findall(r"bin/kvstash (.+)$", makefile, re.M):
        parser.parse_args(shlex.split(line))


def test_llama_server_is_pointed_at_files_its_image_holds() -> None:
    """`-m` names the GGUF ops/llamaserver/Dockerfile copies in; the image's ENTRYPOINT is llama-server itself."""
    dockerfile = ROOT / "ops" / "llamaserver" / "Dockerfile"
    ops = instructions(dockerfile)
    holds = {rest.split()[-1] for op, rest in ops if op == "COPY"}
    (entry,) = [json.loads(rest) for op, rest in ops if op == "ENTRYPOINT"]
    assert entry[0] in holds
    lines = [argv for where, argv in argvs() if where in ("compose llama-server", "k8s llama-server")]
    assert len(lines) == 2
    for argv in lines:
        assert argv[argv.index("-m") + 1] in holds


def test_images_the_manifests_run_are_built_here_or_public() -> None:
    built = {s["image"] for _, s in services() if "build" in s}
    public = {s["image"] for _, s in services() if "build" not in s and "image" in s}
    assert all(re.fullmatch(r"[\w./-]+:[\w.-]+", image) for image in public)  # pinned tags, never :latest
    assert not any(image.endswith(":latest") for image in public)
    for container in k8s_containers():
        assert container["image"] in built, (container["name"], container["image"])


def test_sidecar_image_installs_no_torch_and_no_engine() -> None:
    """The sidecar's image is the core and its `sidecar` extra: no torch (nor its index), no engine."""
    ops = instructions(ROOT / "ops" / "sidecar" / "Dockerfile")
    runs = [rest for op, rest in ops if op == "RUN"]
    assert not any("torch" in r.lower() for r in runs) and not any("TORCH" in rest for _, rest in ops)
    assert any("pip install '.[sidecar]'" in r for r in runs)
    assert not any("llama-cpp-python" in r or "[llamacpp" in r or "load_model" in r for r in runs)
