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
CPU_ENGINE_NOW = 8072  # (+126: int8 sums the gate loops dequantize as they read them, issue 62;
                       # +9: bf16's path named beside int8's, from the same features (stepnet
                       # info spelled it out);
                       # +183: int8 and bf16 products on AMX's tiles, Linux asked for them;
                       # +57: OpenBLAS's count, the process's, held at one while any call of
                       # stepnet's runs, not set and given back by each (calls at once differed in
                       # bits), none running in a forked child;
                       # +28: a save into the cache holds its folder's lock; +4: a chunk posted
                       # ahead is over the sequences running at it;
                       # +68: bf16 products by vdpbf16ps; +20: quantized input products by chunks;
                       # +3: int8 sums start from zero in registers, not from a cleared buffer; issue 62;
                       # +8: the prepared call checks its offsets and states before its kernel reads by them;
                       # +5: threads of one process loading one new kernel take turns;
                       # +3: no library product is called with a leading dimension of 0;
                       # -36: a ragged last-step output computed for every step by CompiledStepNet;
                       # +3: a cached .nbc whose LLVM bitcode is damaged is a cache miss;
                       # +14: a nested net reads its enclosing net's ragged static input;
                       # +4: a step value with LoD levels of its own read by an op refused by name;
                       # +1: an input's rows made contiguous are sized first; -1: one literal helper;
                       # +12: a forked child makes its own thread pool and compile-worker client;
                       # +14: a kept blas.json of another form is measured again, not an error;
                       # +17: a nested net steps over its enclosing net's ragged static input;
                       # +41: a digest ends each compiled-code file; +54: a read-only cache folder
                       # is read from, and a kernel it lacks refused by name; +15: the own loop's
                       # AVX2 blocks of 5 rows, 1.2x its product rate on a Zen 2; +38: float64
                       # products' own-loop limits measured apart from float32's; +5: an item no
                       # pool thread has started runs on the waiting thread, not a deadlock;
                       # +4: the weight gradients' kept choice checked where first read;
                       # +3: a nested net's static input that is a constant of the enclosing
                       # step is read where it is, by its hoisted products too; +15: a hoisted
                       # product another net reads, as a gradient program's nets read the
                       # forward's, is not computed by chunks in its own net's function; +6: the
                       # CPU's features asked of LLVM once, not at each executor call;
                       # +67: the segment ops over a nested net's every step (a hierarchical
                       # attention network's word attention), hoisted with the nested net, its
                       # product by weights one BLAS call; a product of ragged rows by a matrix
                       # over the matrix's rows, which LLVM vectorizes; the segment ops over a
                       # two-level step input as well, its refusal gone)

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
