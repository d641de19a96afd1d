"""The benchmark harness must keep working: a --quick run of stepnet and numpy
lists every workload, stepnet's final states match the float64 reference, and
its W8 gradients match the float64 gradients, which match PyTorch's autograd."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["W1 gru-std", "W2 lstm-std", "W3 gru-latency", "W4 gru-varlen",
             "W5 custom-cell", "W6 nested", "W7 lstm-bi2", "W8 gru-train"]


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


def test_quick_run_lists_every_workload_and_stepnet_is_accurate(tmp_path):
    md = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick",
         "--peers", "stepnet,numpy", "--markdown", str(md)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = md.read_text()
    assert report.strip() in proc.stdout
    header = next(line for line in report.splitlines() if line.startswith("| workload"))
    assert "max\\|dh\\|" in header
    rows = _rows(report)
    for wl in WORKLOADS:
        stepnet = [r for r in rows if r[0] == wl and r[1].startswith("stepnet")]
        assert stepnet, f"{wl}: no stepnet row in\n{report}"
        r = stepnet[0]
        assert "n/a" not in r[1], f"{wl}: stepnet failed:\n{report}"
        assert float(r[2]) > 0 and int(r[4]) >= 2  # median ms, n
        assert float(r[6]) == 1.0  # ratio of stepnet to itself
        assert float(r[7]) < 1e-3, f"{wl}: stepnet max|dh| {r[7]}"
        for other in stepnet[1:]:  # the DSL cells beside the stepnet.nn layers
            assert float(other[7]) < 1e-3, f"{wl} {other[1]}: max|dh| {other[7]}"
        numpy_rows = [r for r in rows if r[0] == wl and r[1].startswith("numpy")]
        assert numpy_rows, f"{wl}: no numpy row\n{report}"
        if wl == "W7 lstm-bi2":  # measured against PyTorch only
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
    assert "sgemm ceiling:" in report and "GFLOP/s" in report
    assert "### stepnet compile time" in report
    assert re.search(r"^\| cold .*\| warm", report, re.DOTALL | re.MULTILINE), report


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
