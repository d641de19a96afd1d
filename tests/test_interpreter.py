"""The reference interpreter against independent per-sequence NumPy loops.

Every oracle here walks each sequence on its own, row by row, with offsets
computed in this file; it shares no code with stepnet. The main cases go
through ``assert_backends_agree``, so every other backend is compared with the
interpreter on them too.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import assert_backends_agree, assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from nets import CHAPTERS, nested_encoder

import stepnet as sn

IN, HID = 3, 4


def offsets(lengths):
    """Row offsets of consecutive sequences of the given lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out


def steps(start, stop, reverse):
    """The positions of one sequence in the order they are processed."""
    return range(stop - 1, start - 1, -1) if reverse else range(start, stop)


def weights(rng, dtype, *shapes):
    return [(rng.standard_normal(s) * 0.5).astype(dtype) for s in shapes]


# ---------------------------------------------------------------------------
# One level: an Elman cell with a static input, two memories, three outputs
# ---------------------------------------------------------------------------


def elman_oracle(x, lengths, W, U, b, S, h0, c0, reverse):
    """h = tanh(x W + h U + b + S[seq]); c = 0.5 c + h; y = h * c."""
    offs = offsets(lengths)
    dtype = W.dtype
    all_h, all_c, all_y = (np.zeros((len(x), HID), dtype) for _ in range(3))
    last_h, last_c = h0.copy(), c0.copy()
    last_y = np.zeros((len(lengths), HID), dtype)
    for s in range(len(lengths)):
        h, c = h0[s].copy(), c0[s].copy()
        for r in steps(offs[s], offs[s + 1], reverse):
            h = np.tanh(x[r] @ W + h @ U + b + S[s])
            c = c * 0.5 + h
            y = h * c
            all_h[r], all_c[r], all_y[r] = h, c, y
            last_h[s], last_c[s], last_y[s] = h, c, y
    return (all_h, all_c, all_y), (last_h, last_c, last_y)


def elman_case(lengths, dtype, reverse, init_kind, seed, input_dtype=None):
    """Build the step-net and its oracle's arguments for one configuration."""
    rng = np.random.default_rng(seed)
    num_seq, rows = len(lengths), int(sum(lengths))
    x = rng.standard_normal((rows, IN)).astype(input_dtype or dtype)
    X = sn.LoDTensor.from_lengths(x, [list(lengths)])
    W, U, b = weights(rng, dtype, (IN, HID), (HID, HID), (HID,))
    S = rng.standard_normal((num_seq, HID)).astype(dtype)
    c0 = rng.standard_normal((num_seq, HID)).astype(dtype)
    if init_kind == "per_sequence":
        h0 = rng.standard_normal((num_seq, HID)).astype(dtype)
        h_init = {"init": h0}
    elif init_kind == "broadcast":
        row = rng.standard_normal(HID).astype(dtype)
        h0, h_init = np.tile(row, (num_seq, 1)), {"init": row}
    elif init_kind == "scalar":
        h0, h_init = np.full((num_seq, HID), 0.25, dtype), {"init": 0.25, "shape": [HID]}
    else:
        h0, h_init = np.zeros((num_seq, HID), dtype), {"shape": [HID]}

    rnn = sn.create_rnn_op(output_num=3, reverse=reverse)
    with rnn.stepnet():
        xt = rnn.add_input(X, name="X")
        s = rnn.add_static_input(S, name="S")
        h = rnn.add_memory(name="h", **h_init)
        c = rnn.add_memory(init=c0, shape=[HID], name="c")
        h.update(sn.ops.tanh(xt @ sn.Parameter(W) + h.pre_state() @ U + b + s))
        c.update(c.pre_state() * 0.5 + h)
        rnn.add_outputs(h, c, h * c)
    oracle_x = x.astype(dtype)
    return rnn, X, (oracle_x, list(lengths), W, U, b, S, h0, c0, reverse)


