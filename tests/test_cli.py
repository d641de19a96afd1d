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
from conftest import assert_close
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


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["bench"], ["export"]])
def test_help_on_every_command(command):
    out = ok(stepnet(*command, "--help"))
    assert out.startswith("usage: stepnet")
    expected = {(): ["run", "check", "bench", "export"], ("run",): ["--input", "--params", "--output",
                "--backend", "--seed", "--quiet"], ("check",): ["MODEL.yaml"],
                ("bench",): ["--repeat", "--backend"],
                ("export",): ["--output", "--scan", "--params"]}[tuple(command)]
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


# ----------------------------------------------------------------------------
# export


def onnx_feeds(feeds):
    """A YAML model's inputs in the exported layout (docs/onnx-export.md)."""
    from stepnet.onnx.export import to_nested_padded

    out = {}
    for name, value in feeds.items():
        if isinstance(value, sn.LoDTensor):
            out[name], lengths = to_nested_padded(value)
            out["lengths"] = lengths[0]
            for level, per_level in enumerate(lengths[1:], 1):
                out[f"{name}_lengths_{level}"] = per_level
        else:
            out[name] = value
    return out


def read_outputs(path):
    """``stepnet run --output`` written back: LoDTensors padded per level."""
    from stepnet.onnx.export import to_nested_padded

    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    out = {}
    for name in [k for k in arrays if "." not in k]:
        levels = [arrays[f"{name}.lod.{k}"] for k in range(3) if f"{name}.lod.{k}" in arrays]
        out[name] = to_nested_padded(sn.LoDTensor(arrays[name], levels))[0] if levels else arrays[name]
    return out


@pytest.mark.parametrize("example", ["char_gru.yaml", "custom_cell.yaml", "hierarchical.yaml"])
def test_export_each_example_runs_in_onnxruntime_as_stepnet_runs(example, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = sn.load_yaml(EXAMPLES / example)
    feeds = model.random_feeds(seed=3, num_sequences=5, max_length=4)
    save_npz(tmp_path / "in.npz", feeds)
    out = ok(stepnet("export", EXAMPLES / example, "-o", tmp_path / "model.onnx"))
    assert "opset 17" in out and "Scan" in out
    ok(stepnet("run", EXAMPLES / example, "--input", tmp_path / "in.npz", "--output",
               tmp_path / "out.npz", "--backend", "interpreter", "-q"))
    expected = read_outputs(tmp_path / "out.npz")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == model.outputs
    for name, actual in zip(names, session.run(None, onnx_feeds(feeds))):
        want = expected[name]
        want = np.pad(want, [(0, a - w) for a, w in zip(actual.shape, want.shape)])
        assert_close(actual, want, what=name)


LAYER_YAML = """
name: tagger
inputs:
  words: {shape: [6], lod_level: 1}
layers:
  encoder:
    type: lstm
    input: words
    hidden_size: 5
    num_layers: 2
    direction: {direction}
outputs:
  states: encoder.all
  last_h: encoder.last.h_n
  last_c: encoder.last.c_n
"""


@pytest.mark.parametrize("direction, scan, node", [("bidirectional_concat", False, "LSTM"),
                                                   ("reverse", True, "Scan"),
                                                   ("bidirectional_sum", False, "Scan")])
def test_export_a_layer_network(direction, scan, node, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "tagger.yaml"
    path.write_text(LAYER_YAML.replace("{direction}", direction))
    out = ok(stepnet("export", path, "-o", tmp_path / "m.onnx", *(["--scan"] if scan else [])))
    assert node in out.split("nodes")[1]
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=1)
    expected = model(feeds, backend="interpreter")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    actual = dict(zip(["states", "last_h", "last_c"], session.run(None, onnx_feeds(feeds))))
    states = expected["states"]
    assert_close(actual["states"], states.to_padded()[0], what="states")
    assert_close(actual["last_h"], expected["last_h"], what="last_h")
    assert_close(actual["last_c"], expected["last_c"], what="last_c")


def test_export_refuses_two_nets_and_names_them(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text((EXAMPLES / "custom_cell.yaml").read_text().replace(
        "outputs:\n  states: mgu.all",
        "  again:\n    inputs: {xt: x}\n    memories: {h: {shape: [32]}}\n"
        "    step: ['h = tanh(xt @ W_c + h.pre @ U_c)']\n    outputs: [h]\n\n"
        "outputs:\n  states: mgu.all"))
    proc = stepnet("export", path, "-o", tmp_path / "two.onnx")
    assert proc.returncode == 1
    assert "one net or one layer" in proc.stderr and "['mgu', 'again']" in proc.stderr
    assert not (tmp_path / "two.onnx").exists()
