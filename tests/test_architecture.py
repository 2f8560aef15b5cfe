"""The package's shape, as docs/ARCHITECTURE.md states it: layers that import only downwards,
no import cycles between modules, and modules small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minfer"

# Bottom to top; a module may import from its own layer or below (docs/ARCHITECTURE.md).
# Each entry is a top-level module or package of minfer/.
LAYERS = [
    ["core", "config", "defaults", "device"],  # types every layer shares
    ["observability"],  # trace events, metrics: about requests, not the engine
    ["kernels", "distributed"],  # Triton kernels; process groups and collectives
    ["kvcache"],  # pool, allocator, page table, prefix caches
    ["attention"],  # backends over the pool
    ["layers"],
    ["models"],
    ["engine"],  # one forward pass + sampling, per rank
    ["scheduler"],  # which requests run; KV bookkeeping through kvcache
    ["ipc"],  # messages between processes
    ["tokenizer"],  # intake, tokenizer and detokenizer workers
    ["runner"],  # the driver: TP step protocol, the scheduler worker process
    ["llm", "server", "bench"],  # front ends
    ["cli", "__main__"],
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
# Modules allowed past MAX_LINES, each with the reason.
LONG_MODULES: dict[str, str] = {
    "config.py": "every option minfer has, one flat list by design: a flag's help text sits beside it",
}
# "About 300 lines" of the dense style the code was written in; `ruff format` (one argument per
# line where a call does not fit) made the same tree 15% longer (11,506 -> 13,258 lines).
MAX_LINES = 350


def modules() -> dict[str, Path]:
    """'minfer.scheduler.prefill' -> its file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """minfer modules `path` imports anywhere (lazy imports count), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("minfer"):
                while name not in known and "." in name:  # `from pkg import module` or a symbol
                    name = name.rsplit(".", 1)[0]
                found.add(name)
                break
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself: `from minfer import __version__`
        return 0
    return LAYER_OF[parts[1]]


def test_every_module_has_a_layer():
    tops = {name.split(".")[1] for name in modules() if "." in name}
    assert tops <= set(LAYER_OF), f"add {sorted(tops - set(LAYER_OF))} to LAYERS and docs/ARCHITECTURE.md"


def test_imports_only_go_down():
    known = modules()
    upward = []
    for name, path in known.items():
        if name == "minfer":  # the public facade re-exports from the top (lazily)
            continue
        for target in imports_of(path, known):
            if layer(target) > layer(name):
                upward.append(f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    known = modules()
    graph = {
        name: imports_of(path, known) - {name, "minfer"} for name, path in known.items() if name != "minfer"
    }
    # A package imports its own modules through __init__ only if it says so; ignore pkg -> pkg.child.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_modules_are_small():
    long = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and rel not in LONG_MODULES:
            long.append(f"{rel}: {lines} lines")
    assert not long, "split these, or say why in LONG_MODULES: " + ", ".join(long)


def test_the_layer_table_is_in_the_architecture_doc():
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    for names in LAYERS:
        for name in names:
            assert f"`{name}`" in doc, f"docs/ARCHITECTURE.md does not mention `{name}`"
