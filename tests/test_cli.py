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
from conftest import assert_close, cache_with_helpers
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


@pytest.mark.parametrize("command", [[], ["run"], ["check"], ["bench"], ["compile"], ["export"]])
def test_help_on_every_command(command):
    out = ok(stepnet(*command, "--help"))
    assert out.startswith("usage: stepnet")
    expected = {(): ["run", "check", "bench", "compile", "export"], ("run",): ["--input", "--params",
                "--output", "--backend", "--seed", "--quiet"], ("check",): ["MODEL.yaml"],
                ("bench",): ["--repeat", "--backend"], ("compile",): ["MODEL.yaml", "--input"],
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
    ("hierarchical_attention.yaml", {"document_state": "ndarray   float32 [4, 8]",
                                     "word_weights": "LoDTensor float32"}),
])
def test_run_each_example_out_of_the_box(example, outputs):
    out = ok(stepnet("run", EXAMPLES / example, "--backend", "interpreter", "--quiet"))
    assert "backend  interpreter" in out
    assert re.search(r"^time +[\d.]+ (s|ms|us) \(one call; on the interpreter backend\)", out, re.M)
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


def test_compile_builds_the_kernels_a_later_run_loads(tmp_path):
    """``stepnet compile`` compiles a network's kernels into the cache; a later
    process, tiered, on other data of the same kinds, runs them from its
    first call (none on the interpreter)."""
    env = {"STEPNET_CACHE_DIR": str(cache_with_helpers(tmp_path / "cache", executor=True)),
           "STEPNET_TIERED": "1"}
    example = EXAMPLES / "custom_cell.yaml"
    out = ok(stepnet("compile", example, env=env))
    found = re.search(r"^compiled (\d+) new kernels? of .*custom_cell.yaml into (.*) in ", out, re.M)
    assert found and int(found.group(1)) >= 1 and found.group(2) == env["STEPNET_CACHE_DIR"], out
    assert "compiled 0 new kernels" in ok(stepnet("compile", example, env=env))  # all there
    bench = ok(stepnet("bench", example, "--sequences", "7", "--max-length", "9", "--seed", "3",
                       "--repeat", "1", env=env))
    assert "compile  " in bench and "answered on the interpreter" not in bench, bench
    refused = stepnet("compile", example, "--backend", "interpreter", env=env)
    assert refused.returncode == 1 and "compile_ahead compiles Numba kernels" in refused.stderr


def test_check_prints_the_ir():
    out = ok(stepnet("check", EXAMPLES / "hierarchical.yaml"))
    assert "examples/hierarchical.yaml: ok" in out
    assert "rnn[name=top" in out and "rnn[name=low" in out
    assert "chapter_init" in out and "W0" in out


def test_bench_reports_compile_and_median():
    out = ok(stepnet("bench", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter",
                     "--repeat", 3, "-q"))
    # the interpreter compiles nothing: no compile figure, no note about kernel caches
    assert re.search(r"^compile +none \(the interpreter compiles nothing; first call [\d.]+ "
                     r"(s|ms|us)\)$", out, re.M), out
    assert "kernels" not in out
    assert re.search(r"^run +median [\d.]+ (s|ms|us) over 3 runs", out, re.M)


def test_bench_compile_line_is_never_a_clamped_negative_figure():
    from stepnet.cli import _compile_line

    line = _compile_line("numba", first=0.001, median=0.002)
    assert line.startswith("none measured (first call 1.00 ms, no slower than the median run")
    assert "0.0 us" not in line and not re.search(r"^-?[\d.]+ ", line)
    assert _compile_line("numba", first=2.5, median=0.5).startswith("2.00 s (first call 2.50 s ")
    assert _compile_line("interpreter", first=0.5, median=0.1).startswith("none (the interpreter")


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


