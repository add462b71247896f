"""The house's shape, checked on every run: layers that import only downward, no import cycle, no module over 400
lines, and a service/ top level that stays small (docs/architecture.md draws the same picture)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGES = ("cachestore", "service", "ops")

# Who may import whom, by prefix: a module under the key imports nothing under any of its values.
FORBIDDEN = {
    "cachestore": ("service", "ops"),
    "service": ("ops",),
    "service.runtime": ("service.http", "service.cache", "service.sidecar", "service.engines", "service.app",
                        "service.state"),
    "service.engines": ("service.http", "service.cache", "service.sidecar", "service.app", "service.state"),
    "service.cache": ("service.http", "service.sidecar", "service.app", "service.state"),
    "service.http": ("service.sidecar", "service.app"),  # handlers read the pod's parts from service.state
    "service.sidecar": ("service.app",),
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under an `if TYPE_CHECKING:` (imports for annotations only)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """The first-party modules `path` imports when it runs (a function's own imports included, an
    `if TYPE_CHECKING:` block's not), or with `top_level_only` only those the module's import runs."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else _runtime_nodes(tree)
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in MODULES}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_layers_import_only_downward() -> None:
    wrong = []
    for module, path in MODULES.items():
        rules = [banned for prefix, banned in FORBIDDEN.items() if _under(module, prefix)]
        for target in _imports(path):
            for banned in rules:
                if any(_under(target, b) for b in banned):
                    wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_import_cycle() -> None:
    # a module importing from its own package's __init__ is not an edge: the package is already being imported
    graph = {module: {t for t in _imports(path) if t != module and not _under(module, t)}
             for module, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # a package importing its own sub-modules from __init__ is not a cycle worth a failure
    cycles = [c for c in cycles if not all(_under(m, c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_400_lines(package: str) -> None:
    long = [f"{path.relative_to(ROOT)}: {n}" for module, path in MODULES.items()
            if _under(module, package) and (n := len(path.read_text().splitlines())) > 400]
    assert not long, "\n".join(long)


def test_service_top_level_stays_small() -> None:
    top = sorted(p.name for p in (ROOT / "service").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 6, top
