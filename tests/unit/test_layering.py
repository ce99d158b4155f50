"""The package's layering, as tests: imports only point down, no two files import each other, few
function-local imports, few `Any` annotations.

The contract lives in pyproject.toml ([tool.importlinter]); the other checks read the source itself, so
they run in well under a second and need no model."""
from __future__ import annotations

import ast
import importlib.util
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tokenloom"

# A function-local import of a tokenloom module dodges start-up cost or an optional dependency; past
# this many, they are dodging circles again.
MAX_LOCAL_IMPORTS = 40
# `Any` where a struct, Protocol or JSON alias says what the value is; this many stay at the edges.
MAX_ANY = 30
LAZY_MARK = "# lazy:"

def _python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_import_linter_contract_is_kept():
    """Every import points down the layer list in pyproject.toml (run as CI runs it)."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0:
        pytest.fail(f"import-linter reports a broken contract:\n{result.stdout[-4000:]}{result.stderr[-2000:]}")


def _strongly_connected_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative, so a long import chain cannot reach the recursion limit."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[node] = min(lowlink[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _import_edges() -> dict[str, set[str]]:
    """Module -> the modules it imports (function-local imports included, TYPE_CHECKING ones not).

    A package's `__init__` importing its own submodules is how a package exposes them, not a circle:
    those edges are left out."""
    origin = importlib.util.find_spec("tokenloom").origin
    assert Path(origin).parent == PACKAGE, (f"tokenloom imports from {origin}, not from this checkout: run "
                                            "`python -m pytest` from the repository root")
    graph = grimp.build_graph("tokenloom", exclude_type_checking_imports=True, cache_dir=None)
    return {module: {imported for imported in graph.find_modules_directly_imported_by(module)
                     if not imported.startswith(module + ".")}
            for module in graph.modules}


def test_the_strongly_connected_components_helper_finds_circles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    components = _strongly_connected_components(edges)
    assert sorted(components) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_two_files_import_each_other():
    """A file circle means neither file can be read, tested or imported without the other."""
    edges = _import_edges()
    circles = [component for component in _strongly_connected_components(edges) if len(component) > 1]
    described = []
    for component in circles:
        members = set(component)
        links = [f"    {module} -> {imported}" for module in component
                 for imported in sorted(edges[module] & members)]
        described.append(" <-> ".join(component) + "\n" + "\n".join(links))
    if circles:
        pytest.fail("file circles in the import graph (each line an import inside the circle):\n"
                    + "\n".join(described))


def _function_local_tokenloom_imports() -> list[tuple[str, int, str]]:
    """(file, line, source line) of every import of a tokenloom module inside a function body."""
    found = []
    for path in _python_files():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    names = ["." * node.level + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                if any(name == "tokenloom" or name.startswith(("tokenloom.", ".")) for name in names):
                    statement = "\n".join(lines[node.lineno - 1:node.end_lineno])
                    found.append((_relative(path), node.lineno, statement))
    # A nested function is walked once for itself and once inside its parent: keep each import once.
    return sorted(set(found))


def test_function_local_imports_are_few_and_each_says_why():
    """At the top of the module unless an optional dependency or start-up time needs it late, and then
    with a `# lazy: <reason>` comment on its line."""
    local_imports = _function_local_tokenloom_imports()
    unexplained = [f"  {path}:{line}: {statement.strip()}" for path, line, statement in local_imports
                   if LAZY_MARK not in statement]
    if unexplained:
        pytest.fail(f"{len(unexplained)} function-local imports of tokenloom modules without a "
                    f"'{LAZY_MARK} <reason>' comment (move them to the top of the module, or say why they are "
                    "late):\n" + "\n".join(unexplained))
    listed = "\n".join(f"  {path}:{line}: {statement.strip()}" for path, line, statement in local_imports)
    if len(local_imports) > MAX_LOCAL_IMPORTS:
        pytest.fail(f"{len(local_imports)} function-local imports of tokenloom modules (at most "
                    f"{MAX_LOCAL_IMPORTS}):\n" + listed)


def _any_uses(path: Path) -> list[int]:
    """Lines that use the name `Any` outside an import statement (comments and strings do not count; a
    line with several counts once, as `grep -w Any` would)."""
    source = path.read_text()
    import_lines: set[int] = set()
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            import_lines.update(range(node.lineno, node.end_lineno + 1))
    return sorted({token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                   if token.type == tokenize.NAME and token.string == "Any" and token.start[0] not in import_lines})


def test_any_annotations_are_few():
    """`Any` says nothing about a value; a struct, Protocol, tensor type or JSON alias says what it is."""
    uses = [(_relative(path), line) for path in _python_files() for line in _any_uses(path)]
    per_file: dict[str, list[int]] = {}
    for path, line in uses:
        per_file.setdefault(path, []).append(line)
    listed = "\n".join(f"  {path}: {len(lines)} (lines {', '.join(map(str, lines))})"
                       for path, lines in sorted(per_file.items(), key=lambda item: -len(item[1])))
    if len(uses) > MAX_ANY:
        pytest.fail(f"{len(uses)} lines use `Any` in tokenloom/ (at most {MAX_ANY}):\n" + listed)
