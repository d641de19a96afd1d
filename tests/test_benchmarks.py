"""The benchmark harness must keep working: a --quick run of stepnet and numpy
lists every workload, and stepnet's final states match the float64 reference."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["W1 gru-std", "W2 lstm-std", "W3 gru-latency", "W4 gru-varlen",
             "W5 custom-cell", "W6 nested", "W7 lstm-bi2"]


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
    assert "sgemm ceiling:" in report and "GFLOP/s" in report
    assert "### stepnet compile time" in report
    assert re.search(r"^\| cold .*\| warm", report, re.DOTALL | re.MULTILINE), report
