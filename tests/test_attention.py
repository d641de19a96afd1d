"""Attention over a ragged memory: a static input given as a LoDTensor, the
segment ops (seq_sum, seq_max, seq_expand, seq_softmax, attention), on every
backend (CUDA on the simulator while runs are small: conftest.default_backends),
with gradients against finite differences and PyTorch."""

import numpy as np
import pytest
from conftest import assert_close, available_backends, default_backends
from gradient_checks import as_tuple, assert_fd_close, fd_gradients, random_cotangents
from nets import attention_prior, document_attention, word_attention
from pairwise import spread_params

import stepnet as sn
from stepnet import executor, interpreter
from stepnet.jit import threads


def _data(value):
    return value.data if isinstance(value, sn.LoDTensor) else value


def _memory(rng, lengths, width):
    return sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), width)).astype(np.float32),
                                     [lengths])


def test_segment_ops_on_lod_tensors_match_numpy(rng):
    x = _memory(rng, [2, 0, 3], 4)
    parts = [x.sequence(s) for s in range(3)]
    assert_close(sn.ops.seq_sum(x), np.stack([p.sum(0) for p in parts]))
    top = sn.ops.seq_max(x)
    assert_close(top[[0, 2]], np.stack([parts[0].max(0), parts[2].max(0)]))
    assert np.all(np.isneginf(top[1]))
    expanded = sn.ops.seq_expand(np.arange(3.0)[:, None], x)
    assert expanded.lod == x.lod and expanded.data[:, 0].tolist() == [0, 0, 2, 2, 2]
    # seq_softmax and attention too (they raised a TypeError on LoDTensors)
    soft = sn.ops.seq_softmax(x)
    assert soft.lod == x.lod
    for p, s in zip([parts[0], parts[2]], [soft.data[:2], soft.data[2:]]):
        assert_close(s, np.exp(p - p.max(0)) / np.exp(p - p.max(0)).sum(0))
    query = rng.standard_normal((3, 4)).astype(np.float32)
    weights = [np.exp(p @ q - (p @ q).max()) / np.exp(p @ q - (p @ q).max()).sum() if len(p)
               else np.zeros(0, np.float32) for p, q in zip(parts, query)]
    assert_close(sn.ops.attention(query, x), np.stack([w @ p for w, p in zip(weights, parts)]))


