"""stepnet.jax: layers and step-nets as JAX functions under jit, grad and vmap,
against a plain JAX loop (lax.scan) and stepnet's own pullback."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import stepnet as sn  # noqa: E402
from nets import CHAPTERS, memory_decoder, nested_encoder  # noqa: E402
import stepnet.jax as sj  # noqa: E402
from stepnet.errors import ShapeError, StepNetError  # noqa: E402

LENGTHS = np.array([5, 2, 0, 4])


def _padded(rng, *features, steps=5):
    return rng.standard_normal((len(LENGTHS), steps) + features).astype(np.float32)


def _tanh_net(rng):
    """h = tanh(x @ W + h.pre @ U + b * s): a LoD input, a static input s [B, 1],
    an initial memory; outputs every h and the last h."""
    W = sn.Parameter((rng.standard_normal((3, 4)) * 0.5).astype(np.float32), name="W")
    U = sn.Parameter((rng.standard_normal((4, 4)) * 0.5).astype(np.float32), name="U")
    b = sn.Parameter((rng.standard_normal(4) * 0.1).astype(np.float32), name="b")
    X = sn.LoDTensor.from_padded(_padded(rng, 3), LENGTHS)
    rnn = sn.create_rnn_op(output_num=2)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        s = rnn.add_static_input(np.ones((len(LENGTHS), 1), np.float32), name="s")
        h = rnn.add_memory(init=np.zeros((len(LENGTHS), 4), np.float32), name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state() @ U + b * s))
        rnn.add_outputs(h, h)
    return rnn


def _tanh_scan(params, x, lengths, s, h0):
    """The same net in JAX: a masked scan over time, batch-first in and out."""
    def step(h, inputs):
        xt, t = inputs
        new = jnp.tanh(xt @ params["W"] + h @ params["U"] + params["b"] * s)
        live = (t < lengths)[:, None]
        h = jnp.where(live, new, h)
        return h, jnp.where(live, new, 0.0)
    steps = jnp.arange(x.shape[1])
    last, ys = jax.lax.scan(step, h0, (jnp.swapaxes(x, 0, 1), steps))
    return jnp.swapaxes(ys, 0, 1), last


def test_a_step_net_under_jit_and_grad_equals_a_jax_scan():
    rng = np.random.default_rng(0)
    rnn = _tanh_net(rng)
    f = sj.function(rnn, output_all_steps=[True, False])
    params = f.params
    assert sorted(params) == ["U", "W", "b"]
    x = _padded(rng, 3)
    s = rng.standard_normal((len(LENGTHS), 1)).astype(np.float32)
    h0 = rng.standard_normal((len(LENGTHS), 4)).astype(np.float32)
    R = rng.standard_normal((len(LENGTHS), 5, 4)).astype(np.float32)
    S = rng.standard_normal((len(LENGTHS), 4)).astype(np.float32)

    ys, last = jax.jit(lambda p, x, s, h0: f(p, x=(x, LENGTHS), s=s, h=h0))(params, x, s, h0)
    ys_ref, last_ref = _tanh_scan(params, x, LENGTHS, s, h0)
    np.testing.assert_allclose(ys, ys_ref, atol=1e-5)
    np.testing.assert_allclose(last, last_ref, atol=1e-5)
    assert np.all(np.asarray(ys)[2] == 0) and np.all(np.asarray(ys)[1, 2:] == 0)

    def loss(fn):
        def value(p, x, s, h0):
            ys, last = fn(p, x, s, h0)
            return (ys * R).sum() + (last * S).sum()
        return value

    ours = jax.jit(jax.grad(loss(lambda p, x, s, h0: f(p, x=(x, LENGTHS), s=s, h=h0)),
                            argnums=(0, 1, 2, 3)))(params, x, s, h0)
    ref = jax.grad(loss(lambda p, x, s, h0: _tanh_scan(p, x, LENGTHS, s, h0)),
                   argnums=(0, 1, 2, 3))(params, x, s, h0)
    for name in params:
        np.testing.assert_allclose(ours[0][name], ref[0][name], rtol=1e-4, atol=1e-5)
    for got, want in zip(ours[1:], ref[1:]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_an_initial_memory_given_as_a_number_or_one_row():
    """As in a direct call, every sequence's initial state (it failed inside
    the bridge, finding the outputs' shapes)."""
    rng = np.random.default_rng(0)
    f = sj.function(_tanh_net(rng), output_all_steps=[True, False])
    x, s = _padded(rng, 3), np.ones((len(LENGTHS), 1), np.float32)
    rows = f(f.params, x=(x, LENGTHS), s=s, h=np.full((len(LENGTHS), 4), 0.5, np.float32))
    for h in (0.5, np.full(4, 0.5, np.float32)):
        got = jax.jit(lambda p, h=h: f(p, x=(x, LENGTHS), s=s, h=h))(f.params)
        for a, b in zip(got, rows):
            np.testing.assert_array_equal(a, b)


