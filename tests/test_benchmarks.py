"""The benchmark harness must keep working: a --quick run of stepnet and numpy
lists its workloads, stepnet's final states match the float64 reference, and
its W8 and W9 gradients match the float64 gradients, which match PyTorch's
autograd."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["W1 gru-std", "W2 lstm-std", "W3 gru-latency", "W4 gru-varlen",
             "W5 custom-cell", "W6 nested", "W7 lstm-bi2", "W8 gru-train", "W9 custom-train"]
NO_NUMPY_PEER = ("W7 lstm-bi2", "W9 custom-train")  # W9: NumPy is its float64 reference


def _section(report, title):
    """The lines of the report's ``### title`` section."""
    start = report.index(f"### {title}\n")
    end = report.find("\n### ", start + 1)
    return report[start:end if end >= 0 else None].splitlines()


def _rows(table_text):
    rows = []
    for line in table_text.splitlines():
        if line.startswith("| W"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def _quick_report(tmp_path, *options):
    """benchmarks/run.py --quick with ``options``: its markdown report."""
    md = tmp_path / "bench.md"
    # (the stepnet worker on the tests' cache: its helpers are compiled)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick",
         "--stepnet-cache", "default", "--markdown", str(md), *options],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = md.read_text()
    assert report.strip() in proc.stdout
    return report


# every kind of row of the report: a layer, a DSL cell and an ONNX session
# (W1), a nested net (W6), gradients (W8, W9), a peer that cannot run one (W9);
# the other workloads' kernels (about a minute of compiles) under -m slow
DEFAULT_WORKLOADS = ["W1 gru-std", "W6 nested", "W8 gru-train", "W9 custom-train"]


@pytest.mark.parametrize("workloads", [
    DEFAULT_WORKLOADS, pytest.param(WORKLOADS, marks=pytest.mark.slow)], ids=["some", "all"])