def run(rnn, main, output_all_steps=True, backends=None, **feeds):
    """Run on the interpreter; a main case also runs on ``backends`` (every
    other backend by default: conftest.assert_backends_agree).

    Only the main cases go to the other backends: each new graph costs a
    compilation there, and the variants around a main case share its kernels
    or test interpreter semantics only.
    """
    if main:
        return assert_backends_agree(rnn, output_all_steps=output_all_steps, backends=backends,
                                     **feeds)
    return rnn(output_all_steps=output_all_steps, backend="interpreter", **feeds)


def lod_outputs(arrays, lengths):
    return tuple(sn.LoDTensor(a, [offsets(lengths)]) for a in arrays)


LENGTHS = {
    "mixed": [3, 0, 1, 5, 2],
    "all_empty": [0, 0, 0],
    "one_sequence": [4],
    "one_step": [1],
    "one_empty": [0],
    "no_sequences": [],
    "sorted_ties": [2, 2, 0, 2, 1],
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
def test_elman_all_steps_and_last(lengths, reverse, dtype):
    rnn, X, args = elman_case(lengths, dtype, reverse, "per_sequence", seed=len(lengths))
    all_steps, last = elman_oracle(*args)

    main = dtype == np.float32
    got_all = run(rnn, main)
    assert_close(got_all, lod_outputs(all_steps, lengths))
    for out in got_all:
        assert out.lod == X.lod and out.dtype == np.dtype(dtype)
    got_last = run(rnn, main, output_all_steps=False)
    assert_close(got_last, last)


@pytest.mark.parametrize("init_kind", ["per_sequence", "broadcast", "scalar", "zeros"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_memory_init_forms(init_kind, dtype):
    lengths = [2, 0, 4, 1]
    rnn, _, args = elman_case(lengths, dtype, False, init_kind, seed=7)
    all_steps, last = elman_oracle(*args)
    main = dtype == np.float32  # the graph of a main case: no new compilation
    assert_close(run(rnn, main), lod_outputs(all_steps, lengths))
    got_last = run(rnn, main, output_all_steps=False)
    assert_close(got_last, last)
    # sequence 1 is empty: memories give their init, the other output zeros
    h0, c0 = args[6], args[7]
    np.testing.assert_array_equal(got_last[0][1], h0[1])
    np.testing.assert_array_equal(got_last[1][1], c0[1])
    np.testing.assert_array_equal(got_last[2][1], np.zeros(HID))
    assert all(v.dtype == np.dtype(dtype) for v in got_last)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=7),
    reverse=st.booleans(),
    init_kind=st.sampled_from(["per_sequence", "broadcast", "scalar", "zeros"]),
)
def test_elman_random_lengths(lengths, reverse, init_kind):
    rnn, _, args = elman_case(lengths, np.float64, reverse, init_kind, seed=sum(lengths))
    all_steps, last = elman_oracle(*args)
    assert_close(rnn(backend="interpreter"), lod_outputs(all_steps, lengths))
    assert_close(rnn(output_all_steps=False, backend="interpreter"), last)


@pytest.mark.parametrize("seed", range(4))
def test_elman_random_lod_float32(seed):
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(0, 9, size=rng.integers(1, 12)).tolist()
    rnn, _, args = elman_case(lengths, np.float32, bool(seed % 2), "per_sequence", seed)
    all_steps, last = elman_oracle(*args)
    assert_close(assert_backends_agree(rnn), lod_outputs(all_steps, lengths))
    assert_close(assert_backends_agree(rnn, output_all_steps=False), last)


def test_float16_input_computed_in_float32():
    lengths = [3, 0, 2, 4]
    rnn, X, args = elman_case(lengths, np.float32, False, "broadcast", seed=3,
                              input_dtype=np.float16)
    assert X.dtype == np.float16
    all_steps, last = elman_oracle(*args)  # the oracle works in float32
    got = rnn(backend="interpreter")
    assert all(o.dtype == np.float16 for o in got)
    assert_close(got, lod_outputs([a.astype(np.float16) for a in all_steps], lengths))
    got_last = rnn(output_all_steps=False, backend="interpreter")
    assert_close(got_last, tuple(a.astype(np.float16) for a in last))


def test_reverse_keeps_positions_and_last_is_position_zero():
    # h = h + x: with reverse=True, position p holds the suffix sum from p.
    x = np.arange(1.0, 7.0)[:, None]
    X = sn.LoDTensor.from_lengths(x, [[2, 0, 4]])
    rnn = sn.create_rnn_op(reverse=True)
    with rnn.stepnet():
        xt = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[1], name="h")
        h.update(h.pre_state() + xt)
        rnn.add_outputs(h)
    np.testing.assert_array_equal(rnn().data[:, 0], [3, 2, 18, 15, 11, 6])
    np.testing.assert_array_equal(rnn(output_all_steps=False)[:, 0], [3, 0, 18])