def test_a_layer_equals_the_layer_and_its_pullback():
    rng = np.random.default_rng(1)
    layer = sn.nn.GRU(3, 4, direction="bidirectional_concat", seed=2)
    f = sj.function(layer)
    params = f.params
    x = _padded(rng, 3)
    y, h_n = f(params, x, LENGTHS)
    Y, H = layer((x, LENGTHS))
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(h_n, H)

    R = rng.standard_normal(y.shape).astype(np.float32)
    S = rng.standard_normal(h_n.shape).astype(np.float32)
    h0 = rng.standard_normal(h_n.shape).astype(np.float32)

    def loss(p, x, h0):
        y, h_n = f(p, x, LENGTHS, h0)
        return (y * R).sum() + (h_n * S).sum()

    g, gx, gh0 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, h0)
    X = sn.LoDTensor.from_padded(x, LENGTHS)
    _, pullback = sn.vjp(layer, X, h0)
    want = pullback([sn.LoDTensor.from_padded(R, LENGTHS).data, S],
                    wrt=["X", "h0"] + layer.parameters())
    np.testing.assert_allclose(gx, sn.LoDTensor(want[0], X.levels).to_padded(steps=5)[0],
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(gx)[2] == 0)  # no gradient to the padding
    np.testing.assert_allclose(gh0, want[1], rtol=1e-5, atol=1e-6)
    for name, w in zip(f.names, want[2:]):
        np.testing.assert_allclose(g[name], w, rtol=1e-5, atol=1e-6)


def test_lstm_states_augru_scores_and_an_mgu_get_gradients():
    rng = np.random.default_rng(3)
    lstm = sn.nn.LSTM(3, 4, seed=4)
    f = sj.function(lstm)
    x = _padded(rng, 3)
    h0, c0 = (rng.standard_normal((1, len(LENGTHS), 4)).astype(np.float32) for _ in range(2))
    y, (h_n, c_n) = f(f.params, x, LENGTHS, (h0, c0))
    Y, (H, C) = lstm((x, LENGTHS), (h0, c0))
    np.testing.assert_array_equal(c_n, C)

    def loss(h0, c0):
        y, (h_n, c_n) = f(f.params, x, LENGTHS, (h0, c0))
        return y.sum() + c_n.sum()

    gh, gc = jax.grad(loss, argnums=(0, 1))(h0, c0)
    _, pullback = sn.vjp(lstm, sn.LoDTensor.from_padded(x, LENGTHS), (h0, c0))
    want = pullback([np.ones((LENGTHS.sum(), 4), np.float32), np.zeros_like(H),
                     np.ones_like(C)], wrt=["h0", "c0"])
    np.testing.assert_allclose(gh, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gc, want[1], rtol=1e-5, atol=1e-6)

    augru = sn.nn.AUGRU(3, 4, seed=5)
    g = sj.function(augru)
    scores = rng.uniform(size=(len(LENGTHS), 5)).astype(np.float32)
    y, _ = g(g.params, x, scores, LENGTHS)
    Y, _ = augru((x, LENGTHS), (scores, LENGTHS))
    np.testing.assert_array_equal(y, Y)
    da = jax.grad(lambda a: g(g.params, x, a, LENGTHS)[0].sum())(scores)
    assert da.shape == scores.shape and np.all(np.asarray(da)[2] == 0)
    assert np.abs(np.asarray(da)[0]).max() > 0

    mgu = sn.nn.MGU(3, 4, seed=6)  # a layer PyTorch and ONNX lack
    m = sj.function(mgu)
    y, h_n = m(m.params, x, LENGTHS, h0)
    Y, H = mgu((x, LENGTHS), h0)
    np.testing.assert_array_equal(y, Y)
    np.testing.assert_array_equal(h_n, H)
    gh = jax.grad(lambda h: m(m.params, x, LENGTHS, h)[1].sum())(h0)
    _, pullback = sn.vjp(mgu, sn.LoDTensor.from_padded(x, LENGTHS), h0)
    want = pullback([np.zeros((LENGTHS.sum(), 4), np.float32), np.ones_like(H)], wrt=["h0"])
    np.testing.assert_allclose(gh, want[0], rtol=1e-5, atol=1e-6)


