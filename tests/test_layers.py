"""The imports show the roles: the scheduler decides, the cache owner applies, the
runner executes; the UI reaches the engine only through `chat`; no module imports itself back.

Read from the source (every import statement, those inside functions and `TYPE_CHECKING` blocks
too: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chat", "cache_sessions", "ui")
MODEL_STEP = {"chat.model_step.resident", "chat.model_step.compiled", "chat.model_step.runner"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    found["app"] = ROOT / "app.py"
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from chat import errors` is chat.errors when that is
    a module, else the package itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle found by a depth-first walk (one per back edge)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    """A package's `__init__` re-exporting its modules is not a cycle unless a module imports the
    package's `__init__` back."""
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_cache_owner_imports_no_model_step():
    edges = graph()
    for owner in ("cache_sessions.owner", "cache_sessions.books"):  # the owner and its books
        assert owner in edges and not edges[owner] & MODEL_STEP
    assert "chat.model_step.runner" in edges["chat.scheduling.scheduler"]  # the one place the step is run from


def test_the_ui_reaches_the_caches_only_through_chat():
    edges = graph()
    reaching = {name: sorted(target for target in targets if target.startswith("cache_sessions"))
                for name, targets in edges.items() if name.startswith("ui") or name == "app"}
    assert {name: targets for name, targets in reaching.items() if targets} == {}


def test_cache_sessions_imports_neither_chat_nor_ui():
    for name, targets in graph().items():
        if name.startswith("cache_sessions"):
            assert not {target for target in targets if target.split(".")[0] in ("chat", "ui", "app")}, name
