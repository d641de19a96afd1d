"""The step-body expression language: ``h = tanh(x @ W + h.pre @ U + b)``.

An expression is parsed with Python's ``ast`` (parsing runs nothing) and
walked over an allow-list of node kinds; nothing is ever passed to ``eval``
or ``exec``. What is allowed:

* names: step inputs, static inputs, memories, parameters, earlier
  assignments of this step or of an enclosing step, nested step-nets;
* ``h.pre`` (a memory's previous value), ``net.last`` / ``net.all`` (a nested
  step-net's last step / all steps; ``net.last.out`` picks an output by name);
* numbers; ``+ - * / @``, unary ``-`` and ``+``; one comparison
  (``< <= > >= ==``, giving a mask for ``where``);
* calls of the functions of ``stepnet.ops`` (``tanh(x)``, ``clip(x, lo=-1)``,
  ``concat([a, b], axis=-1)``), keyword values being numbers or booleans;
* basic feature slices ``x[:, 0:64]``.

Each operator and function is applied exactly as the Python DSL applies it, so
the traced IR is the one the same Python code would give.
"""

from __future__ import annotations

import ast
import inspect
import operator

import numpy as np

from .. import ops, registry
from ..dsl import MemoryHandle
from ..errors import Error
from ..tracing import Parameter, Value
from .document import did_you_mean

# every function of stepnet.ops: each primitive's (its registry entry's) and each composite
FUNCTIONS = {name: getattr(ops, name) for name in ops.__all__ if name != "registry"}
# functions whose first argument is a list of values: the variadic primitives (concat)
LIST_FUNCTIONS = {name for name, op in registry.all_ops().items() if op.num_inputs is None}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.MatMult: operator.matmul,
}
_COMPARE = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: ops.equal,  # Value has no __eq__: `==` on it would compare identities
}
_SYMBOL = {
    ast.Pow: "**", ast.Mod: "%", ast.FloorDiv: "//", ast.BitAnd: "&", ast.BitOr: "|",
    ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Not: "not", ast.Invert: "~",
}


class ExpressionError(Exception):
    """A problem in one expression; the caller adds file, line and key."""


class Scope:
    """Names visible in one step (chained to the enclosing step's scope)."""

    def __init__(self, parent=None, globals_=None):
        self.parent = parent
        self.names = {}
        self.globals = globals_ if globals_ is not None else (parent.globals if parent else {})

    def lookup(self, name):
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        if name in self.globals:
            return self.globals[name]
        raise KeyError(name)

    def visible(self):
        seen = set(self.globals)
        scope = self
        while scope is not None:
            seen |= set(scope.names)
            scope = scope.parent
        return sorted(seen)


class NestedNet:
    """A nested step-net as seen from its enclosing step: ``net.last`` and
    ``net.all`` call it once each (the first time they are read)."""

    def __init__(self, rnn, output_names):
        self.rnn = rnn
        self.output_names = list(output_names)
        self.calls = {}

    def results(self, mode):
        if mode not in self.calls:
            out = self.rnn(output_all_steps=(mode == "all"))
            self.calls[mode] = out if isinstance(out, tuple) else (out,)
        return self.calls[mode]


# the deepest expression tree a step may have (the evaluator recurses by it;
# a longer chain belongs in several steps)
MAX_DEPTH = 300


def _parsed(text, mode):
    """``ast.parse(text, mode)``, its syntax and its depth checked."""
    try:
        tree = ast.parse(text, mode=mode)
    except SyntaxError as exc:
        raise ExpressionError(f"syntax error in {text!r} at column {exc.offset or 0}: "
                              f"{exc.msg}") from None
    except RecursionError:
        tree = None
    stack = [(tree, 1)] if tree is not None else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            break
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    if tree is None or stack:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise ExpressionError(f"{shown!r} is nested more than {MAX_DEPTH} deep (a long chain of "
                              "operators counts one level each): split it into several steps")
    return tree


def parse_assignment(text):
    """``"a, b = expr"`` -> (target names, expression node)."""
    if not isinstance(text, str):
        raise ExpressionError(f"a step is an assignment string like 'h = tanh(x @ W)', got {text!r}")
    tree = _parsed(text.strip(), "exec")
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        raise ExpressionError(f"expected one assignment 'name = expression', got {text.strip()!r}")
    stmt = tree.body[0]
    if len(stmt.targets) != 1:
        raise ExpressionError("chained assignment (a = b = ...) is not allowed")
    target = stmt.targets[0]
    elements = target.elts if isinstance(target, ast.Tuple) else [target]
    names = []
    for t in elements:
        if not isinstance(t, ast.Name):
            raise ExpressionError(
                f"can assign only to plain names, not {ast.unparse(t)!r}"
            )
        names.append(t.id)
    return names, stmt.value, isinstance(target, ast.Tuple)


