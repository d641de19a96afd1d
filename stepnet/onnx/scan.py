"""ONNX's ``Scan`` node as a stepnet step-net.

The body graph is traced into a step-net. A body tensor of ONNX shape ``S``
is a step value: one sequence per row of a shared first axis when the body
keeps rows apart, else one sequence of ``[1, *S]``; Scan 8 has a batch axis,
one sequence per batch entry, and its ``sequence_lens`` becomes the LoD (scan
outputs zero past each length, final states at each sequence's own last
step). Reversed scan inputs are reversed before the run (Scan 8: within each
sequence's length) and reversed scan outputs after it, so the step-net itself
always runs forward. A body that does not trace (an op stepnet has no step
form of, a recurrent node or control flow inside, an integer scan input) runs
node by node: the specification's loop, the body run as a graph at each step.
"""

from __future__ import annotations

import numpy as np

from .. import dsl
from .. import ops as sn_ops
from ..errors import Error
from ..lod import LoDTensor
from ..pullback import vjp
from .ops import NotRowWise, is_step
from .recurrent import node_error, same_array


class ScanNode:
    """An ONNX Scan node run as a step-net traced from its body graph, or node
    by node where the body does not trace."""

    def __init__(self, ctx, attrs, body):
        self.ctx = ctx
        known = {"body", "num_scan_inputs", "directions", "scan_input_axes",
                 "scan_input_directions", "scan_output_axes", "scan_output_directions"}
        unknown = sorted(set(attrs) - known)
        if unknown:
            raise ctx.unsupported(f"attribute {unknown[0]!r} is not supported")
        if ctx.opset < 8:
            raise ctx.unsupported(f"Scan needs opset 8 or later, the model has {ctx.opset}")
        self.body = body
        self.M = int(attrs["num_scan_inputs"])
        self.N = len(body.input_names) - self.M
        self.K = len(body.output_names) - self.N
        if self.N < 0 or self.K < 0:
            raise ctx.unsupported(f"the body has {len(body.input_names)} inputs and "
                                  f"{len(body.output_names)} outputs for {self.M} scan inputs")
        if ctx.opset == 8:
            for name in ("scan_input_axes", "scan_input_directions", "scan_output_axes",
                         "scan_output_directions"):
                if name in attrs:
                    raise ctx.unsupported(f"attribute {name!r} is not in Scan-8")
            self.in_dirs = list(attrs.get("directions", [0] * self.M))
            self.in_axes, self.out_axes, self.out_dirs = [1] * self.M, [1] * self.K, [0] * self.K
        else:
            if "directions" in attrs:
                raise ctx.unsupported("attribute 'directions' is Scan-8's; use scan_input_directions")
            self.in_dirs = list(attrs.get("scan_input_directions", [0] * self.M))
            self.in_axes = list(attrs.get("scan_input_axes", [0] * self.M))
            self.out_dirs = list(attrs.get("scan_output_directions", [0] * self.K))
            self.out_axes = list(attrs.get("scan_output_axes", [0] * self.K))
        for name, values, n in (("scan input directions", self.in_dirs, self.M),
                                ("scan input axes", self.in_axes, self.M),
                                ("scan output directions", self.out_dirs, self.K),
                                ("scan output axes", self.out_axes, self.K)):
            if len(values) != n:
                raise ctx.unsupported(f"{len(values)} {name} for {n} values")
        for d in self.in_dirs + self.out_dirs:
            if d not in (0, 1):
                raise ctx.unsupported(f"direction {d} is not 0 or 1")
        # traced step-nets by what they were traced on: key -> (captured arrays, rnn or None)
        self.nets = {}

    def run(self, inputs, backend, captures):
        """``captures``: the outer-scope arrays the body reads, by name."""
        return self.forward(inputs, backend, captures)[0]

    def forward(self, inputs, backend, captures, keep=False, wrt_captures=()):
        """``(outputs, pullback)``; with ``keep``, ``pullback(grads)`` maps one
        gradient (or None) per output to ``(one per input, {capture name:
        gradient} for wrt_captures)``.

        Scan 9+ first tries one sequence per row of axis 0 (every state and scan
        slice has the same first dimension, the body keeps rows apart); if the
        body mixes rows (:class:`~stepnet.onnx.ops.NotRowWise`) it runs as one
        sequence. Scan 8 runs one sequence per batch entry."""
        ctx = self.ctx
        if ctx.opset == 8:
            lengths, states, scans = inputs[0], inputs[1:1 + self.N], inputs[1 + self.N:]
        else:
            lengths, states, scans = None, inputs[:self.N], inputs[self.N:]
        if len(scans) != self.M or any(x is None for x in list(states) + list(scans)):
            raise ctx.unsupported(f"expects {self.N} states and {self.M} scan inputs, got "
                                  f"{len(states)} and {len(scans)}")
        states = [np.asarray(s) for s in states]
        scans = [np.asarray(x) for x in scans]
        given = (states, scans)
        float16 = any(a.dtype == np.float16 for a in states + scans)
        if float16:  # computed in float32, given back as float16 (docs/design.md §4)
            states, scans = ([a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays]
                             for arrays in (states, scans))
        layout, rnn = self._traced(states, scans, lengths, captures, float16)
        if rnn is None:  # the body does not trace into a step-net: node by node
            if keep:
                raise ctx.unsupported("the Gradient through a Scan whose body runs node by node "
                                      "(it holds an op stepnet does not trace)")
            return self._loop(*given, lengths, backend, captures), None
        flags = (False,) * self.N + (True,) * self.K
        feeds = {f"scan{j}": s for j, s in enumerate(layout.seqs)}
        feeds.update({f"state{i}": s for i, s in enumerate(layout.inits)})
        try:
            if keep:
                outs, rnn_pullback = vjp(rnn, output_all_steps=flags, backend=backend, **feeds)
            else:
                outs = rnn(output_all_steps=flags, backend=backend, **feeds)
        except Error as e:
            raise node_error(ctx, e) from e
        outs = list(outs) if self.N + self.K > 1 else [outs]  # one output comes unwrapped
        results = [layout.final_out(f) for f in outs[:self.N]]
        results += [self._scan_out(layout, k, y) for k, y in enumerate(outs[self.N:])]
        results = [np.array(y, order="C") for y in results]
        if float16:
            results = [y.astype(np.float16) if y.dtype == np.float32 else y for y in results]
        if not keep:
            return results, None

        def pullback(grads):
            grads = list(grads) + [None] * (len(results) - len(grads))
            cts = []
            for i, g in enumerate(grads):
                if g is not None:
                    g = np.asarray(g, np.float32 if float16 else results[i].dtype)
                    g = layout.final_in(g) if i < self.N else self._scan_out_back(layout, i - self.N, g)
                    g = np.ascontiguousarray(g)
                cts.append(g)
            names = list(feeds)
            arrays = [captures[n] for n in wrt_captures]
            try:
                found = rnn_pullback(cts, wrt=names + arrays)
            except Error as e:
                raise node_error(ctx, e) from e
            by_name = dict(zip(names, found))
            d_states = [layout.final_back(by_name[f"state{i}"]) for i in range(self.N)]
            d_scans = [self._scan_in_back(layout, j, by_name[f"scan{j}"]) for j in range(self.M)]
            d_inputs = ([None] if ctx.opset == 8 else []) + d_states + d_scans
            d_inputs = [None if g is None or x is None or np.asarray(x).dtype.kind != "f"
                        else np.asarray(g, np.asarray(x).dtype) for g, x in zip(d_inputs, inputs)]
            return d_inputs, dict(zip(wrt_captures, found[len(names):]))

        return results, pullback

    def _traced(self, states, scans, lengths, captures, float16):
        """``(layout, step-net)`` of the first layout the body traces in (rows,
        then one sequence; Scan 8: by batch entry); the step-net None where
        it traces in none."""
        if self.ctx.opset == 8:
            layouts = [lambda: self._batched(states, scans, lengths)]
        else:
            layouts = [lambda: self._rows(states, scans), lambda: self._single(states, scans)]
        layout = rnn = None
        for make_layout in layouts:
            layout = make_layout()
            if layout is None:
                continue
            # boolean scan inputs (masks) run as 0/1 and are compared back to booleans
            layout.masks = tuple(x.dtype == np.bool_ for x in layout.seqs)
            layout.seqs = [x.astype(np.float32) if x.dtype == np.bool_ else x for x in layout.seqs]
            rnn = self._net(layout, captures, float16)
            if rnn is not None:
                break
        return layout, rnn

    # -- layouts: how the node's arrays become the step-net's feeds ----------------

    def _single(self, states, scans):
        """Scan 9+ as one sequence: each scan input's axis moved first."""
        seqs, T = [], None
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            x = np.moveaxis(x, axis, 0)
            x = np.ascontiguousarray(x[::-1] if d else x)
            if T is not None and x.shape[0] != T:
                raise self.ctx.unsupported(f"scan input {j} has {x.shape[0]} steps, scan input "
                                           f"0 has {T}")
            T = x.shape[0]
            seqs.append(LoDTensor(x, [[0, T]]))
        return _Layout("whole", seqs, [s[None] for s in states], T=T,
                       final_out=lambda f: f[0], final_in=lambda g: g[None],
                       final_back=lambda g: g[0])

    def _rows(self, states, scans):
        """Scan 9+ as one sequence per row of axis 0; None when the shapes do not allow it."""
        steps = []  # each scan input as [B, T, ...]: a view when it is laid out so
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            if x.ndim < 2:
                return None
            x = np.moveaxis(x, axis % x.ndim, 0)
            x = np.moveaxis(x[::-1] if d else x, 0, 1)
            steps.append(x)
        firsts = {a.shape[0] if a.ndim else None for a in states} | {x.shape[0] for x in steps}
        if len(firsts) != 1 or None in firsts or len({x.shape[1] for x in steps}) != 1:
            return None
        (B,), T = firsts, steps[0].shape[1]
        offsets = np.arange(B + 1, dtype=np.int64) * T
        seqs = [LoDTensor(np.ascontiguousarray(x).reshape((B * T,) + x.shape[2:]), [offsets])
                for x in steps]
        identity = lambda a: a  # noqa: E731
        return _Layout("rows", seqs, list(states), T=T, B=B, final_out=identity,
                       final_in=identity, final_back=identity)

    def _batched(self, states, scans, lengths):
        """Scan 8: ``[batch, sequence, ...]`` scan inputs, ``[batch, ...]`` states."""
        ctx = self.ctx
        B, T = scans[0].shape[:2] if scans[0].ndim >= 2 else (None, None)
        for j, x in enumerate(scans):
            if x.ndim < 2 or x.shape[:2] != (B, T):
                raise ctx.bad_input(f"scan input {j} has shape {list(x.shape)}, expected "
                                    f"[{B}, {T}, ...]")
        for i, s in enumerate(states):
            if s.ndim < 1 or s.shape[0] != B:
                raise ctx.bad_input(f"state {i} has shape {list(s.shape)}, expected [{B}, ...]")
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths)
        if lengths.shape != (B,) or lengths.dtype.kind not in "iu":
            raise ctx.bad_input(f"sequence_lens must be integers of shape [{B}]")
        bad = np.flatnonzero((lengths < 0) | (lengths > T))
        if bad.size:
            raise ctx.bad_input(f"sequence_lens[{bad[0]}] = {lengths[bad[0]]} is not in [0, {T}]")
        seqs = [LoDTensor.from_padded(_reverse_within(x, lengths) if d else x, lengths)
                for x, d in zip(scans, self.in_dirs)]
        identity = lambda a: a  # noqa: E731
        return _Layout("batched", seqs, states, T=T, B=B, lengths=lengths, final_out=identity,
                       final_in=identity, final_back=identity)

    def _scan_out(self, layout, k, y):
        """An all-steps output of the step-net as the node's scan output ``k``."""
        if layout.kind == "batched":
            return _padded(y, layout.T)
        data = y.data
        if layout.kind == "rows":  # [B*T, ...] -> [T, B, ...]
            data = data.reshape((layout.B, layout.T) + data.shape[1:]).swapaxes(0, 1)
        return np.moveaxis(data[::-1] if self.out_dirs[k] else data, 0, self.out_axes[k])

    def _scan_out_back(self, layout, k, g):
        """The adjoint of ``_scan_out``: a gradient of scan output ``k`` as rows."""
        if layout.kind == "batched":
            return LoDTensor.from_padded(g, layout.lengths).data
        g = np.moveaxis(g, self.out_axes[k], 0)
        g = g[::-1] if self.out_dirs[k] else g
        if layout.kind == "rows":
            g = g.swapaxes(0, 1).reshape((layout.B * layout.T,) + g.shape[2:])
        return g

    def _scan_in_back(self, layout, j, g):
        """A gradient with respect to the rows of scan input ``j``, in the input's shape."""
        if layout.kind == "batched":
            g = _padded(LoDTensor(g, layout.seqs[j].levels), layout.T)
            return _reverse_within(g, layout.lengths) if self.in_dirs[j] else g
        if layout.kind == "rows":
            g = g.reshape((layout.B, layout.T) + g.shape[1:]).swapaxes(0, 1)
        return np.moveaxis(g[::-1] if self.in_dirs[j] else g, 0, self.in_axes[j])

    # -- node by node ---------------------------------------------------------------

    def _loop(self, states, scans, lengths, backend, captures):
        """The Scan as its specification's loop, the body run as a graph at
        each step (recurrent nodes in it are step-nets of their own)."""
        if self.ctx.opset == 8:
            return self._loop8(states, scans, lengths, backend, captures)
        steps = []
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            x = np.moveaxis(x, axis, 0)
            steps.append(x[::-1] if d else x)
        T = steps[0].shape[0] if steps else 0
        for j, x in enumerate(steps):
            if x.shape[0] != T:
                raise self.ctx.unsupported(f"scan input {j} has {x.shape[0]} steps, scan input "
                                           f"0 has {T}")
        finals, ys = self._steps(list(states), steps, T, backend, captures)
        outs = []
        for k, y in enumerate(ys):
            y = y[::-1] if self.out_dirs[k] else y
            outs.append(np.ascontiguousarray(np.moveaxis(y, 0, self.out_axes[k] % y.ndim)))
        return list(finals) + outs

    def _steps(self, states, slices, T, backend, captures):
        """``T`` steps of the body from ``states`` over ``slices`` (each
        ``[T, ...]``): the final states and each scan output stacked ``[T, ...]``."""
        body = self.body
        ys = [[] for _ in range(self.K)]
        for t in range(T):
            env = {n: captures[n] for n in body.dynamic_captures}
            env.update(zip(body.input_names[:self.N], states))
            env.update(zip(body.input_names[self.N:], (x[t] for x in slices)))
            body.run(env, backend)
            outs = [env[n] for n in body.output_names]
            states = outs[:self.N]
            for k, y in enumerate(outs[self.N:]):
                ys[k].append(np.asarray(y))
        if T == 0:
            return [np.asarray(s) for s in states], self._no_steps(states, slices, backend, captures)
        return [np.asarray(s) for s in states], [np.stack(y) for y in ys]

    def _no_steps(self, states, slices, backend, captures):
        """Each scan output with no steps: ``[0, ...]``, its step's shape
        as declared, or where the body does not declare it, as a step on
        zeros gives it (the outputs' shapes follow the inputs' alone)."""
        body = self.body
        args = body.output_args[self.N:]
        shapes = [arg.shape if arg.shape is not None and all(isinstance(d, int) for d in arg.shape)
                  else None for arg in args]
        if any(shape is None for shape in shapes):
            env = {n: captures[n] for n in body.dynamic_captures}
            env.update(zip(body.input_names[:self.N], states))
            env.update(zip(body.input_names[self.N:], (np.zeros(x.shape[1:], x.dtype) for x in slices)))
            with np.errstate(all="ignore"):
                body.run(env, backend)
            shapes = [np.shape(env[n]) for n in body.output_names[self.N:]]
        return [np.zeros([0, *shape], body.output_dtypes[self.N + k] or np.float32)
                for k, shape in enumerate(shapes)]

    def _loop8(self, states, scans, lengths, backend, captures):
        """Scan 8: each batch entry its own loop over its length."""
        B, T = scans[0].shape[:2] if scans and scans[0].ndim >= 2 else (None, None)
        for j, x in enumerate(scans):
            if x.ndim < 2 or x.shape[:2] != (B, T):
                raise self.ctx.unsupported(f"scan input {j} has shape {list(x.shape)}, expected "
                                           f"[{B}, {T}, ...]")
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths)
        finals, outs = [[] for _ in range(self.N)], [[] for _ in range(self.K)]
        for b in range(B):
            n = int(lengths[b])
            slices = [x[b, :n][::-1] if d else x[b, :n] for x, d in zip(scans, self.in_dirs)]
            final, ys = self._steps([s[b] for s in states], slices, n, backend, captures)
            for i, f in enumerate(final):
                finals[i].append(f)
            for k, y in enumerate(ys):
                outs[k].append(y)
        results = [np.stack(f) for f in finals]
        for ys in outs:
            inner = next((y.shape[1:] for y in ys if len(y)), ys[0].shape[1:])
            padded = np.zeros((B, T) + tuple(inner), ys[0].dtype)
            for b, y in enumerate(ys):
                padded[b, :len(y)] = y
            results.append(padded)
        return results

    # -- tracing ----------------------------------------------------------------

    def _net(self, layout, captures, float16):
        """The step-net for this layout, traced once per shapes and captured
        arrays; None when the body mixes rows in the rows layout or holds an
        op that does not trace on step values."""
        key = (layout.kind, layout.masks, tuple((a.shape[1:], a.dtype.str) for a in
                                              [*layout.inits, *(s.data for s in layout.seqs)]),
               tuple((n, np.shape(v), np.asarray(v).dtype.str) for n, v in captures.items()))
        cached = self.nets.get(key)
        if cached is not None and all(same_array(a, b) for a, b in zip(cached[0], captures.values())):
            return cached[1]
        try:
            rnn = self._trace(layout, captures, float16)
        except NotRowWise:
            if layout.kind != "rows":
                raise
            rnn = None
        except Error:  # an op or a dtype (integer scan inputs) that does not trace:
            rnn = None  # the body runs node by node, where a real error shows again
        self.nets[key] = (tuple(captures.values()), rnn)
        return rnn

    def _trace(self, layout, captures, float16):
        body = self.body
        rnn = dsl.create_rnn_op(name=self.ctx.node)
        with rnn.stepnet():
            env = {k: v.astype(np.float32) if float16 and np.asarray(v).dtype == np.float16 else v
                   for k, v in captures.items()}
            for j, (name, x) in enumerate(zip(body.input_names[self.N:], layout.seqs)):
                v = rnn.add_input(x, name=f"scan{j}")
                env[name] = sn_ops.greater(v, 0.5) if layout.masks[j] else v
            memories = []
            for i, (name, s) in enumerate(zip(body.input_names[:self.N], layout.inits)):
                m = rnn.add_memory(init=s, shape=s.shape[1:], name=f"state{i}")
                memories.append(m)
                env[name] = m.pre_state()
            body.run(env, backend=None, step=True, rows=layout.kind == "rows",
                     float16_as_float32=float16)
            outs = []
            for i, name in enumerate(body.output_names):
                v = env[name]
                if not is_step(v):
                    raise self.ctx.unsupported(f"body output {name!r} does not depend on a state "
                                               "or scan input")
                if i < self.N:
                    memories[i].update(v)
                    v = memories[i]
                outs.append(v)
            rnn.add_outputs(*outs)
        return rnn


class _Layout:
    """How one Scan run maps onto a step-net: ``kind`` is "rows", "whole" or
    "batched"; ``seqs`` the step inputs, ``inits`` the memories' initial
    values, and the maps of the final states to and from the node's layout."""

    def __init__(self, kind, seqs, inits, T, B=1, lengths=None, final_out=None, final_in=None,
                 final_back=None):
        self.kind, self.seqs, self.inits, self.T, self.B, self.lengths = kind, seqs, inits, T, B, lengths
        self.final_out, self.final_in, self.final_back = final_out, final_in, final_back
        self.masks = ()  # per step input: fed as 0/1 for a boolean scan input


def _reverse_within(x, lengths):
    """Each sequence ``b`` of ``x [B, T, ...]`` reversed over its first ``lengths[b]`` steps."""
    x = x.copy()
    for b, n in enumerate(lengths):
        x[b, :n] = x[b, :n][::-1]
    return x


def _padded(y: LoDTensor, T):
    """All-steps rows back into ``[B, T, ...]``, zero past each length."""
    return y.to_padded(steps=T)[0]
