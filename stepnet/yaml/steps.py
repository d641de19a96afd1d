"""Building a net's step from YAML: a top-level or nested net's inputs,
memories, step body (assignments, ``op`` entries, nested nets) and outputs,
each a call of the step-net DSL.
"""

from __future__ import annotations

import numpy as np

from ..dsl import MemoryHandle, create_rnn_op
from ..errors import Error, YAMLError
from ..tracing import Parameter, Value
from . import document
from .expressions import (
    FUNCTIONS,
    LIST_FUNCTIONS,
    Evaluator,
    ExpressionError,
    NestedNet,
    Scope,
    call_function,
    parse_assignment,
    parse_expression,
)
from .network import TopNet

NET_KEYS = ("inputs", "static_inputs", "memories", "step", "outputs", "reverse", "description")
NESTED_KEYS = ("net",) + NET_KEYS
MEMORY_KEYS = ("shape", "init", "dtype", "description")


class NetBuilder:
    """The part of the YAML builder (``model._Builder``) that builds nets.

    It uses what the builder holds: ``doc``, ``model``, ``dtype``,
    ``error(path, message)``, ``_dtype(value, path)``, ``_top_name(name,
    path)`` (a new top-level name, checked) and ``_top_source(ref, path,
    want)`` (a top-level reference's placeholder and source).
    """

    def _top_net(self, name, spec, path):
        doc = self.doc
        self._top_name(name, path)
        spec = doc.mapping(spec, path, NET_KEYS, required=("inputs", "step", "outputs"))
        outputs = self._output_names(spec, path)
        reverse = self._reverse(spec, path)
        rnn = create_rnn_op(output_num=len(outputs), reverse=reverse, name=name)
        net = TopNet(name, rnn, outputs)
        scope = Scope(globals_={**self.model.parameters, **self.model.cells})
        with self._wrap(path), rnn.stepnet():
            for key, want, add in (("inputs", "sequence", rnn.add_input),
                                   ("static_inputs", "static", rnn.add_static_input)):
                for local, ref in doc.mapping(spec.get(key), path + (key,)).items():
                    p = path + (key, local)
                    self._new_local(scope, local, p)
                    placeholder, source = self._top_source(ref, p, want=want)
                    binding = self._binding_name(rnn, name, local)
                    scope.names[local] = self._dsl(p, add, placeholder, name=binding)
                    net.sources[binding] = source
            memories = self._memories(rnn, name, spec, path, scope, None, net)
            self._body(rnn, spec, path, scope, memories)
        self.model.nets[name] = rnn
        self.model._nets.append(net)

    def _wrap(self, path):
        builder = self

        class _Wrap:
            def __enter__(self):
                return self

            def __exit__(self, kind, exc, tb):
                if isinstance(exc, Error) and not isinstance(exc, YAMLError):
                    raise builder.error(path, str(exc)) from None
                return False

        return _Wrap()

    def _dsl(self, path, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except YAMLError:
            raise
        except Error as exc:
            raise self.error(path, str(exc)) from None

    def _new_local(self, scope, name, path):
        self.doc.name(name, path)
        if name in FUNCTIONS:
            raise self.error(path, f"{name!r} is the name of a function; choose another name")
        try:
            existing = scope.lookup(name)
        except KeyError:
            return
        what = "a parameter" if isinstance(existing, Parameter) and name in scope.globals else "defined"
        raise self.error(path, f"name {name!r} is already {what} here; each name is defined once")

    @staticmethod
    def _binding_name(rnn, net_name, local):
        """The DSL name of a binding: the YAML name unless another net of the
        same program took it (then ``net_local``)."""
        names = rnn.frame.state.names
        candidate = local
        counter = 1
        while candidate in names:
            candidate = f"{net_name}_{local}" if counter == 1 else f"{net_name}_{local}_{counter}"
            counter += 1
        return candidate

    def _reverse(self, spec, path):
        reverse = spec.get("reverse", False)
        if not isinstance(reverse, bool):
            raise self.error(path + ("reverse",), f"reverse is true or false, got {reverse!r}")
        return reverse

    def _output_names(self, spec, path):
        outputs = spec["outputs"]
        if isinstance(outputs, str):
            outputs = [outputs]
        outputs = self.doc.sequence(outputs, path + ("outputs",))
        if not outputs:
            raise self.error(path + ("outputs",), "a net needs at least one output")
        for i, o in enumerate(outputs):
            self.doc.name(o, path + ("outputs", i))
        return outputs

    def _memories(self, rnn, net_name, spec, path, scope, outer_scope, net):
        memories = {}
        for local, mspec in self.doc.mapping(spec.get("memories"), path + ("memories",)).items():
            p = path + ("memories", local)
            self._new_local(scope, local, p)
            mspec = self.doc.mapping(mspec, p, MEMORY_KEYS)
            shape = self.doc.shape(mspec["shape"], p + ("shape",)) if "shape" in mspec else None
            dtype = self._dtype(mspec["dtype"], p + ("dtype",)) if "dtype" in mspec else None
            init = mspec.get("init")
            binding = self._binding_name(rnn, net_name, local)
            if init is None:
                if shape is None:
                    raise self.error(p, "a memory needs shape: [...] (starts at zeros) or init:")
                handle = self._dsl(p, rnn.add_memory, shape=list(shape), name=binding, dtype=dtype)
            elif isinstance(init, bool):
                raise self.error(p + ("init",), "init must be a number, a name or an expression, "
                                 f"got {init!r}")
            elif isinstance(init, (int, float)):
                if shape is None:
                    raise self.error(p, "a number init needs shape: [...]")
                handle = self._dsl(p, rnn.add_memory, init=init, shape=list(shape), name=binding,
                                   dtype=dtype)
            elif isinstance(init, list):
                value = np.asarray(init, dtype=dtype or self.dtype)
                handle = self._dsl(p, rnn.add_memory, init=value, shape=None if shape is None
                                   else list(shape), name=binding, dtype=dtype)
            elif outer_scope is None:  # a top-level net: a parameter or a per-sequence source
                if isinstance(init, str) and init in self.model.parameters:
                    handle = self._dsl(p, rnn.add_memory, init=self.model.parameters[init],
                                       shape=None if shape is None else list(shape),
                                       name=binding, dtype=dtype)
                else:
                    placeholder, source = self._top_source(init, p + ("init",), want="init")
                    feature = placeholder.shape[1:]
                    if shape is not None and shape != feature:
                        raise self.error(p + ("init",), f"{init!r} has rows of shape {list(feature)} but "
                                         f"the memory is declared with shape {list(shape)}")
                    handle = self._dsl(p, rnn.add_memory, init=placeholder, shape=list(feature),
                                       name=binding, dtype=dtype)
                    net.sources[binding] = source
            else:  # a nested net: an expression of the enclosing step
                value = self._expression(outer_scope, init, p + ("init",))
                if isinstance(value, np.ndarray) and shape is None:
                    raise self.error(p, "an array init needs shape: [...]")
                handle = self._dsl(p, rnn.add_memory, init=value,
                                   shape=None if shape is None else list(shape),
                                   name=binding, dtype=dtype)
            scope.names[local] = handle
            memories[local] = (handle, p)
        return memories

    def _expression(self, scope, text, path):
        try:
            node = parse_expression(text)
            return Evaluator(scope, str(text)).eval(node)
        except ExpressionError as exc:
            raise self.error(path, str(exc)) from None

    # -- the step body -------------------------------------------------------

    def _body(self, rnn, spec, path, scope, memories):
        body = self.doc.sequence(spec["step"], path + ("step",))
        if not body:
            raise self.error(path + ("step",), "the step is empty; give a list of assignments")
        for i, item in enumerate(body):
            p = path + ("step", i)
            if isinstance(item, str):
                self._assignment(scope, item, p, memories)
            elif isinstance(item, dict) and "net" in item:
                self._nested_net(item, p, scope)
            elif isinstance(item, dict) and "op" in item:
                self._op_entry(scope, item, p, memories)
            else:
                raise self.error(p, "a step entry is an assignment 'h = tanh(x @ W)', an op "
                                 "{op: matmul, in: [x, W], out: xw}, or a nested net {net: name, ...}")
        for local, (handle, mpath) in memories.items():
            if handle.post is None:
                raise self.error(mpath, f"memory {local!r} is never updated in the step; assign it "
                                 f"once, e.g. '{local} = tanh(x @ W + {local}.pre @ U)'")
        values = []
        for i, name in enumerate(self._output_names(spec, path)):
            try:
                value = scope.names[name]
            except KeyError:
                raise self.error(path + ("outputs", i),
                                 f"output {name!r} is not a value of this step"
                                 + document.did_you_mean(name, scope.names)) from None
            if isinstance(value, NestedNet) or not isinstance(value, Value):
                raise self.error(path + ("outputs", i), f"output {name!r} is not a step value")
            values.append(value)
        self._dsl(path + ("outputs",), rnn.add_outputs, *values)

    def _assignment(self, scope, text, path, memories):
        try:
            names, node, unpack = parse_assignment(text)
            value = Evaluator(scope, text.strip()).eval(node)
        except ExpressionError as exc:
            raise self.error(path, str(exc)) from None
        self._assign(scope, names, value, unpack, path, memories)

    def _assign(self, scope, names, value, unpack, path, memories):
        if unpack:
            if not isinstance(value, (list, tuple)) or len(value) != len(names):
                got = len(value) if isinstance(value, (list, tuple)) else 1
                raise self.error(path, f"{len(names)} names on the left but {got} value(s) on the right")
            values = list(value)
        else:
            if isinstance(value, (list, tuple)):
                raise self.error(path, f"the right side gives {len(value)} values; unpack them: "
                                 f"{', '.join(f'v{i}' for i in range(len(value)))} = ...")
            values = [value]
        for name, v in zip(names, values):
            if name in memories:
                handle, _ = memories[name]
                if handle.post is not None:
                    raise self.error(path, f"memory {name!r} is updated twice in one step")
                if not isinstance(v, Value):
                    raise self.error(path, f"memory {name!r} must be updated with a step value, "
                                     f"not a constant")
                self._dsl(path, handle.update, v)
                continue
            try:
                existing = scope.lookup(name)
            except KeyError:
                existing = None
            if isinstance(existing, MemoryHandle):
                raise self.error(path, f"{name!r} is a memory of an enclosing net; a net updates "
                                 "only its own memories")
            if existing is not None or name in FUNCTIONS:
                raise self.error(path, f"name {name!r} is already defined; each name is assigned "
                                 "once (values are not variables)")
            scope.names[name] = v

    def _op_entry(self, scope, item, path, memories):
        op = item["op"]
        if not isinstance(op, str) or op not in FUNCTIONS:
            raise self.error(path + ("op",), f"unknown op {op!r}" + document.did_you_mean(op, FUNCTIONS))
        for key in ("in", "out"):
            if key not in item:
                raise self.error(path, f"op {op!r}: missing key {key!r}")
        ins = item["in"]
        ins = self.doc.sequence(ins if isinstance(ins, list) else [ins], path + ("in",))
        args = [self._expression(scope, x, path + ("in", i)) for i, x in enumerate(ins)]
        attrs = {}
        for key, value in item.items():
            if key in ("op", "in", "out"):
                continue
            if not isinstance(value, (int, float)):
                raise self.error(path + (key,), f"op attribute {key!r} must be a number or boolean, "
                                 f"got {value!r}")
            attrs[key] = value
        if op in LIST_FUNCTIONS:
            args = [args]

        def fail(message):
            raise self.error(path, message)

        value = call_function(op, args, attrs, fail)
        out = item["out"]
        names = out if isinstance(out, list) else [out]
        for i, n in enumerate(names):
            self.doc.name(n, path + ("out",) + ((i,) if isinstance(out, list) else ()))
        self._assign(scope, names, value, isinstance(out, list), path, memories)

    def _nested_net(self, item, path, scope):
        doc = self.doc
        spec = doc.mapping(item, path, NESTED_KEYS, required=("inputs", "step", "outputs"))
        name = doc.name(spec["net"], path + ("net",))
        self._new_local(scope, name, path + ("net",))
        outputs = self._output_names(spec, path)
        # the enclosing step's values are evaluated before the inner block opens
        sources = {}
        for key in ("inputs", "static_inputs"):
            for local, text in doc.mapping(spec.get(key), path + (key,)).items():
                sources[(key, local)] = self._expression(scope, text, path + (key, local))
        inner = create_rnn_op(output_num=len(outputs), reverse=self._reverse(spec, path), name=name)
        inner_scope = Scope(parent=scope)
        with self._wrap(path), inner.stepnet():
            for (key, local), value in sources.items():
                p = path + (key, local)
                self._new_local(inner_scope, local, p)
                binding = self._binding_name(inner, name, local)
                add = inner.add_input if key == "inputs" else inner.add_static_input
                inner_scope.names[local] = self._dsl(p, add, value, name=binding)
            memories = self._memories(inner, name, spec, path, inner_scope, scope, None)
            self._body(inner, spec, path, inner_scope, memories)
        scope.names[name] = NestedNet(inner, outputs)