def test_segment_ops_refuse_dense_values():
    X = sn.LoDTensor.from_lengths(np.zeros((3, 2), np.float32), [[3]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        with pytest.raises(sn.errors.ShapeError, match="not a ragged value"):
            sn.ops.seq_sum(x)
        rnn.add_outputs(x)


def _decoder(rng, X, M, H=5, additive=True, dtype=np.float32):
    """A tanh RNN whose input is joined with the attention context over its
    sequence's own memory rows (additive scores, or dot-product)."""
    D = M.shape[1]
    p = {n: sn.Parameter((rng.standard_normal(s) * 0.5).astype(dtype), name=n)
         for n, s in [("Wq", (H, D)), ("Wx", (X.shape[1] + D, H)), ("U", (H, H)), ("v", (D, 1))]}
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        mem = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[H], name="h", dtype=dtype)
        q = h.pre_state() @ p["Wq"]
        if additive:
            w = sn.ops.seq_softmax(sn.ops.tanh(mem + q) @ p["v"])
            ctx = sn.ops.seq_sum(w * mem)
        else:
            ctx = sn.ops.attention(q, mem)
        h.update(sn.ops.tanh(sn.ops.concat([x, ctx], axis=1) @ p["Wx"] + h.pre_state() @ p["U"]))
        rnn.add_outputs(h)
    return rnn, p


def _reference(X, M, p, additive):
    """The same decoder as plain NumPy loops, one sequence at a time."""
    out = []
    for s in range(X.num_sequences):
        m, h = M.sequence(s).astype(np.float64), np.zeros(p["U"].value.shape[0])
        for x in X.sequence(s):
            q = h @ p["Wq"].value
            scores = np.tanh(m + q) @ p["v"].value if additive else (m @ q)[:, None]
            w = np.exp(scores - scores.max(0)) if len(m) else scores
            w = w / w.sum(0) if len(m) else w
            ctx = (w * m).sum(0)
            h = np.tanh(np.concatenate([x, ctx]) @ p["Wx"].value + h @ p["U"].value)
            out.append(h)
    return np.array(out)


@pytest.mark.parametrize("additive", [True, False])
def test_decoder_with_attention_on_every_backend(rng, additive):
    X = _memory(rng, [2, 1, 4, 0], 2)
    M = _memory(rng, [3, 0, 6, 2], 4)
    rnn, p = _decoder(rng, X, M, additive=additive)
    expected = _reference(X, M, p, additive)
    for backend in ["interpreter", *default_backends(rnn)]:
        out = rnn(backend=backend)
        assert out.lod == X.lod
        assert_close(out.data, expected.astype(np.float32), what=backend)


def test_static_inputs_combined_row_by_row_must_agree(rng):
    X = _memory(rng, [2, 1], 2)
    M, K = _memory(rng, [3, 2], 4), _memory(rng, [3, 2], 4)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        rnn.add_input(X, name="X")
        mem, keys = rnn.add_static_input(M, name="M"), rnn.add_static_input(K, name="K")
        h = rnn.add_memory(shape=[4], name="h")
        h.update(h.pre_state() + sn.ops.attention(h.pre_state(), mem, keys))
        rnn.add_outputs(h)
    for backend in ["interpreter", *default_backends(rnn)]:
        assert_close(rnn(backend=backend), rnn(backend="interpreter"))
        with pytest.raises(sn.LoDError, match="different (LoD|lengths)"):
            rnn(backend=backend, K=_memory(rng, [2, 3], 4))


@pytest.mark.parametrize("backend", ["interpreter", "numba", "cuda"])
def test_gradients_against_finite_differences(rng, backend):
    if backend not in sn.backends():
        pytest.skip(f"no {backend} backend here")
    X = _memory(rng, [2, 3, 0], 2)
    M = _memory(rng, [3, 1, 2], 3)
    X64 = sn.LoDTensor(X.data.astype(np.float64), X.lod)
    M64 = sn.LoDTensor(M.data.astype(np.float64), M.lod)
    rnn, p = _decoder(rng, X64, M64, H=3, dtype=np.float64)
    G = rng.standard_normal((X.shape[0], 3))

    def loss():
        return float((rnn(backend="interpreter").data * G).sum())

    grads = sn.gradients(rnn, wrt=[*p.values(), "M"], grad_outputs=[G], backend=backend)
    eps = 1e-6
    for name, g in zip([*p, "M"], grads):
        target = M64.data if name == "M" else p[name].value
        numeric = np.zeros(target.shape)
        for idx in np.ndindex(*target.shape):
            keep = target[idx]
            target[idx] = keep + eps
            up = loss()
            target[idx] = keep - eps
            numeric[idx] = (up - loss()) / (2 * eps)
            target[idx] = keep
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-7, err_msg=f"d{name}")


def test_gradients_against_torch_autograd(rng):
    # (the sizes and dtype of the finite differences' decoder: its kernels)
    torch = pytest.importorskip("torch")
    X = _memory(rng, [3, 2], 2).astype(np.float64)
    M = _memory(rng, [4, 2], 3).astype(np.float64)
    rnn, p = _decoder(rng, X, M, H=3, additive=True, dtype=np.float64)
    G = rng.standard_normal((X.shape[0], 3))
    grads = sn.gradients(rnn, wrt=[*p.values(), "M"], grad_outputs=[G], backend="numba")
    t = {n: torch.tensor(v.value, requires_grad=True) for n, v in p.items()}
    mem = torch.tensor(M.data, requires_grad=True)
    outs, offsets = [], M.levels[0]
    for s in range(X.num_sequences):
        m, h = mem[offsets[s]:offsets[s + 1]], torch.zeros(3, dtype=torch.float64)
        for x in torch.tensor(X.sequence(s)):
            w = torch.softmax(torch.tanh(m + h @ t["Wq"]) @ t["v"], dim=0)
            h = torch.tanh(torch.cat([x, (w * m).sum(0)]) @ t["Wx"] + h @ t["U"])
            outs.append(h)
    (torch.stack(outs) * torch.tensor(G)).sum().backward()
    for name, g in zip([*p, "M"], grads):
        expected = mem.grad if name == "M" else t[name].grad
        assert_close(g, expected.numpy(), what=f"d{name}")


def _weights_net(rng, X, M, reverse=False, dtype=np.float32):
    """A decoder over memory ``M`` giving its state and its attention weights."""
    W = sn.Parameter(rng.standard_normal((4, 8)).astype(dtype), name="W")
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        mem = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[8], name="h")
        w = sn.ops.seq_softmax(sn.ops.sum(mem * h.pre_state(), axis=-1, keepdims=True))
        h.update(sn.ops.tanh(sn.ops.seq_sum(w * mem) + x @ W))
        rnn.add_outputs(h, w)
    return rnn, W