@pytest.mark.parametrize("args, message", [
    (["--partitions", "2"], "--partitions cuts the batch among --cluster's workers: give --cluster too"),
    (["--partitions", "0", "--cluster", "local:1"], "--partitions must be at least 1"),
    (["--partitions", "2", "--cluster", "local:1", "--input", "examples"],
     "--partitions cuts one batch; --input 'examples' is a directory of shards")])
def test_partitions_without_a_batch_to_cut_among_workers_are_refused(args, message):
    proc = stepnet("run", EXAMPLES / "char_gru.yaml", *args)
    assert proc.returncode == 1 and proc.stdout == "" and message in proc.stderr, proc.stderr


def test_backend_help_lists_stepnets_own_backends():
    from stepnet.backends import BACKENDS

    names = list(BACKENDS)
    assert "cuda" in names
    phrase = ", ".join(names[:-1]) + " or " + names[-1]  # "interpreter, numba or cuda"
    for command in ("run", "bench"):
        out = " ".join(ok(stepnet(command, "--help")).split())  # argparse wraps lines
        assert f"--backend BACKEND {phrase} (default" in out, out


def test_installed_script_and_numba_run_with_progress(tmp_path):
    """The default backend (numba) compiles the net (its kernel new: a cache
    holding stepnet's compiled helpers only, ``cache_with_helpers``): not on
    a terminal, a plain line on stderr names each stage before it starts,
    whatever its time, and the end."""
    script = Path(sys.executable).with_name("stepnet")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "stepnet"]
    env = dict(os.environ, STEPNET_CACHE_DIR=str(cache_with_helpers(tmp_path / "cache")))
    proc = subprocess.run(command + ["run", str(EXAMPLES / "char_gru.yaml")], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    ok(proc)
    assert "backend  numba" in proc.stdout
    assert "(one call; answered by the compiled kernels" in proc.stdout, proc.stdout  # (not tiered)
    # not a terminal: plain lines, the compile named before it starts
    assert re.search(r"^stepnet: compiling net 'gru' \(1/1\) \(at [\d.]+ s\)$", proc.stderr,
                     re.M), proc.stderr
    assert re.search(r"^stepnet: done \(at [\d.]+ s\)$", proc.stderr, re.M), proc.stderr


@pytest.mark.slow
def test_quiet_hides_progress_on_a_long_run(tmp_path):
    """--quiet on a run that compiles its kernel (which, not on a terminal,
    prints a progress line per stage whatever its time: see above)."""
    quiet = stepnet("run", EXAMPLES / "char_gru.yaml", "--quiet",
                    env={"STEPNET_CACHE_DIR": str(cache_with_helpers(tmp_path / "cache"))})
    ok(quiet)
    assert "backend  numba" in quiet.stdout
    assert "stepnet: " not in quiet.stderr, quiet.stderr
    assert list((tmp_path / "cache").glob("stepnet_kernel_*.py")), "no kernel was compiled"


class FakeTTY(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def test_progress_on_a_terminal_updates_during_a_slow_stage():
    """The live line is redrawn while the main thread is busy (as in a compile),
    with the stage and the time so far, and erased at the end."""
    stream = FakeTTY()
    with Progress(stream=stream, interval=0.05, delay=0.0) as progress:
        progress.stage("compiling net 'enc' (1/2)")
        time.sleep(0.6)  # one slow stage, no stage() calls
        progress.stage("running net 'dec' (2/2)")
        time.sleep(0.3)
    text = stream.getvalue()
    times = [float(t) for t in re.findall(r"stepnet: compiling net 'enc' \(1/2\) \.\.\. ([\d.]+) s",
                                          text)]
    assert len(times) >= 3, text  # updated more than once during the stage
    assert times == sorted(times) and times[-1] > times[0]
    assert "stepnet: running net 'dec' (2/2) ... " in text
    assert "\n" not in text  # one line, redrawn in place
    assert text.endswith("\r") and text.rstrip("\r").split("\r")[-1].strip() == ""  # erased


def test_progress_on_a_terminal_waits_for_delay_and_quiet_prints_nothing():
    stream = FakeTTY()
    with Progress(stream=stream, interval=0.01, delay=5.0) as progress:  # a short run
        progress.stage("running net 'a' (1/1)")
        time.sleep(0.1)
    assert stream.getvalue() == ""
    for stream in (FakeTTY(), io.StringIO()):
        with Progress(enabled=False, stream=stream, interval=0.01, delay=0.0) as progress:
            progress.stage("compiling net 'a' (1/1)")
            time.sleep(0.05)
        assert stream.getvalue() == ""


def test_progress_elsewhere_prints_one_plain_line_per_stage():
    stream = io.StringIO()
    with Progress(stream=stream, interval=0.01, delay=0.0) as progress:
        progress.stage("compiling net 'enc' (1/2)")
        time.sleep(0.05)
        progress.stage("compiling net 'enc' (1/2)")  # the same stage again: no new line
        progress.stage("timing run 1/3", log=False)  # terminal only
        progress.stage("running net 'dec' (2/2)")
    lines = stream.getvalue().splitlines()
    assert [re.sub(r" \(at [\d.]+ s\)$", "", line) for line in lines] == [
        "stepnet: compiling net 'enc' (1/2)", "stepnet: running net 'dec' (2/2)", "stepnet: done"]
    assert float(re.search(r"at ([\d.]+) s", lines[1]).group(1)) >= 0.05


TWO_STAGE_YAML = """
name: tagger
inputs:
  words: {shape: [6], lod_level: 1}
layers:
  encoder: {type: gru, input: words, hidden_size: 5}
nets:
  head:
    inputs: {y: encoder.all}
    memories: {h: {shape: [5]}}
    step: ['h = tanh(y + h.pre)']
    outputs: [h]
outputs:
  states: head.all
"""


def test_run_not_on_a_terminal_prints_the_stages_naming_each_net(tmp_path):
    path = tmp_path / "tagger.yaml"
    path.write_text(TWO_STAGE_YAML)
    proc = stepnet("run", path, "--backend", "interpreter")
    ok(proc)
    stages = [re.sub(r" \(at [\d.]+ s\)$", "", line) for line in proc.stderr.splitlines()]
    # the interpreter compiles nothing: every stage is "running"
    assert stages == ["stepnet: running layer 'encoder' (1/2)", "stepnet: running net 'head' (2/2)",
                      "stepnet: done"], proc.stderr
    quiet = stepnet("run", path, "--backend", "interpreter", "--quiet")
    assert ok(quiet) == proc.stdout.replace(re.search(r"time .*", proc.stdout).group(0),
                                            re.search(r"time .*", quiet.stdout).group(0))
    assert quiet.stderr == ""


def test_bench_not_on_a_terminal_prints_the_first_call_and_the_timing():
    proc = stepnet("bench", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter", "--repeat", 4)
    ok(proc)
    stages = [re.sub(r" \(at [\d.]+ s\)$", "", line) for line in proc.stderr.splitlines()]
    assert stages == ["stepnet: first call: running net 'mgu' (1/1)", "stepnet: timing 4 runs",
                      "stepnet: done"], proc.stderr
    assert stepnet("bench", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter", "--repeat",
                   2, "-q").stderr == ""


def test_model_reports_compiling_before_a_first_compile_and_running_after(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache_with_helpers(tmp_path / "cache")))
    path = tmp_path / "tagger.yaml"
    path.write_text(TWO_STAGE_YAML.replace("type: gru", "type: rnn"))
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=0)
    stages = []
    first = model(feeds, backend="numba", progress=stages.append)
    model(model.random_feeds(seed=1, num_sequences=2), backend="numba", progress=stages.append)
    assert stages == ["compiling layer 'encoder' (1/2)", "compiling net 'head' (2/2)",
                      "running layer 'encoder' (1/2)", "running net 'head' (2/2)"]
    stages.clear()
    model(feeds, backend="interpreter", progress=stages.append)
    assert stages == ["running layer 'encoder' (1/2)", "running net 'head' (2/2)"]
    assert_close(first["states"].data, model(feeds, backend="interpreter")["states"].data)


# ----------------------------------------------------------------------------
# what a newcomer reads


def test_run_says_the_file_it_wrote(tmp_path):
    out = ok(stepnet("run", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter", "-q",
                     "--output", tmp_path / "out"))
    assert f"wrote    {tmp_path / 'out.npz'}" in out and (tmp_path / "out.npz").exists()


def test_run_prints_a_summary_of_each_outputs_values(tmp_path):
    out = ok(stepnet("run", EXAMPLES / "custom_cell.yaml", "--backend", "interpreter", "-q",
                     "--output", tmp_path / "out.npz"))
    lines = out.splitlines()
    with np.load(tmp_path / "out.npz") as npz:
        for name in ("states", "final"):
            i = next(i for i, line in enumerate(lines) if line.strip().startswith(name + " "))
            values = npz[name].ravel()
            summary = lines[i + 1].split()
            assert summary[:6] == ["min", f"{values.min():.4g}", "mean", f"{values.mean():.4g}",
                                   "max", f"{values.max():.4g}"], lines[i + 1]
            assert f"first [{values[0]:.4g}, {values[1]:.4g}, " in lines[i + 1]
            assert "NaN" not in lines[i + 1] and "inf" not in lines[i + 1]


def test_value_summary_counts_nan_and_inf():
    from stepnet.cli import _value_summary

    text = _value_summary(np.array([1.0, np.nan, np.inf, -np.inf, 3.0, 2.0], np.float32))
    assert text == "min 1  mean 2  max 3  1 NaN  2 inf  first [1, nan, inf, -inf, ...]"
    assert _value_summary(np.zeros((0, 4))) == "no values"
    assert _value_summary(np.array([np.nan])) == "1 NaN  first [nan]"


def test_input_lod_errors_name_the_file_the_array_and_the_level(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((10, 24), np.float32), **{"x.lengths.0": np.array([4, 5])})
    proc = stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", path, "--backend", "interpreter")
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(
        "data.npz: input 'x': x.lengths.0 (level 0, the only level): lengths sum to 9 but 'x' "
        "has 10 rows"), proc.stderr
    model = sn.load_yaml(EXAMPLES / "hierarchical.yaml")
    init = np.zeros((2, 8), np.float32)
    np.savez(path, chapters=np.zeros((10, 16), np.float32), chapter_init=init,
             **{"chapters.lod.0": np.array([0, 1, 3]), "chapters.lod.1": np.array([0, 4, 9, 11])})
    with pytest.raises(sn.LoDError) as info:
        load_npz(path, model)
    assert str(info.value) == (f"{path}: input 'chapters': chapters.lod.1 (level 1, the finest): "
                               "offsets end at 11 but 'chapters' has 10 rows")
    np.savez(path, chapters=np.zeros((10, 16), np.float32), chapter_init=init,
             **{"chapters.lengths.0": np.array([1, 3]), "chapters.lengths.1": np.array([4, 5, 1])})
    with pytest.raises(sn.LoDError, match=r"input 'chapters': chapters\.lengths\.0 \(level 0, the "
                                          r"coarsest\): lengths sum to 4 but chapters\.lengths\.1 "
                                          r"has 3 entries$"):
        load_npz(path, model)


def test_output_that_is_a_directory_is_refused_before_the_run(tmp_path):
    proc = stepnet("run", EXAMPLES / "custom_cell.yaml", "--output", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"stepnet: error: --output {str(tmp_path)!r} is a directory; one "
                                   "batch's outputs go to one file: give its name (such as "
                                   f"{str(tmp_path / 'outputs.npz')!r})"), proc.stderr
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.npz"))


def test_output_in_a_missing_folder_is_refused_before_the_run(tmp_path):
    target = tmp_path / "missing" / "out.npz"
    proc = stepnet("run", EXAMPLES / "custom_cell.yaml", "--output", target)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"stepnet: error: --output {str(target)!r}: no folder "
                                   f"{str(target.parent)!r} to write it in"), proc.stderr
    assert "outputs" not in proc.stdout  # (refused before the model ran)


