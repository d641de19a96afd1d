"""The Numba backend's tiers and its disk cache: a new kernel answers on the
interpreter while the compile worker compiles it; the cache survives being
removed, shared by two processes at once, and corrupted."""

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from conftest import assert_close, cache_with_helpers
from stepnet.jit import numba_cpu

ROOT = Path(__file__).resolve().parents[1]


def _net(rng, features, hidden, lengths=((3, 1, 4),)):
    """A small gated cell; ``features`` and ``hidden`` give each test a kernel
    of its own (the key is the generated source)."""
    rows = sum(lengths[-1])
    X = sn.LoDTensor.from_lengths(rng.standard_normal((rows, features)), [list(lengths[0])])
    W = sn.Parameter(rng.standard_normal((features, hidden)) * 0.4, name="W")
    U = sn.Parameter(rng.standard_normal((hidden, hidden)) * 0.4, name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[hidden], name="h")
        z = sn.ops.sigmoid(x @ W + h.pre_state() @ U)
        h.update(z * h.pre_state() + (1 - z) * sn.ops.tanh(x @ W))
        rnn.add_outputs(h)
    return rnn, X, (W, U)


@pytest.fixture
def tiered(monkeypatch, tmp_path):
    """Tiers on, and a cache directory with no kernel (the compiled helpers
    only: ``cache_with_helpers``): every kernel is new."""
    cache = cache_with_helpers(tmp_path / "cache")
    monkeypatch.setenv("STEPNET_TIERED", "1")
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache))
    return cache


def test_first_calls_answer_on_the_interpreter_then_on_the_kernel(rng, tiered):
    rnn, X, _ = _net(rng, 5, 11)
    reference = rnn(backend="interpreter")
    compiled = rnn.compile("numba")
    first = rnn()
    run = compiled._runner(True)
    assert isinstance(run, numba_cpu.TieredProgram)
    # the first call answered on the interpreter: the same numbers exactly
    assert not run.ready
    np.testing.assert_array_equal(first.data, reference.data)
    assert compiled.wait(timeout=300), "the kernel was not compiled in 300 s"
    assert run.ready and compiled.ready()
    after = rnn()
    assert_close(after, reference)
    assert run.numba_program.module.program.signatures, "the kernel did not run"
    assert numba_cpu.ready_marker(run.numba_program.key).exists()


def test_a_training_step_answers_before_its_kernels_and_agrees_after(rng, tiered):
    rnn, X, params = _net(rng, 6, 13)
    dY = rng.standard_normal((X.data.shape[0], 13))
    want = sn.gradients(rnn, wrt=list(params) + ["x"], grad_outputs=[dY], backend="interpreter")
    first = sn.gradients(rnn, wrt=list(params) + ["x"], grad_outputs=[dY])
    compiled = rnn.compile("numba")
    assert compiled.wait(timeout=300)
    later = sn.gradients(rnn, wrt=list(params) + ["x"], grad_outputs=[dY])
    for a, b, w in zip(first, later, want):
        assert_close(a, w, what="gradient before the switch")
        assert_close(b, w, what="gradient after the switch")


def test_a_first_training_step_has_the_worker_prepare_the_weight_gradients(rng, tiered,
                                                                          monkeypatch):
    """While a new backward answers on the interpreter, the compile worker
    measures and compiles the weight gradients' product for its dtype
    (``blas.prepare_transposed_products``), so that the first compiled
    backward does not compile it on the caller's thread."""
    (tiered / "transposed_products.json").unlink(missing_ok=True)
    monkeypatch.setattr(numba_cpu, "_PREPARED", set())
    answers = {}
    send = numba_cpu._CompileWorker.send

    def recorded(self, request, callback):
        def answered(error):
            answers[request["key"]] = error
            callback(error)

        send(self, request, answered)

    monkeypatch.setattr(numba_cpu._CompileWorker, "send", recorded)
    rnn, X, params = _net(rng, 7, 9)
    sn.gradients(rnn, wrt=list(params), grad_outputs=[np.ones((X.data.shape[0], 9))])
    deadline = time.time() + 300
    while "transposed products float64" not in answers and time.time() < deadline:
        time.sleep(0.1)
    assert answers.get("transposed products float64", "no answer") is None, answers
    assert (tiered / "transposed_products.json").exists()
    # asked for once per cache directory and dtype
    sn.gradients(rnn, wrt=list(params), grad_outputs=[np.ones((X.data.shape[0], 9))])
    assert numba_cpu._PREPARED == {(tiered, "float64")}