def test_gradients_of_a_decoder_with_projected_input_and_context(rng):
    """``tanh(x @ W + attention(h, M) @ Wc)``: the context's product's weight
    gradient runs after the time loop from the context itself, a dense value,
    on every backend (the memory rows it is summed from stay in the loop)."""
    X = _memory(rng, [2, 1, 3], 2).astype(np.float64)
    M = _memory(rng, [1, 2, 2], 2).astype(np.float64)
    W, Wc = (sn.Parameter(rng.standard_normal((2, 2)), name=n) for n in ("W", "Wc"))
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        mem = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[2], name="h", dtype=np.float64)
        h.update(sn.ops.tanh(x @ W + sn.ops.attention(h.pre_state(), mem) @ Wc))
        rnn.add_outputs(h)
    G = rng.standard_normal((6, 2))
    expected = sn.gradients(rnn, wrt=[W, Wc, "X", "M"], grad_outputs=[G], backend="interpreter")
    step = 1e-6  # (and the interpreter's against finite differences)
    loss = lambda: float((rnn(backend="interpreter").data * G).sum())  # noqa: E731
    Wc.value[0, 1] += step
    up = loss()
    Wc.value[0, 1] -= 2 * step
    down = loss()
    Wc.value[0, 1] += step
    assert np.isclose((up - down) / (2 * step), expected[1][0, 1], rtol=1e-5)
    for backend in default_backends(rnn):
        got = sn.gradients(rnn, wrt=[W, Wc, "X", "M"], grad_outputs=[G], backend=backend)
        assert_close(got, expected, what=backend)


def test_a_step_value_with_lod_levels_of_its_own_read_by_an_op(rng):
    """A step input of two levels gives each step a sequence, its rows read by
    the segment ops as a nested net's every step (a bag of words per
    paragraph), with its gradients; CUDA refuses it by name."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 2)), [[2, 1], [1, 0, 4]])
    W = sn.Parameter(rng.standard_normal((2, 2)), name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[2], name="h", dtype=np.float64)
        h.update(sn.ops.tanh(sn.ops.seq_sum(x @ W) + h.pre_state()))
        rnn.add_outputs(h)
    expected = rnn(backend="interpreter")
    G = rng.standard_normal(expected.data.shape)
    gradients = sn.gradients(rnn, wrt=[W, "X"], grad_outputs=[G], backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=[W, "X"], grad_outputs=[G], backend=backend), gradients,
                     what=f"gradients, {backend}")
    if "cuda" in sn.backends():
        with pytest.raises(sn.UnsupportedError, match="cuda backend: step value .* has LoD levels "
                                                      "of its own"):
            rnn(backend="cuda")


def test_attention_weights_of_every_step_as_an_output(rng):
    """A ragged all-steps output: (sequence, step, that sequence's memory rows)."""
    M = _memory(rng, [3, 6, 0], 8)
    X = _memory(rng, [2, 3, 0], 4)
    rnn, _ = _weights_net(rng, X, M)
    expected = rnn(backend="interpreter")
    assert expected[1].lod == [[0, 2, 5, 5], [0, 3, 6, 12, 18, 24]]
    assert np.isclose(expected[1].data.sum(), 5.0)  # one softmax per step
    for backend in default_backends(rnn):
        assert_close(rnn(backend=backend), expected, what=backend)


@pytest.mark.parametrize("reverse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_gradient_of_every_step_s_attention_weights(reverse, rng):
    """docs/attention.md: against finite differences on the interpreter; on
    the Numba kernels (their backward reads the weights' cotangent at each
    step as the memory's rows), alone and beside the state's; the CUDA
    backend refuses it, naming the output, and runs the state's alone."""
    X64 = sn.LoDTensor(_memory(rng, [2, 3, 0], 4).data.astype(np.float64), [[0, 2, 5, 5]])
    M64 = sn.LoDTensor(_memory(rng, [3, 6, 0], 8).data.astype(np.float64), [[0, 3, 9, 9]])
    rnn, W = _weights_net(rng, X64, M64, reverse=reverse, dtype=np.float64)
    G = rng.standard_normal(rnn(backend="interpreter")[1].data.shape)
    (got,) = sn.gradients(rnn, wrt=[W], grad_outputs=[None, G], backend="interpreter")
    numeric, eps = np.zeros(W.value.shape), 1e-6
    for idx in np.ndindex(*W.value.shape):
        keep = W.value[idx]
        W.value[idx] = keep + eps
        up = float((rnn(backend="interpreter")[1].data * G).sum())
        W.value[idx] = keep - eps
        numeric[idx] = (up - float((rnn(backend="interpreter")[1].data * G).sum())) / (2 * eps)
        W.value[idx] = keep
    np.testing.assert_allclose(got, numeric, rtol=1e-6, atol=1e-8)
    H = rng.standard_normal(rnn(backend="interpreter")[0].data.shape)
    wrt = [W, "X", "M"]
    for cts in ([None, G], [H, G], [H, None]):
        expected = sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend="interpreter")
        for backend in available_backends():
            found = sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend=backend)
            assert_close(found, expected, what=f"{backend}, {[c is not None for c in cts]}")
    if "cuda" in default_backends(rnn):
        with pytest.raises(sn.UnsupportedError, match="cuda backend: the gradient of rnn's ragged "
                                                      "output t[0-9]+ .* backend='interpreter' or 'numba'"):
            sn.gradients(rnn, wrt=[W], grad_outputs=[None, G], backend="cuda")
        assert_close(sn.gradients(rnn, wrt=[W], grad_outputs=[H, None], backend="cuda"),
                     sn.gradients(rnn, wrt=[W], grad_outputs=[H, None], backend="interpreter"))