def parse_expression(text):
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ExpressionError(f"expected a name, number or expression, got {text!r}")
    if not isinstance(text, str):
        return ast.Constant(text)
    return _parsed(text.strip(), "eval").body


class Evaluator:
    """Walk an expression tree over the allow-list, applying DSL operations."""

    def __init__(self, scope, source):
        self.scope = scope
        self.source = source

    def fail(self, node, message):
        col = getattr(node, "col_offset", None)
        where = f", column {col + 1}" if col is not None else ""
        raise ExpressionError(f"{self.source!r}{where}: {message}")

    def eval(self, node):
        method = getattr(self, f"_{type(node).__name__}", None)
        if method is None:
            self.fail(node, f"{_describe(node)} is not allowed in a step expression")
        return method(node)

    def _Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            self.fail(node, f"constant {node.value!r} is not allowed (numbers only)")
        return node.value

    def _Name(self, node):
        try:
            value = self.scope.lookup(node.id)
        except KeyError:
            self.fail(node, f"unknown name {node.id!r}" + did_you_mean(node.id, self.scope.visible()))
        if isinstance(value, MemoryHandle) and value.post is None:
            self.fail(
                node,
                f"memory {node.id!r} is read before its update in this step; "
                f"use {node.id}.pre for the previous step's value",
            )
        if isinstance(value, NestedNet):
            self.fail(node, f"{node.id!r} is a nested step-net; use {node.id}.last or {node.id}.all")
        return value

    def _Attribute(self, node):
        base = node.value
        if isinstance(base, ast.Name):
            try:
                target = self.scope.lookup(base.id)
            except KeyError:
                self.fail(base, f"unknown name {base.id!r}" + did_you_mean(base.id, self.scope.visible()))
            if isinstance(target, MemoryHandle):
                if node.attr != "pre":
                    self.fail(node, f"memory {base.id!r} has only .pre (its previous value), "
                                    f"not .{node.attr}")
                return target.pre_state()
            if isinstance(target, NestedNet):
                return self._net_output(node, base.id, target, node.attr, None)
            self.fail(node, f"{base.id!r} has no attribute .{node.attr} "
                            "(.pre is for memories, .last/.all for nested step-nets)")
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            try:
                target = self.scope.lookup(base.value.id)
            except KeyError:
                target = None
            if isinstance(target, NestedNet):
                return self._net_output(node, base.value.id, target, base.attr, node.attr)
        self.fail(node, f"attribute access {ast.unparse(node)!r} is not allowed")

    def _net_output(self, node, name, net, mode, output):
        if mode not in ("last", "all"):
            self.fail(node, f"nested step-net {name!r}: use {name}.last or {name}.all, not .{mode}")
        if output is None:
            if len(net.output_names) != 1:
                self.fail(node, f"nested step-net {name!r} has outputs {net.output_names}; "
                                f"pick one: {name}.{mode}.{net.output_names[0]}")
            index = 0
        elif output in net.output_names:
            index = net.output_names.index(output)
        else:
            self.fail(node, f"nested step-net {name!r} has no output {output!r} (its outputs: "
                            f"{', '.join(net.output_names)})" + did_you_mean(output, net.output_names))
        try:
            return net.results(mode)[index]
        except Error as exc:
            self.fail(node, str(exc))

    def _BinOp(self, node):
        fn = _BINARY.get(type(node.op))
        if fn is None:
            self.fail(node, f"operator {_SYMBOL.get(type(node.op), type(node.op).__name__)!r} "
                            "is not allowed (use + - * / @ and the functions of stepnet.ops)")
        left, right = self.eval(node.left), self.eval(node.right)
        return self._apply(node, fn, left, right)

    def _UnaryOp(self, node):
        operand = self.eval(node.operand)
        if isinstance(node.op, ast.USub):
            return self._apply(node, operator.neg, operand)
        if isinstance(node.op, ast.UAdd):
            return operand
        self.fail(node, f"operator {_SYMBOL.get(type(node.op), '?')!r} is not allowed")

    def _Compare(self, node):
        if len(node.ops) != 1:
            self.fail(node, "chained comparisons (a < b < c) are not allowed")
        fn = _COMPARE.get(type(node.ops[0]))
        if fn is None:
            self.fail(node, f"comparison {_SYMBOL.get(type(node.ops[0]), '?')!r} is not allowed")
        return self._apply(node, fn, self.eval(node.left), self.eval(node.comparators[0]))

    def _Subscript(self, node):
        value = self.eval(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        index = []
        for item in items:
            if not isinstance(item, ast.Slice):
                self.fail(item, "only slices with ':' are allowed in [...] (x[:, 0:64])")
            bounds = [None if b is None else self._int(b) for b in (item.lower, item.upper, item.step)]
            index.append(slice(*bounds))
        return self._apply(node, operator.getitem, value, tuple(index))

    def _int(self, node):
        value = self._number(node)
        if not isinstance(value, int):
            self.fail(node, "slice bounds must be integers")
        return value

    def _number(self, node):
        """A literal keyword or slice value: a number, a boolean, or -number."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = self._number(node.operand)
            if isinstance(value, bool):
                self.fail(node, "cannot negate a boolean")
            return -value
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.Name) and node.id in ("true", "false", "True", "False"):
            return node.id in ("true", "True")  # YAML's spelling or Python's
        self.fail(node, f"expected a number here, got {ast.unparse(node)!r}")

    def _Call(self, node):
        if not isinstance(node.func, ast.Name):
            self.fail(node, f"only functions of stepnet.ops can be called, not {ast.unparse(node.func)!r}")
        name = node.func.id
        cell = self._cell(name)
        if cell is not None:
            return self._call_cell(node, name, cell)
        fn = FUNCTIONS.get(name)
        if fn is None:
            self.fail(node.func, f"unknown function {name!r}" + did_you_mean(name, FUNCTIONS))
        args = []
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.List) and i == 0 and name in LIST_FUNCTIONS:
                args.append([self.eval(e) for e in arg.elts])
            else:
                args.append(self.eval(arg))
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                self.fail(node, "**kwargs is not allowed")
            kwargs[kw.arg] = self._number(kw.value)
        result = call_function(name, args, kwargs, lambda msg: self.fail(node, msg))
        if args and all(type(a) in (int, float) for a in args) and np.ndim(result) == 0 \
                and isinstance(result, (np.number, np.ndarray)):
            return result.item()  # (a function of numbers is a number: weakly typed, as they are)
        return result

    def _cell(self, name):
        from ..nn.step_cells import _Cell

        try:
            value = self.scope.lookup(name)
        except KeyError:
            return None
        return value if isinstance(value, _Cell) else None

    def _call_cell(self, node, name, cell):
        """``cell(x, h)`` -> the new state; an LSTM's ``cell(x, h, c)`` -> ``(h, c)``;
        an AUGRU's ``cell(x, h, a)`` -> the new state (``a``: the attention score)."""
        kind = cell.kind
        form = f"{name}(x, {', '.join(kind.states)}{', a' if kind.attention else ''})"
        what = "the input, then the previous state" + (
            ", then the attention score, [1] per sequence" if kind.attention else "")
        if len(node.args) != form.count(",") + 1 or node.keywords:
            self.fail(node, f"{name} is a {kind.name} cell, called as {form} ({what})")

        def call(x, *rest):
            states = rest[:len(kind.states)]
            return cell.step(x, states if len(states) > 1 else states[0],
                             attention=rest[-1] if kind.attention else None)

        return self._apply(node, call, *[self.eval(a) for a in node.args])

    def _apply(self, node, fn, *args):
        try:
            result = fn(*args)
        except Error as exc:
            self.fail(node, str(exc))
        except TypeError:
            kinds = " and ".join(_operand_kind(a) for a in args)
            self.fail(node, f"{ast.unparse(node)!r} is not defined for {kinds}")
        except ArithmeticError as exc:  # (constants: 1/0, or a power that overflows)
            self.fail(node, f"{ast.unparse(node)!r}: {exc}")
        if result is NotImplemented:
            self.fail(node, f"{ast.unparse(node)!r} is not defined for these operands")
        return result


def call_function(name, args, kwargs, fail):
    """Call ``stepnet.ops.<name>`` after checking the arguments fit it."""
    fn = FUNCTIONS[name]
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        params = ", ".join(str(p) for p in inspect.signature(fn).parameters.values())
        fail(f"{name}(): {exc}; it takes ({params})")
    if name in LIST_FUNCTIONS and args and not isinstance(args[0], list):
        fail(f"{name}() takes a list of values first: {name}([a, b], axis=-1)")
    try:
        return fn(*args, **kwargs)
    except Error as exc:
        fail(f"{name}(): {exc}")
    except (TypeError, ValueError) as exc:
        fail(f"{name}(): {exc}")


def _operand_kind(value) -> str:
    if isinstance(value, Value):
        try:
            return f"step value {value.var.type_str()}"
        except Error:
            return "a memory"
    if isinstance(value, Parameter):
        return f"parameter {value.name} {list(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"array {list(value.shape)}"
    return type(value).__name__


def _describe(node) -> str:
    names = {
        "Lambda": "lambda", "IfExp": "'x if c else y'", "BoolOp": "and/or",
        "ListComp": "a comprehension", "GeneratorExp": "a comprehension", "DictComp": "a comprehension",
        "SetComp": "a comprehension", "Dict": "a dict", "Set": "a set", "List": "a list",
        "Tuple": "a tuple", "JoinedStr": "an f-string", "Starred": "*args", "Await": "await",
        "Yield": "yield", "NamedExpr": "':='",
    }
    return names.get(type(node).__name__, f"'{ast.unparse(node)}'")
