"""Step-nets and data that several test files build: one builder each.

* :func:`weight` and :func:`lod`: a Parameter scaled by its fan-in, and a
  random LoDTensor of given lengths.
* :func:`tanh_cell` and :func:`gru_net`: a one-product cell and a
  PyTorch-style GRU written in the DSL.
* :func:`small_gru`: a one-gate GRU-like cell on random data of given lengths.
* :func:`nested_encoder`: the README's two-level encoder (chapters of
  paragraphs of words), with the variations the tests use.
* :func:`word_attention`: a hierarchical attention network's paragraph
  encoder, the segment ops over a nested net's every step.
* :func:`attention_prior`: a decoder's attention over its memory with a
  prior given at each step (a step input of two levels combined row by row
  with the memory), giving its attention weights.
* :func:`document_attention`: a nested net attending to its enclosing
  net's memory (a memory per document read by each sentence's words).
* :func:`zero_width_net`: products with no terms or no columns.
"""

from types import SimpleNamespace

import numpy as np

import stepnet as sn

CHAPTERS = [[2, 0, 3, 1], [3, 0, 4, 1, 2, 0]]  # 4 chapters, 6 paragraphs, 10 words; empty ones


def weight(rng, *shape, dtype=np.float32, name=None):
    """A Parameter of standard normal values over the square root of its
    first dimension (its fan-in)."""
    return sn.Parameter((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype), name=name)


def lod(rng, lengths, width, dtype=np.float32):
    """A LoDTensor of standard normal rows of ``width`` features.
    ``lengths``: one level's sequence lengths, or a list of levels."""
    levels = lengths if lengths and isinstance(lengths[0], (list, tuple)) else [lengths]
    data = rng.standard_normal((sum(levels[-1]), width)).astype(dtype)
    return sn.LoDTensor.from_lengths(data, levels)


def tanh_cell(X, W):
    """``h = tanh(x @ W + h_prev)``, ``h`` starting from zeros: the smallest
    step-net with a product and a memory (default names)."""
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[W.shape[1]])
        h.update(sn.ops.tanh(x @ W + h.pre_state()))
        rnn.add_outputs(h)
    return rnn


def named_tanh_net(X, W, U=None, **memory):
    """``h = tanh(x @ W + h_prev (@ U))`` with its input named ``x`` and its
    memory ``h`` (``memory``: add_memory's ``shape=`` or ``init=``)."""
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(name="h", **memory)
        hp = h.pre_state()
        h.update(sn.ops.tanh(x @ W + (hp if U is None else hp @ U)))
        rnn.add_outputs(h)
    return rnn


def gru_net(X, rng, hidden=6, reverse=False, dtype=np.float32):
    """A PyTorch-style GRU: three input matmuls (one hoisted GEMM) and three
    recurrent ones (one packed GEMM per step)."""
    width = X.shape[1]
    Wr, Wz, Wn = (weight(rng, width, hidden, dtype=dtype) for _ in range(3))
    Ur, Uz, Un = (weight(rng, hidden, hidden, dtype=dtype) for _ in range(3))
    br, bz, bn, bhn = (weight(rng, hidden, dtype=dtype) for _ in range(4))
    rnn = sn.create_rnn_op(reverse=reverse)
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[hidden], name="h")
        hp = h.pre_state()
        r = sn.ops.sigmoid(x @ Wr + br + hp @ Ur)
        z = sn.ops.sigmoid(x @ Wz + bz + hp @ Uz)
        n = sn.ops.tanh(x @ Wn + bn + r * (hp @ Un + bhn))
        h.update((1 - z) * n + z * hp)
        rnn.add_outputs(h)
    return rnn