# ---------------------------------------------------------------------------
# Caller's order: statics and initial memories after the internal length sort
# ---------------------------------------------------------------------------


def test_static_and_init_stay_aligned_with_their_sequence():
    lengths = [1, 3, 0, 2]  # the interpreter runs them as 3, 2, 1, 0
    X = sn.LoDTensor.from_lengths(np.ones((6, 1)), [lengths])
    S = np.array([[10.0], [20.0], [30.0], [40.0]])
    h0 = np.array([[1.0], [2.0], [3.0], [4.0]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        xt = rnn.add_input(X, name="X")
        s = rnn.add_static_input(S, name="S")
        h = rnn.add_memory(init=h0, name="h")
        h.update(h.pre_state() + xt * s)
        rnn.add_outputs(h)
    last = run(rnn, True, output_all_steps=False)
    # each sequence ends at its own init + length * its own static
    np.testing.assert_array_equal(last[:, 0], [11.0, 62.0, 3.0, 84.0])
    np.testing.assert_array_equal(rnn().data[:, 0], [11, 22, 42, 62, 44, 84])


def test_lod_static_input_stepped_by_a_nested_rnn():
    # An attention-like static: each sequence owns a ragged set of rows that a
    # nested step-net reduces at every outer step.
    rng = np.random.default_rng(11)
    lengths, mem_lengths = [3, 0, 1, 4], [2, 1, 0, 3]
    x = rng.standard_normal((8, IN))
    m = rng.standard_normal((6, IN))
    X = sn.LoDTensor.from_lengths(x, [lengths])
    M = sn.LoDTensor.from_lengths(m, [mem_lengths])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        xt = rnn.add_input(X, name="X")
        ms = rnn.add_static_input(M, name="M")
        h = rnn.add_memory(shape=[IN], name="h")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            mt = inner.add_input(ms, name="m")
            acc = inner.add_memory(shape=[IN], name="acc")
            acc.update(acc.pre_state() + mt * h.pre_state())
            inner.add_outputs(acc)
        h.update(sn.ops.tanh(xt + inner(output_all_steps=False)))
        rnn.add_outputs(h)

    xo, mo = offsets(lengths), offsets(mem_lengths)
    expected = np.zeros_like(x)
    for s in range(len(lengths)):
        h_s = np.zeros(IN)
        for r in range(xo[s], xo[s + 1]):
            ctx = np.zeros(IN)
            for k in range(mo[s], mo[s + 1]):
                ctx = ctx + m[k] * h_s
            h_s = np.tanh(x[r] + ctx)
            expected[r] = h_s
    # interpreter only: the numba backend refuses LoD static inputs
    assert_close(run(rnn, False), sn.LoDTensor(expected, [xo]))


# ---------------------------------------------------------------------------
# Nested: chapters -> paragraphs -> word rows
# ---------------------------------------------------------------------------


def nested_case(lengths, reverse_outer, reverse_inner, dtype, seed):
    """nets.nested_encoder with every way of reading the chapter level: the
    paragraph net starts from the chapter memory's pre-state and reads the
    chapter's static input G (one row per paragraph)."""
    net = nested_encoder(np.random.default_rng(seed), lengths, IN, HID, dtype,
                         reverse_outer=reverse_outer, reverse_inner=reverse_inner,
                         start_from_outer=True, static=True, init=True)
    args = (net.x, lengths, net.W, net.U, net.V, net.R, net.G, net.H0, reverse_outer,
            reverse_inner)
    return net.rnn, net.X, args


def nested_oracle(x, lengths, W, U, V, R, G, H0, reverse_outer, reverse_inner):
    ch_offs, par_offs = offsets(lengths[0]), offsets(lengths[1])
    num_ch, num_par = len(lengths[0]), len(lengths[1])
    dtype = W.dtype
    word_h = np.zeros((len(x), HID), dtype)
    par_H = np.zeros((num_par, HID), dtype)
    par_last = np.zeros((num_par, HID), dtype)
    last_H, last_par_last = H0.copy(), np.zeros((num_ch, HID), dtype)
    last_par = [None] * num_ch  # the last paragraph processed, per chapter
    for c in range(num_ch):
        Hc = H0[c].copy()
        for p in steps(ch_offs[c], ch_offs[c + 1], reverse_outer):
            h = Hc.copy()  # inner init: the outer memory's previous state
            for r in steps(par_offs[p], par_offs[p + 1], reverse_inner):
                h = np.tanh(x[r] @ W + h @ U + G[c])
                word_h[r] = h
            par_last[p] = h
            Hc = np.tanh(h @ V + Hc @ R)
            par_H[p] = Hc
            last_H[c], last_par_last[c], last_par[c] = Hc, h, p
    all_steps = (
        sn.LoDTensor(par_H, [ch_offs]),
        sn.LoDTensor(word_h, [ch_offs, par_offs]),
        sn.LoDTensor(par_last, [ch_offs]),
    )
    pieces = [
        word_h[par_offs[p]:par_offs[p + 1]] if p is not None else word_h[:0] for p in last_par
    ]
    last_words = sn.LoDTensor(
        np.concatenate(pieces) if pieces else word_h[:0], [offsets(len(q) for q in pieces)]
    )
    return all_steps, (last_H, last_words, last_par_last)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("reverse_outer,reverse_inner", [(False, False), (True, False),
                                                         (False, True), (True, True)])
def test_nested_two_levels(reverse_outer, reverse_inner, dtype):
    outer, X, args = nested_case(CHAPTERS, reverse_outer, reverse_inner, dtype, seed=5)
    expected_all, expected_last = nested_oracle(*args)
    main = (reverse_outer, reverse_inner, dtype) == (True, False, np.float32)
    # not on cuda: it refuses a nested net reading the enclosing step
    got_all = run(outer, main, backends=["numba"])
    assert_close(got_all, expected_all)
    # the inner all-steps output carries X's whole LoD
    assert got_all[1].lod == X.lod == [[0, 2, 2, 5, 6], [0, 3, 3, 7, 8, 10, 10]]
    got_last = run(outer, main, output_all_steps=False, backends=["numba"])
    assert_close(got_last, expected_last)
    # chapter 1 is empty: the memory gives its init, the plain output zeros
    np.testing.assert_array_equal(got_last[0][1], args[7][1])
    np.testing.assert_array_equal(got_last[2][1], np.zeros(HID))


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=4), max_size=5), st.booleans())
def test_nested_two_levels_random_lod(chapters, reverse):
    lengths = [[len(c) for c in chapters], [n for c in chapters for n in c]]
    outer, _, args = nested_case(lengths, reverse, not reverse, np.float64, seed=len(lengths[1]))
    expected_all, expected_last = nested_oracle(*args)
    assert_close(outer(backend="interpreter"), expected_all)
    assert_close(outer(output_all_steps=False, backend="interpreter"), expected_last)


