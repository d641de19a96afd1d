"""An ONNX graph and its nodes, checked and ready to run.

``Graph`` is a model's graph, an ``If``'s branch or a ``Loop``'s or
``Scan``'s body: made once (its nodes checked, those that compute only from
constants computed then), run on each call (``Graph.run``) node by node, the
values a run's key decides taken from a memo (:mod:`stepnet.onnx.static`)
and, on the Numba backend, the key's whole plan compiled into one call where
its every node lowers (:mod:`stepnet.onnx.lowering`), else its runs of
elementwise nodes fused into compiled loops (:mod:`stepnet.onnx.fusion`).
``Node`` is one node: an op run by its
table entry (:mod:`stepnet.onnx.ops`) or the ONNX project's reference
implementation, a recurrent node (:mod:`stepnet.onnx.recurrent`,
:mod:`stepnet.onnx.scan`), ``If`` and ``Loop`` (run here, their branches and
bodies being graphs), or the Gradient operator (:mod:`stepnet.onnx.gradient`).
"""

from __future__ import annotations

import operator

import numpy as np

from ..backends import backend as backend_info
from ..errors import Error, ShapeError, StepNetError, UnsupportedError
from ..nn.cells import ONNX_LAYERS
from . import tensors
from . import conv  # noqa: F401  (registers Conv and the pools in OPS)
from . import pad  # noqa: F401  (registers Pad in OPS)
from . import quantized  # noqa: F401  (registers the integer ops in OPS)
from .fusion import fuse
from .lowering import lower, pending as lowering_pending
from .gradient import GradientNode
from .ops import OPS, UNKNOWN, NodeContext, OnnxOp, is_step
from .recurrent import RecurrentNode, session_constant
from .reference import ReferenceOp
from .scan import ScanNode
from .schema import attributes, check_node, node_schema, type_params, value_info
from .static import RANDOM

TRAINING_DOMAIN = "ai.onnx.preview.training"
# onnxruntime's contrib ops: stepnet runs the int8 LSTM that its quantize_dynamic writes
MICROSOFT_DOMAIN = "com.microsoft"
# exact in any float type: float16 is not widened for them
_MOVES = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat",
          "Split", "Slice", "Gather", "Shape", "Size", "Expand", "Tile", "Pad", "Cast",
          "CastLike", "Constant", "ConstantOfShape"}

_F16 = np.dtype(np.float16)


