"""Shared test helpers: every backend is judged against the interpreter."""

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Without a GPU the CUDA backend runs on Numba's CUDA simulator (it must be
# chosen before numba is imported); tests/test_cuda_backend.py tests it.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# The Numba backend's tests test its kernels: a new kernel answers here on the
# kernel itself, not first on the interpreter (tests/test_tiers.py tests the
# tiers, turning them on itself).
os.environ["STEPNET_TIERED"] = "0"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

import stepnet as sn  # noqa: E402

# No time limit on a hypothesis example: a test here asserts results, never
# speed, and a shared or slow machine takes any time (benchmarks/ measures it)
settings.register_profile("stepnet", deadline=None)
settings.load_profile("stepnet")

TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12, np.dtype(np.float16): 1e-3}


def _data(x):
    return x.data if isinstance(x, sn.LoDTensor) else np.asarray(x)


def assert_close(actual, expected, dtype=None, what="output"):
    """DESIGN.md §4: |a - b| <= tol * max(1, |b|), LoD included."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, dtype, f"{what}[{i}]")
        return
    if isinstance(expected, sn.LoDTensor):
        assert isinstance(actual, sn.LoDTensor), f"{what}: expected a LoDTensor"
        assert actual.lod == expected.lod, f"{what}: LoD {actual.lod} != {expected.lod}"
    a, e = _data(actual), _data(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    if e.dtype.kind in "biu":  # masks and counts agree exactly
        mismatched = np.flatnonzero((a != e).ravel())
        assert mismatched.size == 0, (
            f"{what}: {mismatched.size} elements differ, first at flat index {mismatched[:1]}")
        return
    tol = TOL[np.dtype(dtype or e.dtype)]
    err = np.abs(a.astype(np.float64) - e.astype(np.float64))
    bound = tol * np.maximum(1.0, np.abs(e.astype(np.float64)))
    assert np.all(err <= bound), f"{what}: max error {err.max()} (tolerance {tol})"


def available_backends():
    """The compiled CPU backends. The CUDA backend has its own tests
    (tests/test_cuda_backend.py), and :func:`assert_backends_agree` adds it
    (for small runs on the simulator)."""
    return [b for b in sn.backends() if b not in ("interpreter", "cuda")]


# Numba's CUDA simulator runs every GPU thread as a Python thread (a block of
# 128 per launch), so a call costs about 0.04 s per time step for a small
# batch, and more as rows x width grows. Measured on a small tanh cell (one
# call, warm): 1 step 0.07 s, 4 steps 0.18 s, 8 steps 0.35 s, 16 steps 0.7 s,
# 32 steps 1.1 s; 8 steps of 8 rows x 4 wide 0.43 s, x 16 wide 0.53 s, x 64
# wide 4.1 s. assert_backends_agree adds the CUDA backend to its default
# backends on the simulator for runs of at most SIMULATOR_MAX_STEPS steps and
# SIMULATOR_MAX_WORK rows x width: about 0.3 s a call (more for nets of many
# ops), which keeps what the simulator adds to the default test run under
# about 30 s (the call count is what costs: a test looping over many nets or
# Hypothesis examples names its backends).
SIMULATOR_MAX_STEPS = 6
SIMULATOR_MAX_WORK = 512


def _on_simulator():
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def run_size(rnn, **feeds):
    """``(steps, rows x width)`` of a run of ``rnn``: its longest sequence,
    and the rows of its step inputs (every token of a nested LoD) times its
    widest step value (feature elements)."""
    inputs = [feeds.get(name, b.value) for name, b in rnn.bindings.items()
              if b.kind == "sequence"]
    steps = max((int(np.diff(X.levels[0]).max(initial=0)) for X in inputs), default=0)
    rows = sum(X.data.shape[0] for X in inputs)
    body = rnn.program().eqn.attrs["body"]
    values = [*body.step_inputs, *(m.pre for m in body.memories),
              *(o for e in body.eqns for o in e.outputs)]
    width = max((int(np.prod(v.shape[1:])) for v in values if v.shape and v.shape[0] is None),
                default=1)
    return steps, rows * width


def default_backends(rnn, **feeds):
    """What :func:`assert_backends_agree` compares with the interpreter when
    it is given no ``backends``: every compiled backend; CUDA on a GPU, and on
    the CUDA simulator while ``run_size`` is within ``SIMULATOR_MAX_STEPS``
    and ``SIMULATOR_MAX_WORK``."""
    out = available_backends()
    if "cuda" in sn.backends():
        if not _on_simulator():
            out.append("cuda")
        else:
            steps, work = run_size(rnn, **feeds)
            if steps <= SIMULATOR_MAX_STEPS and work <= SIMULATOR_MAX_WORK:
                out.append("cuda")
    return out


def assert_backends_agree(rnn, output_all_steps=True, backends=None, dtype=None, **feeds):
    """Run ``rnn`` on every backend and compare each with the interpreter
    (``dtype``: the tolerance's dtype, the outputs' by default); returns the
    interpreter's outputs.

    ``backends=None`` is :func:`default_backends`: numba and CUDA (on Numba's
    CUDA simulator when there is no GPU, for small runs only: see
    ``SIMULATOR_MAX_STEPS``). A backend that refuses the net fails the test: a
    test of a net some backend does not support names the backends it runs on.
    """
    expected = rnn(output_all_steps=output_all_steps, backend="interpreter", **feeds)
    if backends is None:
        backends = default_backends(rnn, **feeds)
    for backend in backends:
        actual = rnn(output_all_steps=output_all_steps, backend=backend, **feeds)
        assert_close(actual, expected, dtype=dtype, what=f"{backend} vs interpreter")
    return expected


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def run_apart_calls(monkeypatch):
    """The items of each call of ``threads.run_apart`` that ran them at the
    same time (``SPLIT_MIN_WORK`` set to 0: any work does), in a list the test
    reads."""
    from stepnet.jit import threads

    calls = []
    run_apart = threads.run_apart

    def spy(fn, items, work):
        items = list(items)
        if work > 0 and work >= threads.SPLIT_MIN_WORK:
            calls.append(items)
        return run_apart(fn, items, work)

    monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 0)
    monkeypatch.setattr(threads, "run_apart", spy)
    return calls


def compile_helpers(dtype, executor=False):
    """Compile into this process's cache the helpers that a small net's run
    and gradients of ``dtype`` link (``executor``: and the executor's loop)."""
    dtype = np.dtype(dtype)
    rnn = sn.create_rnn_op()
    X = sn.LoDTensor.from_lengths(np.ones((3, 2), dtype), [[2, 1]])
    with rnn.stepnet():
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[2])
        W = sn.Parameter(np.eye(2, dtype=dtype), name="W")
        h.update(sn.ops.tanh(x @ W + h.pre_state()))
        rnn.add_outputs(h)
    sn.gradients(rnn, wrt=[W], grad_outputs=[np.ones((3, 2), dtype)], backend="numba")
    if executor:
        print("measured", flush=True)  # (the products' timings taken: _compile_helpers_at_once)
        from stepnet import executor_loop

        executor_loop.loop(dtype)


