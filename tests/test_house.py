"""The house's rules, read from the code's own imports (docs/architecture.md): every room imports only rooms on lower
floors (one named exception), no two modules import each other in a circle, imports inside functions stay few, and
no source file grows past 800 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.mode_independent  # reads files only: CI runs it once (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]

# The floor of each room, from the ground up (docs/architecture.md draws them). A room may import rooms on lower
# floors only.
FLOORS = {
    "engine": 0, "collectors": 0, "benchkit": 0,
    "tenancy": 1,
    "jobs": 2, "apikit": 2,
    "fleet": 3, "traces": 3, "notify": 3,
    "ingest": 4, "slo": 4, "regressions": 4,
    "alerts": 5,
    "tuning": 6,
    "rollouts": 7,
    "loops": 8,
    "dashboards": 9,
    "observatory": 10,
}
# Imports that run up a floor, each with its reason (docs/architecture.md lists them).
UPWARD = {
    ("platform/tenancy/management/commands/create_api_token.py", "apikit.inputs.parse_duration"):
        "--expires-in takes the API's one duration syntax (apikit.inputs.parse_duration)",
}
MAX_FUNCTION_IMPORTS = 60
MAX_LINES = 800
LINE_LIMIT_EXEMPT = {"platform/ingest/_otlp_fast.c"}


def _sources() -> list[Path]:
    files = []
    for base in ("platform", "engine", "collectors", "dashboards"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if "migrations" in path.parts or "__pycache__" in path.parts:
                continue
            files.append(path)
    return files


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "platform") if path.is_relative_to(ROOT / "platform") else path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class _Imports(ast.NodeVisitor):
    """(target module, inside a function, line) of every import of a file, relative ones resolved."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.found: list[tuple[str, bool, int]] = []

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, self.depth > 0, node.lineno))

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # "from pkg import name": the submodule pkg.name when there is one, else pkg (resolved against the house)
        for alias in node.names:
            self.found.append((f"{target}.{alias.name}", self.depth > 0, node.lineno))


@pytest.fixture(scope="module")
def graph() -> dict[str, tuple[Path, list[tuple[str, bool, int]]]]:
    out = {}
    for path in _sources():
        module = _module_name(path)
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        out[module] = (path, visitor.found)
    return out


def _room(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in FLOORS else None


def test_every_room_has_a_floor(graph):
    rooms = {module.split(".")[0] for module in graph}
    assert rooms <= set(FLOORS), f"rooms without a floor in FLOORS: {sorted(rooms - set(FLOORS))}"


def test_rooms_import_only_rooms_below_them(graph):
    climbs = []
    for module, (path, imports) in graph.items():
        here = _room(module)
        for target, _inner, line in imports:
            there = _room(target)
            if there is None or there == here or FLOORS[there] < FLOORS[here]:
                continue
            rel = str(path.relative_to(ROOT))
            if (rel, target) not in UPWARD:
                climbs.append(f"{rel}:{line} ({here}, floor {FLOORS[here]}) imports {target} ({there}, floor "
                              f"{FLOORS[there]})")
    assert not climbs, "imports that run up a floor:\n" + "\n".join(climbs)


def test_no_import_circle(graph):
    modules = set(graph)

    def resolve(target: str) -> str | None:
        # "pkg.mod.name" → the longest prefix that is a module of the house
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                return candidate
        return None

    edges = {module: sorted({t for t in (resolve(x) for x, _i, _l in imports) if t and t != module})
             for module, (_p, imports) in graph.items()}
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_imports_inside_functions_stay_few(graph):
    """Only what Django needs in apps.ready(), what a benchmark imports after django.setup(), and heavy or optional
    libraries (SciPy, jsonschema, the OTLP exporters of the protocol in use...)."""
    inner = [f"{path.relative_to(ROOT)}:{line} {target}" for path, imports in graph.values()
             for target, in_function, line in imports if in_function]
    assert len(inner) < MAX_FUNCTION_IMPORTS, f"{len(inner)} imports inside functions:\n" + "\n".join(inner)


def test_no_source_file_over_800_lines():
    big = []
    for base in ("platform", "engine", "collectors", "dashboards", "tests"):
        for path in (ROOT / base).rglob("*"):
            if path.suffix not in (".py", ".c", ".js", ".html") or "__pycache__" in path.parts:
                continue
            rel = str(path.relative_to(ROOT))
            lines = path.read_text(encoding="utf-8", errors="replace").count("\n")
            if lines > MAX_LINES and rel not in LINE_LIMIT_EXEMPT:
                big.append(f"{rel}: {lines}")
    assert not big, "files over 800 lines:\n" + "\n".join(big)
