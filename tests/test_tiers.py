"""The Numba backend's tiers and its disk cache: a new kernel answers on the
interpreter while the compile worker compiles it; the cache survives being
removed, shared by two processes at once, and corrupted."""

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from conftest import assert_close, cache_with_helpers
from stepnet import interpreter
from stepnet.jit import blas, compile_worker, loading

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
    and the executor's loops only: ``cache_with_helpers``): every kernel is new."""
    cache = cache_with_helpers(tmp_path / "cache", executor=True)
    monkeypatch.setenv("STEPNET_TIERED", "1")
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache))
    return cache


def test_first_calls_answer_on_the_executor_then_on_the_kernel(rng, tiered):
    """A new kernel's first calls answer on the schedule executor, on every
    core but the compile worker's, within the kernels' tolerance; then on
    the kernel."""
    rnn, X, _ = _net(rng, 5, 11)
    reference = rnn(backend="interpreter")
    compiled = rnn.compile("numba")
    run = compiled._runner(True)
    assert isinstance(run, loading.TieredProgram) and run._executor is not None
    executed, given = run._executor, []

    def recording(args, consts, workers=1):
        given.append(workers)
        return executed(args, consts, workers=workers)

    recording.prepare = executed.prepare
    run._executor = recording
    first = rnn()
    assert given == [interpreter.cores_beside_a_compile()]
    assert not run.ready
    assert_close(first, reference)
    assert compiled.wait(timeout=300), "the kernel was not compiled in 300 s"
    assert run.ready and compiled.ready()
    after = rnn()
    assert_close(after, reference)
    assert run.numba_program.module.program.signatures, "the kernel did not run"
    assert loading.ready_marker(run.numba_program.key).exists()


def test_a_program_the_executor_does_not_run_answers_on_the_interpreter(rng, tiered):
    """Where the executor does not run a program, the first calls answer on
    the interpreter (the same numbers exactly), NumPy's products off the
    worker's core while it compiles (OpenBLAS's count read by setting it
    again), as before after the call."""
    rnn, X, _ = _net(rng, 3, 10)
    reference = rnn(backend="interpreter")
    run = rnn.compile("numba")._runner(True)
    run._executor = None  # (as for a program the executor does not run: executor.why_not)
    interpreted, blas_threads = run._interpreted, []
    set_count = interpreter._numpy_blas_setter()

    def recording(*args):
        blas_threads.append(set_count(1))
        return interpreted(*args)

    run._interpreted = recording
    if set_count is not None:
        before = set_count(2)
        try:
            first = rnn()
            # (on every core but the worker's, at most the count before)
            assert blas_threads == [min(2, interpreter.cores_beside_a_compile())]
            assert set_count(before) == 2
        finally:
            set_count(before)
    else:  # (a NumPy on another BLAS: nothing to set)
        run._interpreted = interpreted
        first = rnn()
    assert not run.ready
    np.testing.assert_array_equal(first.data, reference.data)


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
    (``transposed.prepare_transposed_products``), so that the first compiled
    backward does not compile it on the caller's thread."""
    (tiered / "transposed_products.json").unlink(missing_ok=True)
    monkeypatch.setattr(loading, "_PREPARED", set())
    answers = {}
    send = compile_worker.Client.send

    def recorded(self, request, callback):
        def answered(error):
            answers[request["key"]] = error
            callback(error)

        send(self, request, answered)

    monkeypatch.setattr(compile_worker.Client, "send", recorded)
    rnn, X, params = _net(rng, 7, 9)
    sn.gradients(rnn, wrt=list(params), grad_outputs=[np.ones((X.data.shape[0], 9))])
    deadline = time.time() + 300
    while "transposed products float64" not in answers and time.time() < deadline:
        time.sleep(0.1)
    assert answers.get("transposed products float64", "no answer") is None, answers
    assert (tiered / "transposed_products.json").exists()
    # asked for once per cache directory and dtype
    sn.gradients(rnn, wrt=list(params), grad_outputs=[np.ones((X.data.shape[0], 9))])
    assert loading._PREPARED == {(tiered, "float64")}


def test_a_kernel_compiled_before_is_not_tiered_in_a_new_process(rng, tiered):
    rnn, X, _ = _net(rng, 4, 9)
    rnn()
    assert rnn.compile("numba").wait(timeout=300)
    script = textwrap.dedent(f"""
        import numpy as np, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_tiers import _net
        rnn, X, _ = _net(np.random.default_rng(1234), 4, 9)
        rnn()
        print(type(rnn.compile("numba")._runner(True)).__name__)
    """)
    # the same draws as the rng fixture, so the same net and kernel
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "NumbaProgram"


