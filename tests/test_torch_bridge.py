"""stepnet.torch: stepnet layers and step-nets as torch modules, checked
against torch's own modules, torch autograd and torch.autograd.gradcheck."""

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stepnet as sn  # noqa: E402
import stepnet.torch as st  # noqa: E402
from nets import attention_prior, memory_decoder, nested_encoder  # noqa: E402
from pairwise import pairwise_params  # noqa: E402
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
I, H, B, T = 3, 4, 3, 5


def close(a, b, dtype, what=""):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, what
    scale = max(1.0, float(b.abs().max()) if b.numel() else 1.0)
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err}"


def torch_layout_grads(module, torch_module):
    """The module's parameter gradients in torch's layout: a copy of the
    layer holding the gradients as weights, converted by ``to_torch``."""
    layer = copy.deepcopy(module.wrapped)
    for p, t in zip(layer.parameters(), module.parameters()):
        assert p.value.shape == tuple(t.shape)
        p.value[...] = t.grad.numpy()
    return dict(layer.to_torch().named_parameters())


def run_both(g, m, x, hx, lstm, packed_lengths=None):
    """Forward and backward of torch's ``g`` and stepnet's ``m`` on the same
    input and upstream gradients: (outputs, input grads) of each."""
    results = []
    gen = torch.Generator().manual_seed(1)
    for module in (g, m):
        xi = x.detach().clone().requires_grad_(True)
        hi = [h.detach().clone().requires_grad_(True) for h in hx]
        inp = xi if packed_lengths is None else pack_padded_sequence(
            xi, packed_lengths, batch_first=True, enforce_sorted=False)
        state = None if not hi else (tuple(hi) if lstm else hi[0])
        out, fin = module(inp, state)
        fins = list(fin) if lstm else [fin]
        y = out.data if packed_lengths is not None else out
        gen.manual_seed(1)
        ups = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in [y] + fins]
        torch.autograd.backward([y] + fins, ups)
        results.append(([y] + fins, [xi.grad] + [h.grad for h in hi]))
    return results


# ----------------------------------------------------------------------------
# torch stays optional


