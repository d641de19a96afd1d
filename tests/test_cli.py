"""The ``stepnet`` command, run through subprocess as a user runs it."""

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from stepnet.cli import Progress, load_npz, save_npz

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def stepnet(*args, env=None, timeout=300):
    """``python -m stepnet ARGS`` (the installed ``stepnet`` script is the same
    entry point, tested once below)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "stepnet", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=timeout, check=False,
    )


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["bench"]])
def test_help_on_every_command(command):
    out = ok(stepnet(*command, "--help"))
    assert out.startswith("usage: stepnet")
    expected = {(): ["run", "check", "bench"], ("run",): ["--input", "--params", "--output",
                "--backend", "--seed", "--quiet"], ("check",): ["MODEL.yaml"],
                ("bench",): ["--repeat", "--backend"]}[tuple(command)]
    for word in expected:
        assert word in out


def test_no_command_prints_usage():
    proc = stepnet()
    assert proc.returncode == 2 and "usage: stepnet" in proc.stdout


@pytest.mark.parametrize("example, outputs", [
    ("char_gru.yaml", {"log_probs": "LoDTensor float32 [{rows}, 48]",
                       "final_state": "ndarray   float32 [4, 64]"}),
    ("hierarchical.yaml", {"chapter_state": "LoDTensor float32", "final_chapter_state":
                           "ndarray   float32 [4, 8]", "sentence_states": "LoDTensor float32"}),
    ("custom_cell.yaml", {"states": "LoDTensor float32 [{rows}, 32]",
                          "final": "ndarray   float32 [4, 32]"}),
])
def test_run_each_example_out_of_the_box(example, outputs):
    out = ok(stepnet("run", EXAMPLES / example, "--backend", "interpreter", "--quiet"))
    assert "backend  interpreter" in out
    assert re.search(r"^time +[\d.]+ (s|ms|us)", out, re.M)
    rows = re.search(r"^  \w+ +LoDTensor float32 \[(\d+), ", out, re.M).group(1)
    for name, text in outputs.items():
        line = next((s for s in out.splitlines() if s.strip().startswith(name + " ")), None)
        assert line is not None, out
        assert text.format(rows=rows) in line, line
    assert "lod [[0, " in out


def test_run_with_input_params_and_output_files(tmp_path):
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml", seed=3)
    feeds = model.random_feeds(seed=9, num_sequences=3)
    save_npz(tmp_path / "data.npz", feeds)
    params = {"d": np.full(32, -1.0, np.float32), "b_c": np.ones(32, np.float32)}
    np.savez(tmp_path / "params.npz", **params)
    ok(stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", tmp_path / "data.npz", "--params",
               tmp_path / "params.npz", "--output", tmp_path / "out.npz", "--seed", 3,
               "--backend", "interpreter", "-q"))
    expected = sn.load_yaml(EXAMPLES / "custom_cell.yaml", params=params, seed=3)(
        feeds, backend="interpreter")
    with np.load(tmp_path / "out.npz") as npz:
        assert sorted(npz.files) == ["final", "states", "states.lod.0"]
        assert np.array_equal(npz["final"], expected["final"])
        assert np.array_equal(npz["states"], expected["states"].data)
        assert npz["states.lod.0"].tolist() == expected["states"].lod[0]
    # the parameters were used: the defaults give other numbers
    default = sn.load_yaml(EXAMPLES / "custom_cell.yaml", seed=3)(feeds, backend="interpreter")
    assert not np.array_equal(default["final"], expected["final"])


def test_input_file_by_lengths_and_missing_arrays(tmp_path):
    model = sn.load_yaml(EXAMPLES / "hierarchical.yaml")
    feeds = model.random_feeds(seed=1)
    chapters = feeds["chapters"]
    np.savez(tmp_path / "lengths.npz", chapters=chapters.data, chapter_init=feeds["chapter_init"],
             **{f"chapters.lengths.{k}": np.asarray(v) for k, v in enumerate(chapters.lengths)})
    loaded = load_npz(tmp_path / "lengths.npz", model)
    assert loaded["chapters"].lod == chapters.lod
    np.savez(tmp_path / "nolod.npz", chapters=chapters.data, chapter_init=feeds["chapter_init"])
    proc = stepnet("run", EXAMPLES / "hierarchical.yaml", "--input", tmp_path / "nolod.npz")
    assert proc.returncode == 1
    assert "chapters.lod.0, chapters.lod.1" in proc.stderr


def test_check_prints_the_ir():
    out = ok(stepnet("check", EXAMPLES / "hierarchical.yaml"))
    assert "examples/hierarchical.yaml: ok" in out
    assert "rnn[name=top" in out and "rnn[name=low" in out
    assert "chapter_init" in out and "W0" in out


def test_bench_reports_compile_and_median():
    out = ok(stepnet("bench", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter",
                     "--repeat", 3, "-q"))
    assert re.search(r"^compile +[\d.]+ (s|ms|us) \(first call", out, re.M)
    assert re.search(r"^run +median [\d.]+ (s|ms|us) over 3 runs", out, re.M)


def test_errors_exit_1_with_file_line_and_key(tmp_path):
    bad = (EXAMPLES / "char_gru.yaml").read_text().replace("h.pre @ U_z", "h.pre @ U_zz")
    (tmp_path / "bad.yaml").write_text(bad)
    proc = stepnet("check", tmp_path / "bad.yaml")
    line = next(i for i, s in enumerate(bad.splitlines(), 1) if "U_zz" in s)
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"bad.yaml:{line}: nets.gru.step[1]: " in proc.stderr
    assert "unknown name 'U_zz'; did you mean 'U_z'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = stepnet("run", EXAMPLES / "char_gru.yaml", "--backend", "cuda9")
    assert proc.returncode == 1 and "unknown backend 'cuda9'" in proc.stderr


def test_installed_script_and_numba_run_with_progress(tmp_path):
    """The default backend (numba) compiling into an empty cache takes over a
    second: the progress line shows on stderr, and --quiet hides it."""
    script = Path(sys.executable).with_name("stepnet")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "stepnet"]
    env = dict(os.environ, STEPNET_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(command + ["run", str(EXAMPLES / "char_gru.yaml")], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    ok(proc)
    assert "backend  numba" in proc.stdout
    assert "stepnet: net 1/1 gru" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_quiet_hides_progress_on_a_long_run(tmp_path):
    quiet = stepnet("run", EXAMPLES / "char_gru.yaml", "--quiet",
                    env={"STEPNET_CACHE_DIR": str(tmp_path / "cache")})
    ok(quiet)
    assert "stepnet: " not in quiet.stderr, quiet.stderr
    if not re.search(r"^time +[\d.]+ s ", quiet.stdout, re.M):
        pytest.skip("the run took under a second: no progress line to hide")


def test_progress_line():
    stream = io.StringIO()
    with Progress(delay=0.0, stream=stream, interval=0.01) as progress:
        progress.stage("compiling")
        time.sleep(0.1)
        progress.stage("running")
        time.sleep(0.1)
    text = stream.getvalue()
    assert "stepnet: compiling ..." in text and "stepnet: running ..." in text
    assert text.count("compiling") == 1  # not a terminal: each stage once
    stream = io.StringIO()
    with Progress(enabled=False, delay=0.0, stream=stream, interval=0.01):
        time.sleep(0.05)
    assert stream.getvalue() == ""
    stream = io.StringIO()
    with Progress(delay=5.0, stream=stream, interval=0.01):  # a short run shows nothing
        time.sleep(0.05)
    assert stream.getvalue() == ""