def test_nested_three_levels():
    # books -> chapters -> paragraphs -> word rows; each level's last state
    # starts the level below and feeds the level above.
    rng = np.random.default_rng(21)
    lengths = [[2, 0, 1], [2, 0, 3], [1, 3, 0, 2, 2]]
    x = rng.standard_normal((sum(lengths[2]), IN))
    X = sn.LoDTensor.from_lengths(x, lengths)
    W, A, B, C = weights(rng, np.float64, (IN, HID), (HID, HID), (HID, HID), (HID, HID))

    top = sn.create_rnn_op(output_num=2)
    with top.stepnet():
        chapter = top.add_input(X, name="X")
        hb = top.add_memory(shape=[HID], name="hb")
        mid = sn.create_rnn_op()
        with mid.stepnet():
            paragraph = mid.add_input(chapter, name="paragraph")
            hc = mid.add_memory(init=hb.pre_state(), name="hc")
            low = sn.create_rnn_op()
            with low.stepnet():
                word = low.add_input(paragraph, name="word")
                hw = low.add_memory(init=hc.pre_state(), name="hw")
                hw.update(sn.ops.tanh(word @ W + hw.pre_state() @ A))
                low.add_outputs(hw)
            hc.update(sn.ops.tanh(low(output_all_steps=False) @ B + hc.pre_state()))
            mid.add_outputs(hc, low())
        _, words = mid()  # ragged: every word state of this chapter
        chapter_state, _ = mid(output_all_steps=False)
        hb.update(sn.ops.tanh(chapter_state @ C + hb.pre_state()))
        top.add_outputs(hb, words)

    o = [offsets(level) for level in lengths]
    word_h = np.zeros((len(x), HID))
    book_h = np.zeros((len(lengths[0]), HID))
    chapter_h = np.zeros((len(lengths[1]), HID))
    for b in range(len(lengths[0])):
        hb_ = np.zeros(HID)
        for c in range(o[0][b], o[0][b + 1]):
            hc_ = hb_.copy()
            for p in range(o[1][c], o[1][c + 1]):
                hw_ = hc_.copy()
                for r in range(o[2][p], o[2][p + 1]):
                    hw_ = np.tanh(x[r] @ W + hw_ @ A)
                    word_h[r] = hw_
                hc_ = np.tanh(hw_ @ B + hc_)
            hb_ = np.tanh(hc_ @ C + hb_)
            chapter_h[c] = hb_
        book_h[b] = hb_

    # interpreter only: the numba backend refuses a nested step-net's last
    # step of a ragged output (mid's `words` here)
    got_all = run(top, False)
    assert_close(got_all, (sn.LoDTensor(chapter_h, o[:1]), sn.LoDTensor(word_h, o[:3])))
    assert got_all[1].lod == X.lod  # words carry the three levels above them
    got_last = run(top, False, output_all_steps=False)
    # the last chapter of each book, its words with their paragraph LoD
    last_chapters = [o[0][b + 1] - 1 for b in range(len(lengths[0])) if lengths[0][b]]
    paragraphs = [p for c in last_chapters for p in range(o[1][c], o[1][c + 1])]
    last_words = sn.LoDTensor.from_lengths(
        np.concatenate([word_h[o[2][p]:o[2][p + 1]] for p in paragraphs]),
        [[lengths[1][o[0][b + 1] - 1] if lengths[0][b] else 0 for b in range(len(lengths[0]))],
         [lengths[2][p] for p in paragraphs]],
    )
    assert_close(got_last, (book_h, last_words))