def test_quick_run_lists_its_workloads_and_stepnet_is_accurate(tmp_path, workloads):
    # (the compile probe, which compiles stepnet's helpers into an empty
    # cache: test_the_compile_probe_times_a_cold_and_a_warm_first_call)
    chosen = ",".join(wl.split()[0] for wl in workloads)
    report = _quick_report(tmp_path, "--peers", "stepnet,numpy", "--no-compile",
                           "--workloads", chosen)
    assert re.search(r"^stepnet's small products \(.*\): stepnet's own loop for ", report, re.M), report
    header = next(line for line in report.splitlines() if line.startswith("| workload"))
    assert "max\\|dh\\|" in header
    rows = _rows(report)
    assert {r[0] for r in rows if " " in r[0]} == set(workloads), report  # (and no other)
    for wl in workloads:
        stepnet = [r for r in rows if r[0] == wl and r[1].startswith("stepnet")]
        assert stepnet, f"{wl}: no stepnet row in\n{report}"
        r = stepnet[0]
        assert "n/a" not in r[1], f"{wl}: stepnet failed:\n{report}"
        assert float(r[2]) > 0 and int(r[4]) >= 2  # median ms, n
        assert float(r[6]) == 1.0  # ratio of stepnet to itself
        assert float(r[7]) < 1e-3, f"{wl}: stepnet max|dh| {r[7]}"
        for other in stepnet[1:]:  # the DSL cells beside the stepnet.nn layers
            if "int8" in other[1]:  # (sn.quantize: int8's own error)
                assert "n/a" not in other[1] and float(other[7]) < 5e-2, f"{wl} {other[1]}"
                continue
            assert float(other[7]) < 1e-3, f"{wl} {other[1]}: max|dh| {other[7]}"
        numpy_rows = [r for r in rows if r[0] == wl and r[1].startswith("numpy")]
        assert numpy_rows, f"{wl}: no numpy row\n{report}"
        if wl in NO_NUMPY_PEER:
            assert numpy_rows[0][1].startswith("numpy: n/a ("), numpy_rows[0]
        else:
            assert float(numpy_rows[0][7]) < 1e-3, f"{wl}: numpy row\n{report}"
    gradients = _section(report, "W8 gru-train: gradients")
    graded = [[c.strip() for c in line.split("|")[1:-1]] for line in gradients
              if line.startswith("| stepnet") or line.startswith("| numpy")]
    for label in ("stepnet nn.GRU: sn.vjp + pullback",
                  "stepnet nn.GRU: layer(keep_workspace=True) + sn.gradients",
                  "stepnet nn.GRU: backward only", "numpy"):
        mine = [r for r in graded if r[0].startswith(label) and r[1] == "float64 NumPy"]
        assert mine, f"W8: no gradient row for {label}:\n{report}"
        assert float(mine[0][-1]) < 1e-3, f"W8 {label}: gradient error {mine[0][-1]}"
    split = next(line for line in gradients if line.startswith("- stepnet:"))
    assert re.search(r"forward [0-9.]+ ms .* \+ backward [0-9.]+ ms", split), split
    assert int(re.search(r"workspace kept: (\d+) bytes", split).group(1)) > 0, split
    _check_w9_gradients(report)
    # the executor's section: the workloads it times (those of these it
    # takes, and W1's GRU quantized to int8), each of their programs on it
    # (a nested net's too)
    found = {r[0]: r for r in _rows("\n".join(_section(report, "stepnet's first tier: the executor")))}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run import EXECUTOR_KEYS  # (importing run.py starts nothing)

    timed = {wl.split()[0] for wl in workloads} & set(EXECUTOR_KEYS) | {"W1-int8"}
    assert set(found) == timed, found
    for key in timed:
        assert float(found[key][3]) > 0 and not found[key][4].startswith("0 of"), found[key]
    # the ceiling: 2 threads x the best single-thread rate of the per-step
    # product, beside the FMA peak of one core
    line = next(line for line in report.splitlines() if line.startswith("GEMM ceiling:"))
    found = re.search(r"\(([^()]*(?:\([^()]*\)[^()]*)*) GFLOP/s\): ([0-9.]+) GFLOP/s\. FMA peak "
                      r"[^:]*: ([0-9.]+) GFLOP/s; the ceiling is ([0-9.]+) of 2 cores", line)
    assert found, line
    rates = [float(part.rsplit(" ", 1)[1]) for part in found.group(1).split(", ")]
    assert len(rates) >= 2 and "stepnet's own loop" in found.group(1), line  # (and numpy's)
    ceiling, peak = float(found.group(2)), float(found.group(3))
    assert abs(ceiling - 2 * max(rates)) < 0.2 and peak > 0, line
    # (the share printed from the unrounded figures; the figures to 0.1)
    share = float(found.group(4))
    assert abs(share - ceiling / (2 * peak)) < 0.006 + share * (0.05 / ceiling + 0.05 / peak), line
    # (whether a product outran the peak compares two timings: on a busy
    # machine it can, and the report lists it under Failures rather than fail)
    # stepnet over the fastest peer, against the targets (here the NumPy loops)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import workloads

    assert "### stepnet compile time" not in report
    if os.environ.get("NUMBA_CPU_NAME", "host") != "host":  # (an emulated run weighs stepnet
        assert "### stepnet against the fastest peer" not in report  # against PyTorch only)
        return
    targets = _rows("\n".join(_section(report, "stepnet against the fastest peer")))
    timed = {r[0].split()[0] for r in rows if r[1].startswith("numpy") and "n/a" not in r[1]}
    assert {r[0] for r in targets} == timed - {"W6", "W9"}, report  # (W6, W9: of torch, jax)
    for r in targets:
        assert r[2].startswith("numpy") and r[5] in ("yes", "no")
        fastest_ms = float(r[2].split()[-1])
        assert abs(float(r[3]) - float(r[1]) / fastest_ms) < 0.02 * float(r[3]) + 0.01
        # the GFLOP/s the target asks for, and their share of 2 cores' FMA
        # peak and of the ceiling
        asked = workloads.flops(workloads.make(r[0], quick=True), "step") / (
            float(r[4]) * fastest_ms * 1e-3) / 1e9
        assert abs(float(r[7]) - asked) < 0.02 * asked + 0.1, r
        assert abs(float(r[8]) - float(r[7]) / (2 * peak)) < 0.01, r
        assert abs(float(r[9]) - float(r[7]) / ceiling) < 0.01, r


@pytest.mark.slow
def test_the_compile_probe_times_a_cold_and_a_warm_first_call(tmp_path):
    report = _quick_report(tmp_path, "--peers", "stepnet", "--workloads", "W1")
    assert "### stepnet compile time" in report
    cold, warm = (re.search(rf"^\| {probe} \((\d+) files in the cache dir after\) \|(.*)\|$",
                            report, re.MULTILINE) for probe in ("cold", "warm"))
    assert cold and warm, report
    assert int(cold.group(1)) > 0 and int(warm.group(1)) >= int(cold.group(1)), report
    for m in (cold, warm):  # import, build, first call, their sum, second call, wall
        figures = [float(c) for c in m.group(2).split("|")]
        assert len(figures) == 6 and min(figures) >= 0 and figures[3] > 0, report


