"""The BLAS chosen by measurement, and the measured limits of stepnet's own
loop (stepnet.jit.blas_choice)."""

import json
import os
import re
import subprocess
import sys

import pytest

import stepnet as sn
from stepnet import cli
from conftest import cache_with_helpers, run_python
from stepnet.jit import blas, blas_choice


@pytest.fixture
def libraries(monkeypatch, tmp_path):
    """``blas_choice._choose`` over the libraries a test names (found, or
    not), whatever this machine has, with a fresh cache directory and
    measurements a test sets (``seconds``; each call of ``measure`` is
    counted in ``measured``)."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STEPNET_BLAS", raising=False)
    state = {"found": {}, "seconds": {}, "measured": 0}
    # the machine's load unread: a kept choice is always checked (the other
    # test processes would otherwise keep the cores busy)
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: None)
    for name in ("mkl", "openblas"):
        monkeypatch.setattr(blas_choice, f"find_{name}",
                            lambda name=name: state["found"].get(name))

    def measure(reachable, shapes=None):
        state["measured"] += 1
        seconds = state["seconds"]  # (a list: one call's figures each)
        seconds = seconds.pop(0) if isinstance(seconds, list) else seconds
        return {lib.name: seconds[lib.name] for lib in reachable}

    monkeypatch.setattr(blas_choice, "measure", measure)
    return state


def test_the_choice_is_measured_once_and_kept(libraries, tmp_path):
    """With two libraries the faster is measured once, kept, read back,
    and measured again where the kept file is corrupt or the library it
    names is gone."""
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    libraries["seconds"] = {"mkl": [2.0, 2.0], "openblas": [1.0, 1.0]}
    first = blas_choice._choose()
    assert (first["name"], first["reason"]) == ("openblas", "measured")
    saved = json.loads((tmp_path / "blas.json").read_text())
    assert saved["name"] == "openblas" and set(saved["seconds"]) == {"mkl", "openblas"}
    # (checked by timing the per-step product again: within 2x, kept)
    libraries["seconds"] = {"mkl": [1.1, 1.1], "openblas": [1.9, 1.9]}
    second = blas_choice._choose()
    assert (second["name"], second["reason"]) == ("openblas", "measured (cached)")
    assert libraries["measured"] == 3  # (twice: the same figures, steady; once checked)
    (tmp_path / "blas.json").write_text("{not json")  # measured again, never a crash
    third = blas_choice._choose()
    assert (third["name"], third["reason"]) == ("mkl", "measured")
    assert libraries["measured"] == 5
    kept = json.loads((tmp_path / "blas.json").read_text())
    for changed in ({"seconds": None}, {"name": ["mkl"]}, {"reason": None},
                    {"seconds": {"mkl": 5, "openblas": 5}}):  # (its key, fields of another form)
        (tmp_path / "blas.json").write_text(json.dumps({**kept, **changed}))
        assert blas_choice._choose()["reason"] == "measured"


@pytest.mark.parametrize("change", ["MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "OPENBLAS_CORETYPE",
                                    "compiled", "offered"])
def test_a_choice_kept_under_other_instructions_is_measured_again(libraries, monkeypatch, change):
    """A choice measured where the libraries ran other kernels (their
    variables), or where stepnet's loops were compiled for other
    instructions (``NUMBA_CPU_NAME`` with ``NUMBA_CPU_FEATURES``), or on a
    machine of the same name offering others, is not read: measured again."""
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    libraries["seconds"] = {"mkl": [1.0, 1.0], "openblas": [2.0, 2.0]}
    assert blas_choice._choose()["reason"] == "measured"
    assert blas_choice._choose()["reason"] == "measured (cached)"
    # (each changed from what this run has: it may emulate a CPU already)
    if change in ("compiled", "offered"):
        from stepnet.jit import own_loop

        name = "compiled_features" if change == "compiled" else "host_features"
        features = getattr(own_loop, name)() ^ {"avx512f"}
        monkeypatch.setattr(own_loop, name, lambda: features)
    else:
        monkeypatch.setenv(change, os.environ.get(change, "") + "1")
    assert blas_choice._choose()["reason"] == "measured"
    assert blas_choice._choose()["reason"] == "measured (cached)"


def test_a_kept_measurement_the_products_contradict_is_taken_again(libraries, tmp_path,
                                                                     monkeypatch):
    """A kept choice whose per-step product now takes more than 2x more or
    less time than it says (measured on a busy machine, or the machine
    changed) is measured again, and the new choice replaces it; on a busy
    machine the kept one stands."""
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    libraries["seconds"] = {"mkl": [2.0, 2.0], "openblas": [1.0, 1.0]}
    assert blas_choice._choose()["name"] == "openblas"
    libraries["seconds"] = {"mkl": [0.25, 0.25], "openblas": [1.0, 1.0]}
    again = blas_choice._choose()
    assert again["name"] == "mkl" and libraries["measured"] == 5
    assert again["reason"] == "measured again (the kept figures were 8.0x off the products " \
                              "timed now)"
    assert json.loads((tmp_path / "blas.json").read_text())["name"] == "mkl"
    assert blas_choice._choose()["reason"] == again["reason"] + " (cached)"
    # a busy machine judges nothing: the kept choice stands, however far off
    clock = iter(range(0, 10**6, 5))  # another process: 5 busy seconds a reading
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: float(next(clock)))
    monkeypatch.setattr(blas_choice.time, "sleep", lambda s: None)
    libraries["seconds"] = {"mkl": [9.0, 9.0], "openblas": [1.0, 1.0]}
    assert blas_choice._choose()["name"] == "mkl" and libraries["measured"] == 7


def test_processes_measuring_at_once_take_the_choice_kept_first(libraries, tmp_path,
                                                                 monkeypatch):
    """A process whose measurement ends after another process kept its
    choice (a cold cache, a noisy machine) takes the kept one: every process
    of a cache directory, and the compile worker they share, use one library."""
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    libraries["seconds"] = {"mkl": [2.0, 2.0], "openblas": [1.0, 1.0]}
    ours = blas_choice._choose()  # (the file it keeps: the key to write another's under)
    other = json.loads((tmp_path / "blas.json").read_text())
    (tmp_path / "blas.json").unlink()
    measure = blas_choice.measure

    def measured_while_another_kept(reachable, shapes=None):
        (tmp_path / "blas.json").write_text(json.dumps(dict(other, name="mkl")))
        return measure(reachable, shapes)

    monkeypatch.setattr(blas_choice, "measure", measured_while_another_kept)
    again = blas_choice._choose()
    assert ours["name"] == "openblas" and again["name"] == "mkl"
    assert json.loads((tmp_path / "blas.json").read_text())["name"] == "mkl"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_measurement_is_taken_again_until_steady_or_said_to_be_noisy(libraries, tmp_path):
    libraries["found"] = {name: blas_choice.Library(name, f"/lib/{name}.so", None)
                          for name in ("mkl", "openblas")}
    mkl = [2.0, 2.0]
    # the second measurement far from the first, the third close to it: steady
    libraries["seconds"] = [{"mkl": mkl, "openblas": [1.0, 1.0]},
                            {"mkl": mkl, "openblas": [1.6, 1.0]},
                            {"mkl": mkl, "openblas": [1.05, 1.0]}]
    choice = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("openblas", "measured")
    assert choice["seconds"]["openblas"] == [1.0, 1.0] and libraries["measured"] == 3
    # never two close: chosen on the best figures, and said to be noisy, kept so
    (tmp_path / "blas.json").unlink()
    libraries["seconds"] = [{"mkl": mkl, "openblas": [1.0, 1.0]},
                            {"mkl": mkl, "openblas": [1.6, 1.0]},
                            {"mkl": mkl, "openblas": [1.3, 1.0]},
                            {"mkl": mkl, "openblas": [1.0, 1.0]}]  # (the kept one checked)
    choice = blas_choice._choose()
    assert choice["name"] == "openblas" and libraries["measured"] == 6
    assert "noisy" in choice["reason"] and "openblas 64x256 @ 256x768" in choice["reason"]
    assert "stepnet info --measure" in choice["reason"]
    again = blas_choice._choose()
    assert again["reason"] == choice["reason"] + " (cached)"


def test_one_library_or_none_is_taken_without_measuring(libraries, tmp_path):
    libraries["found"] = {"openblas": blas_choice.Library("openblas", "/lib/openblas.so", None)}
    choice = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("openblas", "the only one found")
    libraries["found"] = {}
    with pytest.warns(RuntimeWarning, match="no BLAS found"):
        choice = blas_choice._choose()
    assert (choice["name"], choice["reason"]) == ("numpy", "no BLAS found")
    assert libraries["measured"] == 0 and not (tmp_path / "blas.json").exists()


def test_a_requested_library_is_taken_or_warned_about(libraries, monkeypatch):
    libraries["found"] = {"mkl": blas_choice.Library("mkl", "/lib/mkl.so", None)}
    monkeypatch.delitem(sn.config._started, "blas", raising=False)  # (as before the engine starts)
    monkeypatch.setenv("STEPNET_BLAS", "mkl")
    assert blas_choice._choose()["name"] == "mkl"
    monkeypatch.setenv("STEPNET_BLAS", "openblas")
    with pytest.warns(RuntimeWarning, match="STEPNET_BLAS=openblas but"):
        assert blas_choice._choose()["name"] == "numpy"
    monkeypatch.setenv("STEPNET_BLAS", "atlas")
    with pytest.raises(sn.UnsupportedError, match="STEPNET_BLAS='atlas'"):
        blas_choice._choose()
    assert libraries["measured"] == 0


def test_stepnet_blas_names_the_library(tmp_path):
    out = run_python("from stepnet.jit import blas; print(blas.BLAS_NAME)", tmp_path,
                  STEPNET_BLAS="numpy")
    assert out.strip() == "numpy"


def test_the_small_product_rows_are_the_cheapest_measured(tmp_path, monkeypatch):
    """For each size of weights, stepnet's own loop is taken up to the rows
    where, over all rows measured, the time (each relative to the faster of
    the two) is least (every number of rows where that is the most rows
    measured), and shared with the helper where a one-row product took less
    time cut with it than alone (or where not measured; a cut that lost is
    measured twice: one that won by less than a tenth, a near tie, lost);
    the limits are kept and read back."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_choice.time, "sleep", lambda s: None)
    # the machine's load unread: every cut counts (the other test processes
    # would otherwise make some of them crowded; that rule has its own test)
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: None)
    monkeypatch.delenv("STEPNET_SMALL_PRODUCTS", raising=False)
    monkeypatch.delitem(sn.config._started, "small_products", raising=False)
    choice = {"name": "mkl", "cpu": "a CPU", "libraries": {"mkl": "/lib/libmkl_rt.so"}}
    asked, asked_shared = [], []

    def time_both(m, k, n):  # the own loop is faster up to 4 rows, 16 for the smallest weights
        asked.append((m, k, n))
        return (1.0, 2.0) if m <= (16 if k * n < 20000 else 4) else (2.0, 1.0)

    def time_shared(m, k, n):  # never cut under 20000; slower cut up to 200000, a tie to 300000
        asked_shared.append((m, k, n))
        if k * n < 20000:
            return None
        return (1.0, 1.5) if k * n <= 200000 else (1.0, 0.95) if k * n <= 300000 else (2.0, 1.0)

    limits = blas_choice.small_product_rows(choice, time_both, time_shared)
    sizes = [k * n for k, n in blas_choice._STEP_WEIGHTS]
    assert limits == tuple((size, 16 if size < 20000 else 4, int(not 20000 <= size <= 300000))
                           for size in sizes)
    assert len(asked) == len(blas_choice._STEP_WEIGHTS) * len(blas_choice._STEP_ROWS)
    assert asked_shared == [(1, k, n) for k, n in blas_choice._STEP_WEIGHTS
                            for _ in range(2 if 20000 <= k * n <= 300000 else 1)]
    saved = json.loads((tmp_path / "small_products.json").read_text())
    assert [tuple(x) for x in saved["limits"]] == list(limits)
    checked = []

    def time_again(m, k, n, scale=1.0):  # (what time_both gives, scaled)
        checked.append((m, k, n))
        return tuple(scale * s for s in time_both(m, k, n))

    assert blas_choice.small_product_rows(choice, time_again) == limits  # cached: one checked
    assert checked == [blas_choice._CHECKED] and blas_choice._SMALL_PRODUCTS["float32"]["reason"] == \
        "measured (cached)"
    # a kept product more than 2x off what it takes now: every one measured again
    checked.clear()
    limits_again = blas_choice.small_product_rows(choice, lambda m, k, n: time_again(m, k, n, 3.0),
                                                  time_shared)
    assert limits_again == limits
    assert len(checked) == 1 + len(blas_choice._STEP_WEIGHTS) * len(blas_choice._STEP_ROWS)
    assert blas_choice._SMALL_PRODUCTS["float32"]["reason"].startswith("measured again (the kept figures "
                                                            "were 3.0x off")
    # not checked where asked not to (a process that has not linked the product's code)
    checked.clear()
    assert blas_choice.small_product_rows(choice, lambda m, k, n: time_again(m, k, n, 10.0),
                                          check=False) == limits and checked == []
    # another library is measured anew; a library faster everywhere gets 0 rows
    other = dict(choice, name="openblas", libraries={"openblas": "scipy"})
    assert {r for _, r, _ in blas_choice.small_product_rows(other, lambda m, k, n: (2.0, 1.0))} \
        == {0}
    # an own loop faster up to the most rows measured takes every product of
    # that size where, over many rows as the kernels run them, it took at most
    # 0.9 of the library's time (a near tie or nothing measured: up to the
    # most rows measured); nothing measured about the helper: every size shares
    asked_many = []

    def time_many(m, k, n):  # clearly faster for the smallest weights, a near tie for 128 x 384
        asked_many.append((m, k, n))
        return (1.0, 2.0) if k * n < 20000 else (1.0, 1.05)

    third = dict(choice, name="numpy", libraries={})
    limits = blas_choice.small_product_rows(
        third, lambda m, k, n: (1.0, 2.0) if k * n < 50000 or m <= 64 else (2.0, 1.0),
        time_many=time_many)
    assert limits == tuple((size, (1 << 62) if size < 20000 else 256 if size < 50000 else 64, 1)
                           for size in sizes)
    assert asked_many == [(blas_choice._MANY_ROWS, k, n) for k, n in blas_choice._STEP_WEIGHTS
                          if k * n < 50000]
    fourth = dict(choice, name="numpy", cpu="another CPU", libraries={})
    assert blas_choice.small_product_rows(fourth, lambda m, k, n: (1.0, 2.0)) == \
        tuple((size, 256, 1) for size in sizes)
    # float64's products are measured and kept apart from float32's
    assert {r for _, r, _ in blas_choice.small_product_rows(fourth, lambda m, k, n: (2.0, 1.0),
                                                            dtype="float64")} == {0}
    assert (tmp_path / "small_products_float64.json").exists()
    assert blas_choice.small_product_rows(fourth, lambda m, k, n: (1.0, 2.0)) == \
        tuple((size, 256, 1) for size in sizes)
    assert blas_choice._SMALL_PRODUCTS["float32"]["reason"] == "measured (cached)"
    assert blas_choice._SMALL_PRODUCTS["float64"]["reason"] == "measured"
    # (each value read as the engine starts)
    monkeypatch.delitem(sn.config._started, "small_products", raising=False)
    monkeypatch.setenv("STEPNET_SMALL_PRODUCTS", "3")
    assert blas_choice.small_product_rows(choice, None) == ((1 << 62, 3, 1),)  # (none timed)
    monkeypatch.delitem(sn.config._started, "small_products")
    monkeypatch.setenv("STEPNET_SMALL_PRODUCTS", "many")
    with pytest.raises(sn.UnsupportedError, match="STEPNET_SMALL_PRODUCTS='many'"):
        blas_choice.small_product_rows(choice, None)


