"""The primitives: one record each, its function under its registration.

A record holds the op's shape rule, NumPy reference, gradient rule, code for
each backend and ONNX forms (the fields of :class:`registry.OpDef`), then the
public function ``sn.ops.<name>``::

    @register("tanh", unary_float_rule("tanh"), np.tanh, "elementwise", 1,
              grad=derivative(lambda em, x, y: em.op("sub", ONE, em.op("mul", y, y))),
              onnx="Tanh", onnx_import="Tanh")
    def tanh(x):
        return bind("tanh", [x])

The records live by kind: ``elementwise.py`` (arithmetic, activations,
comparisons, where, clip), ``shape_ops.py`` (matmul, sum and the shape ops)
``segments.py`` (the ops over a ragged value's rows) and ``quantized.py``
(the int8 and bf16 products), with what they share
in ``rules.py``. This module imports them in the op table's order (the order
of registration, which ``registry.all_ops()`` keeps) and gives every op's
function under its name, from the table.

On step values the functions trace into the IR; on plain arrays they compute
eagerly with the NumPy reference. Composite ops (the parametric ONNX
activations, mean, split, ...) live in ``composites.py`` and are built from
these, so they need nothing here. docs/adding-an-op.md says how to add one.

A gradient rule is ``grad(em, eqn, g) -> [cotangent or None per operand]``:
``g`` is the cotangent of the equation's output, ``em.val(v)`` gives a forward
value (an operand or the output), and ``em.op(name, *operands, **attrs)``
applies a primitive. Under :mod:`stepnet.autodiff` the emitter appends IR
equations to the backward step (so the backward compiles like the forward);
for constants outside the time loop, and for the ONNX Gradient operator, it
computes with the NumPy references. Each cotangent has the shape of the
equation's output; ``em.unbroadcast`` (applied by the caller) reduces it to the
operand's shape. ``None`` means "no gradient": the condition of ``where``,
Python scalars, and non-float operands.
"""

from .. import registry

# (imported in this order, the modules register their ops in the op table's order)
from . import elementwise  # noqa: F401
from . import shape_ops  # noqa: F401
from . import segments  # noqa: F401
from . import quantized  # noqa: F401
from .rules import derivative, shape_of  # noqa: F401 - what a record or a composite uses

# every op's function under its name, read from its record: a new op is its
# record alone
globals().update({name: op.function for name, op in registry.all_ops().items()})

__all__ = [*registry.all_ops(), "derivative", "shape_of"]