def nested_encoder(rng, lengths=CHAPTERS, features=3, hidden=4, dtype=np.float32, *,
                   reverse_outer=False, reverse_inner=False, start_from_outer=False,
                   inner_reads_outer=False, static=False, init=False,
                   outputs=("h", "words", "last")):
    """Chapters of paragraphs of words, ``X`` of LoD ``lengths`` (two levels)::

        outer net, over a chapter's paragraphs; memory h (zeros, or H0 with ``init``)
            inner net "words", over a paragraph's words; memory hw (zeros, or
            h's pre-state with ``start_from_outer``)
                hw = tanh(word @ W + hw_prev @ U [+ G] [+ h_prev @ Q])
            last = the inner net's last step
            h = tanh(last @ V + h_prev @ R)

    ``static``: ``G`` is a static input of the outer net (one row per
    chapter) that the inner net reads; ``inner_reads_outer``: the inner update
    reads the outer memory (``h_prev @ Q``). With neither, nor
    ``start_from_outer``, the inner net reads only its words (it can run once
    over every paragraph before the outer loop). ``outputs``: the outer net's
    outputs, by name: ``h``, ``words`` (the inner net's every step: X's
    two-level LoD) and ``last``.

    Returns a namespace: ``rnn``, ``X``, ``x`` (X's rows), ``lengths``, the
    weights ``W``, ``U``, ``V``, ``R``, ``Q`` (arrays), ``G`` and ``H0``
    (arrays, or None when not asked).
    """
    dtype = np.dtype(dtype)
    num_chapters = len(lengths[0])
    x = rng.standard_normal((sum(lengths[1]), features)).astype(dtype)
    X = sn.LoDTensor.from_lengths(x, lengths)
    shapes = {"W": (features, hidden), "U": (hidden, hidden), "V": (hidden, hidden),
              "R": (hidden, hidden), "Q": (hidden, hidden)}
    arrays = {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(dtype) for k, s in shapes.items()}
    W, U, V, R, Q = (sn.Parameter(arrays[k], name=k) for k in shapes)
    G = rng.standard_normal((num_chapters, hidden)).astype(dtype) if static else None
    H0 = rng.standard_normal((num_chapters, hidden)).astype(dtype) if init else None

    rnn = sn.create_rnn_op(output_num=len(outputs), reverse=reverse_outer)
    with rnn.stepnet():
        paragraph = rnn.add_input(X, name="X")
        g = rnn.add_static_input(G, name="G") if static else None
        h = rnn.add_memory(init=H0, name="h") if init else rnn.add_memory(shape=[hidden], name="h")
        hp = h.pre_state()
        inner = sn.create_rnn_op(reverse=reverse_inner, name="words")
        with inner.stepnet():
            word = inner.add_input(paragraph, name="word")
            hw = (inner.add_memory(init=hp, name="hw") if start_from_outer
                  else inner.add_memory(shape=[hidden], name="hw"))
            pre = word @ W + hw.pre_state() @ U
            if static:  # read from the enclosing step: one row per paragraph
                pre = pre + g
            if inner_reads_outer:
                pre = pre + hp @ Q
            hw.update(sn.ops.tanh(pre))
            inner.add_outputs(hw)
        named = {"h": h, "words": inner() if "words" in outputs else None,
                 "last": inner(output_all_steps=False)}
        h.update(sn.ops.tanh(named["last"] @ V + hp @ R))
        rnn.add_outputs(*(named[name] for name in outputs))
    return SimpleNamespace(rnn=rnn, X=X, x=x, lengths=lengths, G=G, H0=H0, **arrays)


def word_attention(rng, lengths=CHAPTERS, features=3, hidden=4, dtype=np.float32, *,
                   from_outer=False, reverse=(False, False)):
    """A hierarchical attention network's encoder (chapters of paragraphs of
    words): the nested net "words" over each paragraph's words, the
    paragraph vector an attention over their states::

        u = tanh(words @ A [+ seq_expand(h_prev @ Q, words)])
        a = seq_softmax(u @ v)
        h = tanh(seq_sum(words * a) @ V + h_prev @ R)

    With ``from_outer`` the nested net starts from ``h_prev`` and the
    attention's query reads it: both run at each step; without, the nested
    net reads only its words and runs once over every paragraph before the
    outer loop, the attention with it. Outputs ``h`` and ``a`` (the weights:
    X's two-level LoD). Returns ``(rnn, X)``."""
    X = lod(rng, lengths, features, dtype)
    A, Q, V, R = (weight(rng, *s, dtype=dtype, name=n) for n, s in
                  [("A", (hidden, hidden)), ("Q", (hidden, hidden)), ("V", (hidden, hidden)),
                   ("R", (hidden, hidden))])
    W, U, v = weight(rng, features, hidden, dtype=dtype), weight(rng, hidden, hidden, dtype=dtype), \
        weight(rng, hidden, 1, dtype=dtype)
    rnn = sn.create_rnn_op(output_num=2, reverse=reverse[0])
    with rnn.stepnet():
        paragraph = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[hidden], name="h", dtype=dtype)
        hp = h.pre_state()
        inner = sn.create_rnn_op(reverse=reverse[1], name="words")
        with inner.stepnet():
            hw = inner.add_memory(init=hp if from_outer else None, shape=[hidden], name="hw",
                                  dtype=dtype)
            hw.update(sn.ops.tanh(inner.add_input(paragraph, name="word") @ W + hw.pre_state() @ U))
            inner.add_outputs(hw)
        words = inner()
        u = words @ A
        if from_outer:
            u = u + sn.ops.seq_expand(hp @ Q, words)
        a = sn.ops.seq_softmax(sn.ops.tanh(u) @ v)
        h.update(sn.ops.tanh(sn.ops.seq_sum(words * a) @ V + hp @ R))
        rnn.add_outputs(h, a)
    return rnn, X


def small_gru(rng, lengths, features=8, hidden=16):
    """A GRU-like cell (one gate) on random inputs of ``lengths`` and a
    random initial state."""
    rows = sum(lengths[-1])
    X = sn.LoDTensor.from_lengths(rng.standard_normal((rows, features)).astype(np.float32),
                                  lengths)
    W = sn.Parameter(rng.standard_normal((features, hidden)).astype(np.float32) * 0.3, name="W")
    U = sn.Parameter(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, name="U")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=rng.standard_normal((len(lengths[0]), hidden)).astype(np.float32),
                           name="h")
        z = sn.ops.sigmoid(x @ W + h.pre_state() @ U)
        h.update(z * h.pre_state() + (1 - z) * sn.ops.tanh(x @ W))
        rnn.add_outputs(h)
    return rnn