def test_a_file_that_is_no_npz_is_named_as_such(tmp_path):
    """An .npy file, or bytes that are no zip archive, given where an .npz is
    read: said so (NumPy would offer to unpickle the latter)."""
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml")
    np.save(tmp_path / "x.npy", np.zeros(3, np.float32))
    (tmp_path / "garbage.npz").write_bytes(b"not a zip")
    with pytest.raises(sn.Error, match=r"cannot read input data .*x\.npy': it is an \.npy file "
                                       r"\(one array\), not an \.npz"):
        load_npz(tmp_path / "x.npy", model)
    with pytest.raises(sn.Error, match=r"garbage\.npz': it is not an \.npz file \(a zip archive"):
        load_npz(tmp_path / "garbage.npz", model)
    for bad in ("x.npy", "garbage.npz"):
        with pytest.raises(sn.YAMLError, match=rf"{bad}: cannot read the parameters to override: "
                                               r"it is (an \.npy|not an \.npz) file"):
            sn.load_yaml(EXAMPLES / "custom_cell.yaml", params=tmp_path / bad)


def test_arrays_the_model_does_not_read_are_warned_about(tmp_path):
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml")
    X = model.random_feeds(seed=0)["x"]
    path = tmp_path / "data.npz"
    np.savez(path, x=X.data, typo=np.ones(3), **{"x.lod.0": np.asarray(X.lod[0]),
                                                 "x.lengths.0": np.asarray(X.lengths[0]),
                                                 "x.lod.1": np.array([0])})
    warnings = []
    feeds = load_npz(path, model, warn=warnings.append)
    assert feeds["x"].lod == X.lod
    # x.lod.0 and x.lengths.0 are x's LoD (read); x has one level, so x.lod.1 is not read
    assert warnings == [f"{path}: the model does not read array(s) typo, x.lod.1 (its inputs: x)"]
    proc = stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", path, "--backend",
                   "interpreter", "-q")
    ok(proc)
    assert proc.stderr == f"stepnet: warning: {warnings[0]}\n"
    np.savez(path, x=X.data, **{"x.lod.0": np.asarray(X.lod[0])})
    assert stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", path, "--backend",
                   "interpreter", "-q").stderr == ""


