"""The tests' own house rules, checked on every run: one copy of each helper (never a body written twice), no sleep
that orders events (a test waits for the event, through tests.timing), and no test module importing another."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.paths import TESTS

MODULES = {path: ast.parse(path.read_text()) for path in sorted(TESTS.rglob("*.py"))}
SMALLEST = 24  # AST nodes below which two bodies alike are a phrase, not a helper written twice
MARK = "the wait is the test"  # a sleep that is what a test exercises: a slow client, a stalled server, a TTL


def _name(path: Path) -> str:
    return str(path.relative_to(TESTS.parent))


def _body(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> tuple[str, int]:
    """The body without its docstring, as a dump and a size."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return "\n".join(ast.dump(b) for b in body), sum(1 for b in body for _ in ast.walk(b))


def test_no_helper_is_written_twice() -> None:
    bodies: dict[str, list[str]] = {}
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            helper = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if helper and not node.name.startswith(("test_", "Test")):  # fixtures are helpers too
                dump, size = _body(node)
                if size >= SMALLEST:
                    bodies.setdefault(dump, []).append(f"{_name(path)}:{node.lineno} {node.name}")
    twice = [places for places in bodies.values() if len(places) > 1]
    assert not twice, f"the same body in several places, make it one helper (tests/support.py or a kit): {twice}"


def _sleeps(tree: ast.AST) -> list[tuple[ast.Call, list[ast.While]]]:
    """Every call of a `sleep`, with the `while` loops around it."""
    found: list[tuple[ast.Call, list[ast.While]]] = []

    def visit(node: ast.AST, loops: list[ast.While]) -> None:
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "sleep":
                found.append((node, loops))
        inner = [*loops, node] if isinstance(node, ast.While) else loops
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, [])
    return found


def test_no_sleep_orders_events() -> None:
    """A sleep is allowed only where it paces a loop that polls against a deadline, where it is what the test
    exercises (marked with MARK on its line or the line above), or as sleep(0). Everything else waits for its
    event with tests.timing.wait_for."""
    wrong = []
    for path, tree in MODULES.items():
        if path.name == "timing.py":
            continue
        lines = path.read_text().splitlines()
        for call, loops in _sleeps(tree):
            near = " ".join(lines[max(call.lineno - 2, 0):call.end_lineno or call.lineno])
            polling = any("monotonic" in ast.unparse(loop) or "deadline" in ast.unparse(loop) for loop in loops)
            zero = bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0
            if not (polling or zero or MARK in near):
                wrong.append(f"{_name(path)}:{call.lineno}")
    assert not wrong, f"wait for the event (tests.timing.wait_for), or mark a deliberate delay {MARK!r}: {wrong}"


def test_no_test_module_imports_another() -> None:
    wrong = []
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                if node.module.rsplit(".", 1)[-1].startswith("test_"):
                    wrong.append(f"{_name(path)}:{node.lineno} {node.module}")
    assert not wrong, f"helpers live in helper modules, not in test modules: {wrong}"


def test_every_test_path_named_exists() -> None:
    """The Makefile, CI, ops/ and the docs name test files by path: each exists (a moved test takes its references
    along). CHANGELOG.md keeps the paths of its time."""
    root = TESTS.parent
    named = [root / name for name in ("Makefile", "pyproject.toml", "RELIABILITY.md", "README.md", ".ci/run")]
    named += [*root.glob("docs/**/*.md"), *root.glob("docs/results/*.jsonl"), *root.glob("ops/**/*.py"),
              *root.glob("ops/**/*.md"), *root.glob("cachestore/**/*.py"), *root.glob("service/**/*.py")]
    missing = set()
    for path in named:
        if path.is_file():
            for found in re.findall(r"\btests/[\w/]*\w\.(?:py|json)", path.read_text(errors="replace")):
                if not (root / found).exists():
                    missing.add(f"{path.relative_to(root)}: {found}")
    assert not missing, sorted(missing)


def test_test_modules_sit_in_packages_that_mirror_the_code() -> None:
    """Test modules live in tests/<package>/... (or tests/scenarios/ for suites across packages), each folder a
    package; only the checks of the whole tree sit at the top."""
    top = {"test_architecture.py", "test_layout.py"}
    wrong = []
    for path in MODULES:
        if not path.name.startswith("test_"):
            continue
        folder = path.parent
        if folder == TESTS:
            if path.name not in top:
                wrong.append(_name(path))
        elif path.relative_to(TESTS).parts[0] not in ("cachestore", "service", "ops", "scenarios"):
            wrong.append(_name(path))
        elif not all((parent / "__init__.py").exists() for parent in (folder, *folder.parents)
                   if parent.is_relative_to(TESTS)):
            wrong.append(_name(path))
    assert not wrong, f"put these under the folder of the package they test: {wrong}"