def test_vmap_and_the_nets_parameters_are_left_as_they_were():
    rng = np.random.default_rng(6)
    layer = sn.nn.RNN(3, 4, seed=7)
    f = sj.function(layer)
    before = [p.value.copy() for p in layer.parameters()]
    params = {k: v * 2 for k, v in f.params.items()}
    xs = np.stack([_padded(rng, 3), _padded(rng, 3)])
    batched = jax.vmap(lambda x: f(params, x, LENGTHS)[0])(xs)
    for k in range(2):
        np.testing.assert_array_equal(batched[k], f(params, xs[k], LENGTHS)[0])
    for p, b in zip(layer.parameters(), before):
        np.testing.assert_array_equal(p.value, b)
    # lengths traced under jit: checked when the call runs, on the host
    traced = jax.jit(lambda x, lengths: f(params, x, lengths)[0])(xs[0], LENGTHS)
    np.testing.assert_array_equal(traced, f(params, xs[0], LENGTHS)[0])
    with pytest.raises(Exception, match=r"lengths\[0\] = 6 is outside \[0, 5\]"):
        jax.jit(lambda x, lengths: f(params, x, lengths)[0])(xs[0], np.array([6, 1, 1, 1]))
    assert not np.array_equal(f(params, xs[0], LENGTHS)[0], f(f.params, xs[0], LENGTHS)[0])


def test_errors_name_what_is_wrong():
    rng = np.random.default_rng(8)
    layer = sn.nn.GRU(3, 4, seed=9)
    f = sj.function(layer)
    x = _padded(rng, 3)
    params = f.params
    with pytest.raises(StepNetError, match="missing.*l0_fwd_W_z"):
        f({k: v for k, v in params.items() if k != "l0_fwd_W_z"}, x)
    with pytest.raises(ShapeError, match=r"params\['l0_fwd_W_z'\]: has shape \[4, 4\]"):
        f({**params, "l0_fwd_W_z": np.zeros((4, 4), np.float32)}, x)
    with pytest.raises(ShapeError, match=r"lengths\[0\] = 6 is outside \[0, 5\]"):
        f(params, x, np.array([6, 1, 1, 1]))
    with pytest.raises(ShapeError, match="padded batch-first"):
        f(params, x[0])
    B = x.shape[0]
    with pytest.raises(ShapeError, match=rf"h0 has shape \[2, {B}, 4\], expected .* = \[1, {B}, 4\]"):
        f(params, x, None, np.zeros((2, B, 4), np.float32))  # (the caller's batch named)
    with pytest.raises(StepNetError, match="expects a stepnet.nn layer or a step-net"):
        sj.function(object())
    rnn = _tanh_net(rng)
    with pytest.raises(StepNetError, match="by name"):
        sj.function(rnn)(sj.function(rnn).params, x)
    chapters = sj.function(nested_encoder(rng).rnn)
    x2 = np.ones((1, 2, 4, 3), np.float32)
    with pytest.raises(ShapeError, match=r"expected \[B, T1, T2, \.\.\.\] \(2 levels of LoD\)"):
        chapters(chapters.params, X=np.ones((1, 2), np.float32))
    with pytest.raises(ShapeError, match=r"input X: lengths: expects 2 arrays .*\[1\], \[1, 2\]"):
        chapters(chapters.params, X=(x2, np.array([2])))
    with pytest.raises(ShapeError, match=r"input X: lengths\[1\]\[0, 1\] = 5 is outside \[0, 4\]"):
        chapters(chapters.params, X=(x2, (np.array([2]), np.array([[1, 5]]))))