def test_run_a_directory_of_shards_locally_one_at_a_time(tmp_path):
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml")
    shards = tmp_path / "shards"
    shards.mkdir()
    expected = {}
    for k in range(3):
        feeds = model.random_feeds(seed=k, num_sequences=2 + k)
        save_npz(shards / f"part{k}.npz", feeds)
        expected[f"part{k}.npz"] = (model(feeds, backend="interpreter"), feeds["x"].data.shape[0])
    # in-process, to see that Dask is never imported on this path
    code = ("import sys; from stepnet.cli import main; "
            f"rc = main(['run', {str(EXAMPLES / 'custom_cell.yaml')!r}, '--input', {str(shards)!r}, "
            f"'--output', {str(tmp_path / 'out')!r}, '--backend', 'interpreter', '-q']); "
            "assert not any(m.split('.')[0] in ('dask', 'distributed') for m in sys.modules), "
            "'dask imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)
    out = ok(proc)
    assert "Is a directory" not in proc.stderr
    shard_lines = [line for line in out.splitlines() if line.startswith("shard ")]
    assert len(shard_lines) == 3, out
    for line, (name, (outputs, rows)) in zip(shard_lines, sorted(expected.items())):
        assert line.startswith(f"shard    {shards / name}: {rows} rows, "), line
        assert line.endswith(f" -> {tmp_path / 'out' / name}"), line
        with np.load(tmp_path / "out" / name) as npz:  # named as the --cluster path names them
            assert np.array_equal(npz["final"], outputs["final"])
            assert np.array_equal(npz["states"], outputs["states"].data)
            assert npz["states.lod.0"].tolist() == outputs["states"].lod[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)
    # without --output: run and say so
    out = ok(stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", shards, "--backend",
                     "interpreter", "-q"))
    assert len([line for line in out.splitlines() if line.startswith("shard ")]) == 3
    assert "give --output DIR" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = stepnet("run", EXAMPLES / "custom_cell.yaml", "--input", empty)
    assert proc.returncode == 1 and "no .npz shards" in proc.stderr


