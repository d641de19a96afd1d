"""The code's size budgets (docs/internals.md, "Budgets"): a module of
stepnet/ at most 800 lines, a function at most 80, the CPU engine
(stepnet/jit/ but the CUDA backend's modules) at most 3,500; no import cycle between
modules; no comment or docstring that logs a measurement.

The modules and functions over budget today are listed with their size now,
as is the CPU engine's: each may shrink (lower its figure here as it does),
none may grow, and nothing new may join them.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "stepnet"

MODULE_LINES = 800
FUNCTION_LINES = 80
CPU_ENGINE_LINES = 3500
_CUDA = ("numba_cuda.py", "cuda_run.py")  # the CUDA backend's modules, outside the CPU engine

# over budget today: their line counts may only go down
MODULES_OVER = {}
FUNCTIONS_OVER = {}
CPU_ENGINE_NOW = 8198  # the CPU engine today, over CPU_ENGINE_LINES: it may not grow unseen
# (a change that adds to it raises this figure, its commit message saying why)

# a figure of a measurement: a time with decimals, a rate, a speed-up
_MEASUREMENT = re.compile(r"\d+\.\d+ ?(ms|us|µs)\b|\d+(\.\d+)? ?(GFLOP/s|GB/s|Gflops)"
                          r"|\d+(\.\d+)?x (faster|slower)|\bmeasured (on|at) .* \d+(\.\d+)? ?(ms|us)")


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _name(path):
    return str(path.relative_to(ROOT))


def _lines(path):
    return len(path.read_text().splitlines())


def _functions(path):
    """``{qualified name: lines}`` of every function and method of a module."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def test_modules_stay_within_their_budget():
    over = {_name(p): _lines(p) for p in _modules() if _lines(p) > MODULE_LINES}
    grown = {name: (lines, MODULES_OVER.get(name, MODULE_LINES)) for name, lines in over.items()
             if lines > MODULES_OVER.get(name, MODULE_LINES)}
    assert not grown, f"modules over their budget (lines, budget): {grown}"


def test_functions_stay_within_their_budget():
    grown = {}
    for path in _modules():
        for name, lines in _functions(path).items():
            key = f"{_name(path)}:{name}"
            if lines > FUNCTIONS_OVER.get(key, FUNCTION_LINES):
                grown[key] = (lines, FUNCTIONS_OVER.get(key, FUNCTION_LINES))
    assert not grown, f"functions over their budget (lines, budget): {grown}"


def test_what_is_within_budget_leaves_the_lists():
    """An entry back within budget (or gone) leaves: the lists record what is
    over, no more."""
    sizes = {_name(p): _lines(p) for p in _modules()}
    functions = {f"{_name(p)}:{name}": lines for p in _modules()
                 for name, lines in _functions(p).items()}
    within = [name for name in MODULES_OVER if sizes.get(name, 0) <= MODULE_LINES]
    within += [name for name in FUNCTIONS_OVER if functions.get(name, 0) <= FUNCTION_LINES]
    assert not within, f"take these off the lists: {within}"


def test_the_cpu_engine_does_not_grow():
    engine = sum(_lines(p) for p in (PACKAGE / "jit").glob("*.py") if p.name not in _CUDA)
    assert engine <= max(CPU_ENGINE_NOW, CPU_ENGINE_LINES), engine


def _imports(path, module):
    """The stepnet modules ``module`` (at ``path``) imports when it is
    imported (module-level statements, not those inside functions)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{target}.{a.name}" for a in node.names)
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_import_cycle():
    modules = {}
    for path in _modules():
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: {m for m in _imports(path, name) if m in modules and m != name
                    and not name.startswith(m + ".")}  # (a package's __init__ runs first)
             for name, path in modules.items()}
    done, cycles = set(), []

    def walk(name, trail):
        if name in trail:
            cycles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for dependency in sorted(graph[name]):
            walk(dependency, trail + [name])
        done.add(name)

    for name in sorted(graph):
        walk(name, [])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_no_comment_logs_a_measurement():
    found = []
    for path in _modules():
        source = path.read_text()
        texts = [(i + 1, line.split("#", 1)[1]) for i, line in enumerate(source.splitlines())
                 if "#" in line and not line.strip().startswith(("f\"", "\""))]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                 ast.Module)) and ast.get_docstring(node):
                texts.append((getattr(node, "lineno", 1), ast.get_docstring(node)))
        found += [f"{_name(path)}:{line}: {m.group(0)}" for line, text in texts
                  for m in [_MEASUREMENT.search(text)] if m]
    assert not found, found
