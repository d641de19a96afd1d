"""Gradients at run time: a forward run that keeps its workspace, and the
pullback that runs the backward program (built by :mod:`stepnet.autodiff`)
on the same backend.

``vjp(obj, ...)`` and ``gradients(obj, ...)`` take a step-net or a
``stepnet.nn`` layer (anything with a ``vjp`` method). After the backward
program, :class:`Pullback` sums the per-row terms of each constant's gradient
(``X^T G`` is one GEMM), pushes them through ops on constants alone (with the
NumPy references) and maps them to the Parameters and named inputs asked for.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from . import ir, registry
from .autodiff import (
    Outer,
    Rows,
    _EagerEmitter,
    _is_float,
    const_only_eqns,
    grad_rule,
    sum_to_shape,
)
from .backends import backend as backend_info
from .backends import compiled, default_backend
from .errors import ShapeError, StepNetError, UnsupportedError
from .interpreter import numpy_blas_beside_a_compile
from .ir import Literal, Var
from .config import config
from .lod import LoDTensor, device_array, host_array
from .tracing import Parameter


def _numpy_transposed_products(products):
    return [(a.T @ b, b.sum(0)) if column_sums else a.T @ b for a, b, column_sums in products]


def reduce_terms(layout, outputs, inputs, on_numpy=False, on_device=False) -> dict:
    """Sum the per-row terms: ``{id(const var): gradient}``. A term's index is
    an output of the backward rnn; a Var is one of its inputs (``inputs``:
    id(var) -> value). The rows of a ``Rows`` term are summed once however many
    constants share them, and beside the product of an ``Outer`` term over
    the same rows (a bias next to its weight) when there is one. The
    products run together on stepnet's threads (``transposed.transposed_products``,
    compiled helpers), or with ``on_numpy`` on NumPy: for a backward that ran
    on the interpreter, which must not wait for a compile; with
    ``on_device``, rows that lie on the GPU are summed there."""
    if on_device:
        from .jit.cuda_run import column_sums_on_device, transposed_products as products_of
    elif on_numpy:
        products_of = _numpy_transposed_products
    else:
        from .jit.transposed import transposed_products as products_of  # (loaded: a kernel ran)
    grads, sums = {}, {}

    def key(ref):
        return ("var", id(ref)) if isinstance(ref, Var) else ref

    def rows(ref):
        return (inputs[id(ref)] if isinstance(ref, Var) else outputs[ref]).data

    def add(var, g):
        grads[id(var)] = grads[id(var)] + g if id(var) in grads else g

    summed = {key(term.value) for _, term in layout.contribs if isinstance(term, Rows)}
    products, owners, sums_of = [], [], set()
    for var, term in layout.contribs:
        if isinstance(term, Outer):
            g_rows, g_key = rows(term.g), key(term.g)
            column_sums = g_key in summed and g_key not in sums_of and g_rows.ndim == 2
            if column_sums:
                sums_of.add(g_key)
            products.append((rows(term.a), g_rows, column_sums))
            owners.append((var, g_key if column_sums else None))
    for (var, g_key), product in zip(owners, products_of(products)):
        if g_key is not None:
            product, sums[g_key] = product
        add(var, product)
    for var, term in layout.contribs:
        if isinstance(term, Rows):
            k = key(term.value)
            if k not in sums:
                r = rows(term.value)
                sums[k] = column_sums_on_device(r).ravel() if on_device and device_array(r) is not None \
                    else r.reshape(r.shape[0], int(np.prod(r.shape[1:]))).sum(0)
            add(var, sums[k].reshape(var.shape).copy())
    return grads


def pull_consts(program, grads, const_values) -> dict:
    """Push gradients of values computed from constants alone back to the
    constants they read (NumPy, after the loop)."""
    eqns = const_only_eqns(program)
    if not eqns:
        return grads
    env = {id(v): const_values[v] for v in program.consts}
    for e in eqns:
        args = [v.value if isinstance(v, Literal) else env[id(v)] for v in e.inputs]
        env[id(e.outputs[0])] = registry.get(e.op).numpy(*args, **e.attrs)
    em = _EagerEmitter(env)
    for e in reversed(eqns):
        g = grads.get(id(e.outputs[0]))
        if g is None or not _is_float(e.outputs[0]):
            continue
        for v, gv in zip(e.inputs, grad_rule(e.op)(em, e, g)):
            if gv is not None and _is_float(v):
                gv = em.unbroadcast(gv, v)
                grads[id(v)] = grads[id(v)] + gv if id(v) in grads else gv
    return grads


# ----------------------------------------------------------------------------
# the public API: gradients, vjp, workspaces


class Pullback:
    """The backward of one forward run of a step-net, its workspace kept.

    ``pullback(grad_outputs, wrt=None, accumulate=False, out=None)`` returns one
    gradient per ``wrt`` (default: the step-net's Parameters); it may be called
    any number of times. ``workspace_bytes`` is the size of what is kept per
    step: each memory's previous state, one row per token.
    """

    def __init__(self, rnn, flags, backend, args, outputs, workspace, consts, values):
        self.rnn = rnn
        self.values = values  # binding name -> the value this run was given
        self.flags = flags
        self.backend = backend
        self.args = args
        self.outputs = outputs
        self.workspace = workspace
        self.consts = consts

    @property
    def workspace_bytes(self) -> int:
        return int(sum(w.data.nbytes for w in self.workspace))

    def _check_ragged(self, program, cts, computed, capabilities):
        """Refuse a cotangent for a ragged output computed in the step from a
        ragged static input's rows (attention weights over a memory) where
        its gradient does not run: the backward reads it as a step input of
        two levels, which the CUDA kernels do not read by ops (on the host,
        each step's rows at the memory's rows)."""
        eqn = program.eqn
        body, ragged_memories = eqn.attrs["body"], eqn.attrs.get("ragged_memories", {})
        rows = [v for v in body.static_inputs if v.lod_depth]
        over = {id(v) for v in (*rows, *ir.dependent(body, rows))}
        for c, asked, every, res, mi in zip(cts, self.flags, computed, body.outputs,
                                            eqn.attrs["output_memory"]):
            if c is not None and every and not asked:
                raise UnsupportedError(
                    f"gradient of {self.rnn.name}: the last step of the ragged output {res.name}")
            if (c is not None and capabilities.compiles and not capabilities.host_code
                    and res.lod_depth and id(res) in over and mi not in ragged_memories):
                raise UnsupportedError(
                    f"{self.backend} backend: the gradient of {self.rnn.name}'s ragged output "
                    f"{res.name} (rows computed at every step from a ragged static input's) runs "
                    "on backend='interpreter' or 'numba'")

    def _check_nested_ragged(self, body, capabilities):
        """Refuse a gradient through a nested step-net that steps over or
        reads a ragged static input of its enclosing net (one step a memory
        row; a memory per document read by each sentence's words) on the
        backends that compile for a device: the backward keeps an
        accumulator over that memory's rows per nested sequence, which the
        interpreter and the host's kernels run."""
        ragged = {id(v) for v in body.static_inputs if v.lod_depth}
        for e in body.eqns:
            if e.op != "rnn":
                continue
            seqs, statics, _ = ir.rnn_parts(e)
            steps = any(id(v) in ragged for v in seqs)
            reads = any(id(v) in ragged for v in statics)
            if capabilities.compiles and not capabilities.host_code and (steps or reads):
                raise UnsupportedError(
                    f"{self.backend} backend: the gradient of {self.rnn.name} through its nested "
                    f"step-net {e.attrs['name']}, which {'steps over' if steps else 'reads'} a "
                    "ragged static input of the net enclosing it, runs on backend='interpreter' "
                    "or 'numba'")
            self._check_nested_ragged(e.attrs["body"], capabilities)

    def __call__(self, grad_outputs, wrt=None, accumulate=False, out=None):
        rnn = self.rnn
        if getattr(rnn, "quantized", None):  # (before its wrt: its Parameters are the float model's)
            raise UnsupportedError(f"gradient of {rnn.name}: a quantized model ({rnn.quantized}) has no "
                                   "gradient (it is for inference): train the float model, then quantize it")
        wrt = rnn.parameters() if wrt is None else wrt_list(wrt)
        targets = [_resolve(rnn, item, self.values) for item in wrt]
        program = rnn.program(self.flags)
        cts = _check_grad_outputs(rnn, program, self.outputs, grad_outputs)
        capabilities = backend_info(self.backend)
        # (an all-steps cotangent on the GPU is read there by a device's backend;
        # a last-step one, a row per sequence, and any on another backend, on the host)
        cts = [c if c is None or flag and capabilities.device_memory else host_array(c)
               for c, flag in zip(cts, self.flags)]
        present = tuple(c is not None for c in cts)
        kernel = compiled(rnn, self.backend)
        computed = kernel.kernel_flags(self.flags)  # (the forward's: each step of a ragged output)
        self._check_ragged(program, cts, computed, capabilities)
        self._check_nested_ragged(program.eqn.attrs["body"], capabilities)
        runs, layout = kernel.backward(computed, present)
        seqs, statics, _ = ir.rnn_parts(program.eqn)
        position = {id(v): i for i, v in enumerate(program.inputs)}
        args = [self.args[position[id(v)]] for v in tuple(seqs) + tuple(statics)]
        args += list(self.workspace)
        for c, res, flag in zip(cts, self.outputs, self.flags):
            if c is not None:
                args.append(LoDTensor(c, res.levels) if flag else c)
        values = {}
        for run, prog in runs:
            if not values:
                values.update((id(v), a) for v, a in zip(prog.inputs, args))
            outs = run([values[id(v)] for v in prog.inputs], self.consts)
            values.update((id(v), a) for v, a in zip(prog.eqn.outputs, outs))
        # a backward that ran on the interpreter (its backend, or a kernel's
        # first tier: not ready after its call) sums the weight gradients on
        # NumPy too (not under STEPNET_DETERMINISTIC, whose sums have a fixed order)
        on_numpy = not config.engine("deterministic") and (not capabilities.compiles or any(
            getattr(run, "ready", True) is False for run, _ in runs))
        results = [values[id(v)] for v in layout.values]
        inputs = values
        # (the backward's step inputs on the GPU: its outputs too, summed there)
        on_device = any(isinstance(r, LoDTensor) and r.on_device for r in results)
        if on_numpy and capabilities.host_code:  # the compiled calls' weight gradients:
            from .jit.loading import prepare_weight_gradients  # compiled meanwhile

            for dtype in {np.asarray(getattr(r, "data", r)).dtype for r in results}:
                prepare_weight_gradients(dtype)
        with numpy_blas_beside_a_compile() if on_numpy and capabilities.compiles else nullcontext():
            terms = reduce_terms(layout, results, inputs, on_numpy, on_device)  # (beside a compile)
        grads = pull_consts(program, terms, self.consts)
        lengths = np.diff(np.asarray(self.args[position[id(seqs[0])]].levels[0]))
        d_inits = []
        for i in layout.inits:
            d_inits.append(np.array(host_array(results[i])))
        for k in layout.injected:  # empty sequences: a last-step output is the init itself
            mi = program.eqn.attrs["output_memory"][k]
            if mi >= 0:
                d_inits[mi][lengths == 0] += cts[k][lengths == 0]
        found = []
        for kind, key, like in targets:
            if kind == "const":
                g = grads.get(id(key))
                g = np.zeros(like.shape, like.dtype) if g is None else g
            elif kind == "sequence":
                i = layout.sequences[[id(v) for v in seqs].index(id(key))]
                g = np.zeros(like.data.shape) if i is None else results[i].data
            elif kind == "static":
                i = layout.statics[[id(v) for v in statics].index(id(key))]
                g = np.zeros(np.shape(like)) if i is None else results[i]
                if isinstance(g, LoDTensor):  # a ragged static input's, in its own layout
                    g = g.data
            else:
                inits = ir.rnn_parts(program.eqn)[2]
                g = d_inits[[id(v) for v in inits].index(id(key))]
                g = sum_to_shape(g, np.shape(like))
            if kind == "sequence" and device_array(g) is not None:  # (stays on the GPU)
                found.append(g.reshape(like.shape))
                continue
            found.append(host_array(g).astype(like.dtype, copy=False).reshape(np.shape(like)))
        return _deliver(found, wrt, accumulate, out)


def wrt_list(wrt) -> list:
    """``wrt`` as a list: one Parameter, input name or bound array is a list
    of one."""
    if isinstance(wrt, (str, Parameter, np.ndarray, LoDTensor)):
        return [wrt]
    try:
        return list(wrt)
    except TypeError:
        raise StepNetError(f"wrt: expects Parameters or input names (a list of them), got "
                           f"{type(wrt).__name__}") from None


def _deliver(found, wrt, accumulate, out):
    """Fresh arrays, or written (``accumulate``: added) into ``out``."""
    if out is None:
        if accumulate:
            raise StepNetError("accumulate=True needs out=[one array per wrt]")
        return _apart(found)
    if len(out) != len(found):
        raise StepNetError(f"out has {len(out)} arrays for {len(found)} wrt entries")
    for i, (buf, g) in enumerate(zip(out, found)):
        g = host_array(g)  # (into a host buffer)
        if not isinstance(buf, np.ndarray) or buf.shape != g.shape:
            raise ShapeError(
                f"out[{i}]: needs an ndarray of shape {list(g.shape)} for wrt[{i}], got "
                f"{list(np.shape(buf))}"
            )
        if not buf.flags.writeable or not np.can_cast(g.dtype, buf.dtype, "same_kind"):
            raise ShapeError(f"out[{i}]: needs a writeable array of a {g.dtype} gradient's kind "
                             f"for wrt[{i}], got a {'read-only ' * (not buf.flags.writeable)}"
                             f"{buf.dtype} array")
        if accumulate:
            buf += g
        else:
            buf[...] = g
    return list(out)


def _apart(found):
    """``found`` with each host array its own: one gradient may reach two
    constants as one array (``b = Wb + Rb`` gives both ``db``), and a caller
    that scales or accumulates them in place must change each once."""
    kept = []
    for g in found:
        if isinstance(g, np.ndarray) and any(
                isinstance(h, np.ndarray) and np.may_share_memory(g, h) for h in kept):
            g = g.copy()
        kept.append(g)
    return kept


def _resolve(rnn, item, values):
    """A wrt entry as (kind, key, like): a constant var, or a binding's var and
    the value it was given."""
    if isinstance(item, str):
        b = rnn.bindings.get(item)
        if b is None:
            raise StepNetError(
                f"wrt: {item!r} is not an input of {rnn.name}; its inputs are "
                f"{sorted(rnn.bindings)}"
            )
        if b.zeros_of_shape and values[item] is b.value:  # (a row of zeros, shared)
            return b.kind, b.var, np.zeros(b.memory_shape, b.value.dtype)
        return b.kind, b.var, _like(values[item])
    for var, source in rnn.frame.state.consts.values():
        if source is item or (isinstance(source, Parameter) and source.value is item):
            value = source.value if isinstance(source, Parameter) else np.asarray(source)
            return "const", var, value
    if isinstance(item, (np.ndarray, LoDTensor)):
        for name, b in rnn.bindings.items():
            if values[name] is item:
                return b.kind, b.var, _like(item)
    what = repr(item) if isinstance(item, Parameter) else type(item).__name__
    raise StepNetError(
        f"wrt: {what} is not read by {rnn.name}: give its Parameters, or the names "
        f"of its inputs {sorted(rnn.bindings)}"
    )


def _like(value):
    if isinstance(value, LoDTensor):
        return value
    return np.asarray(value.value if isinstance(value, Parameter) else value)


def _check_grad_outputs(rnn, program, outputs, grad_outputs):
    outs = program.eqn.outputs
    if not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    if len(grad_outputs) != len(outs):
        raise StepNetError(
            f"grad_outputs has {len(grad_outputs)} entries; {rnn.name} has {len(outs)} "
            "outputs (use None for an output that gets no gradient)"
        )
    cts = []
    for k, (g, res, var) in enumerate(zip(grad_outputs, outputs, outs)):
        if g is None:
            cts.append(None)
            continue
        if isinstance(g, LoDTensor):
            g = g.data
        on_gpu = device_array(g)
        g = np.asarray(g) if on_gpu is None else on_gpu
        expected = res.data.shape if isinstance(res, LoDTensor) else np.shape(res)
        if g.shape != tuple(expected):
            raise ShapeError(
                f"grad_outputs[{k}] (output {var.name}) has shape {list(g.shape)}; the output's "
                f"data has shape {list(expected)}"
            )
        if on_gpu is not None and g.dtype != var.dtype:
            raise ShapeError(f"grad_outputs[{k}] (output {var.name}): dtype {g.dtype} on the GPU, "
                             f"the output's is {var.dtype}")
        if g.dtype.kind not in "biuf":
            raise ShapeError(f"grad_outputs[{k}] (output {var.name}): dtype {g.dtype} is not a "
                             "number's")
        cts.append(g if on_gpu is not None else np.ascontiguousarray(g, dtype=var.dtype))
    return cts


def forward_with_workspace(rnn, output_all_steps=True, backend=None, **bindings):
    """Run ``rnn`` keeping its workspace: ``(outputs as rnn() returns, Pullback)``."""
    rnn._require_defined()
    if not rnn._top:
        raise StepNetError(f"{rnn.name} is a nested step-net; differentiate its enclosing one")
    backend = backend or default_backend()
    flags = rnn.all_steps_flags(output_all_steps)
    args = rnn.bind(**bindings)
    consts = rnn.const_values()
    runs = compiled(rnn, backend)
    runs.check_sizes(flags, args, workspace=True)
    results = runs.forward_with_workspace(runs.kernel_flags(flags))(args, consts)
    # (the pullback is this forward's: the weights as they were, whatever an
    # optimizer does to the Parameters in place before it is called)
    consts = {var: np.array(value, copy=True) for var, value in consts.items()}
    n = len(rnn.block.outputs)
    outputs, workspace = runs.last_steps(results[:n], flags), list(results[n:])
    float16 = rnn.float16_input(bindings)
    values = {name: bindings.get(name, b.value) for name, b in rnn.bindings.items()}
    pullback = Pullback(rnn, flags, backend, args, outputs, workspace, consts, values)
    shown = [o.astype(np.float16) for o in outputs] if float16 else outputs
    return (shown[0] if n == 1 else tuple(shown)), pullback


def _is_step_net(obj) -> bool:
    """A step-net (``create_rnn_op()``), told from a layer by what it has: this
    module serves the DSL and so does not import it."""
    return hasattr(obj, "all_steps_flags") and hasattr(obj, "program")


def vjp(obj, *args, output_all_steps=True, backend=None, **inputs):
    """Run ``obj`` (a step-net or a ``stepnet.nn`` layer) once, keeping its
    workspace: returns ``(outputs, pullback)``; ``pullback(grad_outputs,
    wrt=None)`` gives one gradient per ``wrt`` (default: the Parameters).

    Parameters
    ----------
    obj : RNNOp or stepnet.nn layer
        A top-level step-net or a built-in layer.
    *args
        A layer's positional arguments (``X``, then its initial state or
        attention); a step-net takes none.
    output_all_steps : bool or sequence of bool, default True
        As in ``rnn(output_all_steps=...)``; for step-nets only.
    backend : str, optional
        The backend; None: ``default_backend()``.
    **inputs
        A step-net's inputs by name; a layer's keyword arguments.

    Returns
    -------
    outputs
        What ``obj(...)`` returns.
    pullback : Pullback
        ``pullback(grad_outputs, wrt=None, accumulate=False, out=None)``: one
        gradient per ``wrt`` (as :func:`gradients`); it may be called any
        number of times.

    Raises
    ------
    StepNetError
        ``obj`` is neither a step-net nor a layer, or a step-net is given
        positional arguments.
    """
    if _is_step_net(obj):
        if args:
            raise StepNetError("vjp of a step-net takes its inputs by name: vjp(rnn, X=...)")
        return forward_with_workspace(obj, output_all_steps, backend, **inputs)
    if hasattr(obj, "vjp"):
        return obj.vjp(*args, backend=backend, **inputs)
    raise StepNetError(f"vjp: expects a step-net or a stepnet.nn layer, got {type(obj).__name__}")


def gradients(obj, wrt, grad_outputs, output_all_steps=True, backend=None, accumulate=False,
              out=None, **inputs):
    """Gradients of ``obj``'s outputs, weighted by ``grad_outputs``, with respect
    to each entry of ``wrt`` (docs/design.md §6, docs/gradients.md).

    Runs the forward with its workspace kept, then the backward (a step-net
    itself, on the same backend). Without ``inputs``, a workspace kept by the
    last call with ``keep_workspace=True`` is used instead of a new forward
    (for a step-net: when its output flags and backend match).

    Parameters
    ----------
    obj : RNNOp or stepnet.nn layer
        A top-level step-net (``sn.create_rnn_op()``) or a built-in layer.
    wrt : sequence, or one item
        What to differentiate with respect to, one gradient each: a
        ``Parameter`` (or its array); for a step-net the name of an input bound
        by ``add_input``, ``add_memory`` or ``add_static_input`` (or the bound
        array itself); for a layer ``"X"``, ``"h0"``, ``"c0"`` or a parameter.
    grad_outputs : sequence of array or None
        One cotangent per output, shaped like its data (all-steps outputs
        ``[N, ...]``, a LoDTensor accepted; last-step outputs ``[num_seq,
        ...]``); None stands for zeros. For a layer ``[dY, dh_n]`` (LSTM
        ``[dY, dh_n, dc_n]``).
    output_all_steps : bool or sequence of bool, default True
        As in ``rnn(output_all_steps=...)``; layers ignore it.
    backend : str, optional
        The backend; None: ``default_backend()``.
    accumulate : bool, default False
        Add the gradients into ``out`` (oneDNN's accumulate mode); needs ``out``.
    out : list of ndarray, optional
        One array per ``wrt`` the gradients are written (or added) into.
    **inputs
        The inputs by name, as in ``rnn(**inputs)``; for a layer ``X=``,
        ``h0=`` (LSTM ``initial=(h0, c0)``) and ``attention=`` (AUGRU). A layer
        needs them unless it kept a workspace.

    Returns
    -------
    list of ndarray
        One gradient per ``wrt`` entry, shaped and typed like it (``out``
        itself when given).

    Raises
    ------
    StepNetError
        ``obj`` is neither a step-net nor a layer, is a nested step-net, or
        is a layer given no input and holding no workspace; a ``wrt`` entry
        that ``obj`` does not read; ``accumulate`` without ``out``.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> gru = sn.nn.GRU(2, 4, seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 2), np.float32), [[2, 3]])
    >>> dX, = sn.gradients(gru, ["X"], [None, np.ones((1, 2, 4), np.float32)], X=X,
    ...                    backend="interpreter")
    >>> dX.shape
    (5, 2)
    """
    pullback = _pullback_for(obj, output_all_steps, backend, inputs)
    return pullback(grad_outputs, wrt, accumulate=accumulate, out=out)


def _pullback_for(obj, output_all_steps, backend, inputs):
    """The pullback a gradients call runs: that of the workspace ``obj`` kept
    when the call gives no inputs (and, for a step-net, the same output flags
    and backend), else that of a new forward on ``inputs``."""
    kept = getattr(obj, "_workspace", None)
    if _is_step_net(obj):
        flags = obj.all_steps_flags(output_all_steps) if obj.block is not None else None
        if kept is not None and not inputs:
            if kept.flags == flags and (backend is None or backend == kept.backend):
                return kept
            # (a forward again would read the inputs bound at definition, not the kept call's)
            raise StepNetError(
                f"gradients: the workspace {obj.name} kept is of backend {kept.backend!r} and "
                f"output_all_steps={list(kept.flags)}, this call asks for "
                f"{backend or kept.backend!r} and {list(flags)}; ask for the same, or give the "
                "inputs to run the forward again")
        _, pullback = forward_with_workspace(obj, output_all_steps, backend, **inputs)
        return pullback
    if hasattr(obj, "vjp"):
        if inputs:
            _, pullback = obj.vjp(backend=backend, **inputs)
            return pullback
        if kept is not None:
            return kept
        raise StepNetError(
            f"gradients of a {type(obj).__name__} layer need its input: pass X=... (and "
            "its initial state), or call the layer with keep_workspace=True first"
        )
    raise StepNetError(
        f"gradients: expects a step-net or a stepnet.nn layer, got {type(obj).__name__}"
    )


__all__ = ["Pullback", "forward_with_workspace", "gradients", "vjp"]