def cache_with_helpers(path, executor=False):
    """A new ``STEPNET_CACHE_DIR`` at ``path`` with no kernel in it but the
    compiled helpers and the BLAS measurements of this process's cache
    directory (those that a small net's run and gradients link, in both
    float dtypes, compiled there first): for tests of how kernels are
    compiled, cached and loaded, which need every kernel new but not
    stepnet's own helpers (about 20 s of compiles in a process of its own).
    ``executor``: and the executor's loops, marked ready (for tiered runs,
    whose compile worker would otherwise compile them first, about 12 s
    each). A test of an empty cache uses an empty directory."""
    from stepnet.jit import cache

    loops = []
    for dtype in ("float32", "float64"):
        compile_helpers(dtype)
        if executor:
            from stepnet import executor_loop

            loops.append(Path(inspect.getfile(executor_loop.loop(np.dtype(dtype)).py_func)))
    source = cache.cache_dir()
    path.mkdir(parents=True)
    for found in source.glob("*.json"):
        shutil.copy2(found, path / found.name)
    if (source / "numba").is_dir():  # (files are written by atomic renames: each copy is whole)
        shutil.copytree(source / "numba", path / "numba", ignore=shutil.ignore_patterns("*.tmp*"))
    for loop in loops:  # (copy2: Numba's index holds its source file's time and size)
        (path / "__pycache__").mkdir(exist_ok=True)
        for found in [loop, *(source / "__pycache__").glob(f"{loop.stem}.*")]:
            if ".tmp" not in found.name:
                shutil.copy2(found, path / found.relative_to(source))
        (path / f"{loop.stem}.ready").touch()
    return path


def _kernels_in_cache():
    from stepnet.jit import cache

    return {p.name for p in cache.cache_dir().glob("stepnet_kernel_*.py")}


def _compile_helpers_at_once():
    """``compile_helpers`` of each float dtype in a process of its own,
    before xdist's workers start, each of which would otherwise compile all
    of them itself (about a minute with a cold cache). float64's starts once
    float32's has measured the products (a table measured beside another
    compile is taken as "crowded", and shares products it would not on a
    quiet machine), the two then at once."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            "import conftest; conftest.compile_helpers(sys.argv[1], executor=True)")
    procs = []
    for dtype in ("float32", "float64"):
        procs.append(subprocess.Popen([sys.executable, "-c", code, dtype], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        procs[-1].stdout.readline()  # ("measured", or nothing where it failed)
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:  # (the tests compile them then, and say what fails)
            print(f"stepnet: compiling the helpers ahead failed:\n{err[-2000:]}", file=sys.stderr)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # (the main process, under xdist too)
        session.config._stepnet_kernels = _kernels_in_cache()
        if (session.config.getoption("numprocesses", None) or 0) > 1:
            _compile_helpers_at_once()


def pytest_terminal_summary(terminalreporter, config):
    """How many kernels the run compiled into ``STEPNET_CACHE_DIR``: the
    suite's time with a cold cache is mostly theirs."""
    before = getattr(config, "_stepnet_kernels", None)
    if before is not None:
        now = _kernels_in_cache()
        terminalreporter.write_line(f"stepnet: {len(now - before)} new kernels in the cache "
                                    f"({len(now)} in all)")


def run_python(code, tmp_path, **env):
    """``code``'s output in a new process, on a cache of no kernel but this
    process's helpers and measurements (``cache_with_helpers``)."""
    cache = cache_with_helpers(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, STEPNET_CACHE_DIR=str(cache), **env),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