def test_a_cut_is_not_measured_beside_another_process(tmp_path, monkeypatch):
    """A product cut with the helper is measured only while no other process
    keeps a core busy (its cut would lose however fast it is on a free
    core): where every try had company, it is not measured, and the sizes
    share by default; the file says how many were not measured."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("STEPNET_SMALL_PRODUCTS", raising=False)
    monkeypatch.setattr(blas_choice.time, "sleep", lambda s: None)
    clock = iter(range(0, 10**6, 5))  # another process: 5 busy seconds a reading
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: float(next(clock)))
    assert blas_choice.measured_on_free_cores(lambda: 1.0, tries=2) == (None, False)
    choice = {"name": "mkl", "cpu": "a crowded CPU", "libraries": {"mkl": "/lib/libmkl_rt.so"}}
    limits = blas_choice.small_product_rows(choice, lambda m, k, n: (1.0, 2.0),
                                            lambda m, k, n: (1.0, 2.0))
    assert all(shares == 1 for _, _, shares in limits)
    saved = json.loads((tmp_path / "small_products.json").read_text())
    assert saved["crowded"] == len(blas_choice._STEP_WEIGHTS) and saved["shared"] == []
    # a quiet machine: measured (another CPU's key: not the file above)
    monkeypatch.setattr(blas_choice, "_busy_seconds", lambda: 0.0)
    assert blas_choice.measured_on_free_cores(lambda: 1.0) == (1.0, True)
    quiet = dict(choice, cpu="a quiet CPU")
    limits = blas_choice.small_product_rows(quiet, lambda m, k, n: (1.0, 2.0),
                                            lambda m, k, n: (1.0, 2.0))
    assert all(shares == 0 for _, _, shares in limits)
    assert json.loads((tmp_path / "small_products.json").read_text())["crowded"] == 0


def test_stepnet_info_prints_the_choice(tmp_path):
    cache = cache_with_helpers(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-m", "stepnet", "info"], capture_output=True,
                          text=True, env=dict(os.environ, STEPNET_CACHE_DIR=str(cache)),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BLAS: " in proc.stdout and "CPU: " in proc.stdout and "threads: " in proc.stdout
    assert "compile worker: none running" in proc.stdout
    assert re.search(r"stepnet's own loop: blocks of (6 rows x 32|5 rows x 16) columns", proc.stdout)
    for dtype in ("float32", "float64"):  # (each dtype's limits, and the figures they come from)
        assert re.search(rf"^small products, {dtype}: stepnet's own loop for .*\(measured", proc.stdout,
                         re.M), proc.stdout
        assert f"small products measured, {dtype}:" in proc.stdout
    assert (cache / "small_products_float64.json").exists()
    # --measure: the kept measurements taken again, and what changed said
    kept = {name: (cache / name).read_text() for name in cli.MEASUREMENTS if (cache / name).exists()}
    assert "small_products.json" in kept
    (cache / "small_products.json").write_text(  # a point no measurement gives
        kept["small_products.json"].replace('"points": [', '"points": [[7777, 64, 192, 1, 1], ', 1))
    proc = subprocess.run([sys.executable, "-m", "stepnet", "info", "--measure"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, STEPNET_CACHE_DIR=str(cache)))
    assert proc.returncode == 0, proc.stderr
    assert "BLAS: " in proc.stdout and "changed by measuring again:" in proc.stdout, proc.stdout
    changed = proc.stdout.split("changed by measuring again:")[1]
    assert "-  rows x 64 @ 64x192" in changed and "7777: 1000000.0/1000000.0" in changed, changed
    again = json.loads((cache / "small_products.json").read_text())
    assert all(point[0] != 7777 for point in again["points"])


def test_the_transposed_products_loop_is_measured_once_and_kept(tmp_path, monkeypatch):
    """Whether weight gradients run stepnet's own loop is the faster of the
    two on this machine, measured once for each dtype and read back from
    the cache (both dtypes' records in one file)."""
    from stepnet.jit import blas_choice

    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_choice, "measured_on_free_cores", lambda measure, tries=3: (measure(), True))
    for own_s, lib_s in ((1.0, 2.0), (2.0, 1.0)):
        calls = []

        def time_both(rows, m, n, dtype, own_s=own_s, lib_s=lib_s, calls=calls):
            calls.append((rows, m, n, dtype))
            # float64: the other way round
            return (own_s, lib_s) if dtype == "float32" else (lib_s, own_s)

        for f in tmp_path.glob("transposed_products.json"):
            f.unlink()
        for _ in range(2):  # (the second from the cache)
            assert blas_choice.transposed_by_own_loop(blas._choice, time_both) == (own_s < lib_s)
            assert blas_choice.transposed_by_own_loop(blas._choice, time_both, "float64") == \
                (lib_s < own_s)
        # (measured, then each kept record checked where read again)
        assert calls == [(*blas_choice._TN_SHAPE, dtype) for dtype in ("float32", "float64") * 2]
        kept = json.loads((tmp_path / "transposed_products.json").read_text())
        assert kept["seconds"] == {"float32": [own_s, lib_s], "float64": [lib_s, own_s]}
    # a file of the earlier form (one pair of seconds): measured again
    (tmp_path / "transposed_products.json").write_text(json.dumps(
        {**kept, "seconds": [1.0, 2.0]}))
    calls.clear()
    assert blas_choice.transposed_by_own_loop(blas._choice, time_both, "float64") == \
        (lib_s < own_s)
    assert calls == [(*blas_choice._TN_SHAPE, "float64")]


def test_a_transposed_products_record_that_is_off_is_measured_again(tmp_path, monkeypatch):
    """A kept record more than ``DISAGREES`` off the products timed now (it
    was taken on a busy machine) is measured again, and the choice follows."""
    from stepnet.jit import blas_choice

    monkeypatch.setenv("STEPNET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(blas_choice, "measured_on_free_cores", lambda measure, tries=3: (measure(), True))
    now = [(1.0, 2.0)]  # (own, library) seconds the products take now
    assert blas_choice.transposed_by_own_loop(blas._choice, lambda *shape: now[0])
    now[0] = (0.3, 0.2)
    assert not blas_choice.transposed_by_own_loop(blas._choice, lambda *shape: now[0])
    assert blas_choice._TRANSPOSED["float32"]["reason"].startswith("measured again (the kept")
    kept = json.loads((tmp_path / "transposed_products.json").read_text())
    assert kept["seconds"]["float32"] == [0.3, 0.2]
    now[0] = (0.4, 0.25)  # (within DISAGREES of the record: kept)
    assert not blas_choice.transposed_by_own_loop(blas._choice, lambda *shape: now[0])
    assert blas_choice._TRANSPOSED["float32"]["reason"] == "measured (cached)"