# ---------------------------------------------------------------------------
# Rebinding, compile, keep_scopes
# ---------------------------------------------------------------------------


def test_rebinding_with_a_different_number_of_sequences():
    rnn, _, args = elman_case([2, 0, 3], np.float32, False, "per_sequence", seed=1)
    first = rnn(output_all_steps=False, backend="interpreter")
    assert_close(first, elman_oracle(*args)[1])

    rng = np.random.default_rng(2)
    lengths = [4, 1, 0, 2, 3]
    x2 = rng.standard_normal((10, IN)).astype(np.float32)
    h2, c2, S2 = (rng.standard_normal((5, HID)).astype(np.float32) for _ in range(3))
    got = assert_backends_agree(
        rnn, X=sn.LoDTensor.from_lengths(x2, [lengths]), h=h2, c=c2, S=S2
    )
    all_steps, last = elman_oracle(x2, lengths, *args[2:5], S2, h2, c2, False)
    assert_close(got, lod_outputs(all_steps, lengths))
    assert got[0].lod == [offsets(lengths)]
    got_last = rnn(X=sn.LoDTensor.from_lengths(x2, [lengths]), h=h2, c=c2, S=S2,
                   output_all_steps=False)
    assert_close(got_last, last)
    # the bound arrays did not change: the original call gives the original result
    assert_close(rnn(output_all_steps=False), first)


