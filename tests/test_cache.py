"""Everything stepnet compiles lands under STEPNET_CACHE_DIR, never in the package."""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stepnet as sn
from conftest import cache_with_helpers
from stepnet.jit import blas_choice, cache

_SCRIPT = textwrap.dedent(
    """
    import numpy as np, stepnet as sn
    X = sn.LoDTensor.from_lengths(np.arange(10, dtype=np.float32).reshape(5, 2) / 10, [[3, 2]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[2], name="h")
        h.update(sn.ops.tanh(x + h.pre_state()))
        rnn.add_outputs(h)
    compiled, reference = rnn(backend="numba"), rnn(backend="interpreter")
    assert np.allclose(compiled.data, reference.data, atol=1e-6)
    print("ran from", sn.__file__)
    """
)


def _tree(root):
    """Every file and folder below ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


def test_a_run_writes_only_under_the_cache_dir(tmp_path):
    """A read-only copy of the package, an empty cache: the package stays as it
    was, and the generated kernels and Numba's cache of stepnet's own helpers
    are under STEPNET_CACHE_DIR (STEPNET_DEBUG=1 prints the generated source)."""
    site = tmp_path / "site"
    package = site / "stepnet"
    shutil.copytree(Path(sn.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for path in [package, *package.rglob("*")]:
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
                   | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))
    before = _tree(package)
    cache_root = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1",
               STEPNET_CACHE_DIR=str(cache_root), STEPNET_DEBUG="1")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ran from {package / '__init__.py'}" in result.stdout
    assert "def program(" in result.stderr
    assert _tree(package) == before, "the run wrote into the package"
    assert list(cache_root.glob("stepnet_kernel_*.py"))
    assert list(cache_root.glob("__pycache__/stepnet_kernel_*.nbi"))
    helper_index = list(cache_root.glob("numba/*/jit/numba_runtime.*.nbi"))
    assert helper_index, sorted(str(p) for p in cache_root.rglob("*"))


def test_build_settings_give_separate_helper_caches(monkeypatch):
    """Deterministic mode and the library chosen each have helpers of their
    own; the library asked for by name does not: asked for or measured,
    the same library calls the same code."""
    from stepnet.jit import blas  # noqa: F401  (the engine started, run alone too)

    plain = cache.build_key()
    started = sn.config._started  # (the settings this process's engine started with)
    monkeypatch.setitem(started, "deterministic", not started["deterministic"])
    assert cache.build_key() != plain
    monkeypatch.setitem(started, "deterministic", not started["deterministic"])
    assert cache.build_key() == plain
    monkeypatch.setenv("STEPNET_BLAS", "numpy")
    assert cache.build_key() == plain
    monkeypatch.setattr(cache, "_CHOSEN_BLAS", ["another library"])
    assert cache.build_key() != plain


def test_helpers_compiled_for_one_blas_are_not_loaded_for_another(tmp_path):
    """Two processes that measured different BLAS libraries (close on some
    machines; two processes measuring at once can differ) keep their
    compiled helpers apart: the second would otherwise load helpers that
    call the first's library and crash (LLVM: symbol not found). The first
    starts on this process's compiled helpers and measurements
    (``cache_with_helpers``); the second, told the other library was
    measured, keeps its helpers in a build of its own."""
    if blas_choice.find_mkl() is None or blas_choice.find_openblas() is None:
        pytest.skip("needs both MKL and scipy's OpenBLAS")
    cache_root = cache_with_helpers(tmp_path / "cache")
    env = {k: v for k, v in os.environ.items() if k != "STEPNET_BLAS"}
    env.update(STEPNET_CACHE_DIR=str(cache_root), STEPNET_TIERED="0",
               STEPNET_SMALL_PRODUCTS="0")  # every product on the library
    script = _SCRIPT.replace("x + h.pre_state()", "x @ W + h.pre_state() @ W").replace(
        "rnn = sn.create_rnn_op()", "W = sn.Parameter(np.eye(2, dtype=np.float32) / 2)\n"
        "rnn = sn.create_rnn_op()") + (
        "from stepnet.jit import cache\nprint('build', cache.build_key())\n")
    names, keys = [], []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        keys.append(result.stdout.split()[-1])
        saved = json.loads((cache_root / "blas.json").read_text())
        names.append(saved["name"])
        saved["name"] = "openblas" if saved["name"] == "mkl" else "mkl"  # measured otherwise
        (cache_root / "blas.json").write_text(json.dumps(saved))
    assert names[0] != names[1]
    # (the copied cache may hold other builds too: this process's other settings)
    builds = {p.parent.parent.name
              for p in cache_root.glob("numba/*/jit/blas.gemm_hoisted-*.nbi")}
    assert keys[0] != keys[1] and set(keys) <= builds, (keys, builds)  # one per library


def test_default_cache_dir_is_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv("STEPNET_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "stepnet"
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"


def test_a_helper_compiled_with_another_helpers_code_is_stale_when_that_file_changes(tmp_path):
    """blas's functions embed threads' code and constants (share, SHARES):
    Numba's cache stamps a function by its own file only, so stepnet's
    stamps every helper file, and a change to threads.py recompiles blas's
    functions (instead of loading the old threads code inside them)."""
    package = tmp_path / "pkg"
    shutil.copytree(Path(sn.__file__).parent, package / "stepnet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(package), STEPNET_CACHE_DIR=str(tmp_path / "cache"),
               STEPNET_BLAS="openblas")
    script = ("import numpy as np\n"
              "from stepnet.jit import blas, threads\n"
              "blas.row_cut(20, 240, threads.ALONE)\n"
              "print(sum(blas.row_cut.stats.cache_hits.values()))\n")
    hits = []
    for change in (False, False, True):
        if change:
            with open(package / "stepnet" / "jit" / "threads.py", "a") as f:
                f.write("\n# changed\n")
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=600, cwd=tmp_path)  # (not this checkout's)
        assert result.returncode == 0, result.stderr[-3000:]
        hits.append(int(result.stdout.split()[-1]))
    assert hits == [0, 1, 0]



_READ_ONLY = textwrap.dedent(
    """
    import builtins, errno, io, os, sys
    import numpy as np, stepnet as sn
    root = os.path.realpath(os.environ["STEPNET_CACHE_DIR"])
    real_open, real_access = builtins.open, os.access

    def inside(path):
        return os.path.realpath(path).startswith(root)

    def open_(path, mode="r", *args, **kwargs):  # the folder as on a read-only mount
        if any(m in mode for m in "wax+") and inside(path):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, mode, *args, **kwargs)

    X = sn.LoDTensor.from_lengths(np.arange(10, dtype=np.float32).reshape(5, 2) / 10, [[3, 2]])

    def net(scale):
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            h = rnn.add_memory(shape=[2], name="h")
            h.update(sn.ops.tanh(rnn.add_input(X, name="x") * scale + h.pre_state()))
            rnn.add_outputs(h)
        return rnn

    if sys.argv[1] == "fill":
        net(2.0)(backend="numba")
        sys.exit()
    builtins.open = io.open = open_
    os.access = lambda path, mode, **kw: (not (mode & os.W_OK and inside(path))
                                          and real_access(path, mode, **kw))
    compiled = net(2.0).compile("numba")
    compiled()
    print("ready" if compiled.ready() else "tiered")
    try:
        net(3.0)()
    except sn.UnsupportedError as exc:
        print(exc)
    """
)


def test_a_read_only_cache_filled_ahead_is_loaded_and_a_new_kernel_refused(tmp_path):
    """A deployment's folder, filled ahead then read-only: the kernel compiled
    there answers from the first call, nothing is written elsewhere (Numba's
    per-user folder), and a kernel it lacks is refused by name."""
    home = tmp_path / "home"
    env = dict(os.environ, STEPNET_CACHE_DIR=str(cache_with_helpers(tmp_path / "cache")),
               HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    env.pop("NUMBA_CACHE_DIR", None)
    for step, tiered in (("fill", "0"), ("read", "1")):
        run = subprocess.run([sys.executable, "-c", _READ_ONLY, step], capture_output=True,
                             env=dict(env, STEPNET_TIERED=tiered), text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "ready", run.stdout
    assert "holds no kernel for this step-net and cannot take one (Read-only" in lines[1]
    assert not list(home.rglob("*.nbi")), "compiled again into Numba's per-user folder"


def test_two_saves_into_one_index_at_once_keep_both(tmp_path, monkeypatch):
    """Numba reads a function's index, adds a signature and writes the index
    whole: two processes saving at once (the compile worker and its caller,
    one signature each) would keep one. Under stepnet's cache a save holds
    its folder's lock (here two threads, each opening the lock file as a
    process does; each read of the index slowed so that the saves overlap)."""
    import threading
    import time

    from numba.core import caching

    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    files = caching.IndexDataCacheFile
    load_index = files._load_index

    def slow_load_index(self):
        overloads = load_index(self)
        time.sleep(0.2)
        return overloads

    monkeypatch.setattr(files, "_load_index", slow_load_index)
    (tmp_path / "jit").mkdir()
    index = files(str(tmp_path / "jit"), "helper-1", "stamp")
    saves = [threading.Thread(target=index.save, args=(key, f"code of {key}"))
             for key in ("float32", "float64")]
    for save in saves:
        save.start()
    for save in saves:
        save.join()
    again = files(str(tmp_path / "jit"), "helper-1", "stamp")
    assert sorted(again._load_index()) == ["float32", "float64"]
    assert [again.load(key) for key in ("float32", "float64")] == ["code of float32", "code of float64"]
