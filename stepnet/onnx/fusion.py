"""Runs of elementwise nodes computed as one compiled loop.

A model exported from PyTorch does much of its small work in elementwise
nodes (``sqrt(re * re + im * im + eps)`` after an STFT, a bias and an
activation after a product), each a NumPy call that reads and writes a whole
array, often a strided view of another. :func:`fuse` replaces each run of two
or more consecutive elementwise nodes of a key's plan (``Graph.run``) that
compute one float dtype and one output shape by a :class:`FusedNode`: one
loop over the output, written by the Numba backend's emitter of fused loops
(``cpu_emit.strided_run_source``: each op's code as in a step), which reads
each input where it lies and writes only the values that later nodes, or the
graph's outputs, read. This module plans the runs; it writes no code.

- The ops are stepnet's primitives that an ONNX op imports
  (``registry.OpDef.onnx_import``): Add, Sub, Mul, Div, Neg, Abs, Exp, Log,
  Sqrt, Relu, Sigmoid, Tanh, Softplus, Erf; float32 and float64 only. A
  run over fewer than ``MIN_SIZE`` elements still runs node by node (NumPy's
  calls cost less), but its loop is made, for a larger batch's key.
- The loop is called through its machine code's entry point, without
  Numba's type dispatch (which costs more than a small loop): each call
  checks in Python that every input is an aligned array of the planned
  dtype and rank.
- The loop runs over the output in the memory order NumPy gave the run's
  first value (``order="K"``), its innermost axis the one of smallest stride,
  and the outputs are allocated in that order. Along that axis each input
  has unit stride or is broadcast.
- Each call checks, in the kernel, that the inputs' shapes broadcast to the
  output's and that their innermost strides are as planned; where not (an
  input fed in another layout), the nodes run one by one as before.
- The kernel's source names no sizes, so a new batch size or length reuses
  it. It is compiled once, for arrays of any layout, and kept in
  ``STEPNET_CACHE_DIR`` like the step-net kernels; where it is new to the
  machine it compiles in the compile worker (``loading.tiered``) while the
  nodes run one by one. A loop that does not compile leaves its nodes to run
  one by one, with a RuntimeWarning.
- Not under ``STEPNET_DETERMINISTIC=1`` (see :func:`fuse`).
"""

from __future__ import annotations

import threading
import warnings
from types import SimpleNamespace

import numpy as np
from numba import from_dtype, types

from .. import registry

# the ONNX ops a run may hold: stepnet's elementwise primitives by the ONNX
# op they import
_PRIMITIVES = {op.onnx_import: op for op in registry.all_ops().values()
               if op.onnx_import and op.kind == "elementwise" and isinstance(op.numba, str)}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# the fewest elements of the values of a run that its plan runs fused: below,
# NumPy's node-by-node calls cost less than the loop's call from Python (most
# of which is the call, not the kernel), and its log, exp and tanh are
# vectorized where the loop's may not be (at one VAD stream's sizes, a run
# fused is no faster than node by node); its loop is made all the same
# (compiled in the compile worker), so that a larger batch's key finds it
# ready
MIN_SIZE = 1024
_COMPILING = threading.Lock()  # (sessions called from several threads compile a loop once)


def _fusable(node, env):
    """The dtype and shape of ``node``'s output where it can join a run, else None."""
    op = _PRIMITIVES.get(node.op)
    if (op is None or node.kind != "op" or node.attrs or node.table is None
            or len(node.args) != op.num_inputs or len(node.outputs) != 1):
        return None
    out = env.get(node.outputs[0])
    if type(out) is not np.ndarray or out.dtype not in _FLOATS or out.ndim == 0:
        return None
    for name in node.args:
        x = env.get(name)
        if type(x) is not np.ndarray or x.dtype != out.dtype or x.ndim > out.ndim:
            return None
    return out.dtype, out.shape


def fuse(plan, env, keep):
    """``plan`` with each run of two or more fusable nodes replaced by a
    :class:`FusedNode`. ``env`` holds the values of a run of ``plan`` (their
    shapes, dtypes and layouts decide); ``keep`` names values read after
    the plan (the graph's outputs). Under ``STEPNET_DETERMINISTIC=1`` the
    plan as it is: a loop's sigmoid, tanh or exp may differ from NumPy's in
    the last bit, and a call's results must not depend on which calls came
    before it."""
    from ..jit import blas

    if blas.DETERMINISTIC:
        return list(plan)
    read_after = [set(keep)]  # read_after[i]: the names nodes i.. read, and keep
    for node in reversed(plan):
        read_after.append(read_after[-1] | {n for n in (*node.inputs, *node.captures) if n})
    read_after.reverse()
    fused, run, kind = [], [], None
    for i, node in enumerate([*plan, None]):  # (None: the end, closing the last run)
        this = None if node is None else _fusable(node, env)
        if run and this == kind:
            run.append(node)
            continue
        one = FusedNode.of(run, env, read_after[i]) if len(run) >= 2 else None
        fused += [one] if one is not None and np.prod(kind[1]) >= MIN_SIZE else run
        run, kind = ([node], this) if this is not None else ([], None)
        if node is not None and this is None:
            fused.append(node)
    return fused