def test_shard_output_naming_is_shared_with_the_cluster_path(tmp_path):
    from stepnet import distributed

    assert distributed.shard_output_path("out", "shards/part7.npz") == Path("out/part7.npz")
    model = sn.load_yaml(EXAMPLES / "custom_cell.yaml")
    save_npz(tmp_path / "part7.npz", model.random_feeds(seed=7))
    # what a Dask worker runs for one shard (no Dask needed to call it)
    (tmp_path / "out").mkdir()
    distributed._run_shard(model, str(tmp_path / "part7.npz"), str(tmp_path / "out"), "interpreter")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["part7.npz"]


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


@pytest.mark.parametrize("example", ["char_gru.yaml", "custom_cell.yaml", "hierarchical.yaml",
                                     "hierarchical_attention.yaml"])
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


def test_export_an_attention_decoder_whose_sources_and_targets_differ_in_length():
    """examples/attention_decoder.yaml: the encoder's input and the
    decoder's step input have LoDs of their own (``lengths`` and
    ``decoder_lengths``), the encoder's output the decoder's ragged memory;
    onnxruntime's logits are stepnet's."""
    ort = pytest.importorskip("onnxruntime")
    from stepnet.onnx.export import export, to_nested_padded

    model = sn.load_yaml(EXAMPLES / "attention_decoder.yaml")
    onnx_model = export(model)
    assert [i.name for i in onnx_model.graph.input] == ["source", "lengths", "decoder",
                                                        "decoder_lengths"]
    rng = np.random.default_rng(5)
    feeds = {}
    for name, lengths, width in (("source", [5, 2, 0, 3], 10), ("decoder", [3, 4, 2, 1], 11)):
        rows = np.eye(width, dtype=np.float32)[rng.integers(0, width, sum(lengths))]
        feeds[name] = sn.LoDTensor.from_lengths(rows, [lengths])
    (source, (n,)), (decoder, (m,)) = (to_nested_padded(feeds[k]) for k in ("source", "decoder"))
    session = ort.InferenceSession(onnx_model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"source": source, "lengths": n, "decoder": decoder,
                                   "decoder_lengths": m})
    want = to_nested_padded(model(feeds, backend="interpreter")["logits"])[0]
    assert_close(logits, want, what="logits")


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