def _chapters_padded(x):
    """nets.CHAPTERS's rows ``x`` padded [chapters, paragraphs, words, ...],
    with each level's lengths ([B] paragraphs, [B, P] words)."""
    counts = np.array(CHAPTERS[0])
    words = iter(CHAPTERS[1])
    lengths = np.zeros((len(counts), counts.max()), np.int64)
    padded = np.zeros((len(counts), counts.max(), max(CHAPTERS[1])) + x.shape[1:], x.dtype)
    row = 0
    for b, count in enumerate(counts):
        for p in range(count):
            n = lengths[b, p] = next(words)
            padded[b, p, :n] = x[row:row + n]
            row += n
    return padded, (counts, lengths)


def test_a_nested_step_net_takes_its_two_level_input_padded_by_levels():
    """Chapters of paragraphs of words: X (two levels of LoD) given padded
    [B, P, W, features] with the lengths of each level; the outputs come
    padded by their own levels (the paragraphs' states [B, P, H], the words'
    [B, P, W, H], zeros past each length), as a direct call's, and
    jax.grad under jit gives stepnet's pullback, zeros for the padding."""
    rng = np.random.default_rng(4)
    net = nested_encoder(rng, outputs=("h", "words", "last"))
    f = sj.function(net.rnn)
    padded, lengths = _chapters_padded(net.x)
    got = jax.jit(lambda p, x: f(p, X=(x, lengths)))(f.params, padded)
    direct = net.rnn(backend="numba")
    words = np.zeros(padded.shape[:3], bool)  # (where the rows are: each level's lengths)
    for b, p, w in np.ndindex(*words.shape):
        words[b, p, w] = p < lengths[0][b] and w < lengths[1][b, p]
    paragraphs = np.arange(words.shape[1]) < lengths[0][:, None]
    for out, want, mask in zip(got, direct, (paragraphs, words, paragraphs)):
        out = np.asarray(out)
        assert out.shape == mask.shape + (4,)
        np.testing.assert_allclose(out[mask], want.data, rtol=1e-6, atol=1e-6)
        assert np.all(out[~mask] == 0)

    cts = [rng.standard_normal(np.shape(o)).astype(np.float32) for o in got]

    def loss(p, x):
        return sum((o * c).sum() for o, c in zip(f(p, X=(x, lengths)), cts))

    g, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(f.params, padded)
    _, pullback = sn.vjp(net.rnn, backend="numba")
    want = pullback([c[m] for c, m in zip(cts, (paragraphs, words, paragraphs))],
                    wrt=["X"] + net.rnn.parameters())
    np.testing.assert_allclose(np.asarray(gx)[words], want[0], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(gx)[~words] == 0)
    for name, w in zip(f.names, want[1:]):
        np.testing.assert_allclose(g[name], w, rtol=1e-5, atol=1e-6)
    bad = lengths[1].copy()
    bad[0, 1] = 9
    with pytest.raises(Exception, match=r"lengths\[1\]\[0, 1\] = 9 is outside \[0, 4\]"):
        jax.jit(lambda x, n, w: f(f.params, X=(x, (n, w))))(padded, lengths[0], bad)
    # vmap over a stack of such inputs, their lengths traced alike
    batched = jax.vmap(lambda x, n, w: f(f.params, X=(x, (n, w)))[1])(
        np.stack([padded, padded * 2]), np.stack([lengths[0]] * 2), np.stack([lengths[1]] * 2))
    for k in range(2):
        np.testing.assert_allclose(batched[k], f(f.params, X=(padded * (k + 1), lengths))[1],
                                   rtol=1e-6, atol=1e-6)