class Node:
    """One node, checked and ready to run. ``kind`` is "op", "recurrent"
    (GRU, LSTM, RNN, Scan; ``impl``), "if", "loop" or "gradient"."""

    def __init__(self, proto, opsets, index, constants=None):
        self.proto = proto
        self.op = proto.op_type
        self.domain = proto.domain or ""
        self.inputs = list(proto.input)
        self.outputs = list(proto.output)
        self.args = list(self.inputs)  # without the omitted inputs at the end
        while self.args and not self.args[-1]:
            self.args.pop()
        self.fast = None  # the table entry bound to this node (prepare)
        self.widen = False  # float16 inputs are computed in float32
        name = proto.name or f"{self.op}_{index}"
        domain = "" if self.domain in ("", "ai.onnx") else self.domain
        if domain not in opsets:
            raise UnsupportedError(f"ONNX node {name!r} ({self.op}): domain {self.domain!r} is not "
                                   "imported by the model")
        self.ctx = NodeContext(name, self.op, opsets[domain], num_outputs=len(self.outputs))
        self.attrs = attributes(proto)
        self.impl = None  # RecurrentNode, ScanNode or GradientNode
        self.entry = OPS.get(self.op) or OnnxOp(self.op, None, in_step=False)
        self.table = None  # the OPS entry that runs the node, if any
        self.reference = None
        self.captures = []  # outer-scope names read by its subgraphs
        self.dynamic_captures = []  # ... those that are not constants of the enclosing graph
        self.subgraphs = {}
        self.types = None
        if domain == TRAINING_DOMAIN and self.op == "Gradient":
            self.kind = "gradient"
            self.impl = GradientNode(self.ctx, self.attrs, self.inputs)
            return
        if (domain, self.op) == (MICROSOFT_DOMAIN, "DynamicQuantizeLSTM"):
            self.kind = "recurrent"  # (onnxruntime's int8 LSTM: an LSTM layer quantized)
            self.impl = RecurrentNode(self.ctx, self.attrs, quantized=True)
            return
        if domain != "":
            raise self.ctx.unsupported(f"domain {self.domain!r} is not supported (stepnet runs "
                                       "the default ONNX domain)")
        schema = node_schema(proto, self.ctx)
        check_node(proto, schema, self.ctx)
        tensors.check_constant_types(proto, schema, constants or {}, f"ONNX node {name!r} ({self.op})")
        self.types = type_params(schema)
        self.widen = self.op not in _MOVES
        for key in ("body", "then_branch", "else_branch"):
            if key in self.attrs:
                graph = Graph(self.attrs[key], opsets, where=f"the {key} of {name!r}", outer=True,
                              outer_constants=constants)
                self.subgraphs[key] = graph
                self.captures += [c for c in graph.captures if c not in self.captures]
                self.dynamic_captures += [c for c in graph.dynamic_captures
                                          if c not in self.dynamic_captures]
        if self.op in ONNX_LAYERS:
            self.kind = "recurrent"
            self.impl = RecurrentNode(self.ctx, self.attrs)
        elif self.op == "Scan":
            self.kind = "recurrent"
            self.impl = ScanNode(self.ctx, self.attrs, self.subgraphs["body"])
        elif self.op == "If":
            self.kind = "if"
            self.then_branch, self.else_branch = (self.subgraphs["then_branch"],
                                                  self.subgraphs["else_branch"])
            for branch in (self.then_branch, self.else_branch):
                if len(branch.output_names) != len(self.outputs):
                    raise Error(f"ONNX node {name!r} (If): a branch gives "
                                f"{len(branch.output_names)} outputs, the node has "
                                f"{len(self.outputs)}")
        elif self.op == "Loop":
            self.kind = "loop"
            self._check_loop()
        else:
            self.kind = "op"
            entry = OPS.get(self.op)
            if entry is not None and entry.run is not None and set(self.attrs) <= entry.attrs:
                self.table = entry
            self.reference = ReferenceOp(proto, self.ctx, opsets)

    @property
    def recurrent(self) -> bool:
        return self.kind == "recurrent"

    def prepare(self, known):
        """Bind the table entry to what is known before any run (``known``:
        the constants by name): what the attributes and constant inputs
        decide is worked out once."""
        if self.kind == "op" and self.table is not None and self.table.bind is not None:
            values = [known.get(n, UNKNOWN) if n else None for n in self.args]
            self.fast = self.table.bind(self.ctx, values, **self.attrs)
        if self.fast is not None:
            if not self.args or not self.outputs or not self.outputs[0]:
                self.fast = None
            else:  # what Graph.run reads: the inputs (an omitted one is env[""])
                self.get = operator.itemgetter(*self.args)
                self.single, self.out = len(self.args) == 1, self.outputs[0]

    # -- running -----------------------------------------------------------------

    def run(self, graph, env, backend, step=False, rows=False, float16_as_float32=False,
            use_fast=True, key=None):
        """Compute the node from ``env`` into ``env`` (``Graph._run`` inlines
        the common case, an op bound to its table entry)."""
        if self.kind == "gradient":
            outs = self.impl.run(graph, env, backend)
        elif self.kind == "if" and not step:
            outs = self._run_if(env, backend, key)
        else:
            inputs = [env[n] if n else None for n in self.args]
            if self.kind == "op":
                outs = None
                if use_fast and self.fast is not None and not step:
                    outs = self._run_bound(inputs)
                if outs is None:
                    outs = graph.run_op(self, inputs, step, rows, float16_as_float32)
            else:
                if step and (any(is_step(x) for x in inputs)
                             or any(is_step(env[n]) for n in self.dynamic_captures)):
                    raise self.ctx.unsupported("a recurrent or control-flow node on a Scan state "
                                               "or scan input (the body runs node by node)")
                if self.op == "Scan":
                    outs = self.impl.run(inputs, backend,
                                         {n: env[n] for n in self.dynamic_captures})
                elif self.kind == "recurrent":
                    outs = self.impl.run(inputs, backend)
                elif self.kind == "if":
                    outs = self._run_if(env, backend)
                else:
                    outs = self._run_loop(inputs, {n: env[n] for n in self.dynamic_captures},
                                          backend)
        for name, value in zip(self.outputs, outs):
            if name:
                env[name] = value

    def _run_bound(self, inputs):
        """The outputs by the bound table entry, or None where it declines (or
        a float16 input must be widened first: ``Graph.run_op``)."""
        if self.widen and any(type(x) is np.ndarray and x.dtype == _F16 for x in inputs):
            return None
        try:
            out = self.fast(*inputs)
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            if isinstance(e, Error):
                raise
            raise ShapeError(f"ONNX node {self.ctx.node!r} ({self.op}): {e}") from e
        if out is NotImplemented:
            return None
        return [out if type(out) is np.ndarray or isinstance(out, list) or out is None
                else np.asarray(out)]

    def _run_if(self, env, backend, key=None):
        cond = env[self.inputs[0]]
        if cond.size != 1:
            raise ShapeError(f"ONNX node {self.ctx.node!r} (If): cond has shape "
                             f"{list(np.shape(cond))}, not one element")
        branch = self.then_branch if cond.item() else self.else_branch
        inner = {n: env[n] for n in branch.dynamic_captures}
        branch.run(inner, backend, key=key)
        return [inner[n] for n in branch.output_names]

    def _check_loop(self):
        body = self.subgraphs["body"]
        carried = len(self.inputs) - 2
        if len(body.input_names) != carried + 2 or len(body.output_names) < carried + 1:
            raise Error(f"ONNX node {self.ctx.node!r} (Loop): its body has "
                        f"{len(body.input_names)} inputs and {len(body.output_names)} outputs "
                        f"for {carried} loop-carried values")
        if len(self.outputs) != len(body.output_names) - 1:
            raise Error(f"ONNX node {self.ctx.node!r} (Loop): has {len(self.outputs)} outputs, "
                        f"its body gives {len(body.output_names) - 1}")

    def _run_loop(self, inputs, captures, backend):
        """``for i in range(M) while cond: cond, v..., scan... = body(i, cond, v...)``;
        scan outputs stacked on a new first axis."""
        body = self.subgraphs["body"]
        inputs = list(inputs) + [None] * (len(self.inputs) - len(inputs))
        trips, cond, values = inputs[0], inputs[1], list(inputs[2:])
        trips = None if trips is None else int(np.asarray(trips).reshape(-1)[0])
        cond = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        N = len(values)
        scans = [[] for _ in range(len(body.output_names) - 1 - N)]
        i = 0
        while cond and (trips is None or i < trips):
            env = {n: captures[n] for n in body.dynamic_captures}
            env[body.input_names[0]] = np.array(i, np.int64)
            env[body.input_names[1]] = np.array(cond)
            env.update(zip(body.input_names[2:], values))
            body.run(env, backend)
            outs = [env[n] for n in body.output_names]
            cond = bool(np.asarray(outs[0]).reshape(-1)[0])
            values = outs[1:1 + N]
            for k, y in enumerate(outs[1 + N:]):
                scans[k].append(np.asarray(y))
            i += 1
        stacked = []
        for k, ys in enumerate(scans):
            if ys:
                stacked.append(np.stack(ys))
            else:
                dtype = body.output_dtypes[1 + N + k] or np.float32
                stacked.append(np.zeros((0,), dtype))
        return values + stacked


