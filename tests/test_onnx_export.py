"""stepnet.onnx.export: every exported model, run by onnxruntime, gives
stepnet's numbers (the interpreter's) within DESIGN.md §4's tolerance."""

import numpy as np
import pytest

import stepnet as sn
from stepnet.onnx import export_graph
from stepnet.onnx import InferenceSession
from stepnet.onnx.export import export, to_nested_padded

from conftest import assert_close
from nets import attention_prior, document_attention, lod, tanh_cell, weight, word_attention

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

LENGTHS = [3, 0, 1, 5, 2]  # an empty sequence and one of length 1


def run_onnx(model, feeds):
    """onnxruntime's outputs by name."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def padded(value, shape=None):
    """A stepnet output in the exported layout: LoDTensors padded per level
    (with more zeros up to ``shape``: an exported output's inner time axes are
    the input's)."""
    value = to_nested_padded(value)[0] if isinstance(value, sn.LoDTensor) else value
    if shape is not None and value.shape != shape:
        value = np.pad(value, [(0, want - have) for have, want in zip(value.shape, shape)])
    return value


def node_types(model):
    return {node.op_type for node in model.graph.node}


# ----------------------------------------------------------------------------
# the padded layout


def test_to_nested_padded_two_levels():
    X = sn.LoDTensor.from_lengths(np.arange(7.0)[:, None], [[2, 0, 1], [3, 0, 4]])
    values, (top, inner) = to_nested_padded(X)
    assert values.shape == (3, 2, 4, 1)
    assert top.tolist() == [2, 0, 1] and inner.tolist() == [[3, 0], [0, 0], [4, 0]]
    assert values[0, 0, :3, 0].tolist() == [0, 1, 2] and values[2, 0, :, 0].tolist() == [3, 4, 5, 6]
    assert values[0, 1].sum() == 0 and values[1].sum() == 0


# ----------------------------------------------------------------------------
# built-in layers


CELLS = [
    (sn.nn.RNN, {}),
    (sn.nn.RNN, {"nonlinearity": "relu"}),
    (sn.nn.LSTM, {}),
    (sn.nn.LSTM, {"peephole": True}),
    (sn.nn.LSTM, {"input_forget": True}),
    (sn.nn.GRU, {}),
    (sn.nn.GRU, {"linear_before_reset": True}),
]


def layer_feeds(rng, layer, lengths=LENGTHS):
    X = lod(rng, [lengths], layer.input_size, layer.dtype)
    values, (lens,) = to_nested_padded(X)
    return X, {"X": values, "lengths": lens}


def check_layer(layer, rng, **options):
    """Export ``layer``, run it both ways and compare Y, h_n (, c_n)."""
    model = export(layer, **options)
    X, feeds = layer_feeds(rng, layer)
    if options.get("initial_states"):
        for name, width in zip(("h0", "c0"), layer.state_widths()):
            feeds[name] = rng.standard_normal(
                (layer.num_layers * layer.num_directions, len(LENGTHS), width)).astype(layer.dtype)
    initial = [feeds.get("h0"), feeds.get("c0")]
    if isinstance(layer, sn.nn.LSTM):
        Y, (h_n, c_n) = layer(X, tuple(initial), backend="interpreter")
        expected = {"Y": Y, "h_n": h_n, "c_n": c_n}
    else:
        Y, h_n = layer(X, initial[0], backend="interpreter")
        expected = {"Y": Y, "h_n": h_n}
    actual = run_onnx(model, feeds)
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert_close(actual[name], padded(value), what=name)
    return model


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional_concat"])
@pytest.mark.parametrize("cls, options", CELLS, ids=lambda c: getattr(c, "__name__", str(c)))
def test_layer_exports_as_onnx_recurrent_nodes(cls, options, direction, num_layers, rng):
    layer = cls(3, 4, num_layers=num_layers, direction=direction, seed=1, **options)
    model = check_layer(layer, rng)
    op = {sn.nn.RNN: "RNN", sn.nn.LSTM: "LSTM", sn.nn.GRU: "GRU"}[cls]
    assert op in node_types(model) and "Scan" not in node_types(model)
    assert sum(node.op_type == op for node in model.graph.node) == num_layers
    assert [i.name for i in model.graph.input] == ["X", "lengths"]


@pytest.mark.parametrize("cls, options", CELLS, ids=lambda c: getattr(c, "__name__", str(c)))
def test_layer_as_scan_matches_and_takes_initial_states(cls, options, rng):
    layer = cls(3, 4, num_layers=2, direction="bidirectional_concat", seed=2, **options)
    model = check_layer(layer, rng, as_scan=True, initial_states=True)
    assert "Scan" in node_types(model) and not node_types(model) & {"RNN", "GRU", "LSTM"}
    check_layer(layer, rng, initial_states=True)


@pytest.mark.parametrize("layer", [
    sn.nn.GRU(3, 4, direction="bidirectional_sum", seed=3),
    sn.nn.LSTM(3, 4, num_layers=2, direction="bidirectional_concat", combine="final", seed=3),
    sn.nn.LSTM(3, 5, proj_size=2, direction="reverse", seed=3),
    sn.nn.RNN(3, 4, num_layers=2, direction="bidirectional_sum", combine="final", seed=3),
], ids=["bidirectional_sum", "combine_final", "proj_size", "rnn_sum_final"])
def test_layers_onnx_has_no_operator_for_export_as_scan(layer, rng):
    with pytest.raises(sn.UnsupportedError):
        layer.to_onnx()
    model = check_layer(layer, rng)
    assert "Scan" in node_types(model) and not node_types(model) & {"RNN", "GRU", "LSTM"}


def test_a_layer_onnx_has_no_operator_for_exports_as_scan(rng):
    layer = sn.nn.MGU(3, 4, num_layers=2, direction="bidirectional_concat", seed=5)
    model = check_layer(layer, rng, initial_states=True)
    assert "Scan" in node_types(model) and not node_types(model) & {"RNN", "GRU", "LSTM"}


def test_augru_exports_as_scan_with_attention_input(rng):
    layer = sn.nn.AUGRU(3, 4, num_layers=2, direction="bidirectional_concat", seed=4)
    X = lod(rng, [LENGTHS], 3)
    A = sn.LoDTensor.from_lengths(rng.uniform(size=(sum(LENGTHS), 1)).astype(np.float32), [LENGTHS])
    Y, h_n = layer(X, A, backend="interpreter")
    model = export(layer)
    assert [i.name for i in model.graph.input] == ["X", "lengths", "attention"]
    values, (lengths,) = to_nested_padded(X)
    actual = run_onnx(model, {"X": values, "lengths": lengths,
                              "attention": to_nested_padded(A)[0][..., 0]})
    assert_close(actual["Y"], padded(Y), what="Y")
    assert_close(actual["h_n"], h_n, what="h_n")


def test_float64_layer_as_scan_and_as_onnx_gru_node(rng):
    layer = sn.nn.GRU(3, 4, num_layers=2, direction="bidirectional_concat", dtype=np.float64,
                      linear_before_reset=True, seed=5)
    check_layer(layer, rng, as_scan=True)
    # a GRU node in float64 is valid ONNX; onnxruntime's CPU GRU runs float32 only
    model = export(layer)
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.DOUBLE
    assert "GRU" in node_types(model)


def test_layer_with_clip_and_parametric_activations(rng):
    layer = sn.nn.LSTM(3, 4, direction="bidirectional_concat", seed=6, clip=1.5,
                       activations=["HardSigmoid", "LeakyRelu", "ScaledTanh"],
                       activation_alpha=[0.3, 0.05, 1.2], activation_beta=[0.4, 0.9])
    check_layer(layer, rng)
    check_layer(layer, rng, as_scan=True)


# ----------------------------------------------------------------------------
# custom step-nets


def gated_reverse_net(rng, dtype, lengths=LENGTHS):
    """reverse; two memories (one with per-sequence initial values); a static
    input; outputs all-steps and last-step, one a memory's previous value."""
    X = lod(rng, [lengths], 3, dtype)
    context = rng.standard_normal((len(lengths), 2)).astype(dtype)
    h0 = rng.standard_normal((len(lengths), 4)).astype(dtype)
    W = weight(rng, 3, 4, dtype=dtype, name="W")
    U = weight(rng, 4, 4, dtype=dtype, name="U")
    C = weight(rng, 2, 4, dtype=dtype, name="C")
    rnn = sn.create_rnn_op(reverse=True, name="gated")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        ctx = rnn.add_static_input(context, name="context")
        h = rnn.add_memory(init=h0, name="h")
        total = rnn.add_memory(shape=[4], name="total")
        gate = sn.ops.sigmoid(x @ W + ctx @ C)
        h.update(gate * sn.ops.tanh(h.pre_state() @ U + x @ W) + (1 - gate) * h.pre_state())
        total.update(total.pre_state() + sn.ops.relu(h) * 0.5)
        rnn.add_outputs(h, total, h.pre_state(), gate)
    return rnn


def every_op_net(rng, dtype=np.float32, lengths=LENGTHS):
    """forward; every primitive of the registry inside one step."""
    X = lod(rng, [lengths], 4, dtype)
    W = weight(rng, 4, 4, dtype=dtype, name="W")
    M = weight(rng, 2, 3, dtype=dtype, name="M")
    scale = sn.Parameter(np.linspace(0.5, 1.5, 4).astype(dtype), name="scale")
    ops = sn.ops
    rnn = sn.create_rnn_op(name="every_op")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(init=0.25, shape=[4], name="h")
        a = ops.maximum(x @ W, h.pre_state()) - ops.minimum(x, 0.5)
        b = ops.neg(ops.abs(a)) / 2.0 + ops.exp(ops.clip(x, None, 1.0))
        c = ops.log(ops.softplus(a) + 1.0) * ops.sigmoid(scale)
        if np.dtype(dtype) == np.float32:  # onnxruntime has no float64 Erf: test_erf_exports
            c = c + ops.erf(a) * 0.25
        d = ops.where(ops.greater(a, 0.1), c, b) + ops.where(ops.less_equal(x, -0.2), x, 0.0)
        e = ops.where(ops.equal(ops.relu(x), 0.0), d, ops.clip(d, -1.0, 1.0))
        f = ops.where(ops.greater_equal(e, 0.0), e, e * 0.1) + ops.where(ops.less(b, 0.0), b, 0.3)
        total = ops.sum(f, axis=-1, keepdims=True)  # [B, 1]
        grid = ops.broadcast_axis(ops.slice(f, 1, 3), 1, 3)  # [B, 3, 2]
        turned = ops.transpose(grid)  # [B, 2, 3]
        mixed = ops.sum(turned @ ops.transpose(M), axis=1) + ops.sum(grid, axis=1)  # [B, 2]
        wide = ops.concat([ops.pad(mixed, 1, 1), ops.pad(mixed, 0, 2)], axis=-1)  # [B, 8]
        h.update(ops.tanh(ops.slice(wide, 0, 4) + ops.slice(wide, 4, 8) + total))
        rnn.add_outputs(h, wide, h.pre_state())
    return rnn


def run_step_net(rnn, flags, feeds=None, output_names=None, run=run_onnx):
    """stepnet's outputs and onnxruntime's (or ``run``'s), in the same order."""
    expected = rnn(output_all_steps=flags, backend="interpreter")
    expected = expected if isinstance(expected, tuple) else (expected,)
    model = export(rnn, output_all_steps=flags, output_names=output_names)
    if feeds is None:
        feeds = {}
        for name, binding in rnn.bindings.items():
            if binding.kind == "sequence":
                values, lengths = to_nested_padded(binding.value)
                feeds[name] = values
                feeds["lengths"] = lengths[0]
                for level, per_level in enumerate(lengths[1:], 1):
                    feeds[f"{name}_lengths_{level}"] = per_level
            elif binding.kind == "static" or binding.per_sequence:
                feeds[name] = binding.value
    actual = run(model, feeds)
    actual = [actual[o.name] for o in model.graph.output]
    return actual, [padded(e, a.shape) for a, e in zip(actual, expected)], model


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reverse_net_with_memories_static_input_and_both_output_forms(dtype, rng):
    rnn = gated_reverse_net(rng, dtype)
    flags = (True, False, True, False)
    actual, expected, model = run_step_net(rnn, flags)
    assert [i.name for i in model.graph.input] == ["x", "lengths", "context", "h"]
    assert [o.name for o in model.graph.output] == ["h_all", "total_last", "h_prev_all",
                                                    "output3_last"]
    for a, e in zip(actual, expected):
        assert_close(a, e)
    actual, expected, _ = run_step_net(rnn, (False, True, False, True))
    for a, e in zip(actual, expected):
        assert_close(a, e)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_op_exports(dtype, rng):
    rnn = every_op_net(rng, dtype)
    actual, expected, model = run_step_net(rnn, (True, True, False), output_names=["h", "wide",
                                                                                   "h_before"])
    assert [o.name for o in model.graph.output] == ["h", "wide", "h_before"]
    for a, e in zip(actual, expected):
        assert_close(a, e)


def test_boolean_values_and_outputs_export_to_what_onnxruntime_runs(rng):
    """A boolean ``where`` in the step and boolean outputs of every step and
    of the last (masked past a sequence's end): onnxruntime has no boolean
    ``Where``, so they export as ``And``/``Or``/``Not``, to stepnet's values; a
    constant mask (a NumPy boolean array) exports as a boolean initializer."""
    X = lod(rng, [LENGTHS], 3)
    W = weight(rng, 3, 4, name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h")
        hp = h.pre_state()
        c = sn.ops.where(sn.ops.greater(x @ W, 0.0), sn.ops.less(hp, 0.2), sn.ops.greater(hp, -0.2))
        mask = np.array([True, False, True, True])  # (a constant mask too)
        h.update(sn.ops.where(c, sn.ops.tanh(x @ W + hp), sn.ops.where(mask, hp * 0.5, hp)))
        rnn.add_outputs(h, c, sn.ops.greater(h, 0.1))
    for flags in ((True, True, False), (False, False, True)):
        actual, expected, model = run_step_net(rnn, flags)
        assert "Where" in all_node_types(model.graph)  # (the float one stays)
        assert [4] in [list(i.dims) for i in model.graph.initializer
                       if i.data_type == onnx.TensorProto.BOOL]
        for a, e in zip(actual, expected):
            assert a.dtype == e.dtype
            assert_close(a, e)


def test_every_registered_op_has_a_translation():
    """All but the quantized products (not exported yet:
    docs/quantization.md); the segment ops read a ragged value's rows
    (export_graph.SEGMENT_OPS)."""
    missing = [name for name, op in sn.ops.registry.all_ops().items()
               if op.onnx is None and name not in export_graph.SEGMENT_OPS]
    assert sorted(missing) == ["matmul_bf16", "matmul_int8"]


def _attention_decoder(rng, memory_lengths, lengths, dtype, reverse):
    """A decoder attending to a ragged memory at each step (additive scores,
    ``seq_softmax``, ``seq_sum``; ``seq_max`` and dot-product ``attention``
    beside them), giving its state, its attention weights and both others."""
    M, X = lod(rng, memory_lengths, 8, dtype), lod(rng, lengths, 4, dtype)
    Wq, v = weight(rng, 16, 8, dtype=dtype), weight(rng, 8, 1, dtype=dtype)
    W, U = weight(rng, 12, 16, dtype=dtype), weight(rng, 16, 16, dtype=dtype)
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x, mem = rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[16], name="h", dtype=dtype)
        q = h.pre_state() @ Wq
        w = sn.ops.seq_softmax(sn.ops.tanh(mem + q) @ v)
        context = sn.ops.seq_sum(w * mem)
        h.update(sn.ops.tanh(sn.ops.concat([x, context], axis=1) @ W + h.pre_state() @ U))
        rnn.add_outputs(h, w, sn.ops.seq_max(mem * q), sn.ops.attention(q, mem))
    return rnn, X, M


@pytest.mark.parametrize("memory_lengths,lengths,dtype,reverse", [
    ([3, 6, 0, 2], [2, 3, 4, 0], np.float32, False),
    ([3, 6, 0, 2], [2, 3, 4, 0], np.float64, True),
    ([0, 0], [2, 1], np.float32, False)], ids=["float32", "float64-reverse", "no-memory"])
def test_attention_over_a_ragged_memory_exports(memory_lengths, lengths, dtype, reverse, rng):
    """docs/attention.md's decoder: the memory a padded input with its
    lengths, the segment ops over its rows; onnxruntime's outputs (every
    step's state and attention weights, ``[B, T, M, 1]``, each sequence's
    last seq_max, every step's dot-product attention) are stepnet's, a
    sequence with no memory rows and a batch with none included."""
    rnn, X, M = _attention_decoder(rng, memory_lengths, lengths, dtype, reverse)
    flags = (True, True, False, True)
    model = export(rnn, output_all_steps=flags)
    assert [i.name for i in model.graph.input] == ["X", "lengths", "M", "M_lengths_0"]
    (x, (n,)), (m, (k,)) = to_nested_padded(X), to_nested_padded(M)
    actual = run_onnx(model, {"X": x, "lengths": n, "M": m, "M_lengths_0": k})
    expected = rnn(output_all_steps=flags, backend="interpreter")
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for out, e in zip(model.graph.output, expected):  # (-inf where no memory row: equal)
        a = actual[out.name]
        np.testing.assert_allclose(a, padded(e, a.shape), rtol=tol, atol=tol, err_msg=out.name)
    assert actual["output1_all"].shape[2] == max(max(memory_lengths), 1)  # (M, at least one)


def test_a_prior_over_the_memory_given_at_each_step_exports(rng):
    """A step input of two levels combined row by row with the memory: at a
    step it has the active sequences' rows alone, the memory every
    sequence's; the memory's are read at the step's. onnxruntime's outputs
    (the state, the weights ``[B, T, M, 1]``) are stepnet's."""
    rnn, _ = attention_prior(rng, [3, 6, 0, 2], [2, 3, 1, 0], dtype=np.float32)
    X, P, M = (rnn.bindings[k].value for k in ("X", "prior", "M"))
    model = export(rnn)
    (x, (n,)), (p, (_, rows)), (m, (mn,)) = (to_nested_padded(T) for T in (X, P, M))
    actual = run_onnx(model, {"X": x, "lengths": n, "prior": p, "prior_lengths_1": rows, "M": m,
                              "M_lengths_0": mn})
    for out, e in zip(model.graph.output, rnn(backend="interpreter")):
        assert_close(actual[out.name], padded(e, actual[out.name].shape), what=out.name)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_nested_net_attending_to_its_documents_memory_exports(reverse, rng):
    """Each word attending to its document's memory (a nested net reading
    its enclosing net's ragged static inputs, the weights of the outer step
    over the memory given out): onnxruntime's outputs are stepnet's."""
    X = lod(rng, [[2, 1, 0, 2], [1, 3, 0, 2, 1]], 4)
    M, K = lod(rng, [3, 0, 1, 2], 4), lod(rng, [3, 0, 1, 2], 4)
    rnn, _ = document_attention(rng, X, M, K, reverse)
    model = export(rnn)
    (x, (n, words)), (m, (mn,)), (k, (kn,)) = (to_nested_padded(T) for T in (X, M, K))
    actual = run_onnx(model, {"X": x, "lengths": n, "X_lengths_1": words, "M": m,
                              "M_lengths_0": mn, "K": k, "K_lengths_0": kn})
    for out, e in zip(model.graph.output, rnn(backend="interpreter")):
        assert_close(actual[out.name], padded(e, actual[out.name].shape), what=out.name)


@pytest.mark.parametrize("from_outer", [False, True])
def test_a_hierarchical_attention_network_exports(from_outer, rng):
    """The segment ops over a nested net's every step (a sentence's words
    attended to): onnxruntime's outputs are stepnet's, and so are those of
    the model imported back into stepnet's own session."""
    rnn, X = word_attention(rng, dtype=np.float64, from_outer=from_outer)
    model = export(rnn)
    x, (n, words) = to_nested_padded(X)
    feeds = {"X": x, "lengths": n, "X_lengths_1": words}
    actual = run_onnx(model, feeds)
    for out, e in zip(model.graph.output, rnn(backend="interpreter")):
        assert_close(actual[out.name], padded(e, actual[out.name].shape), what=out.name)
    back = run_stepnet_session(model, feeds)
    assert_close(list(back.values()), list(actual.values()), what="stepnet's session")


def run_stepnet_session(model, feeds):
    """stepnet's own InferenceSession's outputs by name: the exported model imported back."""
    names = [o.name for o in model.graph.output]
    return dict(zip(names, InferenceSession(model, backend="interpreter").run(names, feeds)))


def all_node_types(graph):
    """The op types of ``graph`` and of the graphs nested in its nodes (Scan bodies)."""
    types = set()
    for node in graph.node:
        types.add(node.op_type)
        for attr in node.attribute:
            if attr.HasField("g"):
                types |= all_node_types(attr.g)
    return types


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_erf_exports(dtype, rng):
    """erf exports as ONNX Erf and imports back as stepnet's erf; onnxruntime
    runs it in float32 only (it has no float64 Erf)."""
    X = lod(rng, [LENGTHS], 4, dtype)
    W = weight(rng, 4, 4, dtype=dtype, name="W")
    rnn = sn.create_rnn_op(name="erf_net")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h")
        h.update(sn.ops.erf(x @ W + 0.5 * h.pre_state()))
        rnn.add_outputs(h)
    runners = [run_stepnet_session] + ([run_onnx] if dtype == np.float32 else [])
    for run in runners:
        actual, expected, model = run_step_net(rnn, (True,), run=run)
        assert "Erf" in all_node_types(model.graph)
        assert_close(actual, expected)


def nested_net(rng, dtype, inner_reverse=False):
    """chapters -> paragraphs -> sentences (examples/nested_chapters.py): the
    inner net starts from the outer memory, its last state feeds the outer
    step and its every step is a ragged output."""
    lengths = [[2, 0, 3, 1], [3, 0, 1, 4, 2, 1]]  # an empty chapter, an empty paragraph
    X = lod(rng, lengths, 5, dtype)
    init = rng.standard_normal((4, 3)).astype(dtype)
    W, U = weight(rng, 5, 3, dtype=dtype), weight(rng, 3, 3, dtype=dtype)
    W0, U0 = weight(rng, 3, 3, dtype=dtype), weight(rng, 3, 3, dtype=dtype)
    top = sn.create_rnn_op(output_num=3, name="chapters")
    with top.stepnet():
        paragraph = top.add_input(X, name="X")
        chapter = top.add_memory(init=init, name="chapter")
        low = sn.create_rnn_op(reverse=inner_reverse, name="sentences")
        with low.stepnet():
            sentence = low.add_input(paragraph, name="sentence")
            h = low.add_memory(init=chapter.pre_state(), name="h")
            count = low.add_memory(init=0.0, shape=[1], name="count")
            h.update(sn.ops.tanh(sentence @ W + h.pre_state() @ U))
            count.update(count.pre_state() + 1.0)
            low.add_outputs(h, count)
        summary, count = low(output_all_steps=False)
        states, _ = low()
        chapter.update(sn.ops.tanh(summary @ W0 + chapter.pre_state() @ U0) + count * 0.01)
        top.add_outputs(chapter, states, summary)
    return top, low


@pytest.mark.parametrize("dtype, inner_reverse", [(np.float32, False), (np.float64, True)])
def test_nested_net_exports_as_scan_in_scan(dtype, inner_reverse, rng):
    rnn, _ = nested_net(rng, dtype, inner_reverse)
    for flags in [(True, True, True), (False, False, False)]:
        actual, expected, model = run_step_net(rnn, flags)
        for a, e in zip(actual, expected):
            assert_close(a, e)
    assert [i.name for i in model.graph.input] == ["X", "lengths", "X_lengths_1", "chapter"]
    outer = next(n for n in model.graph.node if n.op_type == "Scan")
    body = outer.attribute[0].g
    assert any(n.op_type == "Scan" for n in body.node)


def test_three_level_net_with_ragged_last_step_output(rng):
    lengths = [[2, 1], [1, 3, 0], [2, 0, 1, 3]]
    X = lod(rng, lengths, 2)
    W = weight(rng, 2, 2)
    top = sn.create_rnn_op(name="books")
    with top.stepnet():
        chapter = top.add_input(X, name="X")
        mid = sn.create_rnn_op(name="chapters")
        with mid.stepnet():
            paragraph = mid.add_input(chapter)
            low = sn.create_rnn_op(reverse=True, name="paragraphs")
            with low.stepnet():
                word = low.add_input(paragraph)
                h = low.add_memory(shape=[2], name="h")
                h.update(sn.ops.tanh(word @ W + h.pre_state()))
                low.add_outputs(h)
            mid.add_outputs(low(), low(output_all_steps=False))
        every, last = mid(output_all_steps=(True, False))
        top.add_outputs(every, last)
    actual, expected, model = run_step_net(top, (False, True))
    for a, e in zip(actual, expected):
        assert_close(a, e)
    assert [i.name for i in model.graph.input] == ["X", "lengths", "X_lengths_1", "X_lengths_2"]


# ----------------------------------------------------------------------------
# errors


def simple_net(rng):
    return tanh_cell(lod(rng, [[2, 1]], 3), weight(rng, 3, 3))


def test_export_refuses_what_it_does_not_know_before_writing(rng, tmp_path, monkeypatch):
    target = tmp_path / "model.onnx"
    with pytest.raises(sn.UnsupportedError, match="got dict"):
        export({}, target)
    rnn = simple_net(rng)
    with pytest.raises(sn.StepNetError, match="output_names has 2 names"):
        export(rnn, target, output_names=["a", "b"])
    with pytest.raises(sn.StepNetError, match="used twice"):
        export(rnn, target, output_names=["x"])
    with pytest.raises(sn.StepNetError, match="initial_states does not apply to a step-net"):
        export(rnn, target, initial_states=True)
    with pytest.raises(sn.StepNetError, match="output_names does not apply to a built-in layer"):
        export(sn.nn.GRU(2, 2), target, output_names=["y"])
    monkeypatch.setattr(sn.ops.registry.get("tanh"), "onnx", None)
    with pytest.raises(sn.UnsupportedError, match="step-net rnn: op 'tanh' has no ONNX export"):
        export(rnn, target)
    assert not target.exists()


def test_export_refuses_a_nested_step_net_alone_and_a_missing_folder(rng, tmp_path):
    top, inner = nested_net(rng, np.float32)
    with pytest.raises(sn.StepNetError, match="sentences is a nested step-net"):
        export(inner, tmp_path / "x.onnx")
    with pytest.raises(sn.Error, match="does not exist"):
        export(top, tmp_path / "missing" / "x.onnx")


def test_export_writes_a_file_onnx_loads(rng, tmp_path):
    rnn = simple_net(rng)
    target = tmp_path / "model.onnx"
    model = export(rnn, target)
    loaded = onnx.load(str(target))
    onnx.checker.check_model(loaded, full_check=True)
    assert loaded.opset_import[0].version == export_graph.OPSET == 17
    assert [i.name for i in loaded.graph.initializer][:1] == [model.graph.initializer[0].name]


def test_the_documented_snippet_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    import stepnet.onnx

    assert stepnet.onnx.export is export
    doc = Path(__file__).resolve().parents[1] / "docs" / "onnx-export.md"
    snippet = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, str(doc), "exec"), {})
    assert (tmp_path / "rnn.onnx").exists()