@pytest.mark.parametrize("groups", [False, True])
def test_a_prior_over_the_memory_given_at_each_step(groups, rng, monkeypatch):
    """A step input of two levels combined row by row with the memory: on
    the Numba kernels as on the interpreter (in sequence groups on threads
    too), with its gradients; a step of it with as many rows as its
    sequence's memory, or a LoDError on every backend."""
    if not groups:
        lengths, steps = [3, 6, 0, 2], [2, 3, 1, 0]
    else:
        monkeypatch.setattr(threads, "SPLIT_MIN_WORK", 1)
        lengths, steps = rng.integers(0, 40, 96).tolist(), rng.integers(0, 30, 96).tolist()
    rnn, W = attention_prior(rng, lengths, steps)
    expected = rnn(backend="interpreter")
    cts = [rng.standard_normal(expected[0].data.shape), rng.standard_normal(expected[1].data.shape)]
    grads = sn.gradients(rnn, wrt=[W, "prior", "M"], grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=[W, "prior", "M"], grad_outputs=cts, backend=backend),
                     grads, what=f"{backend} gradients")
    P = rnn.bindings["prior"].value
    wrong = np.array(P.lod[1])
    wrong[1:] += 1  # (one row more at a step of the first sequence)
    bad = sn.LoDTensor(np.zeros((P.data.shape[0] + 1, 1)), [P.lod[0], wrong])
    for backend in ["interpreter", *available_backends()]:
        with pytest.raises(sn.LoDError, match="prior|different LoD"):
            rnn(backend=backend, prior=bad)


@pytest.mark.parametrize("reverse", [False, True])
def test_attention_weights_of_the_last_step_as_an_output(reverse, rng):
    """A ragged last-step output computed in the step (not a memory): each
    sequence's weights at its last step processed, on every backend (the
    compiled ones compute every step's and take the last); none for a
    sequence of no steps. Gradients run beside it; one for it is refused."""
    M = _memory(rng, [3, 6, 2], 8)
    X = _memory(rng, [2, 3, 0], 4)
    rnn, W = _weights_net(rng, X, M, reverse)
    every = rnn(backend="interpreter")[1]
    expected = rnn(backend="interpreter", output_all_steps=False)
    assert expected[1].lod == [[0, 3, 9, 9]]
    # the last step processed: each sequence's last step entry (reverse: its first)
    rows = [every.data[0:3], every.data[6:12]] if reverse else [every.data[3:6], every.data[18:24]]
    assert_close(expected[1].data, np.concatenate(rows))
    G = rng.standard_normal((3, 8)).astype(np.float32)
    wanted = sn.gradients(rnn, wrt=[W], grad_outputs=[G, None], output_all_steps=False,
                          backend="interpreter")
    for backend in default_backends(rnn):
        assert_close(rnn(backend=backend, output_all_steps=False), expected, what=backend)
        assert_close(rnn(backend=backend, output_all_steps=(False, True))[1], every, what=backend)
        if backend == "cuda":  # (rows on the device: the output stays there)
            got = rnn(backend=backend, output_all_steps=False, X=X.to_device(), M=M.to_device())[1]
            assert got.on_device
            assert_close(got.to_host(), expected[1], what=f"{backend}, on the device")
    none = sn.LoDTensor.from_lengths(np.zeros((0, 4), np.float32), [[0, 0, 0]])  # (no step)
    for backend in default_backends(rnn):
        for flags in (True, False):
            got, want = rnn(backend=backend, X=none, output_all_steps=flags)[1], \
                rnn(backend="interpreter", X=none, output_all_steps=flags)[1]
            assert got.lod == want.lod and got.data.shape == want.data.shape, (backend, flags)
    for backend in available_backends():
        got = sn.gradients(rnn, wrt=[W], grad_outputs=[G, None], output_all_steps=False,
                           backend=backend)
        assert_close(got, wanted, what=backend)
        _, pullback = sn.vjp(rnn, output_all_steps=False, backend=backend)
        with pytest.raises(sn.UnsupportedError, match="the last step of the ragged output"):
            pullback([G, np.ones_like(expected[1].data)])


