"""The shape docs/architecture.md promises, read from the source with `ast`: no import loop among
the engine's and kvtop's modules, arrows that point one way (the engine imports nothing of kvtop but
`kvtop.protocol`, the tools never import the engine, the protocol imports neither; under
`if TYPE_CHECKING:` too, so no loop hides there between them), no source file over 400 lines and
no function over 60 lines outside the kernels.

Each test lists every offender, so a failure says what to fix."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kvtop")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
KERNELS = "engine/kernels/"  # Triton/C++ kernels: a kernel reads best as one function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def run_time_imports(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level, in functions and classes; not those under
    `if TYPE_CHECKING:` (they only name a type for the checker and never execute) unless
    `type_checking`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            yield from (n for child in node.orelse for n in run_time_imports(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from run_time_imports(node, type_checking)


def imported(path: Path, name: str, known: dict[str, Path], type_checking: bool = False) -> Iterator[str]:
    """Our modules that `path` (module `name`) imports. `from a import b` counts as importing `a.b`
    when that is a module; importing `a.b` does not count as importing the package `a`."""
    is_package = path.name == "__init__.py"
    for node in run_time_imports(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            # a name inside a module resolves to that module
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(path, name, known, type_checking)) for name, path in known.items()}


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every package `path` imports, under `if TYPE_CHECKING:` too."""
    found = set()
    for node in run_time_imports(ast.parse(path.read_text(), str(path)), type_checking=True):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.add("kvtop")  # relative: within the package
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
        else:
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one loop's
    members in order; a module in one is part of an import loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def sources(tree: str) -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / tree).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def long_functions_in(path: str, text: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{path}:{node.lineno} {node.name} ({lines} lines)"


def long_functions(tree: str) -> list[str]:
    return [f for path, text in sources(tree) if not path.startswith(KERNELS) for f in long_functions_in(path, text)]


TREES = ["engine", "kvtop", "benchmarks"]


def test_the_checks_see_what_they_check():
    """The graph finds imports of each form and the finders find what they look for (else the
    checks below would pass on nothing)."""
    graph = import_graph()
    assert "engine.kv.cache" in graph["engine.llm_engine"]  # from engine.kv.cache import KVCache
    assert "engine.kernels.triton.common" in graph["engine.kernels.triton.decode"]
    assert "engine.kernels.cpu" in graph["engine.model.fused_decode"]  # imported inside a function
    assert "engine.llm_engine" not in graph["engine.telemetry.stats"]  # under `if TYPE_CHECKING:` only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert len(list(sources("engine"))) > 50
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert list(long_functions_in("m.py", f"def f():\n{body}")) == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert not list(long_functions_in("m.py", f"async def f():\n{body[: body.rindex('    x')]}"))


@pytest.mark.parametrize("tree", ["engine", "kvtop"])
def test_no_import_loop(tree):
    loops = [loop for loop in cycles(import_graph()) if loop[0].split(".")[0] == tree]
    assert not loops, "import loops (each line: modules that import each other round a loop):\n" + "\n".join(
        " <-> ".join(loop) for loop in loops
    )


PROTOCOL = "kvtop.protocol"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_engine_imports_only_the_protocol_of_kvtop():
    graph = import_graph(type_checking=True)
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() if _in(m, "engine") for t in targets
                   if _in(t, "kvtop") and not _in(t, PROTOCOL))  # fmt: skip
    assert not wrong, "the engine must not import the operator tools (only kvtop.protocol):\n" + "\n".join(wrong)


def test_the_tools_never_import_the_engine():
    """The light install (`pip install kvtop`, no torch) runs every kvtop module: what the tools need
    of the engine is in kvtop.protocol; commands that run the engine load it by name, through
    kvtop/ctl/engine_gate.py, which says what to install when it is not there."""
    graph = import_graph(type_checking=True)
    wrong = sorted(f"{m} imports {t}" for m, targets in graph.items() if _in(m, "kvtop") for t in targets
                   if _in(t, "engine"))  # fmt: skip
    assert graph["kvtop.ctl.cli"], "the graph sees kvtop's imports"
    assert not wrong, "kvtop must not import the engine:\n" + "\n".join(wrong)


def test_the_protocol_imports_only_itself_and_the_standard_library():
    """Both sides import the protocol; it imports neither (so no loop can pass through it, under
    TYPE_CHECKING either), nor any third-party package but sqlite-utils (writing a snapshot)."""
    import sys

    known = modules()
    allowed = set(sys.stdlib_module_names) | {"sqlite_utils", "kvtop"}
    wrong = []
    for name, path in known.items():
        if not _in(name, PROTOCOL):
            continue
        wrong += [f"{name} imports {t}" for t in sorted(top_level_imports(path) - allowed)]
        wrong += [f"{name} imports {t}" for t in sorted(imported(path, name, known, type_checking=True))
                  if not _in(t, PROTOCOL)]  # fmt: skip
    assert len([n for n in known if _in(n, PROTOCOL)]) >= 8, "the check sees the protocol's modules"
    assert not wrong, "the protocol must stand alone:\n" + "\n".join(wrong)


@pytest.mark.parametrize("tree", TREES)
def test_no_file_over_400_lines(tree):
    big = [f"{path}: {text.count(chr(10))} lines" for path, text in sources(tree) if text.count("\n") > MAX_FILE_LINES]
    assert not big, f"files over {MAX_FILE_LINES} lines (split them by job):\n" + "\n".join(big)


@pytest.mark.parametrize("tree", TREES)
def test_no_function_over_60_lines_outside_the_kernels(tree):
    long = long_functions(tree)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_no_benchmark_script_shadows_an_installed_module():
    """A script run as `python benchmarks/x.py` puts benchmarks/ first on sys.path: a file there named
    like an installed package is imported in its place by whatever imports that package (benchmarks/
    kernels.py hid Hugging Face's `kernels`, which transformers 5 imports: every benchmark that loaded
    transformers failed)."""
    import importlib.machinery
    import sys

    bench = ROOT / "benchmarks"
    scripts = sorted(p.stem for p in bench.glob("*.py"))
    assert "peers" in scripts  # the checks see the scripts
    # where else a module could come from (tests that import a script put benchmarks/ on the path)
    path = [p for p in sys.path if p and Path(p).resolve() != bench]
    shadowing = [s for s in scripts if importlib.machinery.PathFinder.find_spec(s, path) is not None]
    assert shadowing == [], f"benchmarks/ scripts named like installed modules: {shadowing}"