def test_lod_static_input_stepped_over_by_a_nested_net(rng):
    X = lod(rng, [[2, 1, 3]], 2)
    M = lod(rng, [[3, 0, 2]], 2)  # per sequence, a memory to read (one is empty)
    W = weight(rng, 2, 2)
    top = sn.create_rnn_op(name="reader")
    with top.stepnet():
        x = top.add_input(X, name="x")
        memory = top.add_static_input(M, name="memory")
        h = top.add_memory(shape=[2], name="h")
        inner = sn.create_rnn_op(name="attend")
        with inner.stepnet():
            m = inner.add_input(memory)
            a = inner.add_memory(init=h.pre_state(), name="a")
            a.update(sn.ops.tanh(m @ W + a.pre_state()))
            inner.add_outputs(a)
        h.update(sn.ops.tanh(x @ W + inner(output_all_steps=False)))
        top.add_outputs(h)
    model = export(top)
    assert [i.name for i in model.graph.input] == ["x", "lengths", "memory", "memory_lengths_0"]
    x_padded, (lengths,) = to_nested_padded(X)
    m_padded, (m_lengths,) = to_nested_padded(M)
    actual = run_onnx(model, {"x": x_padded, "lengths": lengths, "memory": m_padded,
                              "memory_lengths_0": m_lengths})
    assert_close(actual["h_all"], padded(top(backend="interpreter")))


