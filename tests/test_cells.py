"""A built-in layer as one step inside another step-net's block: ``layer.step``
and ``sn.nn.RNNCell``/``GRUCell``/``LSTMCell``."""

import ast
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close

import stepnet as sn


def _lod(rng, lengths, width):
    return sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), width)).astype(np.float32),
                                     [lengths])


def _stepping(layer, X, layer_index=0, direction=0):
    """A step-net whose step is ``layer.step`` on a memory handle (LSTM: two)."""
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[layer.hidden_size], name="h")
        if isinstance(layer, sn.nn.LSTM):
            c = rnn.add_memory(shape=[layer.hidden_size], name="c")
            layer.step(x, (h, c), layer_index, direction)
        else:
            layer.step(x, h, layer_index, direction)
        rnn.add_outputs(h)
    return rnn


@pytest.mark.parametrize("kind", [sn.nn.RNN, sn.nn.GRU, sn.nn.LSTM, sn.nn.MGU])
def test_a_layer_step_inside_a_block_is_the_layer(rng, kind):
    X = _lod(rng, [3, 1, 4], 3)
    layer = kind(3, 5, seed=1)
    rnn = _stepping(layer, X)
    out = assert_backends_agree(rnn)
    assert_close(out, layer(X, backend="interpreter")[0])


def test_gradients_through_a_cell_are_the_layers(rng):
    X = _lod(rng, [3, 2], 3)
    layer = sn.nn.GRU(3, 4, seed=2, linear_before_reset=True)
    rnn = _stepping(layer, X)
    G = rng.standard_normal((5, 4)).astype(np.float32)
    through_step = sn.gradients(rnn, wrt=layer.parameters(), grad_outputs=[G])
    _, pullback = sn.vjp(layer, X)
    through_layer = pullback([G, None], wrt=layer.parameters())
    for a, b in zip(through_step, through_layer):
        assert_close(a, b, what="gradient")


def test_a_decoder_cell_reads_a_computed_input_and_a_value_state(rng):
    """``h_new = cell(concat(x, extra), h.pre_state())``: a value state is not
    updated; the caller updates the memory."""
    X = _lod(rng, [2, 3], 3)
    cell = sn.nn.LSTMCell(5, 4, seed=3)
    W = sn.Parameter(rng.standard_normal((3, 2)).astype(np.float32), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[4], name="h")
        c = rnn.add_memory(shape=[4], name="c")
        h_new, c_new = cell(sn.ops.concat([x, sn.ops.tanh(x @ W)], axis=1),
                            (h.pre_state(), c.pre_state()))
        h.update(h_new)
        c.update(c_new)
        rnn.add_outputs(h, c)
    assert_backends_agree(rnn)
    # the same step by hand, eagerly on arrays
    h_np, c_np = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
    for row in X.sequence(0):
        inp = np.concatenate([row, np.tanh(row @ W.value)])[None]
        h_np, c_np = cell(inp, (h_np, c_np))
    assert_close(rnn(backend="interpreter")[0].sequence(0)[-1], h_np[0])


@pytest.mark.parametrize("name", ["RNNCell", "GRUCell", "LSTMCell"])
def test_cells_convert_to_and_from_torch(rng, name):
    torch = pytest.importorskip("torch")
    module = getattr(torch.nn, name)(3, 4)
    cell = getattr(sn.nn, name).from_torch(module)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    h = rng.standard_normal((2, 4)).astype(np.float32)
    state = (h, h) if name == "LSTMCell" else h
    tstate = tuple(map(torch.tensor, state)) if name == "LSTMCell" else torch.tensor(h)
    ours = cell(x, state)
    for back in (module, cell.to_torch()):
        theirs = back(torch.tensor(x), tstate)
        for a, b in zip(ours if name == "LSTMCell" else [ours],
                        theirs if name == "LSTMCell" else [theirs]):
            assert_close(a, b.detach().numpy())


@pytest.mark.parametrize("name", ["MGU", "MGUCell", "AUGRU", "AUGRUCell"])
def test_cells_pytorch_or_onnx_lacks_are_refused_there(name):
    cls = getattr(sn.nn, name)
    title = name.removesuffix("Cell")
    with pytest.raises(sn.UnsupportedError, match=rf"{name}.from_torch: PyTorch has no {title}"):
        cls.from_torch(None)
    with pytest.raises(sn.UnsupportedError, match=rf"{name}.to_torch: PyTorch has no {title}"):
        cls(3, 4).to_torch()
    with pytest.raises(sn.UnsupportedError, match=rf"{name}: ONNX has no {title} operator"):
        cls(3, 4).to_onnx()


