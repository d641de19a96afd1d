"""stepnet inside JAX: a ``stepnet.nn`` layer or a step-net as a function of
its parameters and inputs, which ``jax.jit``, ``jax.grad`` and ``jax.vmap``
take::

    import jax, numpy as np, stepnet as sn, stepnet.jax
    gru = stepnet.jax.function(sn.nn.GRU(8, 16))
    params = gru.params                          # {name: array}: the layer's values
    x = np.random.randn(4, 10, 8).astype(np.float32)
    lengths = np.array([10, 7, 3, 1])

    def loss(params, x):
        y, h_n = gru(params, x, lengths)         # y [4, 10, 16], zeros past each length
        return (y ** 2).sum()

    grads = jax.jit(jax.grad(loss))(params, x)   # {name: gradient}

A call runs the step-net on stepnet's backend on the host
(``jax.pure_callback``) with the parameter values it is given. Under a
gradient (``jax.custom_vjp``) the forward keeps its workspace and the
backward takes its pullback by a token; a backward that finds it gone runs
the forward again, so the function stays pure. See docs/jax.md.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from .errors import ShapeError, StepNetError, UnsupportedError, optional_import

jax = optional_import("jax", "stepnet.jax", "pip install jax")

from . import dsl  # noqa: E402
from .backends import get_backend  # noqa: E402
from .lod import LoDTensor, offsets_from_lengths  # noqa: E402
from .nn.layers import LAYERS  # noqa: E402
from .padded import lod_lengths, mask, rows_at_steps, to_padded  # noqa: E402
from .nn.step_cells import _refuse_in_bridge  # noqa: E402
from .pullback import vjp  # noqa: E402

__all__ = ["Function", "function"]

# forwards run for a gradient whose pullback a Function keeps for the backward
# (a backward that finds its own gone, or a gradient taken twice, runs the
# forward again)
KEPT_PULLBACKS = 4


def function(net, output_all_steps=True, *, backend=None) -> Function:
    """``net`` (a ``stepnet.nn`` layer or a top-level step-net) as a JAX
    function: see :class:`Function`.

    Parameters
    ----------
    net : stepnet.nn layer or RNNOp
        A ``stepnet.nn`` RNN, GRU, LSTM, AUGRU or MGU, or a defined, top-level
        step-net. Not a cell (``GRUCell``...): a cell is one step, called
        inside a step-net's block.
    output_all_steps : bool or sequence of bool, default True
        Step-nets only: as in ``rnn(output_all_steps=...)``, for every call.
    backend : str, optional
        The stepnet backend the host callback runs on; None:
        ``default_backend()``.

    Returns
    -------
    Function
        ``f(params, ...)``, which ``jax.jit``, ``jax.grad`` and ``jax.vmap``
        take.

    Raises
    ------
    StepNetError
        ``net`` is neither a layer nor a step-net, or is a cell; a step-net
        not defined yet or nested; ``output_all_steps`` given for a layer, or
        with another number of flags than the step-net has outputs.

    Examples
    --------
    >>> import numpy as np, stepnet as sn, stepnet.jax
    >>> f = stepnet.jax.function(sn.nn.GRU(3, 4, seed=0), backend="interpreter")
    >>> y, h_n = f(f.params, np.ones((2, 5, 3), np.float32), np.array([5, 2]))
    >>> y.shape, h_n.shape
    ((2, 5, 4), (1, 2, 4))
    """
    return Function(net, output_all_steps, backend=backend)


class Function:
    """A layer or a step-net as ``f(params, ...)``.

    ``params`` is a dict of the net's Parameters by name (``f.params`` gives
    their values now; the net's Parameters are not changed by a call).

    - A layer is called ``f(params, x, lengths=None, hx=None)`` (AUGRU:
      ``f(params, x, attention, lengths=None, hx=None)``, attention
      ``[B, T]`` or ``[B, T, 1]``): ``x`` padded batch-first ``[B, T, I]``,
      ``lengths`` ``[B]`` integers (None: every sequence ``T`` steps), ``hx``
      the initial state ``[num_layers * num_directions, B, H]`` (LSTM: a pair
      ``(h0, c0)``). It returns ``(y, h_n)`` (LSTM: ``(y, (h_n, c_n))``), ``y``
      ``[B, T, ...]`` with zeros past each length.
    - A step-net is called ``f(params, **inputs)`` by its input names: a LoD
      input of one level as ``(padded [B, T, ...], lengths)`` or a padded
      array (every sequence ``T`` steps), one of ``d`` levels as ``(padded
      [B, T1, ..., Td, ...], (lengths_1, ..., lengths_d))`` (``[B]``,
      ``[B, T1]``, ...: each level's lengths, padded alike); a ragged static
      input (a decoder's memory: rows per sequence) likewise, other static
      inputs and initial memories as arrays. It returns its outputs (one, or a
      tuple in ``add_outputs`` order): an all-steps output padded like the
      first LoD input by its own levels (a nested net's every step ``[B, T1,
      T2, ...]``), a last-step output ``[B, ...]``.

    Gradients flow to ``params`` and to every float input; lengths are
    integers and get none.

    Parameters
    ----------
    net : stepnet.nn layer or RNNOp
        A ``stepnet.nn`` RNN, GRU, LSTM, AUGRU or MGU, or a defined, top-level
        step-net. Not a cell (``GRUCell``...): a cell is one step, called
        inside a step-net's block.
    output_all_steps : bool or sequence of bool, default True
        Step-nets only: as in ``rnn(output_all_steps=...)``, for every call.
    backend : str, optional
        The stepnet backend the host callback runs on; None:
        ``default_backend()``.

    Raises
    ------
    StepNetError
        ``net`` is neither a layer nor a step-net, or is a cell; a step-net
        not defined yet or nested; ``output_all_steps`` given for a layer, or
        with another number of flags than the step-net has outputs.
    """

    def __init__(self, net, output_all_steps=True, *, backend=None):
        _refuse_in_bridge(net, "stepnet.jax.function")
        if isinstance(net, dsl.RNNOp):
            net._require_defined()
            if not net._top:
                raise StepNetError(f"{net.name} is a nested step-net; wrap its enclosing one")
            self.flags = net.all_steps_flags(output_all_steps)
        elif isinstance(net, tuple(LAYERS.values())):
            if output_all_steps is not True:
                raise StepNetError("a layer gives every step's output and its final states; "
                                   "output_all_steps is for step-nets")
            self.flags = None
        else:
            raise StepNetError(f"stepnet.jax.function: expects a stepnet.nn layer or a step-net, "
                               f"got {type(net).__name__}")
        if backend is not None:
            get_backend(backend)  # an unknown or unavailable name: BackendError, now
        self.net, self.backend = net, backend
        # per output, whether it holds every step (a layer: Y, then its final states)
        self.all_steps = self.flags if self.flags is not None else \
            (True,) + (False,) * len(net.state_widths())
        self._parameters = net.parameters()
        self.names = _unique_names(self._parameters)
        self._calls = {}  # (spec, shapes) -> the differentiable function of that call
        self._lock = threading.Lock()  # one call at a time holds the Parameters
        # the pullbacks of forwards run for a gradient, by token, until their
        # backward takes them
        self._kept, self._tokens, self._kept_lock = OrderedDict(), 0, threading.Lock()

    @property
    def params(self) -> dict:
        """The net's Parameters' values now, by name (JAX arrays)."""
        return {n: jax.numpy.asarray(p.value) for n, p in zip(self.names, self._parameters)}

    def __call__(self, params, *args, **inputs):
        """Run the net with these parameter values (see the class docstring).

        Parameters
        ----------
        params : dict
            Every one of the net's parameters by name (the keys of
            ``f.params``) and no other, each of its Parameter's shape.
        *args
            A layer's positional arguments: ``x``, then (AUGRU:
            ``attention``, then) ``lengths`` and ``hx``. A step-net takes
            none.
        **inputs
            A layer's ``lengths=`` and ``hx=``; a step-net's inputs by name,
            those not given keeping the values bound when it was defined.

        Returns
        -------
        jax.Array or tuple
            A layer: ``(y, h_n)`` (LSTM: ``(y, (h_n, c_n))``). A step-net:
            its output, or a tuple of them.

        Raises
        ------
        StepNetError
            ``params`` is not a dict of exactly the net's names; a step-net
            given positional arguments, or an unknown input name; a layer
            given too many arguments, or an AUGRU no attention.
        ShapeError
            A parameter or input whose shape or dtype does not fit, or
            lengths outside ``[0, T]``.
        UnsupportedError
            An all-steps output whose LoD is not the first LoD input's (nor
            its first levels, nor its steps over a ragged static input's
            rows).
        """
        values = self._param_values(params)
        if self.flags is None:
            slots = self._layer_slots(*args, **inputs)
        else:
            if args:
                raise StepNetError(f"a step-net takes its inputs by name: f(params, "
                                   f"{', '.join(f'{n}=...' for n in self.net.bindings)})")
            slots = self._step_net_slots(inputs)
        spec = tuple((name, kind) for name, kind, _, _ in slots)
        arrays = tuple(jax.numpy.asarray(a) for _, _, a, _ in slots)
        lengths = tuple(lens for _, kind, _, lens in slots if kind in _LOD_KINDS)
        key = (spec, tuple((a.shape, str(a.dtype)) for a in values + arrays))
        if key not in self._calls:
            self._calls[key] = self._differentiable(spec, values, arrays)
        out = self._calls[key](values, arrays, lengths)
        if self.flags is None:  # (y, h_n) or (y, (h_n, c_n))
            return (out[0], tuple(out[1:])) if len(out) > 2 else tuple(out)
        return out[0] if len(out) == 1 else tuple(out)

    # -- the call's inputs --------------------------------------------------------

    def _param_values(self, params):
        if not isinstance(params, dict):
            raise StepNetError(f"params: expects a dict by name (f.params), got "
                               f"{type(params).__name__}")
        missing = [n for n in self.names if n not in params]
        unknown = sorted(set(params) - set(self.names))
        if missing or unknown:
            raise StepNetError(f"params: missing {missing}, unknown {unknown}; the net's "
                               f"parameters are {self.names}")
        values = []
        for n, p in zip(self.names, self._parameters):
            v = jax.numpy.asarray(params[n])
            if tuple(v.shape) != tuple(p.shape):
                raise ShapeError(f"params[{n!r}]: has shape {list(v.shape)}, the parameter is "
                                 f"{list(p.shape)}")
            values.append(v)
        return tuple(values)

    def _layer_slots(self, x, *args, lengths=None, hx=None):
        """(name, kind, array, lengths: a tuple of its levels') of a layer's
        call; the names are the pullback's (``X``, ``attention``, ``h0``, ``c0``)."""
        augru = self.net.kind.attention
        if augru:
            if not args:
                raise StepNetError("an AUGRU is called f(params, x, attention, lengths=None, "
                                   "hx=None)")
            attention, *args = args
        if args:
            lengths, *args = args
        if args:
            hx, *args = args
        if args:
            raise StepNetError(f"a layer is called f(params, x, {'attention, ' if augru else ''}"
                               "lengths=None, hx=None); too many arguments")
        x = jax.numpy.asarray(x)
        if x.ndim != 3:
            raise ShapeError(f"x: has shape {list(x.shape)}, expected padded batch-first "
                             "[B, T, input_size]")
        lens = (_lengths(lengths, x.shape[:2], "lengths"),)  # (one level's)
        slots = [("X", "sequence", x, lens)]
        if augru:
            a = jax.numpy.asarray(attention)
            if a.shape not in (x.shape[:2], x.shape[:2] + (1,)):
                raise ShapeError(f"attention: has shape {list(a.shape)}, expected "
                                 f"{list(x.shape[:2])} or {list(x.shape[:2]) + [1]}")
            slots.append(("attention", "sequence", a, lens))
        if len(self.net.kind.states) > 1:
            if hx is not None:
                if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
                    raise ShapeError("hx: an LSTM takes (h0, c0)")
                slots += [("h0", "array", jax.numpy.asarray(hx[0]), None),
                          ("c0", "array", jax.numpy.asarray(hx[1]), None)]
        elif hx is not None:
            slots.append(("h0", "array", jax.numpy.asarray(hx), None))
        states = [(name, a) for name, kind, a, _ in slots if kind == "array"]
        for (name, a), width in zip(states, self.net.state_widths()):  # (with the caller's B)
            self.net._check_state_shape(a.shape, width, name, x.shape[0])
        return slots

    def _step_net_slots(self, inputs):
        rnn = self.net
        unknown = set(inputs) - set(rnn.bindings)
        if unknown:
            raise StepNetError(f"unknown input name(s) {sorted(unknown)}; {rnn.name} takes "
                               f"{sorted(rnn.bindings)}")
        slots = []
        for name, value in inputs.items():
            b = rnn.bindings[name]
            if b.kind != "sequence" and not b.var.lod_depth:
                if isinstance(value, (LoDTensor, tuple, list)):
                    raise ShapeError(f"input {name}: a static input of one row per sequence "
                                     "(the net was defined with an array), given "
                                     f"{type(value).__name__}")
                a = jax.numpy.asarray(value)
                if not jax.numpy.issubdtype(a.dtype, jax.numpy.floating):
                    raise ShapeError(f"input {name}: has dtype {a.dtype}; stepnet.jax takes "
                                     "float inputs (their gradients flow back)")
                slots.append((name, "array", a, None))
                continue
            depth = b.var.lod_depth  # (a ragged static input's too: a decoder's memory)
            if isinstance(value, LoDTensor):
                raise ShapeError(f"input {name}: stepnet.jax takes a LoD input as (padded, "
                                 "lengths), not a LoDTensor")
            padded, lengths = value if isinstance(value, (tuple, list)) else (value, None)
            padded = jax.numpy.asarray(padded)
            if padded.ndim < depth + 1:
                steps = ", ".join(f"T{i + 1}" for i in range(depth))
                raise ShapeError(f"input {name}: the padded array has shape "
                                 f"{list(padded.shape)}, expected [B, {steps}, ...] ({depth} "
                                 f"level{'s' if depth > 1 else ''} of LoD)")
            if depth == 1:
                lengths = (_lengths(lengths, padded.shape[:2], f"input {name}: lengths"),)
            else:
                lengths = _level_lengths(lengths, padded.shape[:depth + 1], f"input {name}: lengths")
            slots.append((name, "sequence" if b.kind == "sequence" else "ragged", padded, lengths))
        return slots

    # -- the call ---------------------------------------------------------------------

    def _differentiable(self, spec, values, arrays):
        """``apply(values, arrays, lengths)`` for calls of this ``spec`` and
        these shapes and dtypes: a ``jax.custom_vjp`` over two host callbacks."""
        outs, depths = self._output_structs(spec, arrays)
        param_structs = tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values)
        array_structs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)

        token = jax.ShapeDtypeStruct((), np.int64 if jax.config.jax_enable_x64 else np.int32)

        def forward(values, arrays, lengths, keep=False):
            if keep:  # the pullback outlives the callback: its own copies of what it reads
                values, arrays = ([np.array(a) for a in group] for group in (values, arrays))
            with self._bound(values):
                got = self._run(spec, arrays, lengths, self.backend, keep)
                if keep:
                    got, pullback = got
                got = self._outputs(got, spec, arrays, lengths)
            got = tuple(np.asarray(o, s.dtype) for o, s in zip(got, outs))
            return got + (np.asarray(self._keep(pullback), token.dtype),) if keep else got

        def backward(values, arrays, lengths, kept, cts):
            with self._bound(values):
                grads = self._gradients(spec, arrays, lengths, depths, cts, self._take(int(kept)))
            return tuple(np.asarray(g, s.dtype).reshape(s.shape)
                         for g, s in zip(grads, param_structs + array_structs))

        @jax.custom_vjp
        def apply(values, arrays, lengths):
            return jax.pure_callback(forward, outs, values, arrays, lengths,
                                     vmap_method="sequential")

        def apply_fwd(values, arrays, lengths):
            got = jax.pure_callback(lambda *a: forward(*a, keep=True), outs + (token,), values,
                                    arrays, lengths, vmap_method="sequential")
            return got[:-1], (values, arrays, lengths, got[-1])

        def apply_bwd(saved, cts):
            values, arrays, lengths, kept = saved
            grads = jax.pure_callback(backward, param_structs + array_structs, values, arrays,
                                      lengths, kept, tuple(cts), vmap_method="sequential")
            n = len(values)
            return grads[:n], grads[n:], tuple(tuple(None for _ in lens) for lens in lengths)

        apply.defvjp(apply_fwd, apply_bwd)
        return apply

    @contextmanager
    def _bound(self, values):
        """The net's Parameters hold ``values`` (restored after; one call at a
        time: JAX may run callbacks on several threads)."""
        with self._lock:
            before = [p.value for p in self._parameters]
            try:
                for p, v in zip(self._parameters, values):
                    p.value = np.asarray(v)
                yield
            finally:
                for p, v in zip(self._parameters, before):
                    p.value = v

    def _stepnet_inputs(self, spec, arrays, lengths):
        """The call's inputs as stepnet takes them: a layer's positional
        arguments, or a step-net's by name."""
        lens = iter(lengths)
        given = {}
        for (name, kind), a in zip(spec, arrays):
            a = np.asarray(a)
            if kind in _LOD_KINDS:
                steps = a.shape[:2]
                if name == "attention":  # one score per token: rows [1]
                    a = a.reshape(steps + (1,))
                given[name] = _to_lod(a, next(lens))
            else:
                given[name] = a
        if self.flags is not None:
            return [], given
        args = [given["X"]] + ([given["attention"]] if "attention" in given else [])
        if len(self.net.kind.states) > 1:
            args.append((given["h0"], given["c0"]) if "h0" in given else None)
        else:
            args.append(given.get("h0"))
        return args, {}

    def _run(self, spec, arrays, lengths, backend, keep=False):
        """The net's outputs, and with ``keep`` its pullback: ``(outputs,
        pullback)`` (the net does not keep it as its workspace)."""
        args, named = self._stepnet_inputs(spec, arrays, lengths)
        if not keep:
            return self.net(*args, backend=backend) if self.flags is None else \
                self.net(output_all_steps=self.flags, backend=backend, **named)
        if self.flags is None:
            outs, pullback = vjp(self.net, *args, backend=backend)
        else:
            outs, pullback = vjp(self.net, output_all_steps=self.flags, backend=backend, **named)
        if getattr(self.net, "_workspace", None) is pullback:
            self.net._workspace = None  # held by this call's backward only
        return outs, pullback

    def _flat(self, outs):
        """A run's outputs as a list, each with whether it holds every step."""
        if self.flags is None:
            Y, finals = outs
            outs = (Y,) + (finals if isinstance(finals, tuple) else (finals,))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return list(zip(outs, self.all_steps))

    def _outputs(self, outs, spec, arrays, lengths):
        """All-steps outputs padded as ``_padding`` says: one of ``L`` levels
        (a nested net's every step: 2) as ``[B, T1, ..., TL, ...]``."""
        got = []
        for out, every in self._flat(outs):
            if every:
                levels, steps = self._padding(spec, arrays, lengths, out.num_levels)
                if not all(np.array_equal(a, offsets_from_lengths(b))
                           for a, b in zip(out.levels, lod_lengths(levels))):
                    raise UnsupportedError("stepnet.jax: an all-steps output whose LoD is not "
                                           "the first LoD input's (or its first levels), nor "
                                           "its steps over a ragged static input's rows")
                out = to_padded(out.data, levels, steps)
            got.append(np.asarray(out))
        return got

    def _padding(self, spec, arrays, lengths, depth):
        """How an all-steps output of ``depth`` levels is padded: the lengths
        of each level (None where ``lengths`` is) and the padded sizes ``(B,
        T1, ...)``. The first LoD input's first levels; or, one level deeper
        than a one-level first input, its steps, then at each step its
        sequence's rows of the ragged static input (attention weights over a
        memory: ``[B, T, M]``, ``M`` the memory's padded length)."""
        first = next(i for i, (_, kind) in enumerate(spec) if kind == "sequence")
        slots = [i for i, (_, kind) in enumerate(spec) if kind in _LOD_KINDS]
        levels = None if lengths is None else lengths[slots.index(first)]
        first_depth = 1 if self.flags is None else self.net.bindings[spec[first][0]].var.lod_depth
        steps = tuple(int(n) for n in np.shape(arrays[first])[:depth + 1])
        memory = [i for i in slots if spec[i][1] == "ragged"]
        if depth <= first_depth or depth != 2 or not memory:
            return (None if levels is None else levels[:depth]), steps
        steps = steps[:2] + (int(np.shape(arrays[memory[0]])[1]),)
        if levels is None:
            return None, steps
        counts = lengths[slots.index(memory[0])][0]
        return (levels[0], rows_at_steps(levels[0], steps[:2], counts)), steps

    def _output_structs(self, spec, arrays):
        """The outputs' shapes and dtypes for a call of these shapes, and the
        levels of each (0: not an all-steps output), found by
        running the net on the interpreter over the first sequence's first
        step (its features do not depend on the batch or the lengths)."""
        first = next(a for (_, k), a in zip(spec, arrays) if k == "sequence")
        B = int(first.shape[0])
        small, small_lengths = [], []
        for (name, kind), a in zip(spec, arrays):
            if kind in _LOD_KINDS:  # (a layer's inputs: one level)
                depth = 1 if self.flags is None else self.net.bindings[name].var.lod_depth
                small.append(np.zeros((1,) * (depth + 1) + tuple(a.shape[depth + 1:]), a.dtype))
                small_lengths.append(tuple(np.ones((1,) * (i + 1), np.int64) for i in range(depth)))
            else:  # a batch of one: a layer's states are [layers, B, H]; a number stays one
                axis = 1 if self.flags is None else 0
                shape = list(a.shape)
                if len(shape) > axis:
                    shape[axis] = 1
                small.append(np.zeros(shape, a.dtype))
        flat = self._flat(self._run(spec, small, small_lengths, "interpreter"))
        structs, depths = [], []
        for out, every in flat:
            depths.append(out.num_levels if every else 0)
            data = np.asarray(out.data if every else out)
            if every:  # (its levels: the first LoD input's first ones, or _padding's)
                shape = self._padding(spec, arrays, None, out.num_levels)[1] + data.shape[1:]
            elif self.flags is None:  # a layer's final states [layers, B, H]
                shape = data.shape[:1] + (B,) + data.shape[2:]
            else:
                shape = (B,) + data.shape[1:]
            structs.append(jax.ShapeDtypeStruct(shape, _jax_dtype(data.dtype)))
        return tuple(structs), tuple(depths)

    def _keep(self, pullback):
        """A token for ``pullback``, kept until its backward takes it (the
        oldest dropped past ``KEPT_PULLBACKS``)."""
        with self._kept_lock:
            token = self._tokens = (self._tokens + 1) % (1 << 31)
            self._kept[token] = pullback
            while len(self._kept) > KEPT_PULLBACKS:
                self._kept.popitem(last=False)
        return token

    def _take(self, token):
        with self._kept_lock:
            return self._kept.pop(token, None)

    def _gradients(self, spec, arrays, lengths, depths, cts, pullback=None):
        """The gradients of every parameter, then of every input (zeros for
        the padding of a padded one), given the outputs' cotangents (an
        all-steps one of ``depths`` levels, padded like the first LoD
        input); from the forward's ``pullback``, or (None: not kept) the
        forward run again."""
        if pullback is None:
            pullback = self._run(spec, arrays, lengths, self.backend, keep=True)[1]
        rows = []
        for depth, ct in zip(depths, cts):
            ct = np.asarray(ct)
            rows.append(ct[mask(self._padding(spec, arrays, lengths, depth)[0], ct.shape)]
                        if depth else ct)
        wrt = [name for name, _ in spec] + list(self._parameters)
        found = pullback(rows, wrt=wrt)
        inputs, params = found[:len(spec)], found[len(spec):]
        lens = iter(lengths)
        grads = []
        for (_, kind), a, g in zip(spec, arrays, inputs):
            if kind in _LOD_KINDS:
                levels = next(lens)
                g = to_padded(np.asarray(g), levels, np.shape(a)[:len(levels) + 1])
            grads.append(np.asarray(g).reshape(np.shape(a)))
        return list(params) + grads