@pytest.mark.parametrize("direction", ["forward", "bidirectional_concat"])
def test_a_layer_exported_as_nodes_runs_with_no_steps(direction, tmp_path):
    """Every sequence empty (padded T = 0): the nodes' Y reshaped to its width
    given, not inferred (from nothing)."""
    layer = sn.nn.GRU(3, 4, num_layers=2, direction=direction, seed=0)
    path = tmp_path / "gru.onnx"
    export(layer, str(path))
    X, lengths = np.zeros((2, 0, 3), np.float32), np.zeros(2, np.int64)
    want = layer((X, lengths), backend="interpreter")
    got = InferenceSession(str(path), backend="interpreter").run(None, {"X": X, "lengths": lengths})
    assert got[0].shape == want[0].shape
    assert_close(got[1], want[1])


@pytest.mark.parametrize("step", ["pad", "broadcast_axis"])
def test_a_scan_whose_step_shapes_are_not_declared_runs_with_no_steps(step, rng, tmp_path):
    """Every sequence empty: the Scan's all-steps output is ``[B, 1, H]``
    of zeros (one step at least: onnxruntime's Scan fails on none) though
    its body (Pad, Expand) declares no shape for it; onnxruntime runs it."""
    W = weight(rng, 3, 4)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(lod(rng, [4, 0, 2], 3), name="x")
        h = rnn.add_memory(shape=[4], name="h")
        v = (sn.ops.pad(x, 1, 1)[:, 1:4] @ W if step == "pad"
             else sn.ops.sum(sn.ops.broadcast_axis(x @ W, 1, 2), axis=1))
        h.update(sn.ops.tanh(v + h.pre_state()))
        rnn.add_outputs(h)
    path = tmp_path / "step.onnx"
    export(rnn, str(path))
    feeds = {"x": np.zeros((2, 0, 3), np.float32), "lengths": np.zeros(2, np.int64)}
    got = InferenceSession(str(path), backend="interpreter").run(None, feeds)
    assert got[0].shape == (2, 1, 4) and not got[0].any()
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(theirs.run(None, feeds)[0], got[0])


