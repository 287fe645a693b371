"""The package's import graph: no cycles between modules, and no import from a lower pipeline layer to a higher one.

Pure Python (`ast` over src/qerl, nothing imported), so it runs in about a second. Every import counts: module
level and inside functions (a lazy import that goes up is still a dependency that goes up); only imports under
`if TYPE_CHECKING:` are left out, as they never run. `from pkg import name` is an edge to `pkg.name` when that is
a module, else to `pkg` (its `__init__`).

Layers, lowest first (a module may import its own layer and lower ones):
    formats -> quant -> kernels -> nn -> models -> config -> rollout -> rl -> eval, study, bench -> cli
`data` and `rewards` are side inputs: any layer may import them, and they import no pipeline package. So are
the package root `qerl/__init__.py` and the top-level single modules other than `cli` and `config` (leaves such as
the config's allowed values, which import nothing).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "qerl"

LAYERS = {
    "formats": 1, "quant": 2, "kernels": 3, "nn": 4, "models": 5,
    "config": 6,  # a leaf over the pipeline's building blocks: formats, quant, nn, models helpers
    "rollout": 7, "rl": 8, "eval": 9, "study": 9, "bench": 9, "cli": 10,
}
SIDE = {"data", "rewards", ""}  # "" is the package root; side inputs sit below every layer
SIDE_LAYER = 0


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_block(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def module_edges(name: str, is_package: bool, source_text: str, modules) -> set[str]:
    """The qerl modules (among `modules`) that module `name` imports; is_package: it is a package's __init__."""
    package = name if is_package else name.rpartition(".")[0]
    edges = set()
    for node in _imports(ast.parse(source_text, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        for target in targets:
            while target and target not in modules:  # `import qerl.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] == PACKAGE and target != name:
                edges.add(target)
    return edges


def build_graph() -> dict[str, set[str]]:
    """{module: the qerl modules it imports}, over every src/qerl/**/*.py."""
    files = {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
    return {name: module_edges(name, _is_package(path), path.read_text(), files) for name, path in files.items()}


def layer_of(module: str) -> tuple[str, int]:
    """(its package under qerl, or the top-level module's name; its layer)."""
    part = module.split(".")[1] if "." in module else ""
    if part in SIDE or (part not in LAYERS and (ROOT / PACKAGE / f"{part}.py").is_file()):
        return part, SIDE_LAYER
    assert part in LAYERS, f"{module}: package {part!r} has no layer in this test's LAYERS; add it"
    return part, LAYERS[part]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_kind_of_import():
    """On a made-up module: relative and absolute imports, a submodule named in `from pkg import`, a name from
    a package's __init__, a lazy import in a function; nothing under TYPE_CHECKING, nothing outside qerl."""
    modules = {"qerl", "qerl.a", "qerl.a.x", "qerl.a.y", "qerl.b", "qerl.b.z", "qerl.c", "qerl.d", "qerl.e", "qerl.f"}
    text = """
from typing import TYPE_CHECKING
import torch
from . import y
from .. import b
from ..b.z import name
import qerl.c
from qerl.d import thing
if TYPE_CHECKING:
    from qerl.f import never_runs

def later():
    from ..e import lazily
"""
    assert module_edges("qerl.a.x", False, text, modules) == {"qerl.a.y", "qerl.b", "qerl.b.z", "qerl.c", "qerl.d",
                                                              "qerl.e"}
    assert module_edges("qerl.a", True, "from .x import f\nfrom . import y\n", modules) == {"qerl.a.x", "qerl.a.y"}
    assert _cycles({"p": {"q"}, "q": {"r"}, "r": {"p"}, "s": {"p"}}) == [["p", "q", "r"]]
    assert "qerl.models" in build_graph()["qerl.cli"]  # the real tree: `from .models import name`


def test_no_import_cycles():
    cycles = _cycles(build_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_runs_up_the_pipeline():
    bad = []
    for module, edges in sorted(build_graph().items()):
        (part, level) = layer_of(module)
        for target in sorted(edges):
            (target_part, target_level) = layer_of(target)
            if target_level > level:
                bad.append(f"{module} ({part}) imports {target} ({target_part})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)
