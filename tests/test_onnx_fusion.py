"""Runs of elementwise nodes in an InferenceSession fused into one loop
(stepnet/onnx/fusion.py): the same values as node by node, on views,
broadcasts, special values and fed layouts the plan did not see."""

from types import SimpleNamespace

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from conftest import cache_with_helpers  # noqa: E402
from stepnet.jit import loading  # noqa: E402
from stepnet.onnx import InferenceSession  # noqa: E402
from stepnet.onnx import fusion  # noqa: E402
from stepnet.onnx.fusion import FusedNode  # noqa: E402

_ELEM = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}


@pytest.fixture(autouse=True)
def _node_by_node(monkeypatch):
    """These tests are of the fused loops of a plan run node by node: no
    plan is compiled into one call (tests/test_onnx_lowering.py)."""
    from stepnet.onnx import graph

    monkeypatch.setattr(graph, "lower", lambda *args: None)


def _spectrum_model(dtype=np.float32):
    """x [B, 2C, T] -> channels last, halves re and im, then
    ``m = sqrt(re * re + im * im + eps)``, ``y = sigmoid(m * scale) - 0.5``
    (scale [C] broadcast): ``m`` is an output too, so the run writes it."""
    C = 3
    inits = [numpy_helper.from_array(np.array([C], np.int64), "c"),
             numpy_helper.from_array(np.array([2 * C], np.int64), "c2"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2], np.int64), "axis"),
             numpy_helper.from_array(np.array(1e-6, dtype), "eps"),
             numpy_helper.from_array(np.array(0.5, dtype), "half"),
             numpy_helper.from_array(np.linspace(0.5, 2.0, C).astype(dtype), "scale")]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("Slice", ["xt", "zero", "c", "axis"], ["re"]),
             helper.make_node("Slice", ["xt", "c", "c2", "axis"], ["im"]),
             helper.make_node("Mul", ["re", "re"], ["re2"]),
             helper.make_node("Mul", ["im", "im"], ["im2"]),
             helper.make_node("Add", ["re2", "im2"], ["power"]),
             helper.make_node("Add", ["power", "eps"], ["power_eps"]),
             helper.make_node("Sqrt", ["power_eps"], ["m"]),
             helper.make_node("Mul", ["m", "scale"], ["scaled"]),
             helper.make_node("Sigmoid", ["scaled"], ["s"]),
             helper.make_node("Sub", ["s", "half"], ["y"])]
    elem = _ELEM[dtype]
    graph = helper.make_graph(
        nodes, "spectrum", [helper.make_tensor_value_info("x", elem, ["B", 2 * C, "T"])],
        [helper.make_tensor_value_info("y", elem, ["B", "T", C]),
         helper.make_tensor_value_info("m", elem, ["B", "T", C])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _close(got, want):
    """Within a few units in the last place (the loop's sigmoid is stepnet's,
    not SciPy's; sigmoid(x) - 0.5 keeps their difference absolute)."""
    tiny = 1e-7 if got.dtype == np.float32 else 1e-15
    np.testing.assert_allclose(got, want, rtol=100 * tiny, atol=tiny)


def _fused_nodes(session):
    graph = session.graph
    return [node for plan in graph.fused.values() for node in plan if isinstance(node, FusedNode)]


def _runs(session, feeds, times=3):
    return [session.run(None, feeds) for _ in range(times)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_run_of_elementwise_nodes_gives_the_values_of_the_nodes(rng, dtype):
    model = _spectrum_model(dtype)
    session = InferenceSession(model)
    feeds = {"x": rng.standard_normal((4, 6, 100)).astype(dtype)}
    first, _, third = _runs(session, feeds)
    fused = _fused_nodes(session)
    assert [node.op for node in fused] == ["Mul+Mul+Add+Add+Sqrt+Mul+Sigmoid+Sub"]
    assert fused[0].outputs == ["m", "y"]  # what is read after the run: the outputs
    assert fused[0].ready
    for unfused, got in zip(first, third):
        assert got.shape == unfused.shape and got.dtype == dtype
        _close(got, unfused)
    ort = pytest.importorskip("onnxruntime")
    expected = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    for want, got in zip(expected, third):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (NumPy's, node by node: 1e30 * 1e30)
def test_special_values_go_through_the_loop_as_through_numpy(monkeypatch):
    monkeypatch.setattr(fusion, "MIN_SIZE", 1)
    model = _spectrum_model()
    session = InferenceSession(model)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e-30, 3.0], np.float32)
    x = np.resize(specials, (2, 6, 8)).astype(np.float32)
    x[1] = x[1, ::-1]
    first, _, third = _runs(session, {"x": x})
    assert _fused_nodes(session)[0].ready
    for unfused, got in zip(first, third):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(unfused))
        _close(got, unfused)  # inf where NumPy gives inf


def test_a_new_batch_size_reuses_the_kernel(rng):
    session = InferenceSession(_spectrum_model())
    _runs(session, {"x": rng.standard_normal((4, 6, 100)).astype(np.float32)})
    small = {"x": rng.standard_normal((1, 6, 400)).astype(np.float32)}
    first, _, third = _runs(session, small)
    kernels = {node.kernel for node in _fused_nodes(session)}
    assert len(_fused_nodes(session)) == 2 and len(kernels) == 1
    for unfused, got in zip(first, third):
        _close(got, unfused)


def _model_of(nodes, shape, initializer=()):
    """A float32 graph of ``nodes`` from ``x`` to ``y``, both of ``shape``."""
    graph = helper.make_graph(
        nodes, "elementwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializer=list(initializer))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _chain_on_input_model():
    """y = tanh(x * x + b), x [64, 32]."""
    return _model_of([helper.make_node("Mul", ["x", "x"], ["x2"]),
                      helper.make_node("Add", ["x2", "b"], ["y0"]),
                      helper.make_node("Tanh", ["y0"], ["y"])], [64, 32],
                     [numpy_helper.from_array(np.arange(32, dtype=np.float32), "b")])


def _fused_chain(rng):
    """A session of ``_chain_on_input_model`` after the runs that fuse it:
    (session, its loop, the input fed)."""
    session = InferenceSession(_chain_on_input_model())
    x = rng.standard_normal((64, 32)).astype(np.float32)
    _runs(session, {"x": x})
    (node,) = _fused_nodes(session)
    assert node.ready
    return session, node, x


def test_an_input_fed_in_another_layout_runs_node_by_node(rng):
    session, node, x = _fused_chain(rng)
    # the same shape, columns of stride 16 bytes: the loop declines, the nodes run
    transposed = np.asarray(rng.standard_normal((32, 64)).astype(np.float32).T)
    (got,) = session.run(None, {"x": transposed})
    _close(got, np.tanh(transposed * transposed + np.arange(32)))
    (got,) = session.run(None, {"x": x})
    _close(got, np.tanh(x * x + np.arange(32)))


def test_small_values_run_node_by_node_and_a_larger_batch_finds_the_loop_made(rng):
    session = InferenceSession(_spectrum_model())
    x = rng.standard_normal((1, 6, 5)).astype(np.float32)  # 15 elements a value
    first, _, third = _runs(session, {"x": x})
    assert session.graph.fused and not _fused_nodes(session)
    for unfused, got in zip(first, third):
        np.testing.assert_array_equal(got, unfused)
    modules = len(loading._MODULES)
    _runs(session, {"x": rng.standard_normal((4, 6, 100)).astype(np.float32)})
    assert len(_fused_nodes(session)) == 1 and len(loading._MODULES) == modules


def test_an_input_of_another_dtype_or_rank_runs_node_by_node(rng):
    # the loop is called without Numba's dispatch: what it was not compiled
    # for must not reach it
    session, node, x = _fused_chain(rng)
    b = np.arange(32, dtype=np.float32)
    for fed in (x.astype(np.float64), x[None], np.frombuffer(b"\0" + x.tobytes(), np.float32,
                                                             offset=1).reshape(64, 32)):
        env = {"x": fed, "b": b}
        node.run(session.graph, env, "numba")
        want = np.tanh(fed * fed + b)
        assert env["y"].dtype == want.dtype and env["y"].shape == want.shape
        np.testing.assert_allclose(env["y"], want, rtol=1e-6)


def test_the_interpreter_backend_and_integer_runs_are_not_fused(rng, monkeypatch):
    monkeypatch.setattr(fusion, "MIN_SIZE", 1)
    session = InferenceSession(_spectrum_model(), backend="interpreter")
    x = rng.standard_normal((2, 6, 3)).astype(np.float32)
    assert not _fused_nodes(session) and session.graph.fused == {}
    for unfused, got in zip(*_runs(session, {"x": x}, times=2)):
        np.testing.assert_array_equal(got, unfused)
    nodes = [helper.make_node("Mul", ["i", "i"], ["i2"]), helper.make_node("Add", ["i2", "i"], ["o"])]
    graph = helper.make_graph(nodes, "ints",
                              [helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("o", TensorProto.INT64, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = InferenceSession(model)
    for _ in range(3):
        (out,) = session.run(None, {"i": np.array([1, 2, 3], np.int64)})
    assert not _fused_nodes(session)
    np.testing.assert_array_equal(out, [2, 6, 12])


def test_a_new_kernel_compiles_in_the_worker_while_the_nodes_run(rng, tmp_path, monkeypatch):
    """A cache with no kernel (stepnet's compiled helpers only:
    ``cache_with_helpers``): the loop is new, and the worker compiles it."""
    monkeypatch.setenv("STEPNET_TIERED", "1")
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache_with_helpers(tmp_path / "cache")))
    session = InferenceSession(_chain_on_input_model())
    x = rng.standard_normal((64, 32)).astype(np.float32)
    _runs(session, {"x": x}, times=2)
    (node,) = _fused_nodes(session)
    assert node._answered.wait(120), "the compile worker did not answer"
    assert not node.ready  # (the next call loads what the worker compiled)
    (got,) = session.run(None, {"x": x})
    assert node.ready and loading.ready_marker(node._key).exists()
    _close(got, np.tanh(x * x + np.arange(32)))


def test_threads_sharing_a_session_compile_its_loop_once(rng):
    from concurrent.futures import ThreadPoolExecutor

    session = InferenceSession(_chain_on_input_model())
    xs = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(8)]
    session.run(None, {"x": xs[0]})
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: [session.run(None, {"x": x})[0] for _ in range(3)], xs))
    assert all(node.ready for node in _fused_nodes(session))
    for x, runs in zip(xs, outs):
        for got in runs:
            _close(got, np.tanh(x * x + np.arange(32)))