def test_a_kernel_compiled_before_is_not_tiered_in_a_new_process(rng, tiered):
    rnn, X, _ = _net(rng, 4, 9)
    rnn()
    assert rnn.compile("numba").wait(timeout=300)
    script = textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_tiers import _net
        from stepnet.jit import numba_cpu
        rnn, X, _ = _net(np.random.default_rng(1234), 4, 9)
        rnn()
        print(type(rnn.compile("numba")._runner(True)).__name__)
    """)
    # the same draws as the rng fixture, so the same net and kernel
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "NumbaProgram"


def test_a_first_call_on_the_interpreter_compiles_nothing_here(tiered):
    """The answer of a new kernel's first call does not wait for the helpers
    it links (small_gemm's C entry), which on an empty cache take longer to
    compile than the kernel: the compile worker compiles them with the
    kernel, and this process neither compiles nor loads them until the
    kernel first runs here (then from the cache). Nor does a first training
    step wait for the compiled sums of the weight gradients (NumPy sums them
    while the backward runs on the interpreter). The worker's answers are
    held until then, so that the calls answer on the interpreter however
    fast it compiles."""
    script = textwrap.dedent(f"""
        import numpy as np, sys, threading
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_tiers import _net
        import os
        os.environ["STEPNET_TIERED"] = "1"  # (conftest, imported above, turns it off)
        import stepnet as sn
        from stepnet.jit import blas, numba_cpu
        answered, release = numba_cpu.TieredProgram._answered, threading.Event()

        def held(self, error):  # (on the thread reading the worker's answers)
            release.wait(300)
            answered(self, error)

        numba_cpu.TieredProgram._answered = held
        rnn, X, params = _net(np.random.default_rng(5), 7, 12)
        rnn()
        run = rnn.compile("numba")._runner(True)
        dY = np.ones((X.data.shape[0], 12))
        sn.gradients(rnn, wrt=list(params), grad_outputs=[dY])
        sums = (blas.gemm_tn.signatures + blas._gemm_tn_column_sums.signatures
                + blas._own_tn.signatures)
        print(run.ready, sorted(blas._own_entries), len(sums))
        release.set()
        assert rnn.compile("numba").wait(timeout=300)
        rnn()
        print(run.ready, sorted(blas._own_entries))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False [] 0", "True ['float64']"], out.stdout


def test_a_worker_that_fails_leaves_the_compile_to_the_next_call(rng, tiered, monkeypatch):
    class Broken:
        def submit(self, kernel, signature, callback):
            callback("the worker failed")

    monkeypatch.setattr(numba_cpu, "compile_worker", lambda: Broken())
    rnn, X, _ = _net(rng, 3, 7)
    reference = rnn(backend="interpreter")
    first = rnn()  # the worker answered at once: this call already compiles here
    run = rnn.compile("numba")._runner(True)
    assert run.ready
    assert_close(first, reference)


def test_deterministic_runs_are_never_tiered(monkeypatch):
    monkeypatch.setenv("STEPNET_TIERED", "1")
    monkeypatch.setattr(numba_cpu.blas, "DETERMINISTIC", True)
    assert not numba_cpu.tiered()
    monkeypatch.setattr(numba_cpu.blas, "DETERMINISTIC", False)
    assert numba_cpu.tiered()
    monkeypatch.setenv("STEPNET_TIERED", "0")
    assert not numba_cpu.tiered()


# ----------------------------------------------------------------------------
# the disk cache, in processes of their own

_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_tiers import _net
    rnn, X, _ = _net(np.random.default_rng(7), {features}, {hidden})
    print(repr(float(np.abs(rnn().data).sum())))
""")


def _run_script(cache, features, hidden, **env):
    script = _SCRIPT.format(tests=str(ROOT / "tests"), features=features, hidden=hidden)
    environment = dict(os.environ, STEPNET_CACHE_DIR=str(cache), STEPNET_TIERED="0", **env)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out.split()[-1]


def test_two_processes_compile_the_same_net_at_once(tmp_path):
    cache = cache_with_helpers(tmp_path / "cache")
    procs = [_run_script(cache, 3, 6) for _ in range(2)]
    results = [_finish(p) for p in procs]
    assert results[0] == results[1]
    assert _finish(_run_script(cache, 3, 6)) == results[0]  # and loads it after


def test_corrupted_cache_files_are_ignored_and_rebuilt(tmp_path):
    cache = cache_with_helpers(tmp_path / "cache")
    first = _finish(_run_script(cache, 4, 6))
    # every file of the kernel's, and the helpers' of one module (the scalar
    # ones: a recompile of the large product loops would only cost time)
    files = [p for p in cache.rglob("*") if p.is_file()
             and ("numba" not in p.relative_to(cache).parts or p.name.startswith("numba_runtime."))]
    helpers = [p for p in files if p.name.startswith("numba_runtime.")]
    assert any(p.suffix == ".nbi" for p in helpers) and any(p.suffix == ".nbc" for p in helpers)
    assert any(p.name.startswith("stepnet_kernel_") for p in files)
    for p in files:
        p.write_bytes(b"\x80\x04not what stepnet or Numba wrote\xff" * 3)
    assert _finish(_run_script(cache, 4, 6)) == first


def test_a_cache_directory_removed_while_a_process_runs(rng, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache))
    a, _, _ = _net(rng, 2, 5)
    first = a()
    shutil.rmtree(cache)
    b, _, _ = _net(rng, 2, 6)  # a new kernel: written and compiled into a new directory
    assert_close(b(), b(backend="interpreter"))
    assert_close(a(), first)
    assert any(cache.glob("stepnet_kernel_*.py"))


def test_the_command_says_which_tier_answered(tmp_path):
    """``stepnet run`` on a new kernel answers on the interpreter; ``stepnet
    bench`` waits for the kernels before it times them and says when they
    were ready."""
    env = dict(os.environ, STEPNET_CACHE_DIR=str(cache_with_helpers(tmp_path / "cache")),
               STEPNET_TIERED="1")
    example = str(ROOT / "examples" / "custom_cell.yaml")
    run = subprocess.run([sys.executable, "-m", "stepnet.cli", "run", example], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "running on the interpreter while compiling net" in run.stderr
    assert "new kernels answer on the interpreter while they compile" in run.stdout
    # the command did not wait for its worker, which finishes the kernel and marks it
    deadline = time.monotonic() + 120
    while not any((tmp_path / "cache").glob("stepnet_kernel_*.ready")):
        assert time.monotonic() < deadline, "the worker left no compiled kernel behind"
        time.sleep(0.2)
    env["STEPNET_CACHE_DIR"] = str(cache_with_helpers(tmp_path / "other"))
    bench = subprocess.run([sys.executable, "-m", "stepnet.cli", "bench", example, "--repeat", "2"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert bench.returncode == 0, bench.stderr
    assert "waiting for the compiled kernels" in bench.stderr
    assert "kernels  compiled" in bench.stdout