@pytest.mark.parametrize("direction, scan, node, dtype", [
    ("bidirectional_concat", False, "LSTM", "float32"), ("reverse", True, "Scan", "float32"),
    ("bidirectional_sum", False, "Scan", "float32"),
    ("forward", True, "Scan", "float64")])  # (a float64 layer over a float32 input: a Cast)
def test_export_a_layer_network(direction, scan, node, dtype, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "tagger.yaml"
    path.write_text(LAYER_YAML.replace("{direction}", f"{direction}\n    dtype: {dtype}"))
    out = ok(stepnet("export", path, "-o", tmp_path / "m.onnx", *(["--scan"] if scan else [])))
    assert node in out.split("nodes")[1]
    assert "words    float32" in out.split("inputs")[1]  # (as the YAML declares it)
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=1)
    expected = model(feeds, backend="interpreter")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    actual = dict(zip(["states", "last_h", "last_c"], session.run(None, onnx_feeds(feeds))))
    states = expected["states"]
    assert_close(actual["states"], states.to_padded()[0], what="states")
    assert_close(actual["last_h"], expected["last_h"], what="last_h")
    assert_close(actual["last_c"], expected["last_c"], what="last_c")


@pytest.mark.parametrize("score_shape", ["[1]", "[]"])
def test_export_an_augru_layer_network_with_its_attention_input(score_shape, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "interest.yaml"
    path.write_text(LAYER_YAML.replace("type: lstm", "type: augru\n    attention: score")
                    .replace("  words: {shape: [6], lod_level: 1}",
                             "  words: {shape: [6], lod_level: 1}\n"
                             f"  score: {{shape: {score_shape}, lod_level: 1, random: uniform}}")
                    .replace("{direction}", "bidirectional_concat")
                    .replace("  last_c: encoder.last.c_n\n", ""))
    out = ok(stepnet("export", path, "-o", tmp_path / "m.onnx"))
    assert "Scan" in out.split("nodes")[1]
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=2)
    expected = model(feeds, backend="interpreter")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["words", "score", "lengths"]
    actual = dict(zip(["states", "last_h"], session.run(None, onnx_feeds(feeds))))
    assert_close(actual["states"], expected["states"].to_padded()[0], what="states")
    assert_close(actual["last_h"], expected["last_h"], what="last_h")