def test_a_loop_that_does_not_compile_leaves_its_nodes_to_run(rng, monkeypatch):
    session = InferenceSession(_chain_on_input_model())
    x = rng.standard_normal((64, 32)).astype(np.float32)
    session.run(None, {"x": x})  # makes the plan with the loop, which has not run yet
    (node,) = _fused_nodes(session)
    assert not node.ready

    def broken(signature):
        raise TypeError("a fault")

    monkeypatch.setattr(node, "kernel", SimpleNamespace(signatures=[], compile=broken))
    with pytest.warns(RuntimeWarning, match="did not compile.*a fault"):
        (got,) = session.run(None, {"x": x})
    _close(got, np.tanh(x * x + np.arange(32)))
    (got,) = session.run(None, {"x": x})  # (no second warning, nor compile)
    assert not node.ready
    _close(got, np.tanh(x * x + np.arange(32)))


def test_deterministic_runs_are_never_fused(rng, monkeypatch):
    from stepnet.jit import blas

    monkeypatch.setattr(blas, "DETERMINISTIC", True)
    session = InferenceSession(_chain_on_input_model())
    x = rng.standard_normal((64, 32)).astype(np.float32)
    first, _, third = _runs(session, {"x": x})
    assert session.graph.fused and not _fused_nodes(session)
    np.testing.assert_array_equal(third[0], first[0])