@pytest.mark.parametrize("reverse", [(False, False), pytest.param((True, True), marks=pytest.mark.slow)])
@pytest.mark.parametrize("from_outer", [False, True])
def test_attention_over_a_nested_nets_every_step(from_outer, reverse, rng):
    """A hierarchical attention network's word attention: the segment ops
    over a nested net's every step (each paragraph's words; empty ones
    too), the nested net and the attention run once before the loop or at
    each step; the weights given out, for every step or each chapter's
    last. The CUDA backend refuses such a nested net by name."""
    rnn, _ = word_attention(rng, dtype=np.float64, from_outer=from_outer, reverse=reverse)
    for all_steps in (True, False):
        expected = rnn(backend="interpreter", output_all_steps=all_steps)
        assert len(expected[1].lod) == (2 if all_steps else 1)  # (chapters, paragraphs, words)
        for backend in available_backends():
            assert_close(rnn(backend=backend, output_all_steps=all_steps), expected, what=backend)
    if "cuda" in sn.backends():
        with pytest.raises(sn.UnsupportedError, match="cuda backend: nested step-net words .*; it runs on"):
            rnn(backend="cuda")


def _over_memory(rng, X, M, reverse, use, scale=None):
    """A net whose nested net steps over its ragged static input ``M`` (one
    step a memory row), started from the enclosing state, used as ``use``
    says: its last step, its every step summed or attended to, or its every
    step summed and given as an output too."""
    U = sn.Parameter(rng.standard_normal((3, 3)) * 0.5, name="U")
    rnn = sn.create_rnn_op(reverse=reverse[0])
    with rnn.stepnet():
        x, m = rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M")
        c = rnn.add_memory(shape=[3], name="c", dtype=np.float64)
        source = m if scale is None else m * scale
        inner = sn.create_rnn_op(reverse=reverse[1])
        with inner.stepnet():
            h = inner.add_memory(c.pre_state(), name="h")
            w = inner.add_input(source, name="w")
            h.update(sn.ops.tanh(w + h.pre_state() @ U))
            inner.add_outputs(h)
        r = {"last": lambda: inner(output_all_steps=False), "attention":
             lambda: sn.ops.attention(c.pre_state(), inner())}.get(use, lambda: sn.ops.seq_sum(inner()))
        c.update(sn.ops.tanh(r() + x + c.pre_state() @ U))
        rnn.add_outputs(c, *[inner()] * (use == "output"))
    return rnn


@pytest.mark.parametrize("use,reverse", spread_params(
    ["last", "summed", "attention", "output"], [(False, False), (True, False), (False, True)],
    way_ids=lambda r: "-".join("reverse" if x else "forward" for x in r)))