def test_rebinding_broadcast_init_follows_the_new_batch():
    rnn, _, args = elman_case([2, 3], np.float64, True, "broadcast", seed=4)
    rng = np.random.default_rng(5)
    lengths = [1, 0, 3, 2]
    x2 = rng.standard_normal((6, IN))
    c2, S2 = rng.standard_normal((4, HID)), rng.standard_normal((4, HID))
    h0 = np.tile(args[6][0], (4, 1))  # the broadcast row, for every new sequence
    got = rnn(X=sn.LoDTensor.from_lengths(x2, [lengths]), c=c2, S=S2)
    all_steps, _ = elman_oracle(x2, lengths, *args[2:5], S2, h0, c2, True)
    assert_close(got, lod_outputs(all_steps, lengths))


def test_threads_build_step_nets_at_the_same_time():
    """Each thread traces its own step-net (a layer's directions build theirs
    on the threads that run them): two step-nets built in lockstep, each call
    of one between two calls of the other, come out as if built alone."""
    rng = np.random.default_rng(11)
    lengths = [3, 1, 2]
    cases = [(rng.standard_normal((6, IN)).astype(np.float32),
              *weights(rng, np.float32, (IN, HID), (HID, HID))) for _ in range(2)]
    turns = threading.Barrier(2, timeout=30)

    def build(x, W, U):
        rnn = sn.create_rnn_op()
        with rnn.stepnet():
            turns.wait()
            xt = rnn.add_input(sn.LoDTensor.from_lengths(x, [lengths]), name="x")
            turns.wait()
            h = rnn.add_memory(shape=[HID], dtype=np.float32, name="h")
            turns.wait()
            h.update(sn.ops.tanh(xt @ W + h.pre_state() @ U))
            turns.wait()
            rnn.add_outputs(h)
        turns.wait()
        return rnn

    with ThreadPoolExecutor(2) as pool:
        nets = list(pool.map(lambda case: build(*case), cases))
    for rnn, (x, W, U) in zip(nets, cases):
        zeros = np.zeros((len(lengths), HID), np.float32)
        expected = elman_oracle(x, lengths, W, U, np.zeros(HID, np.float32),
                                zeros, zeros, zeros, False)[1][0]
        # (the oracle's cell with b and S zero: its h is tanh(x W + h U))
        assert_close(rnn(output_all_steps=False, backend="interpreter"), expected)


def test_compile_interpreter_returns_the_same():
    rnn, X, args = elman_case([3, 1, 0, 2], np.float32, True, "scalar", seed=9)
    f = rnn.compile("interpreter")
    assert_close(f(), rnn())
    assert_close(f(output_all_steps=False), elman_oracle(*args)[1])
    x2 = sn.LoDTensor.from_lengths(X.data[:4], [[4]])
    S2, c2 = np.ones((1, HID), np.float32), np.zeros((1, HID), np.float32)
    assert_close(f(X=x2, S=S2, c=c2), rnn(X=x2, S=S2, c=c2))


def test_keep_scopes_one_dict_per_step():
    lengths = [2, 0, 4, 1]
    rnn, X, args = elman_case(lengths, np.float64, True, "zeros", seed=6)
    (all_h, _, _), _ = elman_oracle(*args)
    rnn(keep_scopes=True)
    scopes = rnn.step_scopes
    assert isinstance(scopes, list) and len(scopes) == max(lengths)
    post_name = rnn.block.memories[0].post.name
    offs = offsets(lengths)
    for t, scope in enumerate(scopes):
        rows, pos = scope["__rows__"], scope["__positions__"]
        assert sorted(rows.tolist()) == [s for s in range(4) if lengths[s] > t]
        at = [offs[s] + p for s, p in zip(rows, pos)]
        np.testing.assert_array_equal(scope["X_t"], X.data[at])
        np.testing.assert_allclose(scope[post_name], all_h[at], rtol=1e-12)
        assert scope["h_prev"].shape == (len(rows), HID)


