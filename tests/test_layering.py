"""The layering rules (issue 15), asserted from the imports themselves.

Every ``.py`` file under ``neuron_serving/`` and ``proxy/`` is parsed with ``ast``
(nothing is imported); every ``import``/``from ... import`` anywhere in it counts,
at module level or inside a function (a lazy import is still a dependency),
relative imports resolved against the file's package. Importing ``a.b.c`` also
runs ``a`` and ``a.b``, so a module's imports include their parent packages.

    (a) the follower side never imports the leader's modules (executor,
        control server, engine arguments, the in-process unit) nor Triton
    (b) the proxy never imports the unit nor Triton, even through another module
    (c) checkpoint (the format library, below the unit) never imports the unit,
        the local supervisor, nor the shard-writing tool (sharding runs a unit)
    (d) no import cycle between packages (``proxy``, ``neuron_serving.<first
        component>``; a top-level module such as ``neuron_serving.envs`` is its own)
    (e) every package imports only packages of a lower layer (``LAYERS``, the
        table in the top README); the base modules (``neuron_serving/*.py``) sit
        below every layer and may import one another; a new package must be
        given a layer here before it can pass
    (g) inside the proxy, every sub-package imports only lower ones (``PROXY_LAYERS``,
        the stages a request passes through, as in the proxy README's data flow);
        the proxy's single-file modules but ``server`` (config, registry, errors,
        protocol, traffic classes) sit below them all
    (f) no import cycle between modules, type-only imports (``if
        TYPE_CHECKING:``) included: a module that needs another's types for its
        signatures depends on it as much as one that calls it (issue 17 removed
        the last such cycle, the proxy's front ends typing ``ProxyServer``).
        The packages that enclose the importing module do not count (Python has them in ``sys.modules`` before
        the module runs, so ``proxy.routing.cache_aware`` importing
        ``proxy.routing.base`` needs ``base``, not ``proxy/routing/__init__.py``,
        which may re-export its submodules); a name read from an enclosing
        package (``from proxy.routing import make_policy`` inside it) counts

(a)-(c) follow imports transitively and report the chain that breaks the rule;
(d) and (f) report each cycle by its members and the imports that close it.
``test_the_checks_see_a_violation`` runs the same checks on a small tree with a
back-import of each kind, so these tests cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP_PACKAGES = ("neuron_serving", "proxy")
FOLLOWER_SIDE = (
    "neuron_serving.commands.follower",
    "neuron_serving.unit.follower",
    "neuron_serving.unit.worker_loop",
)

Graph = dict[str, set[str]]


@dataclass(frozen=True)
class Rule:
    name: str
    # Modules the rule starts from: exactly these names, or every module in these packages.
    modules: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()
    # Neither these modules nor anything inside them may be reached.
    forbidden: tuple[str, ...] = ()


RULES = (
    Rule(
        "(a) the follower never imports the leader's modules",
        modules=FOLLOWER_SIDE,
        # The leader-only modules of the unit README's file list.
        forbidden=(
            "neuron_serving.unit.executor",
            "neuron_serving.unit.control_server",
            "neuron_serving.unit.engine",
            "neuron_serving.unit.inprocess",
            "neuron_serving.triton",
        ),
    ),
    Rule(
        "(b) the proxy never imports the unit or Triton",
        packages=("proxy",),
        forbidden=("neuron_serving.unit", "neuron_serving.triton"),
    ),
    Rule(
        "(c) checkpoint never imports unit, local or sharding",
        packages=("neuron_serving.checkpoint",),
        forbidden=("neuron_serving.unit", "neuron_serving.local", "neuron_serving.sharding"),
    ),
)


# (e): top to bottom, as in the top README's layout table.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("neuron_serving.cli", "neuron_serving.commands"),
    ("neuron_serving.bench",),
    ("neuron_serving.faults",),
    ("neuron_serving.capacity",),
    ("neuron_serving.deploy",),
    ("neuron_serving.local",),
    ("neuron_serving.ecs",),
    ("neuron_serving.monitoring",),
    ("neuron_serving.sharding",),
    ("neuron_serving.triton",),
    ("neuron_serving.unit",),
    ("neuron_serving.checkpoint",),
    ("neuron_serving.devices", "neuron_serving.models"),
    ("proxy",),  # beside the runtime: only the entry points import it
)

# (g): the proxy's stages, top to bottom. server assembles the rest; the Batch API runs
# its lines through the front ends' pipeline; api/ speaks HTTP to clients; serving/
# queues, places and retries; tokens/ computes the prompt ids routing reads; routing/
# (with routing/kv/) picks units; upstream/ carries the calls to the leaders.
PROXY_LAYERS: tuple[tuple[str, ...], ...] = (
    ("proxy.server",),
    ("proxy.batch",),
    ("proxy.api",),
    ("proxy.serving",),
    ("proxy.tokens",),
    ("proxy.routing",),
    ("proxy.upstream",),
)


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out: dict[str, tuple[Path, bool]] = {}
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _import_nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, ``if TYPE_CHECKING:`` blocks included."""
    return (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))