def test_a_nested_net_steps_over_the_memory_of_the_enclosing_net(use, reverse, rng):
    """On Numba and on the executor (step by step, the nested net over each
    step's rows of the memory) as on the interpreter, a sequence of no steps
    and an empty memory included."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)), [[2, 0, 3, 1]])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((8, 3)), [[3, 4, 0, 1]])
    rnn = _over_memory(rng, X, M, reverse, use)
    _executor_agrees(rnn)
    for flags in (True, False):
        expected = rnn(backend="interpreter", output_all_steps=flags)
        assert_close(rnn(backend="numba", output_all_steps=flags), expected, what=f"{use} {flags}")
    if use == "last" and reverse == (False, False):  # over a ragged value computed in the step
        computed = _over_memory(rng, X, M, reverse, use, scale=2.0)
        _executor_agrees(computed)
        for flags in (True, False):
            assert_close(computed(backend="numba", output_all_steps=flags),
                         computed(backend="interpreter", output_all_steps=flags), what="computed")


def _over_memory_and_prior(rng, rows):
    """A net whose nested net steps over its ragged static input ``M`` and,
    beside it, over ``P``, a step input of two levels: at each step as many
    rows as the sequence's memory (``rows``: each step's)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)), [[2, 0, 3, 1]])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((8, 3)), [[3, 4, 0, 1]])
    P = sn.LoDTensor.from_lengths(rng.standard_normal((sum(rows), 3)), [[2, 0, 3, 1], rows])
    U = sn.Parameter(rng.standard_normal((3, 3)) * 0.5, name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, m, p = (rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M"),
                   rnn.add_input(P, name="P"))
        c = rnn.add_memory(shape=[3], name="c", dtype=np.float64)
        read = sn.ops.seq_sum(p * m)  # (the prior read at the memory's rows before the nested net)
        inner = sn.create_rnn_op()
        with inner.stepnet():
            h = inner.add_memory(c.pre_state(), name="h")
            w, q = inner.add_input(m, name="w"), inner.add_input(p, name="q")
            h.update(sn.ops.tanh(w * q + h.pre_state() @ U))
            inner.add_outputs(h)
        c.update(sn.ops.tanh(sn.ops.seq_sum(inner()) + read + x + c.pre_state() @ U))
        rnn.add_outputs(c)
    return rnn, U


def test_a_nested_net_steps_over_the_memory_and_a_prior_per_step(rng):
    """The nested net reads the prior's rows of each step at the memory's
    rows (its data lies elsewhere): outputs and gradients (of the weights,
    the memory, the prior and the input) on Numba as on the interpreter; a
    step of the prior with more or fewer rows than the sequence's memory is
    a LoDError naming both, before anything runs."""
    rnn, U = _over_memory_and_prior(rng, [3, 3, 0, 0, 0, 1])
    expected = rnn(backend="interpreter")
    wrt = [U, "M", "P", "X"]
    cts = _fd_check(rnn, wrt)
    grads = sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend=backend), grads,
                     what=f"{backend} gradients")
    wrong, _ = _over_memory_and_prior(rng, [3, 2, 0, 0, 0, 1])
    for backend in available_backends():
        with pytest.raises(sn.LoDError, match="M and P .* different lengths"):
            wrong(backend=backend)


@pytest.mark.parametrize("nested", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_step_reads_the_memory_and_a_two_level_input_apart(nested, rng):
    """A step summing a function of its memory's rows and, apart, of a step
    input of two levels (words per step, as many as they are): each over its
    own rows (one fused loop over both read them at one space and refused
    the call, their lengths differing), outputs and gradients on Numba as on
    the interpreter; ``nested``: the memory's rows through a nested net
    stepping over them."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)), [[2, 0, 3, 1]])
    W = sn.LoDTensor.from_lengths(rng.standard_normal((9, 3)), [[2, 0, 3, 1], [2, 1, 0, 3, 1, 2]])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((8, 3)), [[3, 4, 0, 1]])
    U = sn.Parameter(rng.standard_normal((3, 3)) * 0.5, name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, m, w = rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M"), rnn.add_input(W, name="W")
        c = rnn.add_memory(shape=[3], name="c", dtype=np.float64)
        rows = m
        if nested:
            inner = sn.create_rnn_op()
            with inner.stepnet():
                h = inner.add_memory(c.pre_state(), name="h")
                h.update(sn.ops.tanh(inner.add_input(m, name="r") + h.pre_state() @ U))
                inner.add_outputs(h)
            rows = inner()
        c.update(sn.ops.tanh(sn.ops.seq_sum(sn.ops.exp(rows * c.pre_state()))
                             + sn.ops.seq_sum(w * c.pre_state()) + x))
        rnn.add_outputs(c)
    expected = rnn(backend="interpreter")
    wrt = ["M", "W", "X"] + [U] * nested
    cts = [np.ones(expected.data.shape)]
    grads = sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend=backend), grads,
                     what=f"{backend} gradients")


def test_attention_to_two_memories_of_different_lengths(rng):
    """A decoder attending to two memories whose sequences have different
    lengths: its backward's ops over each memory's rows, side by side in a
    step, loop each over their own (one loop over one memory's rows read
    the other's wrongly and wrote past its end); outputs and gradients on
    Numba as on the interpreter."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)), [[2, 0, 3, 1]])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((8, 3)), [[3, 4, 0, 1]])
    K = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)), [[1, 1, 2, 1]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, m, k = (rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M"),
                   rnn.add_static_input(K, name="K"))
        c = rnn.add_memory(shape=[3], name="c", dtype=np.float64)
        c.update(sn.ops.tanh(sn.ops.attention(c.pre_state(), m) + sn.ops.attention(c.pre_state(), k) + x))
        rnn.add_outputs(c)
    expected = rnn(backend="interpreter")
    cts = [rng.standard_normal(expected.data.shape)]
    grads = sn.gradients(rnn, wrt=["M", "K", "X"], grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=["M", "K", "X"], grad_outputs=cts, backend=backend), grads,
                     what=f"{backend} gradients")