def test_bad_steps_are_refused(rng):
    lstm, gru = sn.nn.LSTM(3, 4), sn.nn.GRU(3, 4, num_layers=2)
    x, h = np.zeros((1, 3), np.float32), np.zeros((1, 4), np.float32)
    with pytest.raises(sn.StepNetError, match=r"pair \(h, c\)"):
        lstm.step(x, h)
    with pytest.raises(sn.StepNetError, match="no layer 2"):
        gru.step(x, h, layer=2)
    with pytest.raises(sn.StepNetError, match="one layer and one direction"):
        sn.nn.GRUCell(3, 4, num_layers=2)
    with pytest.raises(sn.StepNetError, match="expects a GRUCell"):
        torch = pytest.importorskip("torch")
        sn.nn.GRUCell.from_torch(torch.nn.GRU(3, 4))


def _augru_stepping(cell, X, A):
    """A step-net stepping ``cell(x, h, a)`` with the attention score a step input."""
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        a = rnn.add_input(A, name="a")
        h = rnn.add_memory(shape=[cell.hidden_size], name="h")
        cell(x, h, a)
        rnn.add_outputs(h)
    return rnn


def test_an_augru_cell_is_the_augru_layer(rng):
    """``AUGRUCell(x, h, a)`` over the tokens with their scores: the AUGRU
    layer called on them (every backend), its gradients (weights, scores)
    the layer's, and one eager step on arrays the same."""
    X = _lod(rng, [3, 1, 4], 3)
    A = sn.LoDTensor.from_lengths(rng.uniform(size=(8, 1)).astype(np.float32), [[3, 1, 4]])
    cell = sn.nn.AUGRUCell(3, 5, seed=4, linear_before_reset=True)
    layer = sn.nn.AUGRU(3, 5, seed=5, linear_before_reset=True)
    for p, q in zip(layer.parameters(), cell.parameters()):
        p.value = q.value.copy()
    rnn = _augru_stepping(cell, X, A)
    out = assert_backends_agree(rnn)
    Y, _ = layer(X, A, backend="interpreter")
    assert_close(out, Y)
    G = rng.standard_normal((8, 5)).astype(np.float32)
    through_cell = sn.gradients(rnn, wrt=cell.parameters() + ["a"], grad_outputs=[G])
    _, pullback = sn.vjp(layer, X, A)
    through_layer = pullback([G, None], wrt=layer.parameters() + ["attention"])
    for a, b in zip(through_cell, through_layer):
        assert_close(np.asarray(getattr(a, "data", a)), np.asarray(getattr(b, "data", b)),
                     what="gradient")
    h = np.zeros((1, 5), np.float32)
    for row, score in zip(X.sequence(2), A.sequence(2)):
        h = cell(row[None], h, score[None])
    assert_close(Y.sequence(2)[-1], h[0])


def test_an_augru_cell_refuses_what_it_cannot_take(rng):
    cell = sn.nn.AUGRUCell(3, 4)
    x, h = np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(sn.ShapeError, match=r"one score per sequence, \[B, 1\]; got shape \[2\]"):
        cell(x, h, np.zeros(2, np.float32))
    with pytest.raises(sn.ShapeError, match=r"got shape \[2, 4\]"):
        cell(x, h, h)
    with pytest.raises(sn.StepNetError, match="attention is for AUGRU only"):
        sn.nn.GRUCell(3, 4).step(x, h, attention=np.zeros((2, 1), np.float32))
    with pytest.raises(sn.UnsupportedError, match="PyTorch has no AUGRU"):
        cell.to_torch()
    with pytest.raises(sn.UnsupportedError, match="PyTorch has no AUGRU"):
        sn.nn.AUGRUCell.from_torch(None)


def test_no_front_end_names_a_cell_kind():
    """The cells' names are written in their records (``cells.CELLS``) and
    the classes' ``cell = ...`` only: every front end reads the record."""
    root = Path(sn.__file__).parent
    names = set(sn.nn.cells.CELLS) - {"rnn"}  # ("rnn" is also the op of a step-net)
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "nn" / "cells.py":
            continue
        tree = ast.parse(path.read_text())
        declared = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and [getattr(t, "id", None) for t in node.targets] == ["cell"]}
        found += [f"{path.relative_to(root)}:{node.lineno} {node.value!r}"
                  for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and node.value in names and id(node) not in declared]
    assert not found, found