def test_a_ragged_static_input_is_a_decoders_memory_padded_with_its_lengths():
    """An attention decoder's memory (a ragged static input: rows per
    sequence) given as (padded [B, M, ...], lengths), like a step input:
    the outputs equal a direct call's, and jax.grad under jit gives the
    memory its rows' gradients (zeros for the padding) as stepnet's
    pullback does; a LoDTensor or a static input of one row given as a pair
    is refused by name."""
    rng = np.random.default_rng(3)
    rnn, X, M, A = memory_decoder(rng)
    (x, x_lengths), (m, m_lengths) = X.to_padded(), M.to_padded()
    f = sj.function(rnn)
    y = jax.jit(lambda p, x, m: f(p, X=(x, x_lengths), M=(m, m_lengths)))(f.params, x, m)
    np.testing.assert_allclose(y, rnn(backend="numba").to_padded(steps=3)[0], rtol=1e-6, atol=1e-7)
    R = rng.standard_normal(np.shape(y)).astype(np.float32)

    def loss(p, x, m):
        return (f(p, X=(x, x_lengths), M=(m, m_lengths)) * R).sum()

    g, gx, gm = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(f.params, x, m)
    _, pullback = sn.vjp(rnn, backend="numba")
    want = pullback([sn.LoDTensor.from_padded(R, x_lengths).data], wrt=["M", "X", A])
    np.testing.assert_allclose(gm, sn.LoDTensor(want[0], M.levels).to_padded(steps=4)[0],
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(gm)[0, 1:] == 0)  # no gradient to the padding
    np.testing.assert_allclose(gx, sn.LoDTensor(want[1], X.levels).to_padded(steps=3)[0],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["A"], want[2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match="input M: stepnet.jax takes a LoD input as "
                                         r"\(padded, lengths\), not a LoDTensor"):
        f(f.params, X=(x, x_lengths), M=M)
    s = sj.function(_tanh_net(rng), output_all_steps=[True, False])
    with pytest.raises(ShapeError, match="input s: a static input of one row per sequence"):
        s(s.params, x=(_padded(rng, 3), LENGTHS), s=(np.ones((4, 1), np.float32), LENGTHS),
          h=np.zeros((4, 4), np.float32))

def test_attention_weights_over_the_memory_are_padded_by_step_and_memory_row():
    """A decoder giving its attention weights at every step (rows of its
    sequence's memory at each step) and reading a prior given at each step:
    the weights come padded ``[B, T, M, 1]`` (zeros past each step count and
    memory length), and jax.grad of a loss of both outputs (a guided
    attention loss) equals stepnet's pullback, the prior's and the memory's
    gradients padded alike."""
    from nets import attention_prior
    from stepnet.onnx.export import to_nested_padded
    from stepnet.padded import mask

    rng = np.random.default_rng(6)
    rnn, W = attention_prior(rng, [3, 6, 0, 2], [2, 3, 1, 0], dtype=np.float32)
    X, P, M = (rnn.bindings[k].value for k in ("X", "prior", "M"))
    (x, x_lengths), (m, m_lengths) = X.to_padded(), M.to_padded()
    p, (p_steps, p_rows) = to_nested_padded(P)
    f = sj.function(rnn)

    def run(params, x, p, m):
        return f(params, X=(x, x_lengths), prior=(p, (p_steps, p_rows)), M=(m, m_lengths))

    h, w = jax.jit(run)(f.params, x, p, m)
    want_h, want_w = rnn(backend="numba")
    assert w.shape == (4, 3, 6, 1)
    np.testing.assert_allclose(w, to_nested_padded(want_w)[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h, want_h.to_padded()[0], rtol=1e-6, atol=1e-7)
    R, Q = (rng.standard_normal(a.shape).astype(np.float32) for a in (h, w))

    def loss(params, x, p, m):
        h, w = run(params, x, p, m)
        return (h * R).sum() + (w * Q).sum()

    g, gx, gp, gm = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(f.params, x, p, m)
    _, pullback = sn.vjp(rnn, backend="numba")
    cts = [sn.LoDTensor.from_padded(R, x_lengths).data,
           np.asarray(Q)[mask((p_steps, p_rows), Q.shape[:3])]]
    want = pullback(cts, wrt=[W, "X", "prior", "M"])
    np.testing.assert_allclose(g["W"], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, sn.LoDTensor(want[1], X.levels).to_padded()[0], atol=1e-6)
    np.testing.assert_allclose(gp, to_nested_padded(sn.LoDTensor(want[2], P.levels))[0], atol=1e-6)
    np.testing.assert_allclose(gm, sn.LoDTensor(want[3], M.levels).to_padded()[0], atol=1e-6)


def test_an_unknown_backend_is_refused_when_the_function_is_made():
    with pytest.raises(sn.BackendError, match="unknown backend 'bogus'"):
        sj.function(sn.nn.GRU(3, 4, seed=0), backend="bogus")


@pytest.mark.parametrize("cell, layer", [("RNNCell", "RNN"), ("GRUCell", "GRU"),
                                         ("LSTMCell", "LSTM"), ("AUGRUCell", "AUGRU"),
                                         ("MGUCell", "MGU")])
def test_a_cell_is_refused_with_what_to_pass_instead(cell, layer):
    with pytest.raises(StepNetError, match=rf"stepnet.jax.function: {cell} is a cell, one step "
                                           rf"of a recurrence .* pass the layer "
                                           rf"sn.nn.{layer}\(...\) instead, or a step-net"):
        sj.function(getattr(sn.nn, cell)(3, 4, seed=0), backend="interpreter")


def test_a_backward_takes_its_forwards_pullback_or_runs_the_forward_again():
    """The forward run for a gradient keeps its pullback until the backward
    takes it; a backward whose pullback is gone (taken by an earlier call of
    the same vjp, or dropped past KEPT_PULLBACKS pending forwards) runs the
    forward again, to the same gradients."""
    rng = np.random.default_rng(10)
    layer = sn.nn.GRU(3, 4, seed=11)
    f = sj.function(layer)
    x = _padded(rng, 3)
    R = rng.standard_normal((len(LENGTHS), 5, 4)).astype(np.float32)

    def y(p, x):
        return f(p, x, LENGTHS)[0]

    _, first = jax.vjp(y, f.params, x)
    assert len(f._kept) == 1
    want = first(R)
    assert len(f._kept) == 0
    again = first(R)  # its pullback taken: the forward runs again
    scales = [1.0] + [0.5 * k for k in range(1, sj.KEPT_PULLBACKS + 1)]
    pending = [jax.vjp(y, f.params, x * c)[1] for c in scales]
    assert len(f._kept) == sj.KEPT_PULLBACKS
    dropped = pending[0](R)  # the oldest was dropped
    kept = pending[-1](R)  # each kept pullback is its own forward's
    fresh = jax.vjp(y, f.params, x * scales[-1])[1](R)
    for got, expected in ((again, want), (dropped, want), (kept, fresh)):
        for name in f.names:
            np.testing.assert_allclose(got[0][name], expected[0][name], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-6, atol=1e-7)
    assert not np.allclose(kept[1], want[1])
    assert layer._workspace is None


@pytest.mark.slow  # (a step-net under jit and grad: the first test; an example learning: the adding problem)
def test_the_example_learns_a_short_version():
    """examples/jax_custom_cell.py: embedding -> the stepnet cell -> a linear
    head, Adam in JAX, to its target accuracy on a short version."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "jax_custom_cell.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    accuracy = example.main(["--steps", "250", "--max-length", "12", "--log-every", "0"])
    assert accuracy >= example.TARGET_ACCURACY
