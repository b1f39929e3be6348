"""The tree's promise (docs/architecture.md): imports only go downwards, so there is no import
cycle among speedrun's modules (counting imports inside functions but not those under `if
TYPE_CHECKING:`, which never run, and a package's face: a
submodule importing names from its own package's `__init__`, which imports it back, is a cycle);
the cluster wing stands on the shared base alone; data and models never reach up into the loop;
no library module imports a command module. Each test names every import that breaks its rule."""
import ast
import os
from pathlib import Path

import speedrun

# The tree to check; SPEEDRUN_LAYOUT_SRC points the rules at another checkout's src/speedrun
# (how the layer test was shown failing on the tree before the cluster stopped importing stopping.py).
SRC = Path(os.environ.get("SPEEDRUN_LAYOUT_SRC", Path(speedrun.__file__).parent))
# Below both halves: what the trainer and the cluster wing may share.
BASE = {"speedrun", "speedrun.errors", "speedrun.files", "speedrun.spot", "speedrun.money", "speedrun.inputs",
        "speedrun.startup"}
# The loop and what only it uses: nothing below it (recipes, data, models) imports these.
LOOP = {"speedrun.engine", "speedrun.learner", "speedrun.checkpoint", "speedrun.stopping", "speedrun.track",
        "speedrun.rundir", "speedrun.local_launch"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:`: they never run, so they make no cycle (a
    provider makes jobs and a job holds its provider: each names the other in annotations only)."""
    return {n for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING" for stmt in node.body for n in ast.walk(stmt)}


def imports(path: Path, modules: set[str]) -> set[str]:
    """The speedrun modules `path` imports, in functions too but not for annotations only
    (type_only). `from pkg import name` counts as importing `pkg.name` when that is a module, else
    as importing the package's face `pkg` (also from inside pkg)."""
    me = module_name(path)
    found = set()
    tree = ast.parse(path.read_text())
    skip = type_only(tree)
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speedrun"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("speedrun"))
    return {m for m in found if m in modules and m != me}


def import_graph() -> dict[str, set[str]]:
    """Every speedrun module -> the speedrun modules it imports."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    return {name: imports(path, set(paths)) for name, path in paths.items()}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_command(module: str) -> bool:
    """A command module (docs/architecture.md): cli.py, <area>/cli.py or <area>_cli.py."""
    last = module.rsplit(".", 1)[-1]
    return last == "cli" or last.endswith("_cli")


def test_no_import_cycles():
    graph = import_graph()
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


def test_no_library_module_imports_a_command_module():
    """docs/architecture.md: the command modules (cli.py, <area>/cli.py, <area>_cli.py) parse,
    check and print; the library code they call never imports them back."""
    graph = import_graph()
    library = {name for name in graph if not is_command(name) and name != "speedrun.__main__"}
    assert "speedrun.engine" in library and "speedrun.train_cli" not in library
    wrong = sorted(f"{name} -> {m}" for name in library for m in graph[name] if is_command(m))
    assert not wrong, "\n".join(wrong)


def test_the_cluster_wing_stands_on_the_shared_base_alone():
    """speedrun.cluster runs any command on any hosts: it imports nothing of the trainer."""
    graph = import_graph()
    assert graph["speedrun.cluster.registry"]  # the scan sees the wing's imports
    wrong = sorted(f"{name} -> {m}" for name in graph if within(name, "speedrun.cluster")
                   for m in graph[name] if not within(m, "speedrun.cluster") and m not in BASE)
    assert not wrong, "the cluster wing imports the trainer:\n" + "\n".join(wrong)


def test_recipes_data_and_models_never_reach_up_into_the_loop_or_the_cluster():
    graph = import_graph()
    floors = ("speedrun.recipe", "speedrun.recipes", "speedrun.data", "speedrun.model", "speedrun.optim")
    wrong = sorted(f"{name} -> {m}" for name in graph if any(within(name, f) for f in floors)
                   for m in graph[name] if m in LOOP or within(m, "speedrun.cluster") or is_command(m))
    assert not wrong, "\n".join(wrong)


def test_no_module_but_a_providers_own_names_a_provider():
    """A provider is one class in its own module or package, listed in providers.PROVIDERS
    (docs/architecture.md, "Changing speedrun"): no other module imports a provider's class or
    spells a provider's name in its code (docstrings may). ssh.py and hosts.py are the transports:
    their program is called ssh and this machine's host local, whatever the providers are called;
    the wing's face re-exports LocalProvider and SSHProvider, as it always has."""
    from speedrun.cluster import providers

    kinds = set(providers.PROVIDERS)
    classes = {cls.__name__ for cls in providers.PROVIDERS.values()}
    assert {"local", "ssh", "aws", "slurm"} <= kinds and "SlurmProvider" in classes
    own = {"speedrun.cluster.providers", "speedrun.cluster.aws", "speedrun.cluster.slurm",
           "speedrun.cluster.ssh", "speedrun.cluster.hosts"}
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        if name == "speedrun.cluster" or any(within(name, o) for o in own):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and id(node) not in docstrings and node.value in kinds:
                wrong.append(f"{name}:{node.lineno}: the string {node.value!r}")
            elif isinstance(node, ast.alias) and node.name in classes:
                wrong.append(f"{name}: imports {node.name}")
            elif isinstance(node, ast.Name) and node.id in classes:
                wrong.append(f"{name}:{node.lineno}: {node.id}")
    assert not wrong, "\n".join(wrong)