def test_stepnet_never_imports_torch_and_stepnet_torch_names_the_install():
    code = (
        "import sys\n"
        "import stepnet\n"
        "assert 'torch' not in sys.modules, 'import stepnet imported torch'\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "try:\n"
        "    import stepnet.torch\n"
        "except stepnet.UnsupportedError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "refused: stepnet.torch needs torch: pip install torch==2.13.0" in proc.stdout


def test_the_module_file_imports_the_top_level_torch():
    assert st.torch is torch and st.torch.__file__ != st.__file__


# ----------------------------------------------------------------------------
# layers against torch.nn.GRU / LSTM


# every pair of a cell, a direction, a layer count and a dtype (six cases);
# the whole product under -m slow
@pytest.mark.parametrize("cell,bidirectional,num_layers,dtype", pairwise_params(
    [["GRU", "LSTM"], [False, True], [1, 2], [torch.float32, torch.float64]],
    ids=[str, lambda bi: "bi" if bi else "uni", str, lambda d: {torch.float32: "f32"}.get(d, "f64")]))
def test_layer_matches_torch_outputs_and_gradients(cell, bidirectional, num_layers, dtype):
    torch.manual_seed(0)
    g = getattr(torch.nn, cell)(I, H, num_layers, batch_first=True,
                                bidirectional=bidirectional).to(dtype)
    m = st.Module(getattr(sn.nn, cell).from_torch(g))
    lstm = cell == "LSTM"
    D = 2 if bidirectional else 1
    x = torch.randn(B, T, I, dtype=dtype)
    hx = [torch.randn(num_layers * D, B, H, dtype=dtype) for _ in range(2 if lstm else 1)]
    (ty, tg), (sy, sg) = run_both(g, m, x, hx, lstm)
    for a, b, what in zip(sy + sg, ty + tg, ["output", "h_n", "c_n"][:len(ty)] +
                          ["d input", "d h_0", "d c_0"][:len(tg)]):
        close(a, b, dtype, what)
    grads = torch_layout_grads(m, g)
    for name, p in g.named_parameters():
        close(grads[name], p.grad, dtype, f"d {name}")


@pytest.fixture(scope="module")
def gru_pair():
    torch.manual_seed(2)
    g = torch.nn.GRU(I, H, 2, bidirectional=True, batch_first=True)
    return g, st.Module(sn.nn.GRU.from_torch(g))


@pytest.fixture(scope="module")
def lstm_pair():
    torch.manual_seed(3)
    g = torch.nn.LSTM(I, H, 2, bidirectional=True, batch_first=True)
    return g, st.Module(sn.nn.LSTM.from_torch(g))


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_packed_sequence_in_packed_sequence_out(kind, gru_pair, lstm_pair):
    g, m = gru_pair if kind == "gru" else lstm_pair
    lstm = kind == "lstm"
    x = torch.randn(4, 6, I)
    hx = [torch.randn(4, 4, H) for _ in range(2 if lstm else 1)]
    lengths = [2, 6, 1, 4]  # unsorted: torch permutes hx and h_n, so must we
    (ty, tg), (sy, sg) = run_both(g, m, x, hx, lstm, packed_lengths=lengths)
    for a, b in zip(sy + sg, ty + tg):
        close(a, b, torch.float32)
    grads = torch_layout_grads(m, g)
    for name, p in g.named_parameters():
        close(grads[name], p.grad, torch.float32, name)
    out, _ = m(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, pack_padded_sequence(
        x, lengths, batch_first=True, enforce_sorted=False).batch_sizes)


def test_time_major_and_unbatched_inputs(gru_pair):
    g, _ = gru_pair
    tm = torch.nn.GRU(I, H, 2, bidirectional=True)  # batch_first=False
    tm.load_state_dict(g.state_dict())
    m = st.Module(sn.nn.GRU.from_torch(tm), batch_first=False)
    x = torch.randn(T, B, I)
    hx = [torch.randn(4, B, H)]
    (ty, tg), (sy, sg) = run_both(tm, m, x, hx, False)
    for a, b in zip(sy + sg, ty + tg):
        close(a, b, torch.float32)
    assert sy[0].is_contiguous()
    one = torch.randn(T, I)  # one sequence, no batch dimension
    y1, h1 = tm(one, hx[0][:, 0])
    y2, h2 = m(one, hx[0][:, 0])
    close(y2, y1, torch.float32)
    close(h2, h1, torch.float32)


# gradcheck tests the bridge's autograd wiring, which is the same on every
# backend; they run on the interpreter (no kernels to compile), and the Numba
# backend's gradients are checked against torch's above and against the
# interpreter's in tests/test_gradients.py.


def test_gradcheck_float64_layers():
    torch.manual_seed(4)
    g = torch.nn.GRU(2, 2, bidirectional=True, batch_first=True).double()
    m = st.Module(sn.nn.GRU.from_torch(g), backend="interpreter")
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 2, 2, dtype=torch.float64, requires_grad=True)
    params = list(m.parameters())
    assert torch.autograd.gradcheck(lambda x, h0, *ps: m(x, h0), (x, h0, *params))

    lstm = st.Module(sn.nn.LSTM(2, 2, seed=1, dtype=np.float64), backend="interpreter")
    lengths = [3, 1]
    h = torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True)

    def packed_run(x, h, c, *ps):
        out, (h_n, c_n) = lstm(pack_padded_sequence(x, lengths, batch_first=True,
                                                    enforce_sorted=False), (h, c))
        return out.data, h_n, c_n

    assert torch.autograd.gradcheck(packed_run, (x, h, c, *lstm.parameters()))