def test_a_first_call_on_the_interpreter_compiles_nothing_here(tmp_path, monkeypatch):
    """The answer of a new kernel's first call does not wait for the helpers
    it links (small_gemm's C entry), which on an empty cache take longer to
    compile than the kernel: the compile worker compiles them with the
    kernel, and this process neither compiles nor loads them until the
    kernel first runs here (then from the cache). Nor does a first training
    step wait for the compiled sums of the weight gradients (NumPy sums them
    while the backward runs on the interpreter), nor the helper thread's
    calls (compiled at their first use). The worker's answers are
    held until then, so that the calls answer on the interpreter however
    fast it compiles. (No executor's loop in the cache: it would link them.)"""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache_with_helpers(tmp_path / "cache")))
    script = textwrap.dedent(f"""
        import numpy as np, sys, threading
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_tiers import _net
        import os
        os.environ["STEPNET_TIERED"] = "1"  # (conftest, imported above, turns it off)
        import stepnet as sn
        from stepnet.jit import blas, loading, transposed
        answered, release = loading.TieredProgram._answered, threading.Event()

        def held(self, error):  # (on the thread reading the worker's answers)
            release.wait(300)
            answered(self, error)

        loading.TieredProgram._answered = held
        rnn, X, params = _net(np.random.default_rng(5), 7, 12)
        rnn()
        run = rnn.compile("numba")._runner(True)
        dY = np.ones((X.data.shape[0], 12))
        sn.gradients(rnn, wrt=list(params), grad_outputs=[dY])
        sums = (blas.gemm_tn.signatures + transposed._gemm_tn_column_sums.signatures
                + transposed._own_tn.signatures)
        from stepnet.jit import threads  # (nor the helper thread's calls, at import)
        sums += [s for f in (threads.run_jobs, threads.group_cut, threads.hold_helper,
                             threads.post_job, threads.finish_job) for s in f.signatures]
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
        def submit(self, kernel, signature, callback, function="program"):
            callback("the worker failed")

    monkeypatch.setattr(loading, "compile_worker", lambda: Broken())
    rnn, X, _ = _net(rng, 3, 7)
    reference = rnn(backend="interpreter")
    first = rnn()  # the worker answered at once: this call already compiles here
    run = rnn.compile("numba")._runner(True)
    assert run.ready
    assert_close(first, reference)


def test_deterministic_runs_are_never_tiered(monkeypatch):
    monkeypatch.setenv("STEPNET_TIERED", "1")
    monkeypatch.setattr(blas, "DETERMINISTIC", True)
    assert not loading.tiered()
    monkeypatch.setattr(blas, "DETERMINISTIC", False)
    assert loading.tiered()
    monkeypatch.setenv("STEPNET_TIERED", "0")
    assert not loading.tiered()


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
    """Files that do not unpickle, then compiled code that does but whose
    LLVM bitcode is damaged, then data files with bytes overwritten, are
    misses: compiled anew, then loaded."""
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
    damaged = 0
    for p in cache.rglob("stepnet_kernel_*.nbc"):  # (written again by that run)
        raw = bytearray(p.read_bytes())
        at = raw.find(b"BC\xc0\xde")  # (LLVM bitcode's magic; not in every function's file)
        if not 0 <= at < len(raw) - 264:
            continue
        raw[at + 200:at + 264] = b"\xff" * 64
        p.write_bytes(bytes(raw))
        damaged += 1
    assert damaged
    assert _finish(_run_script(cache, 4, 6)) == first
    assert _finish(_run_script(cache, 4, 6)) == first  # (written whole again)
    # bytes overwritten anywhere in a data file that still unpickles (machine
    # code run as it is would crash the process): its digest says so
    for p in [*cache.rglob("stepnet_kernel_*.nbc"), *cache.rglob("numba_runtime.*.nbc")]:
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2:len(raw) // 2 + 8] = b"\xff" * 8
        p.write_bytes(bytes(raw))
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
    """``stepnet run`` on a new kernel answers on the executor (the first
    tier); ``stepnet bench`` waits for the kernels before it times them and
    says when they were ready."""
    env = dict(os.environ, STEPNET_TIERED="1",
               STEPNET_CACHE_DIR=str(cache_with_helpers(tmp_path / "cache", executor=True)))
    loops = set((tmp_path / "cache").glob("stepnet_kernel_*.ready"))  # (the executor's, ready)
    example = str(ROOT / "examples" / "custom_cell.yaml")
    run = subprocess.run([sys.executable, "-m", "stepnet.cli", "run", example], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "running on the first tier while compiling net" in run.stderr
    assert "answered on the executor while new kernels compile in the background" in run.stdout
    # the command did not wait for its worker, which finishes the kernel and marks it
    deadline = time.monotonic() + 120
    while not set((tmp_path / "cache").glob("stepnet_kernel_*.ready")) - loops:
        assert time.monotonic() < deadline, "the worker left no compiled kernel behind"
        time.sleep(0.2)
    env["STEPNET_CACHE_DIR"] = str(cache_with_helpers(tmp_path / "other", executor=True))
    bench = subprocess.run([sys.executable, "-m", "stepnet.cli", "bench", example, "--repeat", "2"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert bench.returncode == 0, bench.stderr
    assert "waiting for the compiled kernels" in bench.stderr
    assert "from the start to the compiled kernels; the first call" in bench.stdout
    assert "minus the median run" not in bench.stdout  # the first call compiled nothing


# ----------------------------------------------------------------------------
# one compile worker per cache directory


def _alive(pid) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


needs_unix = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="the worker's tests read /proc (Linux)")


@needs_unix
def test_one_worker_per_cache_directory_below_its_callers_priority(rng, tiered):
    rnn, X, _ = _net(rng, 5, 7)
    rnn()  # a new kernel: asked of the worker
    pid = loading.compile_worker().pid(timeout=300)
    assert _alive(pid)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, ours + compile_worker.NICENESS)
    # another process using the same cache directory asks the same worker
    out = subprocess.run(
        [sys.executable, "-c", "from stepnet.jit import loading; "
                               "print(loading.compile_worker().pid(timeout=300))"],
        capture_output=True, text=True, env=dict(os.environ), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == pid
    assert rnn.compile("numba").wait(timeout=300)
    # gone within seconds once its queue is empty
    deadline = time.monotonic() + compile_worker.IDLE_SECONDS + 60
    while _alive(pid):
        assert time.monotonic() < deadline, "the idle worker did not exit"
        time.sleep(0.2)
    assert compile_worker.status(tiered) is None
    # a process asking after that starts the next one
    rnn2, _, _ = _net(rng, 6, 7)
    rnn2()
    assert rnn2.compile("numba").wait(timeout=300)  # (compiled by the next worker)
    # (this process's client of the ended worker can take a moment to see
    # its connection end: then the next worker serves it)
    deadline = time.monotonic() + 60
    while loading.compile_worker().pid(timeout=300) in (pid, None):
        assert time.monotonic() < deadline, "no next worker"
        time.sleep(0.2)


@needs_unix
def test_info_lists_what_the_worker_compiles(rng, tiered):
    import signal

    rnn, X, _ = _net(rng, 4, 13)
    rnn()
    pid = loading.compile_worker().pid(timeout=300)
    deadline = time.monotonic() + 300
    # (the worker compiles the executor's loops first: then the kernel)
    while "program of" not in str((compile_worker.status(tiered) or {}).get("compiling")):
        assert time.monotonic() < deadline, "the worker never said it was compiling"
        time.sleep(0.005)
    os.kill(pid, signal.SIGSTOP)  # (held at the kernel it compiles while info runs)
    try:
        found = compile_worker.status(tiered)
        info = subprocess.run([sys.executable, "-m", "stepnet", "info"], capture_output=True,
                              text=True, env=dict(os.environ), cwd=ROOT, timeout=300)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert found["compiling"], "the kernel compiled in under 5 ms"
    assert info.returncode == 0, info.stderr
    kernel = rnn.compile("numba")._runner(True).numba_program.module.__file__
    assert f"compile worker: process {pid}, compiling program of {kernel}" in info.stdout, (
        info.stdout)
    assert rnn.compile("numba").wait(timeout=300)


def _serving(monkeypatch, tmp_path, compile_kernel):
    """A worker's server in a thread of this process, compiling with
    ``compile_kernel``: (server, thread, a function connecting a client)."""
    import socket

    monkeypatch.setattr(compile_worker, "compile_kernel", compile_kernel)
    # long enough that a loaded machine connects every client before it ends;
    # _end_when_idle shortens it once the test has sent what it sends
    monkeypatch.setattr(compile_worker, "IDLE_SECONDS", 300)
    path = str(tmp_path / "worker.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    server = compile_worker._Server(tmp_path, listener)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()

    def connect():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        connection = compile_worker._Connection(sock)
        lines = connection.lines()
        assert next(lines) == {"worker": os.getpid()}
        return connection, lines

    return server, thread, connect


def _end_when_idle(monkeypatch, server):
    monkeypatch.setattr(compile_worker, "IDLE_SECONDS", 0.5)
    with server.cond:
        server.cond.notify()


@needs_unix
def test_a_kernel_two_processes_ask_for_is_compiled_once(monkeypatch, tmp_path):
    import socket

    compiled, release = [], threading.Event()

    def compile_kernel(request):
        assert release.wait(60)
        compiled.append(request["key"])

    server, thread, connect = _serving(monkeypatch, tmp_path, compile_kernel)
    (a, a_lines), (b, b_lines), (c, _) = connect(), connect(), connect()
    a.send({"key": "k"})
    _until(lambda: server.current is not None)
    b.send({"key": "k"})  # being compiled: b waits for that compile
    c.send({"key": "orphan"})
    _until(lambda: len(server.current[2]) == 2 and "orphan" in server.queue)
    c.sock.shutdown(socket.SHUT_RDWR)  # its process ended: its request waits behind b's
    _until(lambda: server.queue["orphan"][1] == [])
    b.send({"key": "loop", "function": "steps_loop"})  # (the executor's: after the kernels)
    b.send({"key": "other"})
    _until(lambda: "other" in server.queue)
    _end_when_idle(monkeypatch, server)
    release.set()
    assert next(a_lines) == {"key": "k", "ok": True}
    assert next(b_lines) == {"key": "k", "ok": True}
    assert next(b_lines) == {"key": "other", "ok": True}
    assert next(b_lines) == {"key": "loop", "ok": True}
    _until(lambda: len(compiled) == 4)
    assert compiled == ["k", "other", "loop", "orphan"]
    thread.join(30)  # and it ends once idle
    assert not thread.is_alive() and server.closing


@needs_unix
def test_a_failed_compile_is_answered_to_every_process_that_asked(monkeypatch, tmp_path):
    def compile_kernel(request):
        raise RuntimeError(f"cannot compile {request['key']}")

    server, thread, connect = _serving(monkeypatch, tmp_path, compile_kernel)
    (a, a_lines) = connect()
    a.send({"key": "k"})
    assert next(a_lines) == {"key": "k", "error": "RuntimeError: cannot compile k"}
    _end_when_idle(monkeypatch, server)
    thread.join(30)
    assert not thread.is_alive()


def _until(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@needs_unix
def test_the_worker_imports_the_stepnet_of_the_process_that_starts_it(tmp_path):
    """A process started in a folder holding another ``stepnet`` (a source
    checkout) gets a worker running its own stepnet, whose compiled code it
    then finds in the cache, not one importing that folder's."""
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    (work / "stepnet").mkdir(parents=True)
    (work / "stepnet" / "__init__.py").write_text("raise ImportError('not this stepnet')\n")
    scripts.mkdir()
    (scripts / "start.py").write_text(textwrap.dedent("""
        import os
        from pathlib import Path
        import stepnet
        from stepnet.jit import compile_worker
        root = Path(os.environ["STEPNET_CACHE_DIR"])
        pid = compile_worker.worker(root).pid(timeout=120)
        found = compile_worker.status(root)
        print(pid, found and found["pid"], found and found["stepnet"],
              Path(stepnet.__file__).resolve().parents[1])
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT), STEPNET_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, str(scripts / "start.py")], cwd=work, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    pid, status_pid, worker_stepnet, ours = out.stdout.split()
    assert pid != "None" and pid == status_pid, out.stdout
    assert worker_stepnet == ours == str(ROOT), out.stdout


@needs_unix
def test_a_worker_refuses_a_kernel_of_other_settings_or_another_stepnet(monkeypatch, tmp_path):
    """A kernel asked for by a process of other settings, or of another
    stepnet sharing the cache directory (its helpers' sources differ), is
    answered with an error, and that process compiles it itself: compiled
    here it would embed this stepnet's helpers."""
    server, thread, connect = _serving(monkeypatch, tmp_path, compile_worker.compile_kernel)
    from stepnet.jit import cache

    connection, lines = connect()
    # (the settings alone the same: the helpers' sources are what differs)
    for build in ("0" * 16, cache.build_key()):
        connection.send({"key": build, "blas": blas.SIGNATURE, "build": build, "path": "none"})
        reply = next(lines)
        assert reply["key"] == build and "or another stepnet than the kernel's" in reply["error"], (
            reply)
    _end_when_idle(monkeypatch, server)
    thread.join(30)
    assert not thread.is_alive()


def test_a_forked_child_connects_to_the_compile_worker_itself():
    """The parent's connection is not the child's: the thread reading its
    replies stays in the parent, and a child's kernels would never be told
    compiled."""
    from stepnet.jit import compile_worker

    compile_worker._CLIENTS["parent's"] = object()
    try:
        pid = os.fork()
        if pid == 0:  # (the child: its exit code is the test's answer)
            os._exit(0 if not compile_worker._CLIENTS and not compile_worker._STARTED else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        compile_worker._CLIENTS.pop("parent's")