def compiled_by_worker(module, key, signature, function):
    """An event set once the compile worker has compiled ``module``'s
    ``function`` for ``signature`` into the disk cache (where tiered and it
    is not there yet: the nodes run meanwhile); set at once otherwise, or
    where no worker starts: the caller then compiles it (or loads it) at
    its next call, as it does where the worker failed."""
    from ..jit import loading

    answered = threading.Event()
    if loading.tiered() and not loading.ready_marker(key).exists():
        try:
            loading.compile_worker().submit(SimpleNamespace(key=key, module=module), signature,
                                            lambda error: answered.set(), function=function)
            return answered
        except OSError:
            pass
    answered.set()
    return answered


class FusedNode:
    """Consecutive elementwise nodes of a plan computed by one kernel: reads
    ``inputs``, writes ``outputs`` (the values read after it)."""

    kind, fast, captures = "fused", None, []

    def __init__(self, nodes, inputs, outputs, shape, dtype, order, source, ranks):
        from ..jit import loading

        self.nodes, self.inputs, self.outputs, self.ranks = nodes, inputs, outputs, ranks
        self.op = "+".join(node.op for node in nodes)
        self.ctx = nodes[0].ctx
        self.dtype, self.order = dtype, np.asarray(order, np.int64)
        self.memory_shape = tuple(shape[a] for a in order)
        unorder = tuple(int(a) for a in np.argsort(order))
        self.unorder = None if unorder == tuple(range(len(order))) else unorder
        module = loading.load_source(source)
        self.kernel, self.ready, self._failed = module.fused, False, False
        # one signature for arrays of any layout (inputs may be read-only constants)
        element = from_dtype(dtype)
        self._signature = (types.int64[::1],
                           *[types.Array(element, len(shape), "A")] * len(outputs),
                           *[types.Array(element, rank, "A", readonly=True) for rank in ranks])
        self._key = loading.kernel_key(source)
        self._answered = compiled_by_worker(module, self._key, self._signature, "fused")

    @classmethod
    def of(cls, nodes, env, read_after):
        """The node computing ``nodes`` (a run of fusable nodes, ``env`` the
        values of a run of them), or None where an input's layout rules the
        loop out."""
        first = env[nodes[0].outputs[0]]
        dtype, shape, ndim = first.dtype, first.shape, first.ndim
        # NumPy's layout of the first value: axes by stride, size-1 axes outermost
        order = sorted(range(ndim), key=lambda a: (shape[a] != 1, -abs(first.strides[a]), a))
        inner = order[-1]
        made, inputs, kinds = set(), [], []
        for node in nodes:
            for name in node.args:
                if name not in made and name not in inputs:
                    inputs.append(name)
            made.update(node.outputs)
        for name in inputs:
            x = env[name]
            axis = inner - (ndim - x.ndim)
            if axis < 0 or x.shape[axis] == 1:
                kinds.append("broadcast")
            elif x.strides[axis] == dtype.itemsize or shape[inner] <= 1:
                kinds.append("unit")
            else:
                return None
        outputs = [node.outputs[0] for node in nodes if node.outputs[0] in read_after]
        if not outputs:
            return None
        ranks = [env[n].ndim for n in inputs]
        from ..jit.cpu_emit import strided_run_source

        ops = [(_PRIMITIVES[node.op].name, node.args, node.outputs[0]) for node in nodes]
        source = strided_run_source(ops, inputs, outputs, ranks, kinds, ndim, dtype)
        return cls(nodes, inputs, outputs, shape, dtype, order, source, ranks)

    def run(self, graph, env, backend, *args, **kwargs):
        if not self.ready:
            if not self._answered.is_set() or not self._compile():
                return self._node_by_node(graph, env, backend)
        ins = [env[name] for name in self.inputs]
        dtype = self.dtype
        for x, rank in zip(ins, self.ranks):
            if (type(x) is not np.ndarray or x.ndim != rank or x.dtype != dtype
                    or not x.flags.aligned):
                return self._node_by_node(graph, env, backend)
        outs = [np.empty(self.memory_shape, dtype) for _ in self.outputs]
        if self.unorder is not None:
            outs = [y.transpose(self.unorder) for y in outs]
        if not self.entry(self.order, *outs, *ins):
            return self._node_by_node(graph, env, backend)
        for name, value in zip(self.outputs, outs):
            env[name] = value

    def _compile(self) -> bool:
        """Compile the kernel here, or load what the worker compiled; whether
        it runs. A loop that does not compile (a fault of stepnet's) leaves its
        nodes to run one by one, with a warning: the model still runs."""
        if self._failed:
            return False
        with _COMPILING:
            try:
                if not self.kernel.signatures:  # (not yet by another node of the same source)
                    self.kernel.compile(self._signature)
                    self.kernel.disable_compile()  # (arrays of every layout take the one signature)
            except Exception as exc:  # noqa: BLE001  (Numba's errors have no common base)
                self._failed = True
                warnings.warn(f"stepnet: the loop fusing ONNX nodes {self.op} from "
                              f"{self.ctx.node!r} did not compile ({type(exc).__name__}: {exc}); "
                              "they run one by one", RuntimeWarning, stacklevel=2)
                return False
        from ..jit import loading

        loading.mark_ready(self._key)
        # called without Numba's dispatch (a microsecond or two a call): the
        # one signature takes arrays of any layout; run() checks dtype, rank
        # and alignment
        self.entry = self.kernel.overloads[self.kernel.signatures[0]].entry_point
        self.ready = True
        return True

    def _node_by_node(self, graph, env, backend):
        for node in self.nodes:
            node.run(graph, env, backend)
