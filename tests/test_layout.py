"""The tree's promise (docs/architecture.md): imports only go downwards, so there is no import
cycle among speedrun's modules, counting imports inside functions too."""
import ast
from pathlib import Path

import speedrun

SRC = Path(speedrun.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The speedrun modules `path` imports (a package's own ancestors excluded: Python imports a
    package before its submodules anyway)."""
    me = module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speedrun"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("speedrun"))
    return {m for m in found if m in modules and m != me and not me.startswith(m + ".")}


def test_no_import_cycles():
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: imports(path, set(paths)) for name, path in paths.items()}
    assert graph["speedrun.engine"] >= {"speedrun.learner", "speedrun.checkpoint"}  # the scan sees imports

    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
