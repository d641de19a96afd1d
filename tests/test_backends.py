"""The backend protocol (stepnet.backends): every backend runs through one
interface, and front ends ask a backend's capabilities, never its name."""

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

import stepnet as sn
from conftest import run_python
from stepnet.backends import BACKENDS, answers_while_compiling, backend, compiled
from stepnet.schedule import Schedule

ROOT = Path(__file__).resolve().parent.parent


def _net():
    X = sn.LoDTensor.from_lengths(np.linspace(-1, 1, 14, dtype=np.float32).reshape(7, 2),
                                  [[3, 4]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[2], name="h")
        h.update(sn.ops.tanh(x + 0.5 * h.pre_state()))
        rnn.add_outputs(h)
    return rnn


@pytest.mark.parametrize("name", sn.backends())
def test_every_backend_runs_through_one_interface(name):
    rnn = _net()
    step_net = compiled(rnn, name)
    assert step_net.capabilities is BACKENDS[name] is backend(name)
    source = step_net.source
    assert isinstance(source, str) and (bool(source) == BACKENDS[name].compiles)
    assert isinstance(step_net.schedule, Schedule) and str(step_net.schedule)
    out = step_net()
    assert step_net.wait(timeout=600) and step_net.ready()
    expected = compiled(rnn, "interpreter")()
    assert out.lod == expected.lod
    np.testing.assert_allclose(out.data, expected.data, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sn.backends())
def test_a_prepared_call_gives_the_public_calls_results(name, rng):
    """``prepared()``: on a backend running machine code here, once the
    kernel answers, a call with the weights laid out once that gives the
    public call's results bit for bit (states given and not: zeros), by
    steps too; elsewhere None. A step-net of another form (two sequence
    inputs) has none."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((7, 3)).astype(np.float32), [[3, 4]])
    h0 = rng.standard_normal((2, 5)).astype(np.float32)
    W = rng.standard_normal((3, 5)).astype(np.float32)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(init=h0, name="h")
        h.update(sn.ops.tanh(sn.ops.matmul(x, W) + 0.5 * h.pre_state()))
        rnn.add_outputs(h)
    step_net = compiled(rnn, name)
    flags = (True,)
    expected = step_net(output_all_steps=flags, x=X, h=h0)
    assert step_net.wait(timeout=600)
    call = step_net.prepared(flags)
    if not BACKENDS[name].host_code:
        assert call is None
        return
    data, offsets = X.data, np.asarray(X.lod[0], np.int64)
    got = call(data, offsets, [h0])
    assert np.array_equal(got[0], expected.data)
    zeros = step_net(output_all_steps=flags, x=X, h=np.zeros_like(h0))
    assert np.array_equal(call(data, offsets, [None])[0], zeros.data)
    with pytest.raises(sn.ShapeError, match="takes \\[tokens, 3\\]"):
        call(data[:, :2], offsets, [h0])
    # the rows by steps (two sequences of 3 and 4 steps, padded to 4): the same rows
    steps = np.zeros((8, 3), np.float32)
    steps[0::2][:3], steps[1::2] = data[:3], data[3:]
    by_steps = call.by_steps(steps, offsets, [h0], padded=True)
    if by_steps is not None:  # (None where the run is split over threads)
        assert np.array_equal(by_steps[0][0::2][:3], expected.data[:3])
        assert np.array_equal(by_steps[0][1::2], expected.data[3:])
        assert not by_steps[0][6].any()
    other = sn.create_rnn_op()
    with other.stepnet():
        a, b = other.add_input(X, name="a"), other.add_input(X, name="b")
        m = other.add_memory(shape=[3], name="m")
        m.update(a + b + m.pre_state())
        other.add_outputs(m)
    two_inputs = compiled(other, name)
    two_inputs()
    assert two_inputs.wait(timeout=600) and two_inputs.prepared() is None


def test_front_ends_call_no_backend_private_name():
    """Front ends reach a compiled step-net through its protocol
    (``CompiledStepNet``'s public methods): no module outside
    stepnet/backends.py and stepnet/jit/ reads its ``_runner`` or a
    backend's program (``numba_program``), nor imports the Numba backend's
    module."""
    found = []
    for path in sorted((ROOT / "stepnet").rglob("*.py")):
        relative = path.relative_to(ROOT / "stepnet")
        if relative.parts[0] == "jit" or str(relative) == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.attr if isinstance(node, ast.Attribute) else node.value
                    if isinstance(node, ast.Constant) else None)  # (getattr's too)
            if name in ("_runner", "numba_program"):
                found.append(f"{relative}:{node.lineno} {name}")
            if isinstance(node, ast.ImportFrom) and "numba_cpu" in (node.module or "") + "".join(
                    alias.name for alias in node.names):
                found.append(f"{relative}:{node.lineno} imports the Numba backend's module")
    assert not found, found


def test_capabilities_are_asked_for_not_names(monkeypatch):
    assert backend(None) is BACKENDS[sn.default_backend()]
    with pytest.raises(sn.BackendError, match="unknown backend 'tpu'; known: cuda, interpreter"):
        backend("tpu")
    assert not answers_while_compiling("interpreter")
    monkeypatch.setenv("STEPNET_TIERED", "1")
    if "numba" in sn.backends():
        assert answers_while_compiling("numba")
        with sn.config(tiered=False):
            assert not answers_while_compiling("numba")


def _name_checks(path):
    """Comparisons of something with a backend's name in a module."""
    names = set(BACKENDS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                values = [operand] if isinstance(operand, ast.Constant) else \
                    list(operand.elts) if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else []
                if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_front_ends_check_no_backend_by_name():
    """Outside the backends themselves (stepnet/backends.py, the interpreter,
    stepnet/jit/), no module compares a backend's name: it asks
    ``backend(name)`` what the backend can do."""
    found = []
    for path in sorted((ROOT / "stepnet").rglob("*.py")):
        relative = path.relative_to(ROOT / "stepnet")
        if relative.parts[0] == "jit" or str(relative) in ("backends.py", "interpreter.py"):
            continue
        found += _name_checks(path)
    assert not found, found


def test_the_default_backend_is_numba_and_imports_no_other_backend(tmp_path):
    """A call without ``backend=`` runs on Numba where it is available, and
    choosing it imports no other backend (numba.cuda takes a tenth of a
    second to seconds to import, and a CPU user never needs it)."""
    code = """
import sys, numpy as np, stepnet as sn
layer = sn.nn.GRU(4, 8, seed=0)
layer(sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]]))
print(sn.default_backend(), "numba.cuda" in sys.modules)
"""
    out = run_python(code, tmp_path, STEPNET_TIERED="0")
    assert out.split() == ["numba", "False"], out


def test_the_default_backend_is_the_interpreter_without_numba(monkeypatch):
    from stepnet import errors
    backends_module = sys.modules["stepnet.backends"]
    real = backends_module._module

    def without_numba(name):
        if name == "numba":
            raise errors.BackendError("backend 'numba' is not available here: (test)")
        return real(name)

    monkeypatch.setattr(backends_module, "_module", without_numba)
    monkeypatch.setattr(backends_module, "_default", None)
    assert sn.default_backend() == "interpreter"
    monkeypatch.setattr(backends_module, "_default", None)
    monkeypatch.setattr(backends_module, "_module", real)
    assert sn.default_backend() == "numba"
