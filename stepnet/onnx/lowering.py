"""A key's whole plan compiled into one function: a streaming call of a
small model (a voice-activity detector's chunk of audio) then costs what its
arithmetic costs, not a NumPy call and a Python dispatch for each node.

After a key's first runs (``Graph.run``), :func:`lower` writes the key's
plan as the body of one Numba function, ``graph``, from the values a run of
it made (their shapes and dtypes are the key's, so every shape in it is a
constant):

- each run of elementwise nodes (those :mod:`stepnet.onnx.fusion` fuses,
  and Pow by a constant of the key): one loop nest, each op's code as in a
  step;
- Slice (its starts, ends, axes and steps constants for the key), Split
  and Gather (by sizes and indices the key fixes), Squeeze, Unsqueeze,
  Reshape, Flatten (by the shape the run gave), Transpose, Concat,
  Identity, an ``If`` whose branch the key decides, and a Cast between
  float types: views, reshapes and copies;
- Pad (constant, reflect or edge, its pads constants), a 1-D Conv of one
  group (at stride 1 one product per tap, else its windows copied into rows
  and one product; channels-last, as a Conv node's), other Convs of one or
  two spatial axes and MaxPool by direct loops, MatMul by a 2-D
  matrix and Gemm (the products' rows shared with the helper where big
  enough), ReduceMean and ReduceSum (their loops: :mod:`stepnet.onnx.lowered`);
  each node's lines written by :mod:`stepnet.onnx.lowering_nodes`;
  elementwise loops follow their inputs' memory order (and read and write
  a Conv's rows, a run's outputs and their slices in the C-contiguous arrays
  holding them: ``_Writer.memory``), the values given back stay C-contiguous;
- GRU, LSTM and RNN nodes of one direction or two, no ``sequence_lens``,
  weights that are constants: each direction's step-net kernel, called as
  its prepared call calls it (:mod:`stepnet.jit.prepared`), X's rows read
  by steps;
- Expand, ScatterND, ConvTranspose, and in runs PRelu and
  BatchNormalization (:func:`_extra`): a streaming enhancement model's ops.

A plan with any other node, a value of no dimensions or of another dtype
than float32 or float64, is not lowered: its nodes run as before. The
function compiles in the compile worker (``loading.tiered``) while the nodes
run; at its first call its outputs are compared with the nodes' on the same
inputs (where they disagree, the nodes run from then on, with a
RuntimeWarning), then calls alternate between the two, timed, and the faster
answers from then on (``GraphNode._check``). Not under
``STEPNET_DETERMINISTIC=1`` (as :func:`stepnet.onnx.fusion.fuse`).
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
from numba import typeof, types

from .fusion import _PRIMITIVES, _fusable, compiled_by_worker
from .lowering_nodes import FLOATS, LAYERS, LOWER, known, nest, permuted

_LOCK = threading.Lock()
_TIMINGS = 8  # the calls of the nodes and of the graph timed in turn after the first


class _Refused(Exception):
    """A value the compiled graph cannot take (not an array)."""


class _Writer:
    """The source of ``graph`` as it is written: its arguments (values of the
    call by name, or arrays made here), its module's lines and its body's."""

    def __init__(self, env, fixed, keep):
        self.env, self.fixed, self.keep = dict(env), set(fixed), keep  # (constant() adds)
        self.var = {}  # value name -> its variable in graph
        # value name -> the order of its axes in memory, outermost first, where
        # it is made here and not C-contiguous (elementwise loops follow it)
        self.order = {}
        # value name -> (an array variable known C-contiguous, the value's
        # offset on each axis): the value is the array's elements at those
        # offsets, its axes in the array in ``order``'s order; an elementwise
        # loop reads and writes it there (LLVM vectorizes loops over arrays
        # known contiguous, not over views of any layout)
        self.memory = {}
        # ("env", name), ("array", an array or a tuple), ("board", (kernel, rows,
        # sequences)): a recurrent kernel's, ("product board", multiply-adds)
        self.args = []
        self.head, self.body, self.temps, self.made_count = [], [], 0, 0

    def arg(self, kind, what):
        """A new argument of ``graph`` (``self.args``' ``(kind, what)``): its name."""
        self.args.append((kind, what))
        return f"a{len(self.args) - 1}"

    def ref(self, name):
        """The variable holding value ``name``: an argument where no node of
        the plan made it (an array)."""
        if name not in self.var:
            if type(self.env.get(name)) is not np.ndarray:
                raise _Refused(name)
            self.var[name] = self.arg("env", name)
        return self.var[name]

    def array(self, value):
        """An argument holding ``value``, an array made once for the key."""
        return self.arg("array", value)

    def constant(self, name, value):
        """``name``, a value of the key's own made here (an array once for
        the key), read as the plan's values are: ``name``."""
        if name not in self.var:
            self.env[name], self.var[name] = value, self.array(value)
            self.fixed.add(name)
        return name

    def same_order(self, name, source, offsets=None):
        """Value ``name`` laid out as ``source`` is (a view of it, at
        ``offsets`` from its first element on each axis)."""
        if source in self.order:
            self.order[name] = self.order[source]
        if source in self.memory:
            array, at = self.memory[source]
            self.memory[name] = (array, tuple(a + b for a, b in zip(at, offsets or [0] * len(at))))

    def element(self, name, index):
        """Value ``name``'s element at ``index`` (a loop variable per axis)
        where it lies in an array known C-contiguous (``memory``), else None."""
        if name not in self.memory:
            return None
        array, at = self.memory[name]
        order = self.order.get(name, range(len(index)))
        return f"{array}[{', '.join(index[a] + (f' + {at[a]}' if at[a] else '') for a in order)}]"

    def made(self, name=None):
        """A new variable for value ``name``, made by the current node
        (``None``: a value of the node's own that no other node reads)."""
        var = f"v{self.made_count}"
        self.made_count += 1
        if name is not None:
            self.var[name] = var
        return var

    def product_board(self, multiply_adds):
        """An argument holding the board of a product of this many
        multiply-adds (``blas.board_for_product``): the helper's, woken at
        each call, where the product is cut with it, else ``threads.ALONE``."""
        from ..jit import blas, threads

        if blas.board_for_product(multiply_adds) is threads.ALONE:
            return self.array(threads.ALONE)
        return self.arg("product board", multiply_adds)

    def global_(self, line_of):
        """A global of the module (``line_of(name)`` its line): its name."""
        self.head.append(line_of(f"g{len(self.head)}"))
        return f"g{len(self.head) - 1}"


def pending(plan):
    """Whether a GRU, LSTM or RNN node of ``plan`` has no streaming call
    yet because a direction's kernel has not answered (it compiles): the
    plan is then lowered at a later run, once that call is prepared."""
    return any(node.kind == "recurrent" and node.op in LAYERS
               and getattr(node.impl, "_streaming", None) is None
               and not all(run.tried for run in node.impl.compiled.values())
               for node in plan)


def lower(plan, nodes, env, keep, fixed):
    """A :class:`GraphNode` computing ``plan`` (the key's plan, ``env`` the
    values of a run of it, ``keep`` the names read after it, ``fixed`` the
    names whose values are the same at every run of the key; ``nodes``
    what runs while it compiles: the plan fused), or None where a node is
    not one it lowers."""
    from ..jit import blas

    if blas.DETERMINISTIC or not plan:
        return None
    try:
        return _lower(plan, nodes, env, keep, fixed)
    except _Refused:
        return None


def _lower(plan, nodes, env, keep, fixed):
    w = _Writer(env, fixed, set(keep))
    read_after = [set(keep)]
    for node in reversed(plan):
        read_after.append(read_after[-1] | {n for n in (*node.inputs, *node.captures) if n})
    read_after.reverse()
    i = 0
    while i < len(plan):
        node = plan[i]
        kind = _run_kind(w, node)
        if kind is not None:  # a run of elementwise nodes: one fused loop
            j = i + 1
            while j < len(plan) and _run_kind(w, plan[j]) == kind:
                j += 1
            _elementwise(w, plan[i:j], read_after[j])
            i = j
            continue
        for name in node.outputs:
            value = env.get(name)
            if name and (type(value) is not np.ndarray or value.dtype not in FLOATS
                         or value.ndim == 0):
                return None
        if not LOWER.get(node.op if node.kind in ("op", "copy", "recurrent") else None,
                          lambda *a: False)(w, node):
            return None
        i += 1
    made = {name for node in plan for name in node.outputs if name}
    outputs = [name for name in keep if name in made]
    return GraphNode(nodes, w, outputs) if outputs else None


def _run_kind(w, node):
    """The dtype and shape of ``node``'s output where it joins a run of
    elementwise nodes (``fusion._fusable``, or one of ``_extra``'s), else None."""
    if _extra(w, node) is not None:
        out = w.env[node.outputs[0]]
        return out.dtype, out.shape
    return _fusable(node, w.env)


def _extra(w, node):
    """For the ops a run takes beyond fusion's: ``(the names its loop reads,
    its code given their scalars)`` where ``node`` is one it takes, else
    None. Pow by one float the key fixes (by 2 as NumPy's square, ``x *
    x``), PRelu, and BatchNormalization in inference by constants (as the
    reference computes it, its square root of ``var + epsilon`` once)."""
    out = w.env.get(node.outputs[0]) if len(node.outputs) == 1 else None
    x = w.env.get(node.args[0]) if node.kind == "op" and node.args else None
    if (type(out) is not np.ndarray or out.dtype not in FLOATS or out.ndim == 0
            or type(x) is not np.ndarray or x.dtype != out.dtype or x.shape != out.shape):
        return None
    dt = out.dtype.name
    if node.op == "Pow" and len(node.args) == 2 and not node.attrs:
        e = known(w, node.args[1])
        if np.size(e) != 1 or np.asarray(e).dtype.kind != "f" or not np.all(np.isfinite(e)):
            return None
        e = float(np.asarray(e).reshape(-1)[0])
        return node.args[:1], lambda a: f"({a[0]} * {a[0]})" if e == 2 else f"({a[0]} ** np.{dt}({e!r}))"
    if node.op == "PRelu" and len(node.args) == 2:
        slope = w.env.get(node.args[1])
        if (type(slope) is not np.ndarray or slope.dtype != x.dtype or slope.ndim > x.ndim
                or any(n not in (1, m) for n, m in zip(slope.shape[::-1], x.shape[::-1]))):
            return None
        return node.args, lambda a: f"({a[0]} if {a[0]} >= 0 else {a[1]} * {a[0]})"
    if (node.op == "BatchNormalization" and len(node.args) == 5 and x.ndim >= 2
            and not node.attrs.get("training_mode", 0)):
        params = [known(w, n) for n in node.args[1:]]
        if any(type(v) is not np.ndarray or v.shape != x.shape[1:2] or v.dtype != x.dtype
               for v in params):
            return None
        scale, bias, mean, var = (v.reshape((-1,) + (1,) * (x.ndim - 2)) for v in params)
        root = np.sqrt(var + node.attrs.get("epsilon", 1e-5))
        names = [w.constant(f"{node.outputs[0]}#{k}", v)
                 for k, v in enumerate((scale, mean, root, bias))]
        return [node.args[0], *names], lambda a: f"({a[1]} * ({a[0]} - {a[2]}) / {a[3]} + {a[4]})"
    return None


def _elementwise(w, nodes, read_after):
    """A run of elementwise nodes (one dtype and shape: ``_fusable``) as one
    loop nest over the output, each op's code as in a step
    (``cpu_emit.op_code``), an input broadcast where its axis is 1; only
    the values read after the run stored."""
    from ..jit.cpu_emit import op_code

    out = w.env[nodes[0].outputs[0]]
    shape, dt = out.shape, out.dtype
    index = [f"i{k}" for k in range(len(shape))]
    # the loops in the memory order of the first input that is not broadcast
    # and is not C-contiguous (a Conv's rows channels-last), its outputs made so
    order = next((w.order[n] for node in nodes for n in node.args
                  if n in w.order and w.env[n].shape == shape), tuple(range(len(shape))))
    scalars, loop = {}, []
    for node in nodes:
        args, extra = [], _extra(w, node)
        for name in node.args if extra is None else extra[0]:
            if name not in scalars:
                x, src = w.env[name], w.ref(name)
                at = [index[len(shape) - x.ndim + a] if n != 1 else "0" for a, n in enumerate(x.shape)]
                scalars[name] = (x.shape == shape and w.element(name, index)
                                 or (f"{src}[{', '.join(at)}]" if at else f"{src}[()]"))
            args.append(scalars[name])
        t = f"t{w.temps}"
        w.temps += 1
        code = op_code(_PRIMITIVES[node.op].name, args, dt) if extra is None else extra[1](args)
        loop.append(f"{t} = {code}")
        scalars[node.outputs[0]] = t
    for node in nodes:
        name = node.outputs[0]
        if name in read_after:
            y = w.made(name)
            if order == tuple(range(len(shape))) or name in w.keep:  # (what the call gives back:
                w.body.append(f"    {y} = np.empty({shape}, np.{dt.name})")  # C-contiguous)
            else:  # (laid out in the loops' order: the loop writes the array, others read the view)
                w.order[name], w.memory[name] = order, (f"{y}m", (0,) * len(shape))
                laid = tuple(shape[a] for a in order)
                w.body.append(f"    {y}m = np.empty({laid}, np.{dt.name})")
                w.body.append(f"    {y} = {permuted(f'{y}m', np.argsort(order), laid)}")
            loop.append(f"{w.element(name, index) or y + '[' + ', '.join(index) + ']'} = {scalars[name]}")
    w.body += nest([(index[axis], shape[axis]) for axis in order])
    w.body += [f"{'    ' * (len(shape) + 1)}{line}" for line in loop]


def _agree(ours, theirs):
    """Whether the compiled call's value ``ours`` agrees with the nodes'
    ``theirs``: the same shape and dtype, NaN where it is NaN, each element
    within 1e-4 of its size plus 1e-5 of the value's largest finite one (at
    least 1): the sums of the products and reductions run in another order
    round apart by about the size of their terms, which a sum that cancels
    leaves far above its own size (a wrong value is off by the values)."""
    if type(theirs) is not np.ndarray or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    finite = np.abs(theirs[np.isfinite(theirs)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    return bool(np.allclose(ours, theirs, rtol=1e-4, atol=1e-5 * scale, equal_nan=True))


class GraphNode:
    """A key's plan run by one compiled call (``graph``); its nodes
    (``nodes``: the plan with its elementwise runs fused) run while it
    compiles, at its first call, and from then on where the call disagreed
    with them or was not the faster (``_check``)."""

    kind, fast, captures = "graph", None, []

    def __init__(self, nodes, writer, outputs):
        from ..jit import loading
        from ..jit.cpu_emit import runtime_imports

        self.nodes, self.outputs = nodes, outputs
        self.op, self.ctx = "graph", nodes[0].ctx
        self._args = writer.args
        sample = [self._value(spec, writer.env) for spec in writer.args]
        self._shapes = [getattr(value, "shape", None) for value in sample]
        params = ", ".join(f"a{k}" for k in range(len(writer.args)))
        body = [f"def graph({params}):", "    ok = True", *writer.body,
                f"    return (ok, {', '.join(writer.var[n] for n in outputs)},)"]
        floats = sorted({a.dtype.name for a in sample if isinstance(a, np.ndarray)
                         and a.dtype in FLOATS})
        source = "\n".join([
            "# generated by stepnet: do not edit", "import math", "import numpy as np",
            "from numba import njit",
            "from stepnet.jit.atomics import as_read_only", *runtime_imports(),
            "from stepnet.onnx.lowered import conv1d, conv2d, conv_transpose2d, generated, "
            "max_pool2d, product, reduce_rows",
            f"SMALL_GEMM_DTYPES = {tuple(floats)!r}  # (the kernels' product loops, linked)",
            *writer.head, "", "", "@njit(cache=True, error_model='numpy', nogil=True)", *body, ""])
        self.source = source
        self._signature = tuple(self._type(spec, value) for spec, value in zip(writer.args, sample))
        self._module = module = loading.load_source(source)
        self._key = key = loading.kernel_key(source)
        # "compiling" -> "checking" (its first call) -> "timing" (calls
        # alternate) -> "ready", or "refused" (it disagreed, or did not
        # compile) or "slower" (the nodes run)
        self.entry, self.state = None, "compiling"
        self._answered = compiled_by_worker(module, key, self._signature, "graph")

    @staticmethod
    def _value(spec, env):
        kind, what = spec
        if kind == "env":
            return env[what]
        if kind in ("board", "product board"):
            from ..jit import threads

            return threads.ALONE
        return what

    @staticmethod
    def _type(spec, value):
        if spec[0] == "env":  # (any layout, read only: the call's values are checked, not copied)
            return types.Array(typeof(value).dtype, value.ndim, "A", readonly=True)
        return typeof(value)

    def run(self, graph, env, backend, *args, **kwargs):
        if self.state == "ready" and self._call(env):
            return
        if self.state == "timing":
            ours = len(self._times[1]) < len(self._times[0])
            start = time.perf_counter()
            if not (ours and self._call(env)):
                ours = False
                self._nodes(graph, env, backend, kwargs.get("key"))
            self._timed(ours, time.perf_counter() - start)
            return
        if self.state in ("compiling", "checking") and self._answered.is_set() and self._compile():
            self._check(graph, env, backend, kwargs.get("key"))
            return
        self._nodes(graph, env, backend, kwargs.get("key"))

    def _nodes(self, graph, env, backend, key):
        """The nodes' run (the graph's own loop: bound nodes inlined)."""
        graph._run(env, backend, False, False, False, self.nodes, key, constants=False)

    def _call(self, env):
        """The compiled call on ``env``'s values, its outputs put there;
        whether it ran (False: a value not of the type it was compiled for)."""
        values = self._call_values(env)
        if values is None:
            return False
        result = self.entry(*values)
        if result[0]:
            env.update(zip(self.outputs, result[1:]))
        return bool(result[0])

    def _timed(self, ours, seconds):
        """A call of the timing's (the graph's where ``ours``, else the
        nodes'): once each has ``_TIMINGS``, the faster answers from then on."""
        self._times[int(ours)].append(seconds)
        nodes, graph = self._times
        if len(nodes) >= _TIMINGS and len(graph) >= _TIMINGS:
            self.state = "ready" if min(graph) < min(nodes) else "slower"

    def _call_values(self, env):
        """The arguments of a call from ``env``, or None where a value is not
        of the type and shape ``graph`` was compiled for."""
        values = self._fixed.copy()
        for at, name, shape, dtype in self._fed:
            x = env[name]
            if type(x) is not np.ndarray or x.shape != shape or x.dtype != dtype \
                    or not x.flags.aligned:
                return None  # (the graph indexes by the shapes it was made for)
            values[at] = x
        for at, board, args in self._boards:
            values[at] = board(*args)
        return values

    def _compile(self):
        from ..jit import loading
        from ..jit.blas import board_for_product

        with _LOCK:
            if self.entry is not None:
                return True
            try:
                loading.link_helpers(self._module)
                function = self._module.graph
                function.compile(self._signature)
            except Exception as exc:  # noqa: BLE001  (Numba's errors have no common base)
                self.state = "refused"
                warnings.warn(f"stepnet: the compiled graph of the nodes from {self.ctx.node!r} did "
                              f"not compile ({type(exc).__name__}: {exc}); they run one by one",
                              RuntimeWarning, stacklevel=3)
                return False
            loading.mark_ready(self._key)
            # a call's arguments: the arrays made for the key (_fixed), the
            # values fed or made before it (_fed: checked) and the boards
            self._fixed = [spec[1] if spec[0] == "array" else None for spec in self._args]
            self._fed = [(at, spec[1], self._shapes[at], np.dtype(str(self._signature[at].dtype)))
                         for at, spec in enumerate(self._args) if spec[0] == "env"]
            self._boards = [(at, spec[1][0].program.board, spec[1][1:]) if spec[0] == "board"
                            else (at, board_for_product, (spec[1],))
                            for at, spec in enumerate(self._args)
                            if spec[0] in ("board", "product board")]
            self.entry = function.overloads[function.signatures[0]].entry_point
            self.state = "checking"
        return True

    def _check(self, graph, env, backend, key):
        """The first call: the nodes, and the compiled graph on the same
        inputs, compared (the nodes' outputs are the call's). Where they
        agree, the next calls alternate between the two, timed
        (``_timed``): the graph answers from then on where it was the faster
        (one call saves the nodes' dispatch, which a large batch's work
        hides, where NumPy's and the fused loops' vectorized arrays win)."""
        values = self._call_values(env)
        self._nodes(graph, env, backend, key)
        if values is None:  # (a value not as compiled: checked at a later call)
            return
        result = self.entry(*values)
        agree = bool(result[0]) and all(_agree(ours, env[n])
                                        for n, ours in zip(self.outputs, result[1:]))
        if not agree:
            self.state = "refused"
            warnings.warn(f"stepnet: the compiled graph of the nodes from {self.ctx.node!r} "
                          "disagreed with them; they run one by one", RuntimeWarning, stacklevel=3)
            return
        self._times, self.state = ([], []), "timing"
