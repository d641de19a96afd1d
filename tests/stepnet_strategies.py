"""Hypothesis strategies for stepnet tests: LoDs, step data and random step-nets.

The centre piece is :func:`build_random_stepnet`: given Hypothesis' ``draw``, it
traces a random step-net (random LoD, dtype, step and static inputs, memories,
parameters and a random DAG of registry ops and composites) and returns it with
a dict of feeds that rebind every named input to new data with a new LoD::

    @given(st.data())
    def test_something(data):
        rnn, feeds = build_random_stepnet(data.draw)
        assert_backends_agree(rnn, **feeds)

``random_stepnets()`` is the same as a strategy; ``random_stepnet_case(draw)``
(strategy: ``random_stepnet_cases()``) also returns what the generator knows
of the net (output shapes and dtypes, which outputs are memories, the feeds
that hold one row per sequence) in a :class:`RandomStepNet`.

Values are kept bounded (``tanh`` before ``exp``, ``log(|x| + 1)``, divisors
``|x| + 1``, memories updated through ``tanh``/``sigmoid``) so that every result
is finite, and every discontinuous choice (``where`` on a comparison,
``thresholded_relu``) reads only raw input data, which every backend sees
bit for bit: a comparison never flips because two backends round differently.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

import stepnet as sn

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

float_dtypes = st.sampled_from(FLOAT_DTYPES)


# ----------------------------------------------------------------------------
# LoDs and data


@st.composite
def sequence_lengths(draw, max_sequences=5, max_length=6, min_sequences=0):
    """One LoD level as lengths: 0..max_sequences sequences of 0..max_length
    steps; about one draw in eight has every sequence empty."""
    num = draw(st.integers(min_sequences, max_sequences))
    if draw(st.integers(0, 7)) == 7:
        return [0] * num
    return draw(st.lists(st.integers(0, max_length), min_size=num, max_size=num))


def uniform(rng, shape, dtype, low=-1.0, high=1.0):
    return rng.uniform(low, high, size=shape).astype(dtype)


def lod_tensor(rng, lengths, feature_shape, dtype, low=-1.0, high=1.0):
    """A one-level LoDTensor of uniform data with the given lengths."""
    rows = int(sum(lengths))
    data = uniform(rng, (rows,) + tuple(feature_shape), dtype, low, high)
    return sn.LoDTensor.from_lengths(data, [list(lengths)])


def offsets(lengths) -> list:
    return [0] + list(np.cumsum(lengths, dtype=np.int64).tolist())


def broadcast_features(a, b):
    """The broadcast of two feature shapes the generator uses (``()``, ``(w,)``),
    or None where they do not broadcast (``[B]`` never meets ``[B, w]``)."""
    if a == b:
        return a
    if len(a) == len(b) == 1 and 1 in (a[0], b[0]):
        return a if b == (1,) else b
    return None


# ----------------------------------------------------------------------------
# random step-nets


@dataclass
class _Node:
    """A value of the step being traced, with what the generator knows of it."""

    value: object  # sn.Value (or a MemoryHandle after its update)
    shape: tuple  # feature shape: () or (width,)
    dtype: np.dtype
    bound: float  # |value| <= bound for every element
    exact: bool = False  # raw input data: identical on every backend
    memory: str | None = None  # a memory's pre-state or updated handle: its name


@dataclass
class RandomStepNet:
    """A random step-net and what a test needs to check it.

    ``feeds`` rebind every named input (new LoD, new data); ``defined`` are
    the arrays it was traced with (a memory started from zeros: a zero row).
    ``per_sequence`` names the feeds that hold one row per sequence (step
    inputs, static inputs, per-sequence inits), so a test can cut the batch
    into single sequences. ``outputs`` describes each output: feature shape,
    dtype and, for a memory (pre-state or updated), its name (its initial
    value is the last step of an empty sequence). ``traced_ops`` lists the
    primitives the generator called directly (composites add more).
    """

    rnn: object
    feeds: dict
    defined: dict
    dtype: np.dtype
    reverse: bool
    per_sequence: set
    memory_shapes: dict  # memory name -> feature shape
    outputs: list  # of (shape, dtype, memory name or None)
    traced_ops: list = field(default_factory=list)  # primitives the generator called


class _Builder:
    """Draws one random step-net; one method per kind of op."""

    def __init__(self, draw, rng, dtype):
        self.draw = draw
        self.rng = rng
        self.dtype = dtype
        self.pool = []
        self.traced = []
        self.param_count = 0

    # -- helpers -------------------------------------------------------------

    def choose(self, options):
        return options[self.draw(st.integers(0, len(options) - 1))]

    def flag(self):
        return self.draw(st.booleans())

    def scalar(self, low=-1.5, high=1.5):
        # Rounded so that printed IR and error messages stay short.
        return round(float(self.draw(st.floats(low, high, allow_nan=False))), 3)

    def param(self, shape, scale=1.0):
        self.param_count += 1
        value = uniform(self.rng, shape, self.dtype) * self.dtype.type(scale)
        name = f"P{self.param_count}" if self.flag() else None
        return sn.Parameter(value, name=name)

    def add(self, value, shape, bound, exact=False, memory=None, dtype=None):
        node = _Node(value, tuple(shape), np.dtype(dtype or self.dtype), float(bound), exact,
                     memory)
        self.pool.append(node)
        return node

    def floats(self):
        return [n for n in self.pool if n.dtype.kind == "f"]

    def operand(self, vector=False, max_bound=2.0):
        """A float node (a vector [B, w] if asked), squashed by tanh when large."""
        nodes = [n for n in self.floats() if not vector or len(n.shape) == 1]
        node = self.choose(nodes)
        if node.bound > max_bound:
            self.traced.append("tanh")
            node = self.add(sn.ops.tanh(node.value), node.shape, 1.0)
        return node

    def compatible(self, shape, exact=False, max_bound=None):
        """Float nodes that broadcast with ``shape`` ([B, w] with [B, 1], etc.)."""
        return [
            n for n in self.floats()
            if broadcast_features(n.shape, shape) is not None
            and (n.exact or not exact)
            and (max_bound is None or n.bound <= max_bound)
        ]

    # -- ops ----------------------------------------------------------------

    def unary(self):
        a = self.operand()
        kind = self.choose([
            "neg", "abs", "tanh", "sigmoid", "relu", "softplus", "exp", "log", "clip",
        ])
        v = a.value
        if kind == "neg":
            out, bound = (-v if self.flag() else sn.ops.neg(v)), a.bound
        elif kind == "abs":
            out, bound = (abs(v) if self.flag() else sn.ops.abs(v)), a.bound
        elif kind == "tanh":
            out, bound = sn.ops.tanh(v), 1.0
        elif kind == "sigmoid":
            out, bound = sn.ops.sigmoid(v), 1.0
        elif kind == "relu":
            out, bound = sn.ops.relu(v), a.bound
        elif kind == "softplus":
            out, bound = sn.ops.softplus(v), a.bound + 1.0
        elif kind == "exp":
            self.traced.append("tanh")
            out, bound = sn.ops.exp(sn.ops.tanh(v)), float(np.e)
        elif kind == "log":
            self.traced += ["abs", "add"]
            out, bound = sn.ops.log(sn.ops.abs(v) + 1.0), np.log1p(a.bound)
        else:
            lo = self.scalar(-1.0, 0.0)
            hi = self.scalar(0.0, 1.0)
            out, bound = sn.ops.clip(v, lo, hi), 1.0
        self.traced.append(kind)
        return self.add(out, a.shape, bound)

    def composite(self):
        a = self.operand()
        kind = self.choose([
            "affine", "leaky_relu", "thresholded_relu", "scaled_tanh", "hard_sigmoid",
            "elu", "softsign",
        ])
        v = a.value
        if kind == "affine":
            alpha, beta = self.scalar(), self.scalar()
            out, bound = sn.ops.affine(v, alpha, beta), abs(alpha) * a.bound + abs(beta)
        elif kind == "leaky_relu":
            out = sn.ops.leaky_relu(v, self.scalar(0.0, 1.0)) if self.flag() else \
                sn.ops.leaky_relu(v)
            bound = a.bound
        elif kind == "thresholded_relu":
            # Discontinuous at alpha: only on raw data, so backends cannot disagree.
            a = self.choose([n for n in self.floats() if n.exact])
            alpha = self.scalar(-0.5, 0.5)
            out, bound = sn.ops.thresholded_relu(a.value, alpha), a.bound
        elif kind == "scaled_tanh":
            alpha, beta = self.scalar(), self.scalar()
            out, bound = sn.ops.scaled_tanh(v, alpha, beta), abs(alpha)
        elif kind == "hard_sigmoid":
            out = sn.ops.hard_sigmoid(v, self.scalar(0.0, 1.0), self.scalar(0.0, 1.0)) \
                if self.flag() else sn.ops.hard_sigmoid(v)
            bound = 1.0
        elif kind == "elu":
            alpha = self.scalar(0.0, 1.5)
            out, bound = sn.ops.elu(v, alpha), max(a.bound, alpha)
        else:
            out, bound = sn.ops.softsign(v), 1.0
        return self.add(out, a.shape, bound)

    def with_scalar(self):
        a = self.operand()
        s = self.scalar()
        kind = self.choose(["add", "rsub", "mul", "div", "rdiv"])
        v = a.value
        if kind == "add":
            out, bound = v + s, a.bound + abs(s)
            self.traced.append("add")
        elif kind == "rsub":  # 1 - z style: the scalar is weak
            out, bound = s - v, a.bound + abs(s)
            self.traced.append("sub")
        elif kind == "mul":
            out, bound = (v * s if self.flag() else s * v), a.bound * abs(s)
            self.traced.append("mul")
        elif kind == "div":
            s = self.choose([-2.0, -0.5, 0.5, 1.5, 4.0])
            out, bound = v / s, a.bound / abs(s)
            self.traced.append("div")
        else:
            self.traced += ["abs", "add", "div"]
            out, bound = s / (abs(v) + 1.0), abs(s)
        return self.add(out, a.shape, bound)

    def binary(self):
        a = self.operand()
        b = self.choose(self.compatible(a.shape, max_bound=2.0))
        kind = self.choose(["add", "sub", "mul", "div", "maximum", "minimum"])
        x, y = a.value, b.value
        functional = self.flag()
        if kind == "add":
            out = sn.ops.add(x, y) if functional else x + y
            bound = a.bound + b.bound
        elif kind == "sub":
            out = sn.ops.sub(x, y) if functional else x - y
            bound = a.bound + b.bound
        elif kind == "mul":
            out = sn.ops.mul(x, y) if functional else x * y
            bound = a.bound * b.bound
        elif kind == "div":
            self.traced += ["abs", "add"]
            out = x / (abs(y) + 1.0)
            bound = a.bound
        elif kind == "maximum":
            out, bound = sn.ops.maximum(x, y), max(a.bound, b.bound)
        else:
            out, bound = sn.ops.minimum(x, y), max(a.bound, b.bound)
        self.traced.append(kind)
        return self.add(out, broadcast_features(a.shape, b.shape), bound)

    def with_param(self):
        a = self.operand(vector=True)
        (width,) = a.shape
        kind = self.choose(["matmul", "matmul_vector", "bias", "scale", "rsub"])
        v = a.value
        if kind == "matmul":
            k = self.draw(st.integers(1, 5))
            P = self.param((width, k), 1.0 / width)
            out = sn.ops.matmul(v, P) if self.flag() else v @ P
            self.traced.append("matmul")
            return self.add(out, (k,), a.bound)
        if kind == "matmul_vector":
            P = self.param((width,), 1.0 / width)
            self.traced.append("matmul")
            return self.add(v @ P, (), a.bound)
        shape = self.choose([(width,), (1, width), (1,)])
        if kind == "bias":
            P = self.param(shape)
            out = v + P if self.flag() else P + v
            self.traced.append("add")
            return self.add(out, (width,), a.bound + 1.0)
        if kind == "scale":
            P = self.param(shape)
            self.traced.append("mul")
            return self.add(P * v, (width,), a.bound)
        # a plain NumPy array is a constant too (found by data dependence)
        c = uniform(self.rng, shape, self.dtype)
        self.traced.append("sub")
        return self.add(c - v, (width,), a.bound + 1.0)

    def reduce(self):
        a = self.operand(vector=True)
        keepdims = self.flag()
        shape = (1,) if keepdims else ()
        if self.flag():
            self.traced.append("sum")
            out = sn.ops.sum(a.value, axis=-1, keepdims=keepdims) if self.flag() else \
                sn.ops.sum(a.value, 1, keepdims)
            return self.add(out, shape, a.bound * a.shape[0])
        return self.add(sn.ops.mean(a.value, -1, keepdims), shape, a.bound)

    def shape_op(self):
        a = self.operand(vector=True)
        (width,) = a.shape
        kind = self.choose(["concat", "slice", "getitem", "split"])
        if kind == "concat":
            others = [n for n in self.floats() if len(n.shape) == 1 and n.bound <= 2.0]
            parts = [a] + [self.choose(others) for _ in range(self.draw(st.integers(1, 2)))]
            out = sn.ops.concat([p.value for p in parts], axis=self.choose([-1, 1]))
            self.traced.append("concat")
            return self.add(out, (sum(p.shape[0] for p in parts),),
                            max(p.bound for p in parts), all(p.exact for p in parts))
        start = self.draw(st.integers(0, width - 1))
        stop = self.draw(st.integers(start + 1, width))
        if kind == "slice":
            self.traced.append("slice")
            out = sn.ops.slice(a.value, start, stop)
        elif kind == "getitem":
            self.traced.append("slice")
            out = a.value[:, start:stop] if stop < width or self.flag() else a.value[:, start:]
        else:
            divisors = [d for d in range(1, width + 1) if width % d == 0]
            n = self.choose(divisors)
            parts = sn.ops.split(a.value, n) if self.flag() else \
                sn.ops.split(a.value, [width // n] * n)
            for p in parts:
                self.add(p, (width // n,), a.bound, a.exact)
            return self.pool[-1]
        return self.add(out, (stop - start,), a.bound, a.exact)

    def where(self):
        a = self.operand()
        shape = a.shape
        # The condition compares raw data only (see the module docstring).
        conds = self.compatible(shape, exact=True)
        if not conds:
            return self.unary()
        c = self.choose(conds)
        shape = broadcast_features(shape, c.shape)
        compare = self.choose(["greater", "greater_equal", "less", "less_equal", "equal"])
        other = self.choose(self.compatible(shape, exact=True) + [None])
        if other is None:
            rhs = 0.0 if compare == "equal" else self.scalar(-0.5, 0.5)
        else:
            rhs = other.value
            shape = broadcast_features(shape, other.shape)
        if compare == "equal" or self.flag():
            cond = getattr(sn.ops, compare)(c.value, rhs)
        else:
            symbol = {"greater": operator.gt, "greater_equal": operator.ge,
                      "less": operator.lt, "less_equal": operator.le}[compare]
            cond = symbol(c.value, rhs)
        cond_shape = c.shape if other is None else broadcast_features(c.shape, other.shape)
        self.add(cond, cond_shape, 1.0, dtype=bool)
        self.traced += [compare, "where"]
        bs = self.compatible(shape, max_bound=2.0)
        if bs and self.flag():
            b = self.choose(bs)
            first, second = (a, b) if self.flag() else (b, a)
            out = sn.ops.where(cond, first.value, second.value)
            shape = broadcast_features(shape, b.shape)
            return self.add(out, shape, max(a.bound, b.bound))
        s = self.scalar()
        out = sn.ops.where(cond, a.value, s) if self.flag() else sn.ops.where(cond, s, a.value)
        return self.add(out, shape, max(a.bound, abs(s)))

    def update(self, handle, name, shape, pre):
        """Update a memory with a value of its shape, bounded by 1."""
        (width,) = shape
        v = self.operand(vector=True)
        P = self.param((v.shape[0], width), 1.0 / v.shape[0])
        kind = self.choose(["tanh", "recurrent", "gated", "clip"])
        self.traced.append("matmul")
        if kind == "tanh":
            new = sn.ops.tanh(v.value @ P)
            self.traced.append("tanh")
        elif kind == "recurrent":
            U = self.param((width, width), 1.0 / width)
            b = self.param((width,))
            new = sn.ops.tanh(v.value @ P + pre.value @ U + b)
            self.traced += ["matmul", "add", "add", "tanh"]
        elif kind == "gated":
            gates = [n for n in self.floats() if n.shape == (width,)] or [pre]
            z = sn.ops.sigmoid(self.choose(gates).value)
            new = z * pre.value + (1 - z) * sn.ops.tanh(v.value @ P)
            self.traced += ["sigmoid", "mul", "sub", "tanh", "mul", "add"]
        else:
            new = sn.ops.clip(v.value @ P + pre.value, -1.0, 1.0)
            self.traced += ["add", "clip"]
        handle.update(new)
        # After its update the handle itself stands for the new value.
        return self.add(handle, shape, 1.0, memory=name)


def _memory_init(draw, rng, kind, dtype, width, num_seq):
    """An initial memory value of the given kind, bounded by 1."""
    if kind == "per_sequence":
        return uniform(rng, (num_seq, width), dtype)
    if kind == "broadcast":
        return uniform(rng, draw(st.sampled_from([(width,), (1,)])), dtype)
    if kind == "scalar":  # a NumPy scalar of the net's dtype (Python floats: below)
        return dtype.type(round(rng.uniform(-1, 1), 3))
    return None


def random_stepnet_case(draw, bool_outputs=False, pre_state_outputs=True) -> RandomStepNet:
    """Draw a random step-net and everything needed to check it (see module doc).

    With ``bool_outputs``, comparison results may be outputs too (but
    conftest.assert_close has no tolerance for bool); with ``pre_state_outputs``
    a memory's ``pre_state()`` may be an output."""
    dtype = draw(float_dtypes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = draw(sequence_lengths())
    num_seq = len(lengths)
    new_lengths = draw(sequence_lengths())
    new_num_seq = len(new_lengths)
    reverse = draw(st.booleans())

    num_ops = draw(st.integers(3, 12))
    num_outputs = draw(st.integers(1, 3))
    output_num = num_outputs if draw(st.booleans()) else None

    defined, feeds, per_sequence, memory_shapes = {}, {}, set(), {}
    rnn = sn.create_rnn_op(output_num=output_num, reverse=reverse)
    b = _Builder(draw, rng, dtype)
    with rnn.stepnet():
        for i in range(draw(st.integers(1, 2))):
            name = f"x{i}"
            width = draw(st.integers(1, 5))
            X = lod_tensor(rng, lengths, (width,), dtype)
            defined[name] = X
            feeds[name] = lod_tensor(rng, new_lengths, (width,), dtype)
            per_sequence.add(name)
            b.add(rnn.add_input(X, name=name), (width,), 1.0, exact=True)
        for i in range(draw(st.integers(0, 2))):
            name = f"s{i}"
            width = draw(st.integers(1, 5))
            S = uniform(rng, (num_seq, width), dtype)
            defined[name] = S
            feeds[name] = uniform(rng, (new_num_seq, width), dtype)
            per_sequence.add(name)
            b.add(rnn.add_static_input(S, name=name), (width,), 1.0, exact=True)
        memories = []
        for i in range(draw(st.integers(1, 3))):
            name = f"h{i}"
            width = draw(st.integers(1, 5))
            kind = draw(st.sampled_from(["zeros", "per_sequence", "broadcast", "scalar"]))
            init = _memory_init(draw, rng, kind, dtype, width, num_seq)
            if init is None:
                h = rnn.add_memory(shape=[width], name=name)
            elif kind == "scalar" and draw(st.booleans()):
                # A Python float is weak: the memory takes the step's dtype.
                extra = {"dtype": dtype} if draw(st.booleans()) else {}
                h = rnn.add_memory(init=float(init), shape=[width], name=name, **extra)
            else:
                h = rnn.add_memory(init=init, shape=[width], name=name)
            defined[name] = np.zeros((width,), dtype) if init is None else init
            # Rebinding: a per-sequence init must follow the new batch; the
            # others are rebound sometimes, as per-sequence or broadcast arrays.
            rebind = draw(st.sampled_from(["keep", "per_sequence", "broadcast"]))
            if kind == "per_sequence" or rebind == "per_sequence":
                feeds[name] = uniform(rng, (new_num_seq, width), dtype)
                per_sequence.add(name)
            elif rebind == "broadcast":
                feeds[name] = uniform(rng, (width,), dtype)
            memory_shapes[name] = (width,)
            pre = b.add(h.pre_state(), (width,), 1.0, memory=name)
            memories.append((h, name, (width,), pre))

        # The DAG, with the memories' updates at random places in it.
        steps = ["op"] * num_ops + ["update"] * len(memories)
        order = draw(st.permutations(steps))
        moves = [b.unary, b.composite, b.with_scalar, b.binary, b.with_param, b.reduce,
                 b.shape_op, b.where]
        pending = list(memories)
        for step in order:
            if step == "update":
                b.update(*pending.pop(0))
            else:
                b.choose(moves)()

        # Boolean values (comparisons) are not outputs unless asked for:
        # conftest.assert_close has no tolerance entry for bool.
        candidates = [
            i for i, n in enumerate(b.pool)
            if (bool_outputs or n.dtype.kind == "f")
            and (pre_state_outputs or n.memory is None or isinstance(n.value, sn.MemoryHandle))
        ]
        picks = draw(st.lists(st.sampled_from(candidates), min_size=num_outputs,
                              max_size=num_outputs))
        chosen = [b.pool[i] for i in picks]
        rnn.add_outputs(*[n.value for n in chosen])
    outputs = [(n.shape, n.dtype, n.memory) for n in chosen]
    return RandomStepNet(rnn, feeds, defined, np.dtype(dtype), reverse, per_sequence,
                         memory_shapes, outputs, b.traced)


def build_random_stepnet(draw):
    """A random step-net and a dict of feeds rebinding every named input to
    new data (and a new LoD): ``rnn, feeds = build_random_stepnet(data.draw)``."""
    case = random_stepnet_case(draw)
    return case.rnn, case.feeds


random_stepnets = st.composite(build_random_stepnet)
"""Strategy form: ``@given(random_stepnets())`` gives ``(rnn, feeds)``."""

random_stepnet_cases = st.composite(random_stepnet_case)
"""Strategy form of :func:`random_stepnet_case`."""
