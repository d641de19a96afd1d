"""stepnet.optim: SGD, Adam and clip_grad_norm step by step against PyTorch,
in-place updates, the training loop and the errors."""

import numpy as np
import pytest
from nets import tanh_cell

import stepnet as sn
from stepnet.optim import SGD, Adam, clip_grad_norm, train

SHAPES = [(3, 4), (5,), (), (2, 3, 2)]
TOL = {np.float32: 2e-6, np.float64: 1e-12}


def make_params(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [sn.Parameter(rng.standard_normal(s).astype(dtype), name=f"p{i}")
            for i, s in enumerate(SHAPES)]


def grad_sequence(dtype, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(steps)]


def assert_params_close(params, tensors, dtype, what):
    tol = TOL[dtype]
    for p, t in zip(params, tensors):
        expected = t.detach().numpy()
        assert p.value.dtype == expected.dtype, what
        err = np.abs(p.value.astype(np.float64) - expected)
        assert np.all(err <= tol * np.maximum(1.0, np.abs(expected))), (
            f"{what}: {p.name} max error {err.max()}")


def run_against_torch(make_ours, make_torch, dtype, steps=6):
    """Run the same gradients through both optimizers and compare after each step."""
    torch = pytest.importorskip("torch")
    params = make_params(dtype)
    tensors = [torch.tensor(p.value.copy(), requires_grad=True) for p in params]
    ours, theirs = make_ours(params), make_torch(tensors)
    for k, grads in enumerate(grad_sequence(dtype, steps)):
        ours.step(grads)
        for t, g in zip(tensors, grads):
            t.grad = torch.tensor(g)
        theirs.step()
        assert_params_close(params, tensors, dtype, f"step {k + 1}")
    return params


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True},
    {"weight_decay": 0.01},
    {"momentum": 0.5, "weight_decay": 0.1, "nesterov": True},
    {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.02},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_sgd_matches_torch(kw, dtype):
    torch = pytest.importorskip("torch")
    run_against_torch(lambda ps: SGD(ps, lr=0.05, **kw),
                      lambda ts: torch.optim.SGD(ts, lr=0.05, **kw), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [
    {},
    {"lr": 0.01, "betas": (0.8, 0.99)},
    {"lr": 0.003, "weight_decay": 0.05, "eps": 1e-6},
    {"lr": 0.1, "betas": (0.0, 0.5)},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_adam_matches_torch(kw, dtype):
    torch = pytest.importorskip("torch")
    run_against_torch(lambda ps: Adam(ps, **kw),
                      lambda ts: torch.optim.Adam(ts, **kw), dtype, steps=8)


def test_missing_gradient_skips_the_parameter_as_torch_does():
    torch = pytest.importorskip("torch")
    dtype = np.float32
    params = make_params(dtype)
    tensors = [torch.tensor(p.value.copy(), requires_grad=True) for p in params]
    ours, theirs = Adam(params, lr=0.01), torch.optim.Adam(tensors, lr=0.01)
    for k, grads in enumerate(grad_sequence(dtype, 5)):
        skip = k % len(SHAPES)  # each step one parameter gets no gradient
        ours.step([None if i == skip else g for i, g in enumerate(grads)])
        for i, (t, g) in enumerate(zip(tensors, grads)):
            t.grad = None if i == skip else torch.tensor(g)
        theirs.step()
        assert_params_close(params, tensors, dtype, f"step {k + 1}")
    assert ours.steps == 5 and ours.state[0]["step"] == 3  # skipped at steps 1 and 5


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_updates_in_place_so_a_step_net_sees_them_without_retracing(backend):
    rng = np.random.default_rng(0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(np.float32), [[2, 3]])
    W = sn.Parameter(rng.standard_normal((3, 4)).astype(np.float32), name="W")
    rnn = tanh_cell(X, W)
    before = rnn(output_all_steps=False, backend=backend)
    array, old = W.value, W.value.copy()
    grad = rng.standard_normal((3, 4)).astype(np.float32)
    SGD([W], lr=0.1).step([grad])
    assert W.value is array  # the same array, changed in place
    np.testing.assert_array_equal(W.value, old - np.float32(0.1) * grad)
    after = rnn(output_all_steps=False, backend=backend)
    assert not np.allclose(before, after)
    # the same as a step-net built on the updated weights from scratch
    rnn2 = tanh_cell(X, sn.Parameter(W.value.copy()))
    np.testing.assert_array_equal(after, rnn2(output_all_steps=False, backend=backend))


def test_gradients_are_not_modified_and_other_dtypes_are_cast():
    p = sn.Parameter(np.zeros(3, np.float32), name="b")
    g = np.array([1.0, 2.0, 3.0])  # float64 for a float32 parameter
    kept = g.copy()
    opt = SGD([p], lr=1.0, momentum=0.9)
    opt.step([g])
    opt.step([g])
    np.testing.assert_array_equal(g, kept)
    assert p.value.dtype == np.float32
    np.testing.assert_allclose(p.value, -(1 + 1.9) * kept, rtol=1e-6)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(max_norm, norm_type):
    torch = pytest.importorskip("torch")
    grads = grad_sequence(np.float32, 1, seed=3)[0]
    tensors = [torch.tensor(g.copy(), requires_grad=True) for g in grads]
    for t, g in zip(tensors, grads):
        t.grad = torch.tensor(g.copy())
    expected = torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type=norm_type)
    total = clip_grad_norm(grads, max_norm, norm_type=norm_type)
    assert isinstance(total, float)
    assert abs(total - float(expected)) <= 1e-5 * max(1.0, float(expected))
    for g, t in zip(grads, tensors):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=2e-6, atol=1e-7)
    if max_norm < total:
        clipped = clip_grad_norm(grads, np.inf, norm_type=norm_type)
        assert clipped == pytest.approx(max_norm, rel=1e-4)


