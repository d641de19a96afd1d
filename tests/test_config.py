"""stepnet's settings: ``sn.config`` (stepnet/config.py) and the environment."""

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from nets import tanh_cell
from stepnet.config import FLAGS, describe

ROOT = Path(__file__).resolve().parent.parent


def _fresh(code, **env):
    """``code``'s stdout in a new process with ``env`` added."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_setting_comes_from_a_block_then_the_environment_then_its_default(monkeypatch):
    monkeypatch.delenv("STEPNET_TIERED", raising=False)
    assert sn.config.tiered is True
    monkeypatch.setenv("STEPNET_TIERED", "0")
    assert sn.config.tiered is False
    with sn.config(tiered=True):
        assert sn.config.tiered is True
        with sn.config(tiered=False, debug=True):
            assert (sn.config.tiered, sn.config.debug) == (False, True)
        assert sn.config.tiered is True
    assert sn.config.tiered is False
    assert "tiered = False  (STEPNET_TIERED" in repr(sn.config)


def test_a_block_holds_for_every_thread_while_it_runs(monkeypatch):
    monkeypatch.delenv("STEPNET_DEBUG", raising=False)
    seen = []
    with sn.config(debug=True):
        thread = threading.Thread(target=lambda: seen.append(sn.config.debug))
        thread.start()
        thread.join()
    assert seen == [True] and sn.config.debug is False


def test_one_block_entered_twice_or_by_two_threads_ends_each_entry_alone(monkeypatch):
    monkeypatch.delenv("STEPNET_DEBUG", raising=False)
    block = sn.config(debug=True)
    with block:
        with block:
            pass
        assert sn.config.debug is True  # (the outer entry still runs)
    assert sn.config.debug is False
    inside, left = threading.Event(), threading.Event()
    seen = []

    def first():
        with block:
            inside.set()
            left.wait(10)
            seen.append(sn.config.debug)  # (after the other thread's entry ended)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with block:
        pass
    left.set()
    thread.join()
    assert seen == [True] and sn.config.debug is False


@pytest.mark.parametrize("settings, message", [
    ({"blas": "atlas"}, r"sn.config\(blas='atlas'\): expected one of openblas, mkl, numpy"),
    ({"small_products": -1}, r"sn.config\(small_products=-1\): expected a number of rows"),
    ({"small_products": 10**23}, r"sn.config\(small_products=10+\): expected a number of rows"),
    ({"tiered": "no"}, r"sn.config\(tiered='no'\): expected True or False"),
    ({"threads": 2}, r"sn.config\(threads=...\): no such setting; the settings: cache_dir"),
    ({"max_memory": "inf"}, r"sn.config\(max_memory='inf'\): expected a number of bytes"),
    ({"max_memory": "1e400"}, r"sn.config\(max_memory='1e400'\): expected a number of bytes"),
    ({"cache_dir": __file__}, r"sn.config\(cache_dir=.*\): .*test_config.py is a file, not a directory"),
    ({"cache_dir": __file__ + "/below"}, r"test_config.py is a file, not a directory"),
])
def test_a_wrong_setting_is_named_when_the_block_is_made(settings, message):
    with pytest.raises(sn.UnsupportedError, match=message):
        sn.config(**settings)


def test_a_wrong_variable_is_named_when_read(monkeypatch):
    for wrong in ("many", "\u00b2", "9" * 23):  # (a superscript digit; past an int64)
        monkeypatch.setenv("STEPNET_SMALL_PRODUCTS", wrong)
        with pytest.raises(sn.UnsupportedError, match=f"STEPNET_SMALL_PRODUCTS='{wrong}': expected"):
            sn.config.small_products  # noqa: B018
    with pytest.raises(AttributeError, match="no setting 'blsa'"):
        sn.config.blsa  # noqa: B018
    with pytest.raises(sn.StepNetError, match=r"with sn.config\(blas=...\)"):
        sn.config.blas = "mkl"


def test_importing_stepnet_starts_no_engine(tmp_path):
    """No BLAS chosen or measured, no Numba helper loaded, nothing written,
    no setting frozen: importing stepnet defines things only."""
    out = _fresh("import sys, stepnet as sn; "
                 "print(sorted(m for m in sys.modules if m.startswith('stepnet.jit'))); "
                 "print(sn.config._started)", STEPNET_CACHE_DIR=str(tmp_path / "cache"))
    assert out.split("\n")[:2] == ["[]", "{}"]
    assert not (tmp_path / "cache").exists()


def test_engine_settings_hold_once_the_engine_started(tmp_path):
    """A block may not change a setting the Numba engine has read: it raises
    rather than be ignored; the value the engine runs with is allowed."""
    out = _fresh(
        "import stepnet as sn\n"
        "with sn.config(blas='numpy'):\n"
        "    from stepnet.jit import blas\n"
        "print(blas.BLAS_NAME, sn.config.blas, sn.config.engine('blas'))\n"
        "with sn.config(blas='numpy'):\n"
        "    pass\n"
        "try:\n"
        "    with sn.config(blas='openblas'):\n"
        "        print('ignored')\n"
        "except sn.StepNetError as e:\n"
        "    print(e)\n"
        "print('started with' in repr(sn.config))\n",
        STEPNET_CACHE_DIR=str(tmp_path / "cache"), STEPNET_BLAS="openblas",
        STEPNET_SMALL_PRODUCTS="0")
    lines = out.strip().split("\n")
    assert lines[0] == "numpy openblas numpy"
    assert lines[1].startswith("sn.config(blas='openblas'): the Numba engine of this process "
                               "started with blas='numpy'")
    assert lines[2] == "True"


def test_engine_settings_a_block_started_the_engine_with_hold_after_it(tmp_path):
    """The small products' limit and the BLAS the engine started with inside
    a block hold after the block: float64's limits are float32's (they were
    measured, and the two tables could not be joined), ``choose`` names the
    started library."""
    out = _fresh(
        "import stepnet as sn\n"
        "with sn.config(small_products=7, blas='numpy'):\n"
        "    from stepnet.jit import blas_choice, product_timing\n"
        "    product_timing.small_rows_table()\n"
        "table = product_timing.small_rows_table(float64=True)\n"
        "print(table.shape, table[1].tolist(), table[4].tolist(), blas_choice.choose()['name'])\n",
        STEPNET_CACHE_DIR=str(tmp_path / "cache"))
    assert out.strip() == "(6, 1) [7] [7] numpy"


def test_debug_prints_the_source_to_stderr(capsys):
    X = sn.LoDTensor.from_lengths(np.zeros((3, 2), np.float32), [[3]])
    with sn.config(debug=True, tiered=False):
        rnn = tanh_cell(X, sn.Parameter(np.eye(2, dtype=np.float32)))
        source = rnn.compile("numba").source  # (generated: compiled at the first call)
    captured = capsys.readouterr()
    assert source in captured.err and "def program(" in captured.err
    assert source not in captured.out


def test_the_docs_list_every_setting():
    assert describe() in (ROOT / "docs" / "environment.md").read_text()
    assert all(f"`{flag.env}`" in describe() for flag in FLAGS)


def _environment_reads(tree):
    """The ``STEPNET_*`` names a module reads from os.environ (get, getenv,
    subscript, ``in``)."""
    found = []
    for node in ast.walk(tree):
        strings = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "getenv") and node.args:
            strings = [node.args[0]]
        elif isinstance(node, ast.Subscript):
            strings = [node.slice]
        elif isinstance(node, ast.Compare):
            strings = [node.left]
        found += [s.value for s in strings
                  if isinstance(s, ast.Constant) and isinstance(s.value, str)
                  and s.value.startswith("STEPNET_")]
    return found


def test_only_the_config_module_reads_stepnets_variables():
    readers = {}
    for path in sorted((ROOT / "stepnet").rglob("*.py")):
        if path == ROOT / "stepnet" / "config.py":
            continue
        reads = _environment_reads(ast.parse(path.read_text()))
        if reads:
            readers[str(path.relative_to(ROOT))] = reads
    assert readers == {}
