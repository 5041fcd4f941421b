"""The TUI's modules import one way: no module of gputui/tui (or gputui/watch.py) imports one that
imports it back, however indirectly, not even under TYPE_CHECKING or inside a function."""

import ast
from pathlib import Path

import gputui

ROOT = Path(gputui.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The gputui modules `path` imports, wherever the import statement is."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found - {name}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: imports(path, set(paths)) for name, path in paths.items()}


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A chain of imports from `start` to `goal`, if any."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        for nxt in edges[chain[-1]]:
            if nxt == goal:
                return [*chain, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*chain, nxt])
    return None


def test_the_graph_sees_the_imports_it_should():
    edges = graph()
    assert {"gputui.tui.view", "gputui.tui.panels.memory", "gputui.tui.screens"} <= edges["gputui.tui.app"]
    assert "gputui.tui.watch_app" in edges["gputui.watch"]  # imported inside run_screen()


def test_no_tui_module_imports_one_that_imports_it_back():
    edges = graph()
    ours = sorted(name for name in edges if name.startswith("gputui.tui") or name == "gputui.watch")
    cycles = [chain for name in ours if (chain := reaches(edges, name, name))]
    assert cycles == []