def _imported_names(tree: ast.AST, package: str) -> Iterable[str]:
    """Every dotted name an import statement anywhere in ``tree`` may load (the
    packages above each name are the caller's to add)."""
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        if node.level:  # relative: from the file's package, up level-1 packages
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        # `from pkg import name`: name may be a submodule of pkg; if it is not,
        # the name resolves to pkg itself.
        yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph(root: Path = ROOT, *, runtime: bool = False) -> Graph:
    """Project module -> the project modules it imports (parent packages included).

    ``runtime``: the graph of rule (f): no edges to the packages enclosing the
    importing module unless a name is read from one (see the module docstring)."""
    files = _module_files(root)

    def project_module(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts) or None

    graph: Graph = {}
    for module, (path, is_package) in files.items():
        package = module if is_package else module.rpartition(".")[0]
        targets = graph.setdefault(module, set())
        tree = ast.parse(path.read_text(), str(path))
        for name in _imported_names(tree, package):
            found = project_module(name)
            if found:
                targets.add(found)
            while found and "." in found:  # every package above it
                found = project_module(found.rpartition(".")[0])
                if found and not (runtime and _inside(module, found)):
                    targets.add(found)
        targets.discard(module)
    return graph


def _reachable(graph: Graph, start: str) -> dict[str, str | None]:
    """Every module ``start`` imports, transitively -> the module that imported it."""
    parent: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        module = todo.pop()
        for target in sorted(graph.get(module, ())):
            if target not in parent:
                parent[target] = module
                todo.append(target)
    return parent


def _chain(parent: dict[str, str | None], end: str) -> str:
    path = [end]
    while (up := parent[path[-1]]) is not None:
        path.append(up)
    return " -> ".join(reversed(path))


def rule_violations(graph: Graph, rule: Rule) -> list[str]:
    """One import chain per (start module, forbidden module) that breaks ``rule``."""
    starts = [m for m in graph if m in rule.modules or any(_inside(m, p) for p in rule.packages)]
    missing = [m for m in rule.modules if m not in graph]
    out = [f"{m}: no such module (renamed? update the rule)" for m in missing]
    if not starts:
        out.append(f"no module matches {rule.modules or rule.packages}")
    for start in sorted(starts):
        parent = _reachable(graph, start)
        out += [_chain(parent, m) for m in sorted(parent)
                if any(_inside(m, f) for f in rule.forbidden)]  # fmt: skip
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return "proxy" if parts[0] == "proxy" else ".".join(parts[:2])


def proxy_package_of(module: str) -> str:
    """A proxy module's stage: its sub-package, or itself (a single-file module)."""
    return ".".join(module.split(".")[:2])