# the slots given as (padded, lengths): step inputs, and ragged static inputs
# (rows per sequence: a decoder's memory)
_LOD_KINDS = ("sequence", "ragged")


def _unique_names(parameters):
    """A dict key per Parameter: its name, made unique with a suffix."""
    names, seen = [], set()
    for i, p in enumerate(parameters):
        base = p.name or f"param{i}"
        name, k = base, 1
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        seen.add(name)
        names.append(name)
    return names


def _to_lod(padded, levels):
    """A padded array's rows as a LoDTensor of ``len(levels)`` levels
    (``padded.mask``), each level's lengths checked first (traced ones reach here
    unchecked) as ``_lengths`` checks them."""
    padded = np.asarray(padded)
    for i, lens in enumerate(levels):
        _in_range(np.asarray(lens), padded.shape[i + 1], "lengths" if len(levels) == 1 else f"lengths[{i}]")
    return LoDTensor.from_lengths(padded[mask(levels, padded.shape)], lod_lengths(levels))


def _level_lengths(lengths, shape, what):
    """The lengths of each of the ``d`` levels of a padded input of ``shape``
    ``[B, T1, ..., Td]`` as int32 arrays ``[B]``, ``[B, T1]``, ...: ``lengths``
    a sequence of ``d`` of them (None: every sequence full), each checked as
    ``_lengths`` checks one level's."""
    depth = len(shape) - 1
    if lengths is None:
        return tuple(jax.numpy.full(shape[:i + 1], shape[i + 1], jax.numpy.int32)
                     for i in range(depth))
    if not isinstance(lengths, (tuple, list)) or len(lengths) != depth:
        raise ShapeError(f"{what}: expects {depth} arrays (the lengths of each level: "
                         f"{', '.join(str(list(shape[:i + 1])) for i in range(depth))}), got "
                         f"{type(lengths).__name__}"
                         + (f" of {len(lengths)}" if isinstance(lengths, (tuple, list)) else ""))
    return tuple(_lengths(lens, shape[:i + 2], f"{what}[{i}]") for i, lens in enumerate(lengths))


