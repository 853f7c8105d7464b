"""The tree's layering, checked from the source: what may import what, and who may read the
engine's internals. The engine's face is rooflm/engine/report.py (EngineInfo, snapshot(),
StepReport observers, the PhaseTracer hook); everything outside rooflm/engine/ uses only that."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rooflm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """rooflm modules a file imports, at the top or inside functions (lazy imports count)."""
    found = set()
    tree = ast.parse(path.read_text())
    # Imports for type checkers only never run: they cannot make a cycle.
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rooflm"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rooflm"):
            found.add(node.module)
            # `from rooflm.model import gguf_loader` imports a module, not a name
            for alias in node.names:
                candidate = PACKAGE.parent / Path(*f"{node.module}.{alias.name}".split("."))
                if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
                    found.add(f"{node.module}.{alias.name}")
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imports_of(path) if m in modules and m != name}
    return graph


def test_the_module_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_engine_imports_nothing_above_it():
    above = ("rooflm.server", "rooflm.perf", "rooflm.bench", "rooflm.cli", "rooflm.llm")
    for name, deps in import_graph().items():
        if name.startswith("rooflm.engine"):
            upward = sorted(d for d in deps if d.startswith(above))
            assert not upward, f"{name} imports {upward}"


PRIVATE_READ = re.compile(r"\b(engine|llm|self\.engine|runner|scheduler|block_manager|bm)\._[a-z]\w*")
INTERNALS = re.compile(r"\bengine\.(scheduler|block_manager|runner|stats|requests)\b")


def outside_engine_sources():
    for path in list(PACKAGE.rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py")):
        if "rooflm/engine/" not in path.as_posix():
            yield path


def test_nothing_outside_the_engine_reads_its_private_attributes():
    offenders = []
    for path in outside_engine_sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_READ.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_server_bench_and_perf_read_only_the_engine_face():
    offenders = []
    for path in outside_engine_sources():
        if path.parts[-2] not in ("server", "bench", "perf") and path.name not in ("cli.py", "llm.py"):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if INTERNALS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