class Graph:
    """An ONNX graph (a model's, a branch or a body) ready to run.

    ``outer=True`` marks a subgraph: names it reads but does not define are
    taken from the enclosing graph (``captures``)."""

    def __init__(self, proto, opsets, where="graph", outer=False, outer_constants=None):
        self.where = where
        self.initializers = {t.name: tensors.to_array(t, f"ONNX {where}: initializer")
                             for t in proto.initializer}
        for sparse in proto.sparse_initializer:
            self.initializers[sparse.values.name] = tensors.dense(sparse, f"ONNX {where}: sparse "
                                                                  "initializer")
        self.input_args, self.input_dtypes = [], {}
        for info in proto.input:
            arg, dtype = value_info(info, f"{where} input")
            self.input_args.append(arg)
            self.input_dtypes[info.name] = dtype
        self.input_names = [i.name for i in proto.input]
        outputs = [value_info(o, f"{where} output") for o in proto.output]
        self.output_args = [a for a, _ in outputs]
        self.output_dtypes = [d for _, d in outputs]
        self.output_names = [o.name for o in proto.output]
        defined = set(self.input_names) | set(self.initializers)
        # what is known before any run: initializers that cannot be fed, the
        # enclosing graph's constants, and what nodes compute from them alone
        known = {k: v for k, v in (outer_constants or {}).items() if k not in defined}
        known.update((k, v) for k, v in self.initializers.items() if k not in self.input_names)
        folding = not any(p.domain == TRAINING_DOMAIN for p in proto.node)
        self.nodes, self.captures, self.plan, self.constants = [], [], [], {}
        for i, p in enumerate(proto.node):
            for name in p.input:
                if name and name not in defined and name not in self.captures:
                    if not outer:
                        raise StepNetError(f"ONNX {where}: node {p.name or p.op_type!r} reads "
                                           f"{name!r}, which nothing before it defines")
                    self.captures.append(name)
            node = Node(p, opsets, i, constants=known if folding else {})
            self.nodes.append(node)
            for name in node.captures:
                if name not in defined and name not in self.captures:
                    if not outer:
                        raise StepNetError(f"ONNX {where}: a subgraph of node {node.ctx.node!r} "
                                           f"reads {name!r}, which nothing before it defines")
                    self.captures.append(name)
            for name in p.output:
                if name and name in defined:
                    raise Error(f"ONNX {where}: node {node.ctx.node!r} ({node.op}) defines "
                                f"{name!r}, which is already defined")
            defined.update(n for n in p.output if n)
            if folding and node.kind == "op" and node.op not in RANDOM and all(
                    n in known for n in node.inputs if n):
                self._fold(node, known)
            else:
                node.prepare(known)
                self.plan.append(node)
        for name in self.output_names:
            if name not in defined and name not in self.captures:
                if not outer:
                    raise StepNetError(f"ONNX {where}: output {name!r} is computed by no node")
                self.captures.append(name)
        # what a run puts into its environment: the constants the nodes left
        # to run (and their subgraphs) read, the enclosing graph's constants
        # it captures (bound here, not copied in on each run), and
        # initializers a feed may replace
        read = set(self.output_names)
        for node in self.plan:
            read.update(node.inputs)
            read.update(node.captures)
        outer = {n: known[n] for n in self.captures if n in known}
        self.dynamic_captures = [n for n in self.captures if n not in outer]
        self.run_constants = {k: v for k, v in {**self.initializers, **self.constants,
                                                **outer}.items()
                              if k in read and k not in self.input_names}
        self.defaults = {k: v for k, v in self.initializers.items() if k in self.input_names}
        self.constants32 = {k: v.astype(np.float32)
                            if isinstance(v, np.ndarray) and v.dtype == np.float16 else v
                            for k, v in {**self.run_constants, **self.defaults}.items()}
        for value in [*self.initializers.values(), *self.constants.values(),
                      *self.constants32.values()]:
            session_constant(value)  # shared by every run
        self.widen = True  # a node may meet float16 (no_widening clears it)
        self.decided, self.rest, self.memo = [], self.plan, {}
        self.fused = {}  # key -> its plan with runs of elementwise nodes fused (_fuse)

    def _fold(self, node, known):
        """Compute a node that reads only constants, once, now."""
        inputs = [known[n] if n else None for n in node.inputs]
        while inputs and inputs[-1] is None:
            inputs.pop()
        for name, value in zip(node.outputs, self.run_op(node, inputs, False, False, False)):
            if name:
                known[name] = self.constants[name] = value

    def decide(self, decided):
        """Remember the nodes whose values a run's key decides
        (:mod:`stepnet.onnx.static`): run once per key, then taken from a memo."""
        chosen = {id(n) for n in decided}
        self.decided = [name for n in decided for name in n.outputs if name]
        self.rest = [n for n in self.plan if id(n) not in chosen]
        self.memo, self.fused = {}, {}

    def one_compiled_call(self, key):
        """Whether a run of ``key`` is answered by one compiled call
        (:mod:`stepnet.onnx.lowering`: its plan lowered, checked and the
        faster), no NumPy product in it."""
        plan = self.fused.get(key) if key is not None else None
        return plan is not None and len(plan) == 1 and getattr(plan[0], "state", None) == "ready"

    def run(self, env, backend, step=False, rows=False, float16_as_float32=False, key=None):
        """Evaluate every node into ``env`` (name -> value), which holds the
        graph's inputs (and, for a subgraph, what it captures). ``key``: the
        fed shapes and small integer values (see ``decide``). Inside a Scan
        body being traced (``step``) values may be step values, in the layout
        ``rows`` says (:mod:`stepnet.onnx.ops`). On the Numba backend a key's
        later runs take its plan with runs of elementwise nodes fused
        (``_fuse``)."""
        plain = not (step or float16_as_float32 or self.widen)
        memo = self.memo.get(key) if key is not None and self.decided else None
        if key is None or not self.decided or memo is not None:
            plan, node_key, constants = self.plan, None, True
            if memo is not None:  # (a plain run's memo needs no constants: they are in it)
                (known, plan, constants), node_key = memo, key
                env.update(known)
            fusing = key is not None and backend_info(backend).host_code and plain
            fused = self.fused.get(key) if fusing else None
            self._run(env, backend, step, rows, float16_as_float32, fused or plan, node_key,
                      constants)
            if fusing and fused is None:
                self._fuse(key, plan, env)
            return env
        self._run(env, backend, step, rows, float16_as_float32, self.plan, key)
        if len(self.memo) >= 16:
            self.memo.clear()
        known = {n: session_constant(env[n].copy() if isinstance(env[n], np.ndarray) else env[n])
                 for n in self.decided}
        plan, constants = self.rest, True
        if plain:
            plan = self._key_plan(known, key)
            # the memoized values and constants that the plan and the outputs read
            read = {n for node in plan for n in (*node.inputs, *node.captures) if n}
            read.update(self.output_names)
            known = {n: v for n, v in {**self.run_constants, **known}.items() if n in read}
            constants = False
        self.memo[key] = (known, plan, constants)
        return env

    def _fuse(self, key, plan, env):
        """Remember ``plan`` for the runs of ``key``, from the values of a run
        of it (``env``): compiled into one call where every node lowers
        (:mod:`stepnet.onnx.lowering`), else with its runs of elementwise
        nodes fused (:mod:`stepnet.onnx.fusion`)."""
        if lowering_pending(plan):  # (its recurrent nodes' kernels compile: a later run)
            return
        if len(self.fused) >= 16:
            self.fused.clear()
        fused = fuse(plan, env, self.output_names)
        memo = self.memo.get(key)
        fixed = set(self.run_constants) | (set(memo[0]) if memo is not None else set())
        whole = lower(plan, fused, env, self.output_names, fixed)
        self.fused[key] = fused if whole is None else [whole]

    def _key_plan(self, known, key):
        """The nodes a run with the memoized values ``known`` computes: each
        ``If`` whose condition is among them replaced by its branch for
        these values (the branch's nodes, then its outputs copied to the
        If's; the branch's constants added to ``known``; a branch with
        values of its own that ``key`` decides gives its plan for ``key``
        and those values), and only the nodes that the graph's outputs need."""
        taken = set(self.input_names) | set(self.initializers) | set(self.constants) | set(
            self.captures) | {n for node in self.nodes for n in node.outputs}
        plan = self._inline(self.rest, known, taken, key)
        needed, kept = set(self.output_names), []
        for node in reversed(plan):
            if any(n in needed for n in node.outputs if n):
                kept.append(node)
                needed.update(n for n in node.inputs if n)
                needed.update(node.captures)
        return kept[::-1]

    def _inline(self, nodes, known, taken, key):
        plan = []
        for node in nodes:
            branch = memo = None
            if node.kind == "if" and node.inputs[0] in known:
                cond = known[node.inputs[0]]
                if isinstance(cond, np.ndarray) and cond.size == 1:
                    branch = node.then_branch if cond.item() else node.else_branch
            if branch is not None:
                # a branch with values of its own that the key decides: its
                # plan for the key, made when the If ran it (Graph.run)
                memo = branch.memo.get(key) if branch.decided else None
                if memo is not None and memo[2]:
                    memo = None  # (not a plain run's plan: it needs its constants)
                defined = ({n for inner in branch.nodes for n in inner.outputs if n}
                           | set(branch.initializers) | set(branch.constants))
                if memo is not None:  # (its values but the constants it captures)
                    defined |= (set(memo[0]) - set(branch.captures)
                                | {n for inner in memo[1] for n in inner.outputs if n})
                if ((branch.decided and memo is None) or branch.widen or defined & taken
                        or any(inner.kind == "gradient" for inner in branch.nodes)):
                    branch = None  # run by the If node itself
                else:
                    taken |= defined
            if branch is None:
                plan.append(node)
                continue
            if memo is not None:
                known.update(memo[0])
                plan += memo[1]
            else:
                for name, value in branch.run_constants.items():
                    known.setdefault(name, value)
                plan += self._inline(branch.plan, known, taken, key)
            plan += [_Copy(node, source, name)
                     for source, name in zip(branch.output_names, node.outputs) if name]
        return plan

    def _run(self, env, backend, step, rows, float16_as_float32, plan, key, constants=True):
        """``plan`` run into ``env``; ``constants``: whether ``env`` needs
        the graph's constants (a key's plan has them among its memoized
        values)."""
        if float16_as_float32:
            for name, value in self.constants32.items():
                env.setdefault(name, value)
        else:
            if constants:
                env.update(self.run_constants)
            for name, value in self.defaults.items():  # inputs that were not fed
                env.setdefault(name, value)
        if step or float16_as_float32 or self.widen:
            for node in plan:
                node.run(self, env, backend, step, rows, float16_as_float32, key=key)
            return env
        # the common case, inlined: a node bound to its table entry (Node.run)
        env[""] = None  # an omitted input
        node = None
        try:
            for node in plan:
                fast = node.fast
                if fast is None:
                    node.run(self, env, backend, key=key)
                    continue
                out = fast(node.get(env)) if node.single else fast(*node.get(env))
                if type(out) is np.ndarray:
                    env[node.out] = out
                elif out is NotImplemented:
                    node.run(self, env, backend, use_fast=False)
                else:
                    env[node.out] = out if isinstance(out, list) else np.asarray(out)
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            if isinstance(e, Error) or node is None:
                raise
            raise ShapeError(f"ONNX node {node.ctx.node!r} ({node.op}): {e}") from e
        return env

    def run_op(self, node, inputs, step, rows, float16_as_float32):
        """One op node on its inputs: its outputs, as a list. Inside a Scan body
        being traced, step values go to the node's table entry; an op it cannot
        trace raises UnsupportedError (the Scan then runs node by node)."""
        ctx = node.ctx
        if node.kind != "op":  # the Gradient operator re-running If or Loop
            raise ctx.unsupported("If and Loop inside the graph a Gradient node differentiates")
        if step and any(is_step(x) for x in inputs):
            ctx = NodeContext(ctx.node, node.op, ctx.opset, step=True, rows=rows,
                              num_outputs=len(node.outputs))
            if node.table is None or not node.table.in_step:
                raise ctx.unsupported("this op on a Scan state or scan input inside a Scan body "
                                      "is not traced")
            out = self._call(node.table, ctx, inputs, node.attrs)
            if out is NotImplemented:
                raise ctx.unsupported("this case on a Scan state or scan input is not traced")
            return self._outputs(node, out)
        half = None
        if node.types is not None and node.op not in _MOVES:
            half = {j for j, x in enumerate(inputs)
                    if isinstance(x, np.ndarray) and x.dtype == np.float16}
            if half:  # float16 is computed in float32 (docs/design.md §4)
                inputs = [x.astype(np.float32) if j in half else x for j, x in enumerate(inputs)]
        out = NotImplemented
        if node.table is not None:
            out = self._call(node.table, ctx, inputs, node.attrs)
        outs = self._outputs(node, out) if out is not NotImplemented else node.reference(*inputs)
        if half:
            ins, outs_t = node.types
            types = {ins[min(j, len(ins) - 1)] for j in half}
            outs = [y.astype(np.float16) if isinstance(y, np.ndarray) and y.dtype == np.float32
                    and outs_t[min(k, len(outs_t) - 1)] in types else y
                    for k, y in enumerate(outs)]
        return outs

    @staticmethod
    def _call(entry, ctx, inputs, attrs):
        try:
            return entry.run(ctx, *inputs, **attrs)
        except Error as e:
            if str(e).startswith("ONNX node"):
                raise
            raise type(e)(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e
        except (TypeError, ValueError, IndexError) as e:  # NumPy's own complaints
            raise ShapeError(f"ONNX node {ctx.node!r} ({ctx.op}): {e}") from e

    @staticmethod
    def _outputs(node, out):
        outs = list(out) if isinstance(out, tuple) else [out]
        if len(outs) < len([n for n in node.outputs if n]):
            raise node.ctx.unsupported(f"gives {len(outs)} output(s), the node asks for "
                                       f"{len(node.outputs)}")
        return [o if is_step(o) or isinstance(o, (np.ndarray, list)) or o is None
                else np.asarray(o) for o in outs]


class _Copy:
    """An ``If``'s output taken from the output of its branch inlined in a
    plan (``Graph._key_plan``): run like a node bound to its table entry."""

    def __init__(self, node, source, name):
        self.ctx, self.op, self.kind = node.ctx, node.op, "copy"
        self.inputs, self.captures, self.outputs = [source], [], [name]
        self.get, self.single, self.out = operator.itemgetter(source), True, name

    @staticmethod
    def fast(value):
        return value if type(value) is np.ndarray else NotImplemented

    def run(self, graph, env, backend, *args, **kwargs):
        env[self.out] = env[self.inputs[0]]


def has_decided(graph) -> bool:
    """Whether a graph or a subgraph of it has nodes its key decides."""
    return bool(graph.decided) or any(has_decided(sub) for node in graph.nodes
                                      for sub in node.subgraphs.values())


def no_widening(graph):
    """No node of a graph without float16 needs to look for float16 inputs."""
    graph.widen = False
    for node in graph.nodes:
        node.widen = False
        for sub in node.subgraphs.values():
            no_widening(sub)
