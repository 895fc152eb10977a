"""The package's shape, from its own imports (read with ast, nothing imported): no cycle, imports only down the
layers of docs/architecture.md (a few by design, listed), and the operator never reaches JAX.

Imports inside functions count too: a lazy import still ties two files together, and hides a cycle only until the
function runs. Imports under `if TYPE_CHECKING:` count as well (they name what a file depends on).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The folders' import names (pyproject.toml's package-dir).
PACKAGES = {"capstan.runtime": ROOT / "runtime", "capstan.operator": ROOT / "operator"}
JAX = ("jax", "jaxlib", "haliax", "equinox", "optax")


def module_files() -> dict[str, Path]:
    """Import name -> file, for every module of capstan.runtime and capstan.operator."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(the package's modules this one imports, the top-level names of the others it imports)."""
    is_package = path.name == "__init__.py"
    inside: set[str] = set()
    outside: set[str] = set()

    def add(target: str):
        if target.split(".")[0] != "capstan":
            outside.add(target.split(".")[0])
            return
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            inside.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1 more
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from package import module` imports the module
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return inside, outside


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = module_files()
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name], external[name] = imports_of(name, path, modules)
    return graph, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph, external = import_graph()
    assert "capstan.runtime.engine.engine" in graph["capstan.runtime.engine.llm"]
    assert "jax" in external["capstan.runtime.engine.engine"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "modules that import each other (move what they share below both):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_operator_never_reaches_jax():
    graph, external = import_graph()
    reached, todo = set(), [m for m in graph if m.startswith("capstan.operator")]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph[m])
    offenders = {m: sorted(external[m] & set(JAX)) for m in sorted(reached) if external[m] & set(JAX)}
    assert not offenders, f"the operator imports JAX through: {offenders}"


# The layers, top to bottom (docs/architecture.md): a module imports only from layers below its own, and rooms that
# share a layer import nothing of each other. A room is a folder of runtime/ (its package included) or a top-level
# file; a module that ranks apart from its folder is named in full (parallel.mesh, which every device room reads).
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("picker",),  # capstan picker: picks with the gateway's replica pool and routing policy
    ("gateway",),
    ("operator",),  # capstan.operator: the gateway reads its CRD and cluster client; it reads server's metric names
    ("server",),
    ("engine",),
    ("speculative",),
    ("scheduling",),
    ("generation_config",),
    ("compilation_cache",),  # where compiled programs are kept, and the image's baked ones
    ("config",),
    ("sampling_keys",),
    ("lora",),
    ("sampling",),
    ("tokenizer",),
    ("gguf_tokenizer",),
    ("parallel",),
    ("models",),
    ("kv",),
    ("attention",),
    ("kernels",),
    # what every room reads, importing nothing of the package
    (
        "parallel.mesh",
        "limits",
        "arrays",
        "compat",
        "special_tokens",
        "gguf_metadata",
        "speculative_config",
        "arg_types",
        "__init__",
    ),
]
# Imports that run up by design, each with its reason: a kernel reads the shared types of the room that calls it.
BY_DESIGN = {
    ("kernels", "attention.metadata"): "a kernel reads the step's AttentionMetadata, which attention/ builds",
    ("kernels", "attention.kv_quantization"): "a kernel dequantizes FP8 K/V pages as the XLA reference does",
    ("kernels", "sampling.candidates"): "gpu_sampler's kernels draw the candidates the sampler's XLA path draws",
}


def room_of(module: str) -> str:
    """The LAYERS entry a module belongs to: its longest matching prefix (below capstan.runtime), or "operator"."""
    if module.startswith("capstan.operator"):
        return "operator"
    name = module.removeprefix("capstan.runtime").removeprefix(".") or "__init__"
    rooms = {room for layer in LAYERS for room in layer}
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rooms:
            return ".".join(parts[:n])
    return ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that do not run down the layers (besides BY_DESIGN's), and modules no layer names."""
    rank = {room: r for r, layer in enumerate(LAYERS) for room in layer}
    found = []
    for a, targets in sorted(graph.items()):
        ra = room_of(a)
        if not ra:
            found.append(f"{a}: in no layer (add its room to LAYERS)")
            continue
        for b in sorted(targets):
            rb = room_of(b)
            if rb == ra or rb and rank[rb] > rank[ra]:
                continue
            if any(ra.startswith(x) and b.removeprefix("capstan.runtime.").startswith(y) for x, y in BY_DESIGN):
                continue
            found.append(f"{a} -> {b}  ({rb} is not below {ra})" if rb else f"{a} -> {b}: {b} is in no layer")
    return found


def test_imports_run_down_the_layers():
    graph, _ = import_graph()
    found = upward_imports(graph)
    assert not found, "imports that run up the layers (move what is shared below both):\n" + "\n".join(found)


def test_an_upward_import_is_found():
    graph, _ = import_graph()
    graph["capstan.runtime.sampling.sampler"] = graph["capstan.runtime.sampling.sampler"] | {
        "capstan.runtime.scheduling.batch"
    }
    graph["capstan.runtime.kv.cache"] = graph["capstan.runtime.kv.cache"] | {"capstan.runtime.models.decoder"}
    graph["capstan.runtime.limits"] = graph["capstan.runtime.limits"] | {"capstan.runtime.arrays"}  # one layer
    graph["capstan.runtime.newroom.x"] = set()
    assert upward_imports(graph) == [
        "capstan.runtime.kv.cache -> capstan.runtime.models.decoder  (models is not below kv)",
        "capstan.runtime.limits -> capstan.runtime.arrays  (arrays is not below limits)",
        "capstan.runtime.newroom.x: in no layer (add its room to LAYERS)",
        "capstan.runtime.sampling.sampler -> capstan.runtime.scheduling.batch  (scheduling is not below sampling)",
    ]