def test_augru_attention_gradcheck():
    layer = sn.nn.AUGRU(2, 3, seed=0, dtype=np.float64)
    m = st.Module(layer, backend="interpreter")
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    a = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    y, h_n = m(x, a)
    Y, h_ref = layer((x.detach().numpy(), [3, 3]), (a.detach().numpy(), [3, 3]))
    np.testing.assert_allclose(y.detach().numpy(), Y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(h_n.detach().numpy(), h_ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, a, *ps: m(x, a), (x, a, *m.parameters()))


def test_a_layer_pytorch_lacks_runs_and_trains_in_a_module():
    layer = sn.nn.MGU(2, 3, seed=0, dtype=np.float64)
    m = st.Module(layer, backend="interpreter")
    x = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True)
    y, h_n = m(x, h0)
    Y, h_ref = layer((x.detach().numpy(), [3, 3]), h0.detach().numpy())
    np.testing.assert_allclose(y.detach().numpy(), Y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(h_n.detach().numpy(), h_ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, h0, *ps: m(x, h0), (x, h0, *m.parameters()))


# ----------------------------------------------------------------------------
# parameters: shared memory, optimizers, state dicts, dtypes


def test_parameters_share_memory_and_torch_optim_updates_what_stepnet_computes_with():
    layer = sn.nn.GRU(I, H, seed=5)
    m = st.Module(layer)
    names = [n for n, _ in m.named_parameters()]
    assert names == [p.name for p in layer.parameters()]
    for name, t in m.named_parameters():
        assert np.shares_memory(m.stepnet_parameter(name).value, t.detach().numpy())
    x = torch.randn(B, T, I)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    before = [p.value.copy() for p in layer.parameters()]
    y, h = m(x)
    (y.square().sum() + h.sum()).backward()
    opt.step()
    assert all(not np.array_equal(b, p.value) for b, p in zip(before, layer.parameters()))
    Y, h_n = layer((x.numpy(), [T] * B))  # stepnet alone sees the updated weights
    y2, h2 = m(x)
    np.testing.assert_array_equal(y2.detach().numpy(), Y)
    np.testing.assert_array_equal(h2.detach().numpy(), h_n)


def test_state_dict_round_trip_and_deep_copy():
    x = torch.randn(B, T, I)
    m = st.Module(sn.nn.LSTM(I, H, seed=6))
    other = st.Module(sn.nn.LSTM(I, H, seed=7))
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    y1, (h1, c1) = m(x)
    y2, (h2, c2) = other(x)
    assert torch.equal(y1, y2) and torch.equal(h1, h2) and torch.equal(c1, c2)

    twin = copy.deepcopy(m)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    y3, _ = twin(x)
    y4, _ = m(x)
    assert torch.equal(y4, y1) and not torch.allclose(y3, y1)
    for name, t in twin.named_parameters():  # the copy computes with its own parameters
        assert np.shares_memory(twin.stepnet_parameter(name).value, t.detach().numpy())


def test_to_float64_rebuilds_the_layer_and_keeps_the_torch_parameters(gru_pair):
    g, _ = gru_pair
    m = st.Module(sn.nn.GRU.from_torch(g))
    params = list(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    assert m.double() is m
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]  # the optimizer's
    assert m.wrapped.dtype == np.float64 and all(p.dtype == torch.float64 for p in params)
    g64 = copy.deepcopy(g).double()
    x = torch.randn(B, T, I, dtype=torch.float64)
    (ty, tg), (sy, sg) = run_both(g64, m, x, [], False)
    for a, b in zip(sy, ty):
        close(a, b, torch.float64)
    grads = torch_layout_grads(m, g64)
    for name, p in g64.named_parameters():
        close(grads[name], p.grad, torch.float64, name)
    opt.step()
    for name, t in m.named_parameters():
        assert np.shares_memory(m.stepnet_parameter(name).value, t.detach().numpy())
    m.float()
    assert m.wrapped.dtype == np.float32
    with pytest.raises(sn.ShapeError, match="dtype torch.float64"):
        m(x)


def test_to_float64_keeps_a_layer_without_biases():
    """``.double()`` of a layer module made with ``bias=False`` builds it
    again without biases (it was rebuilt with them: refused half-converted)."""
    g = torch.nn.GRU(3, 4, bias=False, batch_first=True)
    m = st.Module(sn.nn.GRU.from_torch(g))
    m.double()
    assert m.wrapped.dtype == np.float64 and not m.wrapped.bias
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    close(m(x)[0], copy.deepcopy(g).double()(x)[0], torch.float64)


def test_unsupported_conversions_are_refused_before_anything_changes(gru_pair):
    _, m = gru_pair
    with pytest.raises(sn.UnsupportedError, match="float32 or float64, not torch.float16"):
        m.half()
    with pytest.raises(sn.UnsupportedError, match="runs on the CPU"):
        m.to("meta")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in m.parameters())


# ----------------------------------------------------------------------------
# no_grad keeps nothing; bad input is refused before anything runs


def test_no_grad_keeps_no_workspace(gru_pair):
    _, m = gru_pair
    x = torch.randn(B, T, I, requires_grad=True)
    with torch.no_grad():
        y, h = m(x)
    assert y.grad_fn is None and h.grad_fn is None
    assert m.wrapped._workspace is None
    y, h = m(x)
    assert y.grad_fn is not None
    assert m.wrapped._workspace is None  # the workspace lives in the autograd graph only


