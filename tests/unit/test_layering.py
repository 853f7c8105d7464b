"""The tree's layering, checked from the source: the package order (lazy imports included), and
who may read the engine's internals. The engine's face is rooflm/engine/report.py (EngineInfo, snapshot(),
StepReport observers, the PhaseTracer hook); everything outside rooflm/engine/ uses only that."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rooflm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    candidate = PACKAGE.parent / Path(*dotted.split("."))
    return candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists()


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
            # `from rooflm import config` imports the module rooflm.config, not the root's names
            if node.module != "rooflm" or not all(_is_module(f"rooflm.{a.name}") for a in node.names):
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


# The packages bottom to top (docs/architecture.md, "Layers"). A package imports only from its
# own level or below, and never from another package of its own level: the tools stand side by
# side on the layers below them. Top-level modules (rooflm/config.py, ...) are packages here.
LEVELS = [
    ("errors", "envs", "version"),           # typed errors, the one registry of environment switches
    ("config", "sampling_params"),           # frozen configuration; a request's sampling parameters
    ("engine_args",),                        # the engine's command-line flags, generated from the config
    ("kernels", "structured"),               # Triton kernels + references; grammars and token bitmasks
    ("quant",),                              # quantized weight formats and the linear methods that multiply them
    ("layers",),                             # model parts, the paged-KV contract, attention backends, sampler
    ("deterministic", "distributed", "lora"),  # batch-invariant kernels; TP groups, all-reduce, sharded
                                             # linears; LoRA adapters, slot pool and the hooks on layers' linears
    ("model",),                              # families: config -> parts, weight names, loaders
    ("tokenizer",),                          # tokenizers, detokenizer, text windows, the dummy model directory
    ("engine",),                             # scheduler, block manager, runner, core process, TP workers
    ("spec", "dp", "perf"),                  # speculative decoding, data-parallel replicas, the roofline model
    ("server", "llm"),                       # the OpenAI server; the offline LLM class
    ("bench", "sim", "train", "quantize", "eval"),  # tools
    ("rooflm",),                             # the package's public names (LLM, LLMEngine, SamplingParams)
    ("cli",),                                # entry points
    ("__main__",),
]

# Imports that run against the order, each with its reason. Nothing else may.
ALLOWED_UPWARD = {
    ("rooflm.engine.llm_engine", "rooflm.spec.factory"):
        "strategy_for: an engine configured for speculative decoding attaches spec's step strategy. "
        "LLMEngine is built in several places (LLM, the server's thread front end, the engine-core "
        "process, DP replicas), so no one builder above the engine could attach it; one lazy import "
        "in one function keeps the rest of engine/ free of spec.",
}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rooflm"


def level_of(package: str) -> int:
    for i, level in enumerate(LEVELS):
        if package in level:
            return i
    raise AssertionError(f"package rooflm.{package} is not in LEVELS: give it a level")


def test_every_package_has_a_level():
    for name in import_graph():
        level_of(package_of(name))


def test_packages_import_only_downward():
    offenders = []
    for name, deps in sorted(import_graph().items()):
        src = package_of(name)
        for dep in sorted(deps):
            dst = package_of(dep)
            if dst == src or (name, dep) in ALLOWED_UPWARD:
                continue
            if level_of(dst) >= level_of(src):
                offenders.append(f"{name} -> {dep} ({src} is level {level_of(src)}, {dst} level {level_of(dst)})")
    assert not offenders, "imports against the declared layers:\n" + "\n".join(offenders)


def test_the_allowed_upward_imports_exist_and_are_few():
    graph = import_graph()
    for (name, dep), reason in ALLOWED_UPWARD.items():
        assert dep in graph.get(name, ()), f"{name} no longer imports {dep}: drop it from ALLOWED_UPWARD"
        assert reason
    assert len(ALLOWED_UPWARD) <= 6


def test_no_two_packages_import_each_other():
    """Besides the listed upward imports (each the one way back between its two packages)."""
    pairs = set()
    for name, deps in import_graph().items():
        pairs.update((package_of(name), package_of(d)) for d in deps
                     if package_of(d) != package_of(name) and (name, d) not in ALLOWED_UPWARD)
    two_way = sorted(f"{a} <-> {b}" for a, b in pairs if (b, a) in pairs and a < b)
    assert not two_way, "packages that import each other: " + ", ".join(two_way)


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