def test_the_graph_inputs_keep_their_names_before_the_parameters(rng):
    """A Parameter called like an input (``x``, the documented ``lengths``)
    gets the suffix, not the input; an output may not take an input's name."""
    X = lod(rng, [2, 3], 3)
    for name in ("x", "lengths"):
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            x = rnn.add_input(X, name="x")
            h = rnn.add_memory(shape=[4], name="h")
            h.update(sn.ops.tanh(x @ weight(rng, 3, 4, name=name) + h.pre_state()))
            rnn.add_outputs(h)
        model = export(rnn)
        inputs = [i.name for i in model.graph.input]
        assert inputs == ["x", "lengths"]
        (renamed,) = [i.name for i in model.graph.initializer if i.name.startswith(name)]
        assert renamed.startswith(f"{name}_") and renamed not in inputs
        with pytest.raises(sn.StepNetError, match=r"output name\(s\) \['lengths'\] are used twice"):
            export(rnn, output_names=["lengths"])


def test_output_names_that_are_not_strings_are_named(rng):
    rnn = tanh_cell(lod(rng, [2, 3], 3), weight(rng, 3, 4))
    with pytest.raises(sn.StepNetError, match=r"output_names must be non-empty strings, got \[3\]"):
        export(rnn, output_names=[3])