@pytest.mark.parametrize("layer", [sn.nn.GRU(3, 5, num_layers=2), sn.nn.LSTM(3, 4), sn.nn.RNN(3, 4)],
                         ids=["GRU", "LSTM", "RNN"])
def test_layer_gradients_are_arrays_of_their_own(layer):
    """A layer's two biases of a gate reach its step as one sum, and so get
    one gradient: given as two arrays, so that clipping scales each once and
    accumulating into them adds each once."""
    X = sn.LoDTensor.from_lengths(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32),
                                  [[2, 3]])
    outputs, pullback = sn.vjp(layer, X)
    cts = [np.ones_like(outputs[0].data), None] + [None] * isinstance(layer, sn.nn.LSTM)
    grads = pullback(cts)
    assert not any(np.may_share_memory(a, b) for i, a in enumerate(grads) for b in grads[:i])
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    clip_grad_norm(grads, 0.5 * norm)
    clipped = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    assert np.isclose(clipped, 0.5 * norm, rtol=1e-5)
    once = pullback(cts)
    twice = pullback(cts, accumulate=True, out=pullback(cts))  # (into a result itself)
    for g, g2 in zip(once, twice):
        np.testing.assert_allclose(g2, 2 * g, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_edge_cases():
    assert clip_grad_norm([], 1.0) == 0.0
    assert clip_grad_norm([None], 1.0) == 0.0
    g = np.array([3.0, 4.0])
    assert clip_grad_norm(g, 1.0) == 5.0  # a single array is accepted
    np.testing.assert_allclose(g, [0.6, 0.8], rtol=1e-6)
    with pytest.raises(sn.StepNetError, match="max_norm must be >= 0"):
        clip_grad_norm([g], -1.0)
    with pytest.raises(sn.StepNetError, match="norm_type"):
        clip_grad_norm([g], 1.0, norm_type=0)
    with pytest.raises(sn.StepNetError, match="gradient 0 is not a float ndarray"):
        clip_grad_norm([[1.0, 2.0]], 1.0)
    w, r = np.full(3, 10.0), np.full(3, 10.0)
    r.flags.writeable = False
    with pytest.raises(sn.StepNetError, match="gradient 1 is read-only"):
        clip_grad_norm([w, r], 1.0)
    np.testing.assert_array_equal(w, 10.0)  # refused before any was scaled


def test_step_validates_count_and_shapes_naming_the_parameter():
    params = make_params(np.float32)
    opt = Adam(params)
    with pytest.raises(sn.StepNetError, match="got 3 gradients for 4 parameters"):
        opt.step(grad_sequence(np.float32, 1)[0][:3])
    grads = grad_sequence(np.float32, 1)[0]
    grads[1] = np.zeros((5, 1), np.float32)
    with pytest.raises(sn.ShapeError, match=r"parameter 1 \('p1'\) has shape \(5, 1\); "
                                            r"the parameter has shape \(5,\)"):
        opt.step(grads)
    grads[1] = np.array(["a"] * 5)
    with pytest.raises(sn.ShapeError, match=r"parameter 1 \('p1'\) has dtype <U1"):
        opt.step(grads)
    with pytest.raises(sn.StepNetError, match="not a single array"):
        SGD(params[:1], lr=0.1).step(np.zeros((3, 4), np.float32))
    assert opt.steps == 0 and not any(opt.state)  # nothing was applied


def test_constructor_errors():
    p = sn.Parameter(np.zeros(2, np.float32), name="w")
    with pytest.raises(sn.StepNetError, match="empty parameter list"):
        SGD([], lr=0.1)
    with pytest.raises(sn.StepNetError, match="not a single Parameter"):
        SGD(p, lr=0.1)
    with pytest.raises(sn.StepNetError, match=r"params\[1\] is a ndarray"):
        SGD([p, np.zeros(2)], lr=0.1)
    with pytest.raises(sn.StepNetError, match=r"parameter 1 \('w'\) is the same Parameter as parameter 0"):
        Adam([p, p])
    with pytest.raises(sn.StepNetError, match="SGD: lr must be >= 0"):
        SGD([p], lr=-1)
    with pytest.raises(sn.StepNetError, match="nesterov=True needs momentum > 0"):
        SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(sn.StepNetError, match="momentum must be >= 0"):
        SGD([p], lr=0.1, momentum=-0.5)
    with pytest.raises(sn.StepNetError, match="betas must be two numbers"):
        Adam([p], betas=(0.9, 1.0))
    with pytest.raises(sn.StepNetError, match="eps must be >= 0"):
        Adam([p], eps=float("nan"))
    with pytest.raises(sn.StepNetError, match="Adam: betas must be two numbers in .*got 0.9"):
        Adam([p], betas=0.9)
    with pytest.raises(sn.StepNetError, match="Adam: lr must be a number, got 'a'"):
        Adam([p], lr="a")
    frozen = sn.Parameter(np.zeros(2, np.float32), name="frozen")
    frozen.value.flags.writeable = False
    with pytest.raises(sn.StepNetError, match=r"parameter 0 \('frozen'\)'s value is read-only"):
        Adam([frozen])


def quadratic(target):
    """A step function for the loss 0.5 * |w - target|^2 on a batch scale."""

    def step_fn(w):
        def f(scale):
            diff = w.value - target
            return 0.5 * scale * float(diff @ diff), [scale * diff]
        return f

    return step_fn


def test_train_minimizes_logs_and_stops_on_callback():
    target = np.array([1.0, -2.0, 0.5])
    w = sn.Parameter(np.zeros(3), name="w")
    lines, seen = [], []
    losses = train(quadratic(target)(w), SGD([w], lr=0.2, momentum=0.5), [1.0, 1.0, 1.0, 1.0],
                   epochs=5, log_every=4, callback=lambda s, l: seen.append((s, l)), log=lines.append)
    assert len(losses) == 20 and [s for s, _ in seen] == list(range(1, 21))
    assert losses[-1] < 1e-4 * losses[0]
    np.testing.assert_allclose(w.value, target, atol=1e-2)
    assert len(lines) == 5 and lines[0].startswith("step      4  epoch 1  loss ")
    assert float(lines[0].split()[-1]) == pytest.approx(np.mean(losses[:4]))
    # a callback returning True stops there; batches may be a function of the epoch
    w.value[...] = 0
    epochs_seen = []

    def batches(epoch):
        epochs_seen.append(epoch)
        return [1.0, 1.0]

    losses = train(quadratic(target)(w), Adam([w], lr=0.1), batches, epochs=10,
                   callback=lambda s, l: s == 3)
    assert len(losses) == 3 and epochs_seen == [0, 1]


def test_train_stops_on_any_truthy_callback_return():
    def run(callback):
        w = sn.Parameter(np.array([4.0]), name="w")
        return train(lambda b: (float(w.value[0] ** 2), [2 * w.value]), SGD([w], lr=0.25),
                     [None] * 6, callback=callback)

    # NumPy comparisons give np.True_: it stops as True does
    assert run(lambda s, loss: np.float64(loss) < 1.0) == [16.0, 4.0, 1.0, 0.25]
    assert run(lambda s, loss: np.array(s) == 2) == [16.0, 4.0]
    assert run(lambda s, loss: 1 if s == 3 else 0) == [16.0, 4.0, 1.0]
    assert len(run(lambda s, loss: np.False_)) == 6
    assert len(run(lambda s, loss: None)) == 6
    with pytest.raises(sn.StepNetError, match=r"train: callback returned ndarray at step 1, which "
                                              r"has no truth value .*; return True to stop"):
        run(lambda s, loss: np.array([True, False]))


def test_train_errors():
    w = sn.Parameter(np.zeros(1), name="w")
    opt = SGD([w], lr=0.1)
    with pytest.raises(sn.StepNetError, match="iterator, which runs out after one epoch"):
        train(lambda b: (0.0, [np.zeros(1)]), opt, iter([1, 2]), epochs=2)
    with pytest.raises(sn.StepNetError, match=r"must return \(loss, grads\), got float"):
        train(lambda b: 0.0, opt, [1])
    with pytest.raises(sn.StepNetError, match="got 2 gradients for 1 parameters"):
        train(lambda b: (0.0, [np.zeros(1), np.zeros(1)]), opt, [1])
    with pytest.raises(sn.StepNetError, match="train: epochs must be a whole number, got 1.5"):
        train(lambda b: (0.0, [np.zeros(1)]), opt, [1], epochs=1.5)
    with pytest.raises(sn.StepNetError, match="the loss step_fn.batch. returns must be a number"):
        train(lambda b: (np.zeros(2), [np.zeros(1)]), opt, [1])
    # a one-shot iterator is fine for a single epoch
    assert train(lambda b: (float(b), [np.zeros(1)]), opt, iter([1, 2])) == [1.0, 2.0]


def test_training_a_step_net_with_gradients_lowers_its_loss():
    """sn.gradients on the kept workspace, Adam, train(): the loss of a small
    RNN learning each sequence's mean first feature falls well below what
    predicting 0 scores."""
    rng = np.random.default_rng(0)
    W = sn.Parameter(rng.normal(0, 0.5, (3, 8)), name="W")
    U = sn.Parameter(rng.normal(0, 0.25, (8, 8)), name="U")
    v = sn.Parameter(rng.normal(0, 0.25, (8, 1)), name="v")

    def make_batch(n=16):
        lengths = rng.integers(1, 7, n)
        X = sn.LoDTensor.from_lengths(rng.standard_normal((lengths.sum(), 3)), [lengths.tolist()])
        y = np.array([X.sequence(i)[:, 0].mean() for i in range(n)])[:, None]
        return X, y

    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(make_batch()[0], name="X")
        h = rnn.add_memory(shape=[8], name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state() @ U))
        rnn.add_outputs(h)

    def step_fn(batch):
        X, y = batch
        last = rnn(X=X, output_all_steps=False, backend="interpreter", keep_workspace=True)
        err = last @ v.value - y
        dpred = 2 * err / err.size
        gW, gU = sn.gradients(rnn, wrt=[W, U], grad_outputs=[dpred @ v.value.T],
                              output_all_steps=False, backend="interpreter")
        return float(np.mean(err ** 2)), [gW, gU, last.T @ dpred]

    batches = [make_batch() for _ in range(8)]
    test = make_batch(200)
    baseline = float(np.mean(test[1] ** 2))
    losses = train(step_fn, Adam([W, U, v], lr=0.02), batches, epochs=15)
    assert len(losses) == 120
    assert np.mean(losses[-8:]) < 0.5 * np.mean(losses[:8])
    assert step_fn(test)[0] < 0.5 * baseline


def test_clip_grad_norm_leaves_gradients_with_a_nan_norm_alone():
    g = np.array([np.nan, 1.0])
    assert np.isnan(clip_grad_norm([g], 1.0))
    np.testing.assert_array_equal(g, [np.nan, 1.0])