def test_an_input_changed_in_place_before_backward_is_refused(gru_pair):
    _, m = gru_pair
    x = torch.randn(B, T, I, requires_grad=True)
    xin = x * 1.0
    y, _ = m(xin)
    with torch.no_grad():
        xin.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
def test_a_module_without_biases_trains_as_torchs(kind):
    torch.manual_seed(4)
    g = getattr(torch.nn, kind)(3, 4, num_layers=2, bias=False, batch_first=True).double()
    m = st.Module(getattr(sn.nn, kind).from_torch(g))
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in g.parameters())
    assert m.layer.to_torch().bias is False
    cell = getattr(sn.nn, kind + "Cell").from_torch(getattr(torch.nn, kind + "Cell")(3, 4, bias=False))
    assert not cell.bias and cell.to_torch().bias is False
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    optimizers = [torch.optim.SGD(mod.parameters(), lr=0.5) for mod in (g, m)]
    for _ in range(3):
        for mod, opt in zip((g, m), optimizers):
            opt.zero_grad()
            y, _ = mod(x)
            y.pow(2).sum().backward()
            opt.step()
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], g(x)[0])


def test_a_gradient_of_a_gradient_is_refused_not_dropped(gru_pair):
    """A gradient penalty: the first gradient's incoming gradient needs none
    (``y.sum()``), so only the refusal keeps its second-order terms from
    being lost."""
    _, m = gru_pair
    x = torch.randn(B, T, I, requires_grad=True)
    y, _ = m(x)
    with pytest.raises(sn.UnsupportedError, match="create_graph=True"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    y, _ = m(x)
    gx, = torch.autograd.grad(y.sum(), x)  # (without create_graph: as before)
    assert gx.shape == x.shape and gx.grad_fn is None


def test_bad_layer_input_gets_a_clear_error(gru_pair):
    _, m = gru_pair
    with pytest.raises(sn.ShapeError, match="dtype torch.float64.*float32"):
        m(torch.randn(B, T, I, dtype=torch.float64))
    with pytest.raises(sn.ShapeError, match=r"input has shape \[3, 5, 7\], expected \[B, T, 3\]"):
        m(torch.randn(B, T, 7))
    with pytest.raises(sn.ShapeError, match=r"h_0 has shape \[2, 3, 4\], expected \[4, 3, 4\]"):
        m(torch.randn(B, T, I), torch.randn(2, B, H))
    with pytest.raises(sn.ShapeError, match="expects a torch.Tensor, got ndarray"):
        m(np.zeros((B, T, I), np.float32))
    with pytest.raises(sn.UnsupportedError, match="is on meta"):
        m(torch.empty(B, T, I, device="meta"))
    with pytest.raises(sn.StepNetError, match="expects a stepnet.nn layer or a step-net"):
        st.Module(torch.nn.GRU(2, 2))
    with pytest.raises(sn.BackendError, match="unknown backend 'bogus'"):  # when it is made
        st.Module(sn.nn.GRU(I, H, seed=0), backend="bogus")


@pytest.mark.parametrize("cell, layer", [("RNNCell", "RNN"), ("GRUCell", "GRU"),
                                         ("LSTMCell", "LSTM"), ("AUGRUCell", "AUGRU"),
                                         ("MGUCell", "MGU")])
def test_a_cell_is_refused_and_a_step_net_calling_it_runs(cell, layer):
    c = getattr(sn.nn, cell)(I, H, seed=0)
    for wrap, where in [(st.Module, "stepnet.torch.Module"), (st.LayerModule, "LayerModule")]:
        with pytest.raises(sn.StepNetError, match=rf"{where}: {cell} is a cell, one step of a "
                                                  rf"recurrence .* pass the layer "
                                                  rf"sn.nn.{layer}\(...\) instead, or a step-net"):
            wrap(c)
    if cell != "GRUCell":
        return
    # what the message offers: a step-net whose step calls the cell
    X = sn.LoDTensor.from_lengths(np.zeros((3, I), np.float32), [[1, 2]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        h = rnn.add_memory(shape=H, name="h")
        rnn.add_outputs(c(rnn.add_input(X, name="x"), h))
    m = st.Module(rnn, output_all_steps=False, backend="interpreter")
    x, h0, lengths = torch.randn(2, T, I), torch.randn(2, H), [4, 2]
    want = []
    for i, n in enumerate(lengths):  # the cell called directly, step by step
        h = h0[i:i + 1].numpy()
        for t in range(n):
            h = c(x[i, t:t + 1].numpy(), h)
        want.append(h[0])
    close(m(x=(x, lengths), h=h0), torch.from_numpy(np.stack(want)), torch.float32, "last h")


# ----------------------------------------------------------------------------
# step-nets


def custom_cell(dtype=np.float32, with_static=False):
    """A tanh cell with a gate, written in the DSL, two outputs (every step, last)."""
    rng = np.random.default_rng(8)
    W = sn.Parameter(rng.normal(0, 0.5, (I, H)).astype(dtype), name="W")
    U = sn.Parameter(rng.normal(0, 0.5, (H, H)).astype(dtype), name="U")
    Wz = sn.Parameter(rng.normal(0, 0.5, (I, H)).astype(dtype), name="Wz")
    b = sn.Parameter(rng.normal(0, 0.5, (H,)).astype(dtype), name="b")
    X = sn.LoDTensor.from_lengths(np.zeros((3, I), dtype), [[1, 2]])
    rnn = sn.create_rnn_op(name="cell")
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[H], name="h", dtype=dtype)
        hp = h.pre_state()
        z = sn.ops.sigmoid(x @ Wz)
        pre = x @ W + hp @ U + b
        if with_static:
            pre = pre + rnn.add_static_input(np.zeros((2, H), dtype), name="ctx")
        h.update((1 - z) * hp + z * sn.ops.tanh(pre))
        rnn.add_outputs(h, h)
    return rnn


def custom_cell_torch(m, x, lengths, h0, ctx=None):
    """The same cell in torch, one sequence at a time: padded outputs, last states."""
    Y = torch.zeros(x.shape[0], x.shape[1], H, dtype=x.dtype)
    rows, last = [], []
    for i, n in enumerate(lengths):
        h = h0[i]
        steps = []
        for t in range(n):
            z = torch.sigmoid(x[i, t] @ m.Wz)
            pre = x[i, t] @ m.W + h @ m.U + m.b + (0 if ctx is None else ctx[i])
            h = (1 - z) * h + z * torch.tanh(pre)
            steps.append(h)
        rows.append(torch.stack(steps) if steps else x.new_zeros(0, H))
        last.append(h)
    Y = torch.stack([torch.cat([r, x.new_zeros(x.shape[1] - len(r), H)]) for r in rows])
    return Y, torch.stack(last)


@pytest.fixture(scope="module")
def cell32():
    return st.Module(custom_cell(), output_all_steps=(True, False))


@pytest.fixture(scope="module")
def cell64():
    return st.Module(custom_cell(np.float64, with_static=True), output_all_steps=(True, False),
                     backend="interpreter")  # for gradcheck (see above)


def test_step_net_padded_with_lengths_matches_torch(cell32):
    m = cell32
    x = torch.randn(4, 6, I, requires_grad=True)
    h0 = torch.randn(4, H, requires_grad=True)
    lengths = [3, 6, 0, 2]  # an empty sequence: its last state is its initial one
    Y, last = m(x=(x, lengths), h=h0)
    Yr, lr = custom_cell_torch(m, x, lengths, h0)
    close(Y, Yr, torch.float32, "Y")
    close(last, lr, torch.float32, "last")
    gY, gl = torch.randn_like(Y), torch.randn_like(last)
    leaves = [x, h0] + list(m.parameters())
    ours = torch.autograd.grad((Y, last), leaves, (gY, gl))
    theirs = torch.autograd.grad((Yr, lr), leaves, (gY, gl))
    for a, b, what in zip(ours, theirs, ["x", "h0", "W", "U", "Wz", "b"]):
        close(a, b, torch.float32, what)


def test_step_net_packed_and_time_major(cell32):
    m = cell32
    x = torch.randn(3, 5, I, requires_grad=True)
    h0 = torch.randn(3, H)
    lengths = [2, 5, 3]
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    Y, last = m(x=packed, h=h0)
    assert isinstance(Y, PackedSequence) and torch.equal(Y.batch_sizes, packed.batch_sizes)
    Yr, lr = custom_cell_torch(m, x, lengths, h0)
    close(Y.data, pack_padded_sequence(Yr, lengths, batch_first=True,
                                       enforce_sorted=False).data, torch.float32)
    close(last, lr, torch.float32)
    (g,) = torch.autograd.grad(Y.data.sum() + last.sum(), x)
    (gr,) = torch.autograd.grad(pack_padded_sequence(Yr, lengths, batch_first=True,
                                                     enforce_sorted=False).data.sum() + lr.sum(), x)
    close(g, gr, torch.float32)
    tm = st.Module(m.wrapped, output_all_steps=(True, False), batch_first=False)
    Yt, last_t = tm(x=(x.transpose(0, 1), lengths), h=h0)
    close(Yt.transpose(0, 1), Yr, torch.float32)
    close(last_t, lr, torch.float32)


def test_step_net_gradcheck_float64_with_a_static_input(cell64):
    m = cell64
    x = torch.randn(3, 4, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
    ctx = torch.randn(3, H, dtype=torch.float64, requires_grad=True)
    lengths = [4, 1, 0]
    Y, last = m(x=(x, lengths), h=h0, ctx=ctx)
    Yr, lr = custom_cell_torch(m, x, lengths, h0, ctx)
    close(Y, Yr, torch.float64)
    close(last, lr, torch.float64)
    assert torch.autograd.gradcheck(lambda x, h0, ctx, *ps: m(x=(x, lengths), h=h0, ctx=ctx),
                                    (x, h0, ctx, *m.parameters()))


def test_a_decoders_ragged_memory_is_a_lod_input_with_its_gradients():
    """An attention decoder's memory (a ragged static input: rows per
    sequence) given as (padded, lengths) or (rows, lod), in any order among
    the inputs: the outputs are the direct call's (in the step input's
    layout; as (rows, lod) where none is given), and gradcheck passes
    through the memory's rows."""
    rnn, X, M, _ = memory_decoder(np.random.default_rng(2), np.float64)
    m = st.Module(rnn)
    x = torch.tensor(X.to_padded()[0], requires_grad=True)
    memory = torch.tensor(M.data, requires_grad=True)
    want = rnn(backend="numba").to_padded()[0]
    y = m(M=(memory, M.lod), X=(x, [3, 2]))  # (the memory first: y in X's layout)
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-12)
    padded = torch.tensor(M.to_padded()[0], requires_grad=True)
    np.testing.assert_allclose(m(X=(x, [3, 2]), M=(padded, [1, 4])).detach().numpy(), want,
                               rtol=1e-12)
    assert torch.autograd.gradcheck(lambda x, mem, *ps: m(M=(mem, M.lod), X=(x, [3, 2])),
                                    (x, memory, *m.parameters()))
    assert torch.autograd.gradcheck(lambda mem: m(X=(x, [3, 2]), M=(mem, [1, 4])), (padded,))
    rows, lod = m(M=(memory, M.lod))  # (no step input given: the output as (rows, lod))
    assert lod == X.lod and np.allclose(rows.detach().numpy(), rnn(backend="numba").data)


def test_nested_step_net_rows_and_lod_gradcheck():
    """Words -> sentences: a two-level LoD input given as (rows, lod)."""
    rng = np.random.default_rng(9)
    Ww = sn.Parameter(rng.normal(0, 0.5, (2, 3)), name="Ww")
    Uw = sn.Parameter(rng.normal(0, 0.5, (3, 3)), name="Uw")
    Us = sn.Parameter(rng.normal(0, 0.5, (3, 3)), name="Us")
    lod = [[0, 2, 3], [0, 2, 5, 6]]  # 2 documents of 2 and 1 sentences; 6 words
    X = sn.LoDTensor(np.zeros((6, 2)), lod)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        sentence = rnn.add_input(X, name="x")
        s = rnn.add_memory(shape=[3], name="s", dtype=np.float64)
        inner = sn.create_rnn_op()
        with inner.stepnet():
            w = inner.add_input(sentence)
            hw = inner.add_memory(shape=[3], dtype=np.float64)
            hw.update(sn.ops.tanh(w @ Ww + hw.pre_state() @ Uw))
            inner.add_outputs(hw)
        s.update(sn.ops.tanh(inner(output_all_steps=False) + s.pre_state() @ Us))
        rnn.add_outputs(s)
    m = st.Module(rnn, backend="interpreter")
    rows = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    out, out_lod = m(x=(rows, lod))
    assert out_lod == [[0, 2, 3]] and tuple(out.shape) == (3, 3)
    ref = rnn(x=sn.LoDTensor(rows.detach().numpy(), lod))
    np.testing.assert_allclose(out.detach().numpy(), ref.data, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda r, *ps: m(x=(r, lod))[0], (rows, *m.parameters()))


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_nested_step_net_takes_a_tensor_padded_by_every_level(batch_first):
    """Chapters of paragraphs of words as ``[B, T1, T2, F]`` with the lengths
    of each level (``[B]``, ``[B, T1]``): outputs padded by their own levels
    (the chapters' ``[B, T1, H]``, the words' ``[B, T1, T2, H]``) with zeros
    past each length, and gradients, as given as (rows, lod); gradcheck."""
    rng = np.random.default_rng(4)
    net = nested_encoder(rng, dtype=np.float64, outputs=("h", "words", "last"))
    X = net.X
    paragraphs = np.diff(X.levels[0])
    T1, T2 = int(paragraphs.max()), int(np.diff(X.levels[1]).max())
    words = np.zeros((len(paragraphs), T1), np.int64)  # (zeros past a chapter's paragraphs)
    for b, (first, n) in enumerate(zip(X.levels[0][:-1], paragraphs)):
        words[b, :n] = np.diff(X.levels[1])[first:first + n]
    mask = (np.arange(T1) < paragraphs[:, None])[..., None] & (np.arange(T2) < words[..., None])
    padded = np.zeros(mask.shape + (3,))
    padded[mask] = net.x
    m = st.Module(net.rnn, output_all_steps=(True, True, False), batch_first=batch_first)
    rows = torch.tensor(net.x, requires_grad=True)
    expected = m(X=(rows, X.lod))
    x = torch.tensor(padded if batch_first else padded.transpose(1, 0, 2, 3), requires_grad=True)
    lengths = (torch.tensor(paragraphs), words)
    h, every, last = m(X=(x, lengths))
    axes = (lambda a: a) if batch_first else (lambda a: a.transpose(0, 1))
    chapters = np.arange(T1) < paragraphs[:, None]
    assert tuple(axes(h).shape) == (len(paragraphs), T1, 4)
    np.testing.assert_allclose(axes(h).detach().numpy()[chapters], expected[0][0].detach().numpy())
    assert not axes(h).detach().numpy()[~chapters].any()
    assert tuple(axes(every).shape) == mask.shape + (4,)
    np.testing.assert_allclose(axes(every).detach().numpy()[mask], expected[1][0].detach().numpy())
    assert not axes(every).detach().numpy()[~mask].any()
    np.testing.assert_allclose(last.detach().numpy(), expected[2].detach().numpy())
    upstream = [torch.randn(t.shape, dtype=torch.float64) for t in (h, every, last)]
    grads = torch.autograd.grad([h, every, last], [x, *m.parameters()], upstream)
    reference = torch.autograd.grad(
        [expected[0][0], expected[1][0], expected[2]], [rows, *m.parameters()],
        [axes(upstream[0])[torch.tensor(chapters)], axes(upstream[1])[torch.tensor(mask)], upstream[2]])
    np.testing.assert_allclose(axes(grads[0]).numpy()[mask], reference[0].numpy(), atol=1e-12)
    assert not axes(grads[0]).numpy()[~mask].any()
    for got, want in zip(grads[1:], reference[1:]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-12)
    if batch_first:
        assert torch.autograd.gradcheck(lambda a, *ps: m(X=(a, lengths))[1], (x, *m.parameters()))
        full = m(X=(x, None))[2]  # (every entry full: T1 paragraphs of T2 words each)
        assert tuple(full.shape) == (len(paragraphs), 4)
        with pytest.raises(sn.ShapeError, match=r"takes 2 lengths \(\[B\], \[B, T1\], ...\), got tuple of 1"):
            m(X=(x, (paragraphs,)))
        bad = words.copy()
        bad[0, 1] = 9
        with pytest.raises(sn.ShapeError, match=r"lengths\[1\]\[0, 1\] = 9 is outside \[0, 4\]"):
            m(X=(x, (paragraphs, bad)))
        with pytest.raises(sn.ShapeError, match=r"lengths\[1\] must be 2-D integers, got int64"):
            m(X=(x, (paragraphs, paragraphs)))


def test_attention_weights_over_the_memory_come_padded_by_step_and_memory_row():
    """A decoder's attention weights at every step, with a prior given at
    each step (as (rows, lod)): ``[B, T, M, 1]`` with zeros past each step
    count and memory length, where the step input is padded; gradcheck
    through them (a guided attention loss) to the inputs, the memory, the
    prior and the weights."""
    from stepnet.onnx.export import to_nested_padded

    rnn, _ = attention_prior(np.random.default_rng(8), [3, 6, 0, 2], [2, 3, 1, 0])
    X, P, M = (rnn.bindings[k].value for k in ("X", "prior", "M"))
    m = st.Module(rnn)
    x, mem = (torch.tensor(T.to_padded()[0], requires_grad=True) for T in (X, M))
    rows = torch.tensor(P.data, requires_grad=True)

    def run(x, rows, mem, *params):
        return m(X=(x, np.diff(X.lod[0])), prior=(rows, P.lod), M=(mem, np.diff(M.lod[0])))

    h, w = run(x, rows, mem)
    assert tuple(w.shape) == (4, 3, 6, 1)
    np.testing.assert_allclose(w.detach().numpy(), to_nested_padded(rnn()[1])[0], atol=1e-12)
    assert torch.autograd.gradcheck(lambda *a: run(*a)[1], (x, rows, mem, *m.parameters()))
    as_rows = {k: (torch.tensor(T.data), T.lod) for k, T in (("X", X), ("prior", P), ("M", M))}
    (tail,) = st.Module(rnn)(**as_rows)[1:]
    assert tail[1] == P.lod  # (the step input as (rows, lod): the weights as (rows, lod) too)


def test_step_net_refuses_bad_input_and_dtype_changes(cell32):
    m = cell32
    x = torch.randn(2, 3, I)
    with pytest.raises(sn.StepNetError, match=r"unknown input name\(s\) \['y'\]"):
        m(y=(x, [3, 3]))
    with pytest.raises(sn.ShapeError, match=r"lengths\[1\] = 4 is outside \[0, 3\]"):
        m(x=(x, [3, 4]))
    with pytest.raises(sn.ShapeError, match=r"feature shape \[2\]; it was defined with \[3\]"):
        m(x=(torch.randn(2, 3, 2), [3, 3]))
    with pytest.raises(sn.ShapeError, match="a LoD input is given as a PackedSequence"):
        m(x=x)
    with pytest.raises(sn.ShapeError, match="dtype torch.float64"):
        m(x=(x.double(), [3, 3]))
    with pytest.raises(sn.UnsupportedError, match="define it again with torch.float64"):
        m.double()
    assert all(p.dtype == torch.float32 for p in m.parameters())
    with pytest.raises(sn.ShapeError, match="defined with 2 LoD levels"):
        nested = st.Module(two_level_rnn())
        nested(x=(torch.zeros(2, 3, 2, dtype=torch.float64), [3, 3]))


def two_level_rnn():
    """A two-level step-net (used above to check the PackedSequence refusal)."""
    X = sn.LoDTensor(np.zeros((3, 2)), [[0, 1], [0, 3]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        sentence = rnn.add_input(X, name="x")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            w = inner.add_input(sentence)
            hw = inner.add_memory(shape=[2], dtype=np.float64)
            hw.update(w + hw.pre_state())
            inner.add_outputs(hw)
        s = rnn.add_memory(shape=[2], dtype=np.float64)
        s.update(inner(output_all_steps=False) + s.pre_state())
        rnn.add_outputs(s)
    return rnn


@pytest.mark.slow
def test_a_compiled_model_runs_the_bridge_eagerly(cell32):
    """torch.compile around the bridge: a graph break at the module, same numbers."""
    head = torch.nn.Linear(H, 2)
    model = lambda x, n: head(cell32(x=(torch.tanh(x), n))[1])  # noqa: E731
    compiled = torch.compile(model)
    x = torch.randn(3, 4, I)
    lengths = [4, 2, 3]
    close(compiled(x, lengths), model(x, lengths), torch.float32)
    compiled(x, lengths).sum().backward()
    assert all(p.grad is not None for p in cell32.parameters())


# ----------------------------------------------------------------------------
# the example and the benchmark


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_learns_a_short_version():
    example = _load(ROOT / "examples" / "torch_custom_cell.py")
    accuracy = example.main(["--steps", "250", "--max-length", "12", "--log-every", "0"])
    assert accuracy >= example.TARGET_ACCURACY


@pytest.mark.slow
def test_example_runs_as_a_script_and_meets_its_target():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_custom_cell.py")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(target >= 0.95: met)" in proc.stdout


@pytest.mark.slow
def test_benchmark_quick_run_prints_the_table():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_bridge.py"), "--quick",
                           "--compile", "none", "--rounds", "2", "--calls", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| stepnet.torch |" in out and "| torch eager |" in out and "CPU: " in out
    assert "bridge overhead" in out