def _lengths(lengths, shape, what):
    """``lengths`` as int32 of ``shape[:-1]`` (``[B]``: each sequence's
    steps; a deeper level's ``[B, T1, ...]``), each in ``[0, shape[-1]]``
    (None: all ``shape[-1]``); a concrete value is checked here, a traced
    one when the call runs."""
    *lead, T = (int(n) for n in shape)
    if lengths is None:
        return jax.numpy.full(tuple(lead), T, jax.numpy.int32)
    lens = jax.numpy.asarray(lengths)
    if lens.shape != tuple(lead) or not jax.numpy.issubdtype(lens.dtype, jax.numpy.integer):
        expected = f"{lead[0]} integers" if len(lead) == 1 else f"integers of shape {lead}"
        raise ShapeError(f"{what}: expects {expected}, got {lens.dtype} of shape "
                         f"{list(lens.shape)}")
    if not isinstance(lens, jax.core.Tracer):
        _in_range(np.asarray(lens), T, what)
    return lens


def _in_range(lens, T, what):
    """``ShapeError`` naming the first of ``lens`` (NumPy) outside ``[0, T]``."""
    bad = np.argwhere((lens < 0) | (lens > T))
    if bad.size:
        i = tuple(int(j) for j in bad[0])
        raise ShapeError(f"{what}[{', '.join(map(str, i))}] = {int(lens[i])} is outside [0, {T}] "
                         f"(the padded array has {T} steps)")


def _jax_dtype(dtype):
    """The dtype JAX holds ``dtype`` in (float64 is float32 unless
    ``jax_enable_x64``)."""
    return jax.dtypes.canonicalize_dtype(np.dtype(dtype))