def test_memory_handle_name_is_its_updated_value_and_memory_name_its_own():
    X = sn.LoDTensor.from_lengths(np.arange(10.0).reshape(5, 2), [[2, 3]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[2], name="h")
        with pytest.raises(sn.StepNetError, match=r"memory 'h' is used before its update; "
                                                  r"use h.pre_state\(\)"):
            _ = h.name
        h.update(h.pre_state() + x)
        rnn.add_outputs(h)
    assert h.memory_name == "h" and h.pre_state().name == "h_prev"
    assert h.name == rnn.block.memories[0].post.name != "h"
    out = rnn(backend="interpreter", keep_scopes=True)
    np.testing.assert_array_equal(out.data, [[0, 1], [2, 4], [4, 5], [10, 12], [18, 21]])
    for t, scope in enumerate(rnn.step_scopes):  # the running sums of each sequence at step t
        np.testing.assert_array_equal(scope[h.name], out.data[[[0, 2][s] + t for s in scope["__rows__"]]])
    rebound = rnn(backend="interpreter", **{h.memory_name: np.ones((2, 2))})
    np.testing.assert_array_equal(rebound.data, out.data + 1)


def test_keep_scopes_nested_keeps_inner_scopes():
    outer, _, _ = nested_case(CHAPTERS, False, False, np.float64, seed=5)
    outer(keep_scopes=True)
    scopes = outer.step_scopes
    assert len(scopes) == max(CHAPTERS[0])
    inner_name = next(e.attrs["name"] for e in outer.block.eqns if e.op == "rnn")
    first = scopes[0][inner_name]
    assert all(isinstance(s, dict) and "word_t" in s for s in first)
    # outer step 0 runs paragraphs 0, 2, 5 (3, 4 and 0 words): 4 inner steps,
    # twice, as the inner step-net is called for all steps and for the last
    assert len(first) == 2 * 4


def test_keep_scopes_needs_the_interpreter():
    rnn, _, _ = elman_case([1], np.float64, False, "zeros", seed=0)
    with pytest.raises(sn.UnsupportedError, match="numba backend: keep_scopes"):
        rnn(keep_scopes=True, backend="numba")


def test_numpy_products_on_one_thread_inside_the_block_and_as_before_after():
    """``numpy_blas_on_one_thread``: NumPy's OpenBLAS count is 1 inside the
    block, whichever thread asks; blocks nest and overlap across threads,
    and the count is restored once the last one ends."""
    import threading

    from stepnet.interpreter import _numpy_blas_setter, numpy_blas_on_one_thread

    set_count = _numpy_blas_setter()
    if set_count is None:
        pytest.skip("NumPy's BLAS is not OpenBLAS")
    before = set_count(3)
    try:
        inside, other_open, release = [], threading.Event(), threading.Event()

        def other():
            with numpy_blas_on_one_thread():
                other_open.set()
                release.wait(30)

        with numpy_blas_on_one_thread():
            inside.append(set_count(1))
            thread = threading.Thread(target=other)
            thread.start()
            assert other_open.wait(30)
            with numpy_blas_on_one_thread():
                inside.append(set_count(1))
        inside.append(set_count(1))  # (the other thread's block still open)
        release.set()
        thread.join(30)
        assert inside == [1, 1, 1]
        assert set_count(3) == 3  # restored once both ended
    finally:
        set_count(before)


def test_numpy_products_on_the_fewest_threads_any_open_block_asks_for(monkeypatch):
    """``numpy_blas_threads``: the fewest of the open blocks' counts and the
    count before; ``numpy_blas_beside_a_compile``: every core but one."""
    import os

    from stepnet import interpreter

    set_count = interpreter._numpy_blas_setter()
    if set_count is None:
        pytest.skip("NumPy's BLAS is not OpenBLAS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    before = set_count(16)
    try:
        seen = []
        with interpreter.numpy_blas_beside_a_compile():
            seen.append(set_count(15))
            with interpreter.numpy_blas_threads(4):
                seen.append(set_count(4))
                with interpreter.numpy_blas_threads(8):
                    seen.append(set_count(4))
            seen.append(set_count(15))
        seen.append(set_count(16))
        assert seen == [15, 4, 4, 15, 16]
        set_count(3)  # never more than before
        with interpreter.numpy_blas_threads(8):
            seen.append(set_count(3))
        assert seen[-1] == 3 and set_count(3) == 3
    finally:
        set_count(before)