NETWORK_YAML = """
name: pipeline
inputs:
  x: {shape: [5], lod_level: 1}
parameters:
  V: {shape: [12, 3], init: xavier}
  U: {shape: [3, 3], init: xavier}
layers:
  enc:
    type: rnn
    nonlinearity: relu
    direction: bidirectional_concat
    input: x
    hidden_size: 6
  top:
    type: lstm
    num_layers: 2
    hidden_size: 4
    input: enc.all
nets:
  head:
    memories: {s: {shape: [3]}}
    inputs: {y: enc.all}
    step:
      - s = tanh(s.pre @ U + y @ V)
    outputs: [s]
  tail:
    inputs: {z: head.all}
    memories: {t: {shape: [3], init: head.last}}
    step:
      - t = t.pre + z
    outputs: [t]
outputs:
  y: enc.all
  h_n: enc.last
  c_n: top.last.c_n
  s: head.last
  t: tail.all
"""


def test_export_a_network_of_layers_and_nets(tmp_path):
    """Layers, then nets, each reading what an earlier one gives (a layer's
    Y, a net's all-steps and last-step outputs): one ONNX graph, its outputs
    in the YAML's order, equal to stepnet's."""
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "pipeline.yaml"
    path.write_text(NETWORK_YAML)
    ok(stepnet("export", path, "-o", tmp_path / "m.onnx"))
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=5)
    expected = model(feeds, backend="interpreter")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == model.outputs
    for name, actual in zip(model.outputs, session.run(None, onnx_feeds(feeds))):
        want = expected[name]
        want = want.to_padded()[0] if isinstance(want, sn.LoDTensor) else want
        assert_close(actual, want, what=name)


def test_export_refuses_a_layer_over_a_nested_input(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text(LAYER_YAML.replace("{direction}", "forward").replace(
        "words: {shape: [6], lod_level: 1}", "words: {shape: [6], lod_level: 2}"))
    proc = stepnet("export", path, "-o", tmp_path / "nested.onnx")
    assert proc.returncode == 1
    assert "layer encoder reads 'words' with lod_level 2" in proc.stderr
    assert not (tmp_path / "nested.onnx").exists()


def test_info_says_when_the_compile_worker_runs_another_stepnet():
    """``stepnet info``'s worker line names a worker of another stepnet
    (another environment sharing the cache directory), which refuses this
    process's kernels; a worker of this stepnet gets no such line."""
    from stepnet.cli import _compiling
    from stepnet.jit.compile_worker import PACKAGE_FOLDER

    ours = {"pid": 7, "stepnet": PACKAGE_FOLDER, "compiling": None, "queued": []}
    assert _compiling(ours) == "compile worker: process 7, idle"
    other = dict(ours, stepnet="/elsewhere/site-packages")
    assert "it runs the stepnet in /elsewhere/site-packages, not this one's" in _compiling(other)