def _executor_agrees(rnn):
    """The executor's outputs (all steps, and each sequence's last) against the interpreter's."""
    for flags in (True, False):
        program = rnn.program(rnn.all_steps_flags(flags))
        args, consts = rnn.bind(), rnn.const_values()
        found = executor.compile_program(program)(args, consts)
        assert_close(found, interpreter.compile_program(program)(args, consts),
                     what=f"executor, output_all_steps={flags}")


@pytest.mark.parametrize("reverse", [False, True])
def test_a_nested_net_attends_to_the_memory_of_the_enclosing_net(reverse, rng):
    """A nested net's static input that is its enclosing net's (one memory
    per document, read by each sentence's words) on every backend, with a
    document of no sentences, a sentence of no words and an empty memory;
    keys the enclosing step computes over the memory's rows (the document's
    state times its keys), outputs and gradients."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((7, 4)).astype(np.float32),
                                  [[2, 1, 0, 2], [1, 3, 0, 2, 1]])
    M, K = _memory(rng, [3, 0, 1, 2], 4), _memory(rng, [3, 0, 1, 2], 4)
    top, W = document_attention(rng, X, M, K, reverse)
    expected = top(backend="interpreter")
    for backend in available_backends():
        assert_close(top(backend=backend), expected, what=backend)
        assert_close(top(backend=backend, output_all_steps=False)[0],
                     top(backend="interpreter", output_all_steps=False)[0], what=backend)
    top, W = document_attention(rng, X, M, K, reverse, keys_of_the_step=True)
    expected = top(backend="interpreter")  # (the keys computed in the enclosing step)
    cts = [rng.standard_normal(o.data.shape).astype(np.float32) for o in expected]
    grads = sn.gradients(top, wrt=[W, "M", "K", "X"], grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(top(backend=backend), expected, what=f"{backend}, keys of the step")
        if not reverse:  # (the gradients once: their compile is most of the test's time)
            assert_close(sn.gradients(top, wrt=[W, "M", "K", "X"], grad_outputs=cts, backend=backend),
                         grads, what=f"{backend} gradients, keys of the step")
    top, _ = document_attention(rng, X, M, K, reverse, weights_out=True)
    for backend in available_backends():  # (the words' weights of every step)
        with pytest.raises(sn.UnsupportedError, match="gives a ragged value over its static input"):
            top(backend=backend)


def _fd_check(rnn, wrt):
    """The interpreter's gradients of ``rnn`` (float64) for random
    cotangents of its all-steps outputs against finite differences: those
    cotangents."""
    flags = rnn.all_steps_flags(True)
    cts = random_cotangents(np.random.default_rng(11), as_tuple(rnn(backend="interpreter")))
    found = sn.gradients(rnn, wrt=wrt, grad_outputs=cts, backend="interpreter")
    assert_fd_close(found, fd_gradients(rnn, wrt, cts, flags, {}), wrt)
    return cts


@pytest.mark.parametrize("form,reverse", [("products", False), ("where", True), ("slices", False)])
def test_ops_combining_a_prior_with_the_memory_rows(form, reverse, rng):
    """A step input of two levels (three features a row) read by products,
    comparisons and slices beside the memory's rows, and summed apart from
    it: the Numba kernels' outputs and gradients (of the weights, the prior,
    the memory and the inputs) are the interpreter's."""
    lengths, steps = [3, 6, 0, 2, 5], [2, 3, 1, 0, 4]
    rows = [n for n, t in zip(lengths, steps) for _ in range(t)]
    M, X = (sn.LoDTensor.from_lengths(rng.standard_normal((sum(n), w)), [n])
            for n, w in ((lengths, 8), (steps, 4)))
    P = sn.LoDTensor.from_lengths(rng.standard_normal((sum(rows), 3)), [steps, rows])
    V, U, W = (sn.Parameter(rng.standard_normal(s) * 0.3, name=n)
               for n, s in (("V", (8, 3)), ("U", (3, 8)), ("W", (4, 8))))
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x, p = rnn.add_input(X, name="X"), rnn.add_input(P, name="P")
        mem = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[8], name="h", dtype=np.float64)
        if form == "products":
            r = sn.ops.seq_sum(sn.ops.tanh(mem @ V + p) @ U)
        elif form == "where":
            r = sn.ops.seq_max(sn.ops.where(sn.ops.greater(p @ U, 0.0), mem, 0.0) * h.pre_state())
        else:
            r = sn.ops.seq_sum(p @ U) + sn.ops.seq_sum(mem * sn.ops.exp(p[:, 1:2]))
        h.update(sn.ops.tanh(r + x @ W + h.pre_state() * 0.5))
        rnn.add_outputs(h)
    expected = rnn(backend="interpreter")
    G = rng.standard_normal(expected.data.shape)
    wrt = rnn.parameters() + ["P", "M", "X"]
    grads = sn.gradients(rnn, wrt=wrt, grad_outputs=[G], backend="interpreter")
    for backend in available_backends():
        assert_close(rnn(backend=backend), expected, what=backend)
        assert_close(sn.gradients(rnn, wrt=wrt, grad_outputs=[G], backend=backend), grads,
                     what=f"{backend} gradients")