def package_edges(
    graph: Graph, of: Callable[[str], str] = package_of
) -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> the module imports behind that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        for target in sorted(targets):
            a, b = of(module), of(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    return edges


def strongly_connected(nodes: Iterable[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(out)


def package_cycles(graph: Graph) -> list[str]:
    """One line per cycle between packages: its members and the imports that close it."""
    edges = package_edges(graph)
    succ: dict[str, set[str]] = {}
    for a, b in edges:
        succ.setdefault(a, set()).add(b)
    lines = []
    for members in strongly_connected({package_of(m) for m in graph}, succ):
        inner = [imp for (a, b), imps in sorted(edges.items())
                 if a in members and b in members for imp in imps[:3]]  # fmt: skip
        lines.append(f"cycle between {', '.join(members)}: " + "; ".join(inner))
    return lines


def module_cycles(graph: Graph) -> list[str]:
    """One line per cycle between modules: its members and the imports that close it."""
    lines = []
    for members in strongly_connected(graph, graph):
        inner = [f"{a} -> {b}" for a in members for b in sorted(graph[a]) if b in members]
        lines.append(f"cycle between {', '.join(members)}: " + "; ".join(inner))
    return lines


def layer_violations(
    graph: Graph,
    layers: tuple[tuple[str, ...], ...] = LAYERS,
    of: Callable[[str], str] = package_of,
    root: str = "neuron_serving",
) -> list[str]:
    """Package imports that do not point to a lower layer, and packages with no layer
    (``of`` names a module's package; ``root`` and single-file modules are the base)."""
    rank = {pkg: i for i, row in enumerate(layers) for pkg in row}
    base = len(layers)  # the root package and its single-file modules

    def layer(pkg: str) -> int | None:
        if pkg in rank:
            return rank[pkg]
        return base if pkg == root or not _is_package(graph, pkg) else None

    name = "PROXY_LAYERS" if layers is PROXY_LAYERS else "LAYERS"
    bad = [f"{pkg} has no layer in {name}" for pkg in sorted({of(m) for m in graph})
           if layer(pkg) is None]  # fmt: skip
    for (a, b), imports in sorted(package_edges(graph, of).items()):
        la, lb = layer(a), layer(b)
        if la is None or lb is None or lb > la or (la == lb == base):
            continue
        bad.append(f"{a} imports {b} (same or higher layer): " + "; ".join(imports[:3]))
    return bad


def proxy_layer_violations(graph: Graph) -> list[str]:
    """(g): ``layer_violations`` among the proxy's stages."""
    inner = {m: {t for t in ts if _inside(t, "proxy")} for m, ts in graph.items()
             if _inside(m, "proxy")}  # fmt: skip
    return layer_violations(inner, PROXY_LAYERS, proxy_package_of, "proxy")


def _is_package(graph: Graph, name: str) -> bool:
    return any(m.startswith(name + ".") for m in graph)


def _check(rule: Rule) -> None:
    bad = rule_violations(import_graph(), rule)
    assert not bad, f"{rule.name}:\n  " + "\n  ".join(bad)


def test_follower_never_imports_the_leader() -> None:
    _check(RULES[0])


def test_proxy_never_imports_the_unit_or_triton() -> None:
    _check(RULES[1])


def test_checkpoint_imports_nothing_above_it() -> None:
    _check(RULES[2])


def test_no_import_cycles_between_packages() -> None:
    cycles = package_cycles(import_graph())
    assert not cycles, "\n".join(cycles)


def test_no_import_cycles_between_modules() -> None:
    cycles = module_cycles(import_graph(runtime=True))
    assert not cycles, "\n".join(cycles)


def test_packages_import_only_lower_layers() -> None:
    bad = layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_proxy_stages_import_only_lower_ones() -> None:
    bad = proxy_layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_the_graph_sees_the_real_imports() -> None:
    # A parser that found nothing would pass every rule above.
    graph = import_graph()
    follower = _reachable(graph, "neuron_serving.commands.follower")
    assert "neuron_serving.unit.worker_loop" in follower, sorted(follower)
    assert "neuron_serving.envs" in follower  # through function-level imports too
    assert {package_of(m) for m in graph} >= {"proxy", "neuron_serving.unit",
                                              "neuron_serving.checkpoint"}  # fmt: skip


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """A tree with one back-import of each kind, through relative, function-level and
    transitive imports: every rule and the cycle check must report it."""
    root = _tree(tmp_path, {
        "neuron_serving/__init__.py": "",
        "neuron_serving/envs.py": "",
        "neuron_serving/commands/__init__.py": "",
        "neuron_serving/commands/follower.py": "def main():\n    from ..unit import follower\n",
        "neuron_serving/unit/__init__.py": "",
        "neuron_serving/unit/follower.py": "from . import worker_loop\n",
        "neuron_serving/unit/worker_loop.py": "from .executor import STEP\n",
        "neuron_serving/unit/executor.py": "import neuron_serving.checkpoint.store\nSTEP = 1\n",
        "neuron_serving/checkpoint/__init__.py": "",
        "neuron_serving/checkpoint/store.py": "def f():\n    from ..local.cluster import X\n",
        "neuron_serving/local/__init__.py": "",
        "neuron_serving/local/cluster.py": "from neuron_serving.checkpoint import store\nX = 1\n",
        "proxy/__init__.py": "",
        "proxy/server.py": "from neuron_serving import envs\nfrom proxy.util import y\n",
        # A type-only back-import still closes a cycle.
        "proxy/util.py": "from typing import TYPE_CHECKING\nimport neuron_serving.unit.follower\n"
                         "if TYPE_CHECKING:\n    from proxy.server import S\ny = 1\n",
        # A submodule reading a name its package's __init__ defines after importing it.
        "proxy/bad/__init__.py": "from proxy.bad.x import X\nY = 1\n",
        "proxy/bad/x.py": "from proxy.bad import Y\nX = 1\n",
        "neuron_serving/newpkg/__init__.py": "",
        "neuron_serving/newpkg/a.py": "from neuron_serving import envs\n",
        # A stage importing a higher one (proxy.bad above: a stage with no layer).
        "proxy/api/__init__.py": "",
        "proxy/api/front.py": "Z = 1\n",
        "proxy/upstream/__init__.py": "",
        "proxy/upstream/grpc.py": "def f():\n    from ..api.front import Z\n",
    })  # fmt: skip
    graph = import_graph(root)
    follower, proxy, checkpoint = (rule_violations(graph, rule) for rule in RULES)
    assert "neuron_serving.unit.worker_loop -> neuron_serving.unit.executor" in follower[0]
    assert any(v.startswith("neuron_serving.commands.follower -> ") for v in follower)
    assert "proxy.server -> proxy.util -> neuron_serving.unit" in proxy
    assert "neuron_serving.checkpoint.store -> neuron_serving.local" in checkpoint
    cycles = package_cycles(graph)
    assert len(cycles) == 1, cycles
    assert cycles[0].startswith("cycle between neuron_serving.checkpoint, neuron_serving.local:")
    assert "neuron_serving.checkpoint.store -> neuron_serving.local.cluster" in cycles[0]
    layers = layer_violations(graph)
    assert any(
        v.startswith("neuron_serving.checkpoint imports neuron_serving.local ") for v in layers
    )
    assert any(v.startswith("proxy imports neuron_serving.unit ") for v in layers), layers
    assert not any(v.startswith("neuron_serving.local imports") for v in layers), layers
    assert "neuron_serving.newpkg has no layer in LAYERS" in layers
    stages = proxy_layer_violations(graph)
    assert any(v.startswith("proxy.upstream imports proxy.api ") for v in stages), stages
    assert "proxy.bad has no layer in PROXY_LAYERS" in stages
    assert any(v.startswith("proxy.util imports proxy.server ") for v in stages), stages
    assert not any(v.startswith("proxy.server imports") for v in stages), stages
    modules = module_cycles(import_graph(root, runtime=True))
    assert len(modules) == 3, modules
    assert modules[0].startswith(
        "cycle between neuron_serving.checkpoint.store, neuron_serving.local.cluster:"
    )
    assert modules[1] == (
        "cycle between proxy.bad, proxy.bad.x: proxy.bad -> proxy.bad.x; proxy.bad.x -> proxy.bad"
    )
    assert modules[2] == (
        "cycle between proxy.server, proxy.util: proxy.server -> proxy.util; "
        "proxy.util -> proxy.server"
    )
    # and a clean tree passes: the same files without the back-imports
    clean = _tree(tmp_path / "clean", {
        "neuron_serving/__init__.py": "",
        "neuron_serving/unit/__init__.py": "",
        "neuron_serving/unit/follower.py": "from . import worker_loop\n",
        "neuron_serving/unit/worker_loop.py": "import neuron_serving.checkpoint.store\n",
        "neuron_serving/unit/executor.py": "from .worker_loop import *\n",
        "neuron_serving/checkpoint/__init__.py": "",
        "neuron_serving/checkpoint/store.py": "",
        "proxy/__init__.py": "",
        "proxy/server.py": "from neuron_serving.checkpoint import store\nfrom proxy.routing import R\n",
        # Not a cycle: a package re-exporting its submodules, which import their
        # siblings (and so, implicitly, the package).
        "proxy/routing/__init__.py": "from proxy.routing.rr import R\n",
        "proxy/routing/base.py": "B = 1\n",
        "proxy/routing/rr.py": "from typing import TYPE_CHECKING\nfrom .base import B\n"
                               "if TYPE_CHECKING:\n    from proxy.routing.base import T\nR = B\n",
    })  # fmt: skip
    graph = import_graph(clean)
    assert not package_cycles(graph)
    assert not module_cycles(import_graph(clean, runtime=True))
    assert not rule_violations(graph, RULES[1]) and not rule_violations(graph, RULES[2])