def memory_decoder(rng, dtype=np.float32):
    """``h = tanh(x @ A + attention(h_prev, M))``: a step input ``X`` of
    lengths [3, 2] and a ragged static input ``M`` (a decoder's memory) of
    lengths [1, 4], 3 features each. Returns ``(rnn, X, M, A)``."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(dtype), [[3, 2]])
    M = sn.LoDTensor.from_lengths(rng.standard_normal((5, 3)).astype(dtype), [[1, 4]])
    A = sn.Parameter((rng.standard_normal((3, 3)) * 0.5).astype(dtype), name="A")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, mem = rnn.add_input(X, name="X"), rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[3], name="h")
        h.update(sn.ops.tanh(x @ A + sn.ops.attention(h.pre_state(), mem)))
        rnn.add_outputs(h)
    return rnn, X, M, A


def attention_prior(rng, lengths, steps, width=8, dtype=np.float64):
    """A decoder over a memory ``M`` of sequence ``lengths`` whose scores add
    a prior given at each step (``prior``: a step input of two levels, each
    step as many rows as its sequence's memory), over inputs ``X`` of
    ``steps`` steps. Gives its state and its attention weights.
    Returns ``(rnn, W)``."""
    M, X = lod(rng, lengths, width, dtype), lod(rng, steps, 4, dtype)
    P = lod(rng, [steps, [n for n, t in zip(lengths, steps) for _ in range(t)]], 1, dtype)
    W = weight(rng, 4, width, dtype=dtype, name="W")
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, p = rnn.add_input(X, name="X"), rnn.add_input(P, name="prior")
        mem = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[width], name="h", dtype=dtype)
        w = sn.ops.seq_softmax(sn.ops.sum(mem * h.pre_state(), axis=-1, keepdims=True) + p)
        h.update(sn.ops.tanh(sn.ops.seq_sum(w * mem) + x @ W))
        rnn.add_outputs(h, w)
    return rnn, W


def document_attention(rng, X, M, K, reverse, keys_of_the_step=False, weights_out=False):
    """Documents -> sentences -> words, a memory per document (values ``M``,
    keys ``K``: ragged static inputs): each word attends to its document's
    memory in a nested net "words" (in X's dtype). ``keys_of_the_step``: the
    keys computed in the enclosing step; ``weights_out``: the words' weights
    of every step given out. Returns ``(rnn, W)``."""
    W = sn.Parameter(rng.standard_normal((4, 4)).astype(X.dtype) * 0.5, name="W")
    top = sn.create_rnn_op(name="documents", reverse=reverse)
    with top.stepnet():
        sentence = top.add_input(X, name="X")
        values = top.add_static_input(M, name="M")
        keys = top.add_static_input(K, name="K")
        s = top.add_memory(shape=[4], name="s", dtype=X.dtype)
        if keys_of_the_step:  # (a ragged value computed at each step of the enclosing net)
            keys = keys * s.pre_state()
        words = sn.create_rnn_op(name="words", reverse=reverse)
        with words.stepnet():
            w = words.add_input(sentence)
            m, k = words.add_static_input(values), words.add_static_input(keys)
            h = words.add_memory(init=s.pre_state(), name="h")
            a = sn.ops.seq_softmax(sn.ops.sum(k * h.pre_state(), axis=-1, keepdims=True))
            h.update(sn.ops.tanh(w @ W + sn.ops.seq_sum(a * m)))
            words.add_outputs(h, *[a] * weights_out)
        s.update(words(output_all_steps=False)[0] if weights_out else words(output_all_steps=False))
        top.add_outputs(s, words()[1] if weights_out else sn.ops.seq_softmax(
            sn.ops.sum(values * s.pre_state(), axis=-1, keepdims=True)))
    return top, W


def zero_width_net(rng, lengths):
    """A step-net whose products have no terms (an input of width 0 by
    ``[0, 4]`` weights, before the loop and per step) or no columns (by
    ``[4, 0]``); float64. ``[20] * 40 + [60]``: rows enough for the
    library's products, and a last sequence whose steps alone take one row."""
    X = sn.LoDTensor.from_lengths(np.zeros((sum(lengths), 0)), [lengths])
    Z = sn.LoDTensor.from_lengths(rng.standard_normal((sum(lengths), 4)), [lengths])
    U = sn.Parameter(rng.standard_normal((4, 4)) * 0.5, name="U")
    weights = [U, sn.Parameter(np.zeros((0, 4)), name="W0"), sn.Parameter(np.zeros((4, 0)), name="Wn"),
               sn.Parameter(np.zeros((0, 4)), name="V0")]
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x, z = rnn.add_input(X, name="x"), rnn.add_input(Z, name="z")
        h = rnn.add_memory(init=np.ones(4), name="h")
        e = rnn.add_memory(shape=[0], name="e", dtype=np.float64)
        e.update(sn.ops.tanh(z @ weights[2] + e.pre_state()))
        h.update(sn.ops.tanh(x @ weights[1] + h.pre_state() @ U + e.pre_state() @ weights[3] + z))
        rnn.add_outputs(h, e)
    return rnn, weights