@pytest.mark.parametrize("reverse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradients_through_a_nested_nets_memory_of_the_enclosing_net(reverse, rng):
    """A nested net reading its enclosing net's ragged static inputs (each
    word attends to its document's memory), or stepping over one (one step a
    memory row; its every step also an output, whose cotangent is a
    two-level step input of the backward): gradients of the weights, the
    memories and the inputs against finite differences on the interpreter,
    and on the Numba kernels as there (an accumulator over the document's
    memory rows per sentence; the nested net's forward run again in the
    backward's step, and its backward stepping over what that computes)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((7, 4)), [[2, 1, 0, 2], [1, 3, 0, 2, 1]])
    M, K = (sn.LoDTensor.from_lengths(rng.standard_normal((6, 4)), [[3, 0, 1, 2]]) for _ in "MK")
    top, W = document_attention(rng, X, M, K, reverse)
    wrt = [W, "M", "K", "X"]
    cts = _fd_check(top, wrt)
    expected = sn.gradients(top, wrt=wrt, grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(sn.gradients(top, wrt=wrt, grad_outputs=cts, backend=backend), expected,
                     what=backend)
    Y = sn.LoDTensor.from_lengths(rng.standard_normal((6, 3)), [[2, 0, 3, 1]])
    N = sn.LoDTensor.from_lengths(rng.standard_normal((8, 3)), [[3, 4, 0, 1]])
    over = _over_memory(rng, Y, N, (reverse, not reverse), "output")
    (U,) = over.parameters()
    cts = _fd_check(over, [U, "M", "X"])
    expected = sn.gradients(over, wrt=[U, "M", "X"], grad_outputs=cts, backend="interpreter")
    for backend in available_backends():
        assert_close(sn.gradients(over, wrt=[U, "M", "X"], grad_outputs=cts, backend=backend),
                     expected, what=f"{backend}, stepping over the memory")


def test_special_values_behave_as_on_the_interpreter():
    """NaN and inf in the memory go through seq_sum, seq_max, seq_expand and
    seq_softmax on numba as on the interpreter (NaN wins a maximum)."""
    values = np.array([[np.nan, 1.0], [2.0, np.inf], [-np.inf, 3.0], [0.5, -1.0], [np.inf, -np.inf],
                       [4.0, 5.0], [0.0, -0.0], [-0.0, -0.0]], np.float32)
    M = sn.LoDTensor.from_lengths(values, [[2, 1, 3, 2]])  # (0.0 and -0.0 tie in a maximum)
    X = sn.LoDTensor.from_lengths(np.ones((4, 2), np.float32), [[1, 1, 1, 1]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        mem = rnn.add_static_input(M, name="M")
        rnn.add_outputs(sn.ops.seq_sum(mem) + x, sn.ops.seq_max(mem), sn.ops.seq_softmax(mem),
                        sn.ops.seq_expand(x, mem) * mem)
    expected = rnn(backend="interpreter")
    assert np.isnan(expected[1].data[0, 0])
    for backend in default_backends(rnn):
        for actual, want in zip(rnn(backend=backend), expected):
            np.testing.assert_allclose(_data(actual), _data(want), rtol=1e-6,  # NaN, inf: equal
                                       err_msg=backend)
        maximum = _data(rnn(backend=backend)[1])
        np.testing.assert_array_equal(np.signbit(maximum[3]), np.signbit(_data(expected[1])[3]))


def test_the_example_of_docs_attention_md_runs():
    """docs/attention.md's first example, as written (numba by default)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "attention.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(code, "docs/attention.md", "exec"), scope)  # noqa: S102
    assert scope["dW"].shape == (12, 16) and scope["dM"].shape == (9, 8)
    assert scope["Y"].lod == [[0, 2, 5]]