def _check_w9_gradients(report):
    """W9's gradient table: every weight of the custom cell and x, each
    stepnet row within 1e-3 of the float64 BPTT; stepnet's split of the step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import workloads

    gradients = _section(report, "W9 custom-train: gradients")
    header = next(line for line in gradients if line.startswith("| peer"))
    assert [c.strip() for c in header.split("|")[1:-1]] == (
        ["peer", "compared with"] + list(workloads.CUSTOM_GRADIENTS) + ["max"]), header
    graded = [[c.strip() for c in line.split("|")[1:-1]] for line in gradients
              if line.startswith("| stepnet")]
    for label in ("stepnet custom cell in the DSL: sn.vjp + pullback",
                  "stepnet custom cell in the DSL: rnn(keep_workspace=True) + sn.gradients",
                  "stepnet custom cell: backward only"):
        mine = [r for r in graded if r[0].startswith(label) and r[1] == "float64 NumPy"]
        assert mine, f"W9: no gradient row for {label}:\n{report}"
        assert all(c != "n/a" for c in mine[0][2:]), mine[0]
        assert float(mine[0][-1]) < 1e-3, f"W9 {label}: gradient error {mine[0][-1]}"
    split = next(line for line in gradients if line.startswith("- stepnet:"))
    assert re.search(r"forward [0-9.]+ ms .* \+ backward [0-9.]+ ms", split), split
    assert int(re.search(r"workspace kept: (\d+) bytes", split).group(1)) > 0, split


def test_w8_float64_gradients_match_torch_autograd():
    """The W8 oracle (a hand-written backpropagation through time) against
    PyTorch's autograd, both in float64."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import workloads

    wl = workloads.make("W8", quick=True)
    ref = workloads.gradient_reference(wl)
    m = torch.nn.GRU(wl.dims["I"], wl.dims["H"]).double()
    with torch.no_grad():
        for name, key in (("weight_ih", "w_ih"), ("weight_hh", "w_hh"),
                          ("bias_ih", "b_ih"), ("bias_hh", "b_hh")):
            getattr(m, name + "_l0").copy_(torch.from_numpy(wl.weights[key]))
    x = torch.from_numpy(wl.x_time_major().astype(np.float64)).requires_grad_(True)
    y, h = m(x)
    dY = torch.from_numpy(wl.extra["dY"].transpose(1, 0, 2).astype(np.float64))
    torch.autograd.backward((y, h), (dY, torch.from_numpy(wl.extra["dh"][None].astype(np.float64))))
    got = {name: getattr(m, name + "_l0").grad.numpy()
           for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
    got["x"] = x.grad.numpy().transpose(1, 0, 2)
    assert set(ref) == set(workloads.GRADIENTS)
    for name in workloads.GRADIENTS:
        np.testing.assert_allclose(ref[name], got[name], rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(workloads.reference(wl), h[0].detach().numpy(), rtol=1e-10)


def test_w9_float64_gradients_match_torch_autograd():
    """The W9 oracle (``workloads.custom_train``, a hand-written
    backpropagation through time of W5's cell) against PyTorch's autograd of
    a plain per-step loop of the cell (no hoisting, batch-major), both in
    float64; the forward against W5's per-sequence reference loop."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import workloads

    wl = workloads.make("W9", quick=True)
    assert wl.kind == "custom-train" and set(wl.extra) == {"dY"}
    w5 = workloads.make("W5", quick=True)
    np.testing.assert_array_equal(wl.x, w5.x)
    ref = workloads.gradient_reference(wl)
    assert tuple(ref) == workloads.CUSTOM_GRADIENTS == workloads.gradient_names(wl)
    w = {k: torch.from_numpy(v.astype(np.float64)).requires_grad_(True)
         for k, v in wl.weights.items()}
    x = torch.from_numpy(wl.x.astype(np.float64)).requires_grad_(True)  # [B, T, I]
    B, T, _ = x.shape
    h = torch.zeros(B, wl.dims["H"], dtype=torch.float64)
    ys = []
    for t in range(T):
        xt = x[:, t]
        z = torch.sigmoid(xt @ w["Wz"] + h @ w["Uz"] + w["bz"])
        r = torch.sigmoid(xt @ w["Wr"] + h @ w["Ur"] + w["br"])
        cand = w["s"] * torch.tanh(xt @ w["Wx"] + (r * h) @ w["Wh"] + w["b"])
        h = (1 - z) * h + z * cand + 0.1 * (xt @ w["P"])
        ys.append(h)
    Y = torch.stack(ys, dim=1)
    torch.autograd.backward(Y, torch.from_numpy(wl.extra["dY"].astype(np.float64)))
    for name in workloads.CUSTOM_GRADIENTS:
        got = (x if name == "x" else w[name]).grad.numpy()
        assert got.shape == ref[name].shape, name
        np.testing.assert_allclose(ref[name], got, rtol=1e-10, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(workloads.reference(wl), h.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(workloads.reference(wl), workloads.reference(w5), rtol=0)
    assert workloads.flops(wl) == 3 * workloads.flops(w5)


@pytest.mark.slow
def test_first_result_benchmark_prints_every_setting():
    """benchmarks/first_result.py: fresh processes, empty caches, one row per
    setting, each with a first result and the kernels' call."""
    pytest.importorskip("onnx")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_result.py"),
                           "--cases", "onnx-gru"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| onnx-gru")]
    assert [r[2].strip() for r in rows] == ["tiered", "compiled", "warm"]
    for r in rows:
        assert float(r[4]) > 0 and float(r[7]) > 0  # first forward s, a kernel call ms


@pytest.mark.slow
def test_attention_benchmark_runs_both_models_to_the_same_loss():
    """benchmarks/attention.py --quick: stepnet and PyTorch train the same
    seq2seq on the same batches; the first losses agree (it exits 1 if not)."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--quick"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| stepnet |" in proc.stdout and "| torch |" in proc.stdout
    assert "Padding in PyTorch's work" in proc.stdout


@pytest.mark.slow
def test_cuda_profile_times_every_driver_of_every_workload():
    """benchmarks/cuda_profile.py --quick (on Numba's simulator without a GPU):
    each workload under each time-loop driver with what its call counted,
    the same results on each, and one call of the planned driver by phase."""
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not os.path.exists("/dev/nvidiactl"):
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_profile.py"), "--quick"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cuda_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for key in ("W1", "W3", "W5"):
        for driver in cuda_profile.DRIVERS:
            line = re.search(rf"^{key} +{re.escape(driver)} .*$", proc.stdout, re.M)
            assert line and "1 copies" in line.group(), (key, driver, proc.stdout)
            diff = float(re.search(r"max\|dh\| (\S+) from", line.group()).group(1))
            assert diff < 1e-5, line.group()
        assert re.search(rf"^{key} +phases .*time loop [0-9.]+", proc.stdout, re.M), key
    # T=20 steps of 3 stages, and the hoisted GEMM
    assert re.search(r"^W3 +a launch per stage and step .* 61 launches", proc.stdout, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("options,parts", [
    # (at these sizes the input products run over every step at once, not by chunks)
    ([], {"without per-step products", "without products over every step"}),
    (["--int8"], {"without quantized products (sn.quantize)"})])
def test_the_parts_of_a_kernel_are_timed_by_subtraction(options, parts):
    """benchmarks/parts.py times one group's kernel whole and without each
    kind of product it has (``--int8``: of the workload quantized), and
    gives each part's time."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parts.py"), "W2", "--quick", "--seconds", "0.05",
         "--rounds", "2", *options], check=False, cwd=ROOT, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = dict(re.findall(r"^  (\S.*?)\s+([0-9.]+) \(", proc.stdout, flags=re.M))
    assert set(times) == {"whole kernel", "without any product"} | parts, proc.stdout
    assert all(float(t) > 0 for t in times.values()), proc.stdout
    assert proc.stdout.count("the part:") == len(times) - 1, proc.stdout


def test_a_report_becomes_its_machines_section_of_the_benchmarks_page(tmp_path, monkeypatch):
    """``--markdown docs/benchmarks.md`` puts the report under its CPU in the
    page's Results, replacing that CPU's earlier one and keeping the others';
    any other file gets the report alone."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run

    page = tmp_path / "benchmarks.md"
    page.write_text((ROOT / "docs" / "benchmarks.md").read_text())

    def machines(text):
        results = text[text.index("\n## Results\n"):]
        results = results[:results.index("\n## ", 5)]
        return results, [line for line in results.splitlines() if line.startswith("### ")]

    recorded = machines(page.read_text())[1]  # (the page's own, kept)
    report = "## stepnet benchmark: full sizes\n\n| workload |\n|---|\n| W1 |\n\n### Failures\n\nnone"
    for cpu, cell in (("CPU A (family 25, avx512f no)", "W1"), ("CPU B (family 6, avx512f yes)", "W1"),
                      ("CPU A (family 25, avx512f no)", "W2")):
        monkeypatch.setattr(run, "_cpu_model", lambda cpu=cpu: cpu)
        run.write_markdown(page, report.replace("| W1 |", f"| {cell} |"))
    run.write_markdown(page, report, "GPU G (GPU; CPU B (family 6, avx512f yes))")  # its own section
    text = page.read_text()
    results, headings = machines(text)
    assert headings == sorted(recorded + ["### CPU A (family 25, avx512f no)",
                                          "### CPU B (family 6, avx512f yes)",
                                          "### GPU G (GPU; CPU B (family 6, avx512f yes))"])
    a = results[results.index("### CPU A"):results.index("### CPU B")]
    assert "| W2 |" in a and "| W1 |" not in a and "#### stepnet benchmark" in a
    assert "##### Failures" in a and "No table has been recorded" not in text
    assert text.startswith("# Benchmarks") and "\n## Other benchmarks\n" in text
    other = tmp_path / "results.md"
    run.write_markdown(other, report)
    assert other.read_text() == report + "\n"


def test_an_emulated_run_is_its_own_section_and_weighs_stepnet_against_pytorch(monkeypatch):
    """Under ``NUMBA_CPU_NAME`` (another CPU's instructions) the section's
    heading names the emulated CPU, and the targets and the int8 table weigh
    stepnet against PyTorch's rows, the peer that emulates it too; without
    it, against the fastest CPU peer."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run
    import workloads as wl

    def rec(family, seconds, label=None):
        return {"workload": "W1", "family": family, "label": label or family, "status": "ok",
                "median_s": seconds}

    recs = [rec("stepnet", 0.020), rec("torch", 0.032, "torch nn.GRU"),
            rec("onnxruntime", 0.024, "onnxruntime GRU node"), rec("stepnet-int8", 0.017),
            rec("torch-int8", 0.018, "torch int8"), rec("onnxruntime-int8", 0.007, "ort int8")]
    wls = {"W1": wl.make("W1", quick=True)}
    for name, fastest, int8_peer in (("haswell", "torch nn.GRU 32.", "torch int8 18."),
                                     ("host", "onnxruntime GRU node 24.", "ort int8 7.")):
        monkeypatch.setenv("NUMBA_CPU_NAME", name)
        assert ("emulating haswell" in run._cpu_model()) == (name == "haswell")
        targets = _rows("\n".join(run.targets_section(["W1"], wls, recs, {}, None)))
        assert targets[0][2].startswith(fastest), targets
        assert targets[0][5] == ("yes" if name == "haswell" else "no")  # 0.62 / 0.83 of 0.65
        int8 = _rows("\n".join(run.quantized_section(["W1"], recs)))
        assert int8[0][4].startswith(int8_peer), int8


def test_every_mechanism_of_the_mechanisms_benchmark_can_be_turned_off():
    """benchmarks/mechanisms.py turns each mechanism off by a name in the
    engine: every name it uses must exist, and each switch must change it
    while on and restore it after."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mechanisms
    from stepnet.jit import plan, threads, transposed

    def state():
        return (int(threads.BOARD[threads.SHARES]), plan._one_group, transposed._SPLIT_TN_WORK,
                threads.run_apart)

    before = state()
    for name, (_, off) in mechanisms.MECHANISMS.items():
        with off():
            assert (state() == before) == (name == "plain again"), name
        assert state() == before, name


def test_a_timeline_row_reads_the_calls_as_a_user_meets_them():
    """benchmarks/first_result.py --timeline: the first result, a call's
    median on the interpreter (the first call left out), when the kernels
    ran first, and full speed from the first fast call after which the
    median of every ten calls is fast, not from one lucky call."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import first_result

    durations = [2, 1, 1, 0.9, 1, 1, 0.5, 0.1, 0.1, 0.1, 0.5, 0.1] + [0.1] * 13
    calls, end = [], 0.0
    for i, d in enumerate(durations):
        end += d
        calls.append((end, d, i >= 6))
    row = [c.strip() for c in first_result.timeline_row("stepnet:W5", calls).split("|")[1:-1]]
    assert row[:5] == ["stepnet:W5", "2.00", "1000", "6.9", "7.4"], row  # (call 7 starts at 7.4)
    assert row[5] == "100.0" and row[6] == "25", row


def test_the_neighbour_benchmark_times_each_peer_alone_and_beside_the_other():
    """benchmarks/neighbour.py --quick: stepnet's and PyTorch's W1 in one
    process, each alone and taking turns; the ratio is beside over alone."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "neighbour.py"), "--quick",
                           "--rounds", "2", "--calls", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r[0]: r[1:] for r in (
        [c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
        if line.startswith("| stepnet") or line.startswith("| torch"))}
    assert set(rows) == {"stepnet", "torch"}, proc.stdout
    for alone, beside, ratio in rows.values():
        assert float(alone) > 0 and abs(float(ratio) - float(beside) / float(alone)) < 0.02
