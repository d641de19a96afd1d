"""The step-net front end, in PaddlePaddle's RNN-operator style.

>>> import numpy as np, stepnet as sn
>>> X = sn.LoDTensor.from_lengths(np.ones((5, 3), np.float32), [[2, 3]])
>>> W = sn.Parameter(np.full((3, 4), 0.1, np.float32), name="W")
>>> U = sn.Parameter(np.eye(4, dtype=np.float32), name="U")
>>> rnn = sn.create_rnn_op(output_num=1)
>>> with rnn.stepnet():
...     x = rnn.add_input(X, name="x")
...     h = rnn.add_memory(shape=[4], name="h")
...     h.update(sn.ops.tanh(x @ W + h.pre_state() @ U))
...     rnn.add_outputs(h)
>>> rnn().data.shape, rnn(output_all_steps=False).shape
((5, 4), (2, 4))
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import ir
from .dsl_binding import (
    Binding,
    bind_init,
    bind_static,
    check_lod_agreement,
    check_sequence_inputs,
    same_offsets,
)
from .dsl_memory import (
    MemoryHandle,
    feature_shape,
    initial_array,
    memory_from_step_value,
    memory_shape,
)
from .errors import ShapeError, StepNetError, UnsupportedError
from .ir import Literal, Var
from .lod import LoDTensor
from .tracing import (
    Frame,
    Parameter,
    ProgramState,
    Value,
    _operand_var,
    compute_dtype,
    current_frame,
    pop_frame,
    push_frame,
)


def create_rnn_op(output_num=None, reverse=False, name=None):
    """A new step-net; define its step in ``with rnn.stepnet():``.

    PaddlePaddle's spelling of ``RNNOp(...)``.

    Parameters
    ----------
    output_num : int, optional
        How many outputs ``add_outputs`` must declare; checked when the block
        ends. None: any number (at least one).
    reverse : bool, default False
        Step each sequence from its end. All-steps outputs stay at their
        original positions; the "last step" is the last one processed,
        position 0.
    name : str, optional
        The step-net's name in the IR and in error messages (made unique);
        None: ``"rnn"``.

    Returns
    -------
    RNNOp
        Not defined yet: open its block with ``with rnn.stepnet():``.

    Examples
    --------
    >>> import stepnet as sn
    >>> rnn = sn.create_rnn_op(output_num=1, reverse=True)
    """
    return RNNOp(output_num=output_num, reverse=reverse, name=name)


class RNNOp:
    """A recurrent operator whose body is one time step (see module docstring).

    Declared inside another step-net's block, it is a nested RNN: its inputs
    are the enclosing step's ragged values, and calling it inside that block
    returns symbolic values of the enclosing step.

    Parameters
    ----------
    output_num : int, optional
        How many outputs ``add_outputs`` must declare; checked when the block
        ends. None: any number (at least one).
    reverse : bool, default False
        Step each sequence from its end. All-steps outputs stay at their
        original positions; the "last step" is the last one processed,
        position 0 (ONNX's ``Y_h`` and PyTorch's ``h_n`` convention).
    name : str, optional
        The step-net's name in the IR and in error messages (made unique
        within its program when the block opens); None: ``"rnn"``.
    """

    def __init__(self, output_num=None, reverse=False, name=None):
        self.output_num = output_num
        self.reverse = bool(reverse)
        self.name = name
        self.frame = None
        self.block = None
        self.parent = None
        self.bindings = {}  # name -> Binding (top level only)
        self.output_memory = ()
        self._programs = {}
        self._has_nested_nets = False  # whether the block calls a nested step-net
        self.step_scopes = None
        self._workspace = None  # kept by rnn(keep_workspace=True) for sn.gradients

    def __getstate__(self):
        """Pickled (e.g. to a Dask worker) without a kept workspace; compiled
        kernels are never part of a step-net (stepnet.backends holds them): the
        receiver compiles its own, from its kernel cache."""
        return dict(self.__dict__, _workspace=None)

    # -- definition ----------------------------------------------------------

    @contextlib.contextmanager
    def stepnet(self):
        """Open the step block: everything traced inside is one time step."""
        if self.frame is not None:
            raise StepNetError("this step-net's stepnet() block is already defined")
        parent = current_frame()
        state = parent.state if parent is not None else ProgramState()
        self.parent = parent
        self.name = state.fresh(self.name or "rnn")
        frame = Frame(self, parent, state)
        self.frame = frame
        push_frame(frame)
        try:
            yield self
        finally:
            pop_frame(frame)
            frame.closed = True
        self._finish()

    def _own_frame(self, what):
        frame = current_frame()
        if self.frame is None or frame is not self.frame or frame.closed:
            raise StepNetError(f"{what} must be called inside `with rnn.stepnet():` of its step-net")
        return frame

    def _binding_name(self, name, default):
        state = self.frame.state
        if name is None:
            return state.fresh(default)
        if not isinstance(name, str) or not name.isidentifier():
            raise StepNetError(f"name {name!r} must be a Python identifier")
        if name in self.bindings or name in state.names:
            raise StepNetError(f"name {name!r} is used twice in this step-net")
        state.names.add(name)
        return name

    @property
    def _top(self):
        return self.parent is None

    def _default_dtype(self):
        for v in self.frame.step_inputs:
            return v[0].dtype
        return np.dtype(np.float32)

    def _num_sequences(self):
        for b in self.bindings.values():
            if b.kind == "sequence":
                return b.value.num_sequences
        return None

    def add_input(self, X, name=None):
        """Step over the coarsest level of ``X``; returns this step's element.

        Call it inside ``with rnn.stepnet():``. Every step input of one
        step-net must have the same sequence lengths at the level stepped
        over.

        Parameters
        ----------
        X : LoDTensor or Value
            At the top level, a LoDTensor with at least one level (float16,
            float32 or float64; float16 is computed in float32). In a nested
            step-net, a ragged value of the enclosing step (e.g. the
            enclosing ``add_input`` of a multi-level LoDTensor).
        name : str, optional
            A Python identifier, unique in the step-net: the keyword that
            rebinds this input (``rnn(name=...)``). None: a fresh name.

        Returns
        -------
        Value
            This step's element: ``[batch, ...]`` for a one-level ``X``, a
            ragged value one level shallower otherwise.

        Raises
        ------
        StepNetError
            Called outside the block; ``X`` is of the wrong kind, has no
            level to step over, or has other sequence lengths than the
            step-net's other inputs; ``name`` is not an identifier or is
            taken.
        ShapeError
            ``X``'s dtype is not a float dtype.
        """
        frame = self._own_frame("add_input")
        name = self._binding_name(name, "x")
        if self._top:
            if not isinstance(X, LoDTensor):
                raise StepNetError(
                    f"add_input({name}): expects a LoDTensor, got {type(X).__name__}; "
                    "build one with sn.LoDTensor.from_lengths(data, [lengths])"
                )
            if X.num_levels == 0:
                raise StepNetError(f"add_input({name}): the LoDTensor has no LoD level to step over")
            dtype = compute_dtype(X.dtype, f"add_input({name})")
            outer = Var(name, dtype, (None,) + tuple(X.shape[1:]), X.num_levels)
            for other in self.bindings.values():
                if other.kind == "sequence" and not same_offsets(other.value, X, 1):
                    raise StepNetError(
                        f"step inputs {other.var.name} and {name} have different LoD at level 0; "
                        "every step input of one step-net must have the same sequence lengths"
                    )
            self.bindings[name] = Binding("sequence", outer, X)
        else:
            if not isinstance(X, Value) or X.frame is not self.parent:
                raise StepNetError(
                    f"add_input({name}) of a nested step-net takes a ragged value of the "
                    "enclosing step (e.g. the enclosing add_input of a multi-level LoDTensor)"
                )
            outer = X.var
            if outer.lod_depth < 1:
                raise StepNetError(
                    f"add_input({name}): {outer.name} is one row per sequence, not a sequence; "
                    "a nested step-net steps over a ragged (multi-level LoD) value"
                )
        step = frame.define(
            Var(frame.state.fresh(f"{name}_t"), outer.dtype, outer.shape, outer.lod_depth - 1)
        )
        frame.step_inputs.append((step, outer))
        return Value(step, frame)

    def add_static_input(self, value, name=None):
        """A per-sequence constant, the same at every step (e.g. attention memory).

        Parameters
        ----------
        value : array_like, LoDTensor or Value
            At the top level, a ``[num_seq, ...]`` array or a LoDTensor with
            one sequence per sequence of the step inputs, in the caller's
            order. In a nested step-net, a value of the enclosing step (read
            arrays and Parameters directly instead).
        name : str, optional
            A Python identifier, unique in the step-net: the keyword that
            rebinds this input. None: a fresh name.

        Returns
        -------
        Value
            Each active sequence's row (or sub-sequence, for a LoDTensor).

        Raises
        ------
        StepNetError
            Called outside the block; a nested step-net given something
            other than a step value; ``name`` is not an identifier or is taken.
        ShapeError
            A scalar ``value``, or one whose dtype is not a float dtype.
        """
        frame = self._own_frame("add_static_input")
        name = self._binding_name(name, "static")
        if self._top:
            if isinstance(value, LoDTensor):
                dtype = compute_dtype(value.dtype, f"add_static_input({name})")
                outer = Var(name, dtype, (None,) + tuple(value.shape[1:]), value.num_levels)
            else:
                value = np.asarray(value)
                if value.ndim < 1:
                    raise ShapeError(
                        f"add_static_input({name}): needs one row per sequence, got a scalar"
                    )
                dtype = compute_dtype(value.dtype, f"add_static_input({name})")
                outer = Var(name, dtype, (None,) + tuple(value.shape[1:]))
            self.bindings[name] = Binding("static", outer, value)
        else:
            if not isinstance(value, Value):
                raise StepNetError(
                    f"add_static_input({name}) of a nested step-net takes a value of the "
                    "enclosing step; read arrays and Parameters directly instead"
                )
            outer = _operand_var(value, self.parent)
        step = frame.define(
            Var(frame.state.fresh(f"{name}_s"), outer.dtype, outer.shape, outer.lod_depth)
        )
        frame.static_inputs.append((step, outer))
        return Value(step, frame)

    def add_memory(self, init=None, shape=None, name=None, dtype=None):
        """A recurrent state; see docs/design.md §2 for the forms of ``init``.

        With ``shape`` omitted, an array ``init`` of two or more dimensions whose
        first dimension is the number of sequences is per-sequence; any other
        array is one value for every sequence. Pass ``shape`` to disambiguate.

        Parameters
        ----------
        init : array_like, Parameter, scalar or Value, optional
            The value at the first step: a ``[num_seq, *shape]`` array (one
            row per sequence, caller's order), an array or scalar that
            broadcasts to ``shape`` (one value for every sequence), or, in a
            nested step-net, a ``[batch, ...]`` value of the enclosing step.
            None: zeros (``shape`` is then required).
        shape : int or sequence of int, optional
            The memory's feature shape, without the batch axis (``[64]``). An
            int ``n`` means ``[n]``, as in NumPy; ``[]`` is one number per
            sequence. None: taken from ``init``.
        name : str, optional
            A Python identifier, unique in the step-net: the keyword that
            rebinds the initial value (``rnn(h=...)``). None: a fresh name.
        dtype : data-type, optional
            float32 or float64 (float16 is computed in float32). None:
            ``init``'s float dtype; for a Python scalar, an integer or boolean
            array, or no ``init``, the dtype of the first step input (float32
            if there is none yet).

        Returns
        -------
        MemoryHandle
            ``pre_state()`` gives the value at t-1; set the value at t with
            ``update`` exactly once.

        Raises
        ------
        StepNetError
            Called outside the block; neither ``init`` nor ``shape`` given;
            a scalar ``init`` without ``shape``; ``shape`` is not an int or a
            sequence of non-negative ints; a step value starting a top-level
            memory; ``name`` is not an identifier or is taken.
        ShapeError
            ``init`` fits neither ``[num_seq, *shape]`` nor ``shape``, or has
            another number of rows than the step inputs have sequences.
        """
        frame = self._own_frame("add_memory")
        name = self._binding_name(name, "h")
        if shape is not None:
            shape = feature_shape(shape, f"add_memory({name})")
        if isinstance(init, Value):
            if self._top:
                raise StepNetError(f"add_memory({name}): a step value cannot start a top-level memory")
            shape, mem_dtype, init_operand = memory_from_step_value(name, init, shape, self.parent)
        else:
            init_arr, mem_dtype = initial_array(name, init, shape, dtype, self._default_dtype())
            shape, per_sequence = memory_shape(name, init_arr, shape, self._num_sequences(),
                                               self._top)
            init_operand = self._initial_operand(name, init_arr, shape, mem_dtype, per_sequence)
            if self._top and init is None:
                self.bindings[name].zeros_of_shape = True
        pre = frame.define(
            Var(frame.state.fresh(f"{name}_prev"), mem_dtype, (None,) + tuple(shape))
        )
        handle = MemoryHandle(name, pre, frame)
        frame.memories.append((handle, init_operand))
        return handle

    def _initial_operand(self, name, init_arr, shape, dtype, per_sequence):
        """What a memory starts from: at the top level an input of the program
        (``rnn(name=...)`` rebinds it); in a nested step-net a literal or a
        constant, broadcast to the memory's shape."""
        if self._top:
            outer = Var(name, dtype, (None,) + tuple(shape))
            self.bindings[name] = Binding("init", outer, init_arr, tuple(shape), per_sequence)
            return outer
        if init_arr.ndim == 0:
            return Literal(float(init_arr))
        return self.frame.state.const(np.broadcast_to(init_arr.astype(dtype), shape).copy())

    def add_outputs(self, *values):
        """Declare the step's outputs (each step's values are gathered).

        Call it inside the block; the outputs of ``rnn()`` come in this order.

        Parameters
        ----------
        *values : Value or MemoryHandle
            Step values of this block (a memory stands for its updated
            value), or one list or tuple of them. Constants are refused.

        Raises
        ------
        StepNetError
            Called outside the block, given something other than a step
            value, or given a constant.
        """
        frame = self._own_frame("add_outputs")
        if len(values) == 1 and isinstance(values[0], (list, tuple)):
            values = tuple(values[0])
        for v in values:
            if not isinstance(v, Value):
                raise StepNetError(f"add_outputs takes step values, got {type(v).__name__}")
            if isinstance(v, MemoryHandle) and v.frame is frame:
                frame.outputs.append(v)  # resolved at the end of the block
            else:
                var = _operand_var(v, frame)
                if not var.batched:
                    raise StepNetError(f"output {var.name} is a constant, not a step value")
                frame.outputs.append(var)

    def _finish(self):
        frame = self.frame
        for handle, _ in frame.memories:
            if handle.post is None:
                raise StepNetError(f"memory {handle.memory_name!r} is never updated in its step")
        outputs = []
        for out in frame.outputs:
            if isinstance(out, MemoryHandle):
                out = out.post
            outputs.append(out)
        if not outputs:
            raise StepNetError(f"step-net {self.name} has no outputs: call add_outputs(...)")
        if self.output_num is not None and len(outputs) != self.output_num:
            raise StepNetError(
                f"step-net {self.name}: output_num={self.output_num} but add_outputs "
                f"declared {len(outputs)} outputs"
            )
        if not frame.step_inputs:
            raise StepNetError(f"step-net {self.name} has no step input: call add_input(...)")
        memories = tuple(ir.Memory(h.memory_name, h.pre, h.post) for h, _ in frame.memories)
        self.block = ir.Block(
            step_inputs=tuple(v for v, _ in frame.step_inputs),
            static_inputs=tuple(v for v, _ in frame.static_inputs),
            memories=memories,
            eqns=tuple(frame.eqns),
            outputs=tuple(outputs),
        )
        self._has_nested_nets = any(e.op == "rnn" for e in self.block.eqns)
        # For empty sequences: a memory's output is its initial value, others zeros.
        mem_index = {}
        for i, m in enumerate(memories):
            mem_index.setdefault(id(m.post), i)
            mem_index.setdefault(id(m.pre), i)
        self.output_memory = tuple(mem_index.get(id(o), -1) for o in outputs)
        if self._top:
            self.program(True)  # checks the IR now, at definition time
            check_lod_agreement(self.program(True), self._top_values())

    def _eqn_operands(self):
        frame = self.frame
        seqs = tuple(o for _, o in frame.step_inputs)
        statics = tuple(o for _, o in frame.static_inputs)
        inits = tuple(o for _, o in frame.memories)
        return seqs, statics, inits

    def all_steps_flags(self, output_all_steps) -> tuple:
        """``output_all_steps`` (one bool, or one per output) as one bool per output.

        Parameters
        ----------
        output_all_steps : bool or sequence of bool
            One flag for every output, or one per output.

        Returns
        -------
        tuple of bool
            One per output of ``add_outputs``.

        Raises
        ------
        StepNetError
            A sequence whose length is not the number of outputs.
        """
        count = len(self.block.outputs)
        if isinstance(output_all_steps, (bool, int, np.bool_, np.integer)):
            return (bool(output_all_steps),) * count
        if isinstance(output_all_steps, (str, bytes)) or not hasattr(output_all_steps, "__iter__"):
            raise StepNetError(f"output_all_steps: expects a bool, or one per output; got "
                               f"{output_all_steps!r}")
        flags = tuple(bool(f) for f in output_all_steps)
        if len(flags) != count:
            raise StepNetError(
                f"step-net {self.name}: output_all_steps has {len(flags)} flags for "
                f"{count} outputs"
            )
        return flags

    def _make_eqn(self, all_steps, fresh):
        seqs, statics, inits = self._eqn_operands()
        outs = []
        for v, flag in zip(self.block.outputs, all_steps):
            depth = v.lod_depth + 1 if flag else v.lod_depth
            outs.append(Var(fresh(v.name, flag), v.dtype, v.shape, depth))
        attrs = {
            "name": self.name,
            "body": self.block,
            "reverse": self.reverse,
            "all_steps": tuple(all_steps),
            "output_memory": self.output_memory,
            "num_sequence_inputs": len(seqs),
            "num_static_inputs": len(statics),
        }
        return ir.Eqn("rnn", seqs + statics + inits, tuple(outs), attrs)

    def program(self, all_steps=True) -> ir.Program:
        """The top-level program (IR) of this step-net.

        Built once per set of output flags and checked, then kept.

        Parameters
        ----------
        all_steps : bool or sequence of bool, default True
            As ``output_all_steps`` of ``rnn()``: per output, whether it
            gathers every step or each sequence's last.

        Returns
        -------
        stepnet.ir.Program

        Raises
        ------
        StepNetError
            The step-net is not defined yet, or is nested (its program is
            part of the enclosing one).
        """
        self._require_defined()
        if not self._top:
            raise StepNetError(f"{self.name} is a nested step-net; call it inside its enclosing block")
        key = self.all_steps_flags(all_steps)
        if key not in self._programs:
            state = self.frame.state
            eqn = self._make_eqn(key, lambda n, flag: f"{n}_all" if flag else f"{n}_last")
            consts = tuple(var for var, _ in state.consts.values())
            inputs = tuple(b.var for b in self.bindings.values())
            program = ir.Program(inputs, consts, eqn)
            ir.check(program)
            self._programs[key] = program
        return self._programs[key]

    def const_values(self) -> dict:
        """The current arrays of the program's constants, keyed by their
        :class:`ir.Var` (``program.consts``)."""
        out = {}
        for var, source in self.frame.state.consts.values():
            arr = source.value if isinstance(source, Parameter) else np.asarray(source)
            if arr.shape != var.shape:  # (kernels index it by the defined shape)
                what = f"Parameter {source.name}" if isinstance(source, Parameter) else \
                    f"constant {var.name}"
                raise ShapeError(f"{what}: its value now has shape {list(arr.shape)}, but "
                                 f"{self.name} was defined with {list(var.shape)}; give it an "
                                 "array of that shape, or define the step-net again")
            out[var] = arr.astype(var.dtype, copy=False)
        return out

    def parameters(self) -> list:
        """The Parameters this step-net reads (found by data dependence)."""
        return [s for _, s in self.frame.state.consts.values() if isinstance(s, Parameter)]

    def ir(self) -> str:
        """The IR as text, one line per op (like a jaxpr)."""
        if self._top:
            return ir.format_program(self.program(True))
        return "\n".join(ir.format_block(self.block))

    def __str__(self):
        return self.ir()

    # -- running -------------------------------------------------------------

    def _top_values(self):
        return {name: b.value for name, b in self.bindings.items()}

    def float16_input(self, bindings) -> bool:
        """Whether a step input of this run is float16.

        Such a run computes in float32 and gives its outputs back as float16.

        Parameters
        ----------
        bindings : dict
            The run's new input values by name; inputs not in it keep their
            bound values.

        Returns
        -------
        bool
        """
        return any(
            b.kind == "sequence" and np.dtype(bindings.get(name, b.value).dtype) == np.float16
            for name, b in self.bindings.items()
        )

    def bind(self, **bindings) -> list:
        """Validate new arrays for the named inputs.

        Parameters
        ----------
        **bindings
            New values by the names given to ``add_input``,
            ``add_static_input`` and ``add_memory``; the others keep the
            values bound when the step-net was defined.

        Returns
        -------
        list
            The program's arguments in order: each LoD input as a LoDTensor
            in the computing dtype, each static input and initial memory as
            an array with one row per sequence.

        Raises
        ------
        StepNetError
            An unknown name, or step inputs (top-level or nested) whose
            sequence lengths differ.
        ShapeError
            A value whose kind, LoD depth, feature shape, dtype or number of
            sequences does not fit the input; a per-sequence initial memory
            left bound while the step inputs change their number of
            sequences.
        """
        unknown = set(bindings) - set(self.bindings)
        if unknown:
            raise StepNetError(
                f"unknown input name(s) {sorted(unknown)}; this step-net takes "
                f"{sorted(self.bindings)}"
            )
        values = {n: bindings.get(n, b.value) for n, b in self.bindings.items()}
        first, num_seq = check_sequence_inputs(self.bindings, values)
        if bindings and self._has_nested_nets:
            # nested step inputs must agree too, before any backend runs (the
            # top-level ones were compared above)
            check_lod_agreement(self.program(True), values)
        args = []
        for name, b in self.bindings.items():
            v = values[name]
            if b.kind == "sequence" and v.dtype != b.var.dtype and v.on_device:
                raise ShapeError(f"input {name}: {v.dtype} rows on the GPU, computed in "
                                 f"{b.var.dtype}: give them in {b.var.dtype} on the device, or "
                                 "on the host (where they are cast)")
            if b.kind == "sequence":
                args.append(v.astype(b.var.dtype) if v.dtype != b.var.dtype else v)
            elif b.kind == "static":
                args.append(bind_static(name, b, v, num_seq))
            else:
                args.append(bind_init(name, b, v, num_seq, rebound=name in bindings,
                                       sequence_input=first))
        return args

    def __call__(self, output_all_steps=True, backend=None, keep_scopes=False,
                 keep_workspace=False, **bindings):
        """Run the step-net: ``rnn(**inputs)``, the entry point.

        At the top level it runs the step-net over every step of every
        sequence on a backend; inside the block of the step-net it is nested
        in, it adds the nested step-net to that step and returns step values.

        Parameters
        ----------
        output_all_steps : bool or sequence of bool, default True
            Per output (one flag for all): True gives every step's value, a
            LoDTensor with the stepped input's LoD (the finest level
            dropped for a nested input); False gives each sequence's last
            step, an ndarray ``[num_seq, ...]`` (a sequence of length 0 gives
            the memory's initial value).
        backend : str, optional
            ``"interpreter"``, ``"numba"`` or ``"cuda"``; None:
            ``default_backend()``.
        keep_scopes : bool, default False
            Keep every step's values in ``rnn.step_scopes`` (the interpreter
            only).
        keep_workspace : bool, default False
            Keep the forward's workspace, so that the next
            ``sn.gradients(rnn, ...)`` without inputs runs only the backward.
        **bindings
            New values for the inputs, by the names given to ``add_input``,
            ``add_static_input`` and ``add_memory``; unnamed ones keep the
            values bound when the step-net was defined. A nested call takes
            none.

        Returns
        -------
        LoDTensor, ndarray or tuple of them
            One per output of ``add_outputs`` (a tuple for two or more); in a
            nested call, step values.

        Raises
        ------
        StepNetError
            The step-net is not defined yet; a nested step-net called
            outside its block or given arrays.
        UnsupportedError
            ``keep_scopes`` on another backend than the interpreter.
        BackendError
            The backend is unknown or not available.
        LoDError, ShapeError
            Inputs whose LoD or shapes do not fit the step-net.

        Examples
        --------
        >>> import numpy as np, stepnet as sn
        >>> X = sn.LoDTensor.from_lengths(np.ones((5, 3), np.float32), [[2, 3]])
        >>> rnn = sn.create_rnn_op()
        >>> with rnn.stepnet():
        ...     x = rnn.add_input(X, name="X")
        ...     h = rnn.add_memory(shape=[3], name="h")
        ...     h.update(sn.ops.tanh(x + h.pre_state()))
        ...     rnn.add_outputs(h)
        >>> rnn(backend="interpreter").lod
        [[0, 2, 5]]
        >>> rnn(output_all_steps=False, backend="interpreter").shape
        (2, 3)
        """
        self._require_defined()
        if not self._top:
            return self._call_nested(output_all_steps, bindings)
        if keep_workspace:
            from .pullback import forward_with_workspace

            outputs, self._workspace = forward_with_workspace(
                self, output_all_steps, backend, **bindings)
            return outputs
        from .backends import backend as backend_info, get_backend

        if keep_scopes and backend is not None and not backend_info(backend).keeps_scopes:
            raise UnsupportedError(f"{backend} backend: keep_scopes=True needs backend='interpreter'")
        runner = get_backend("interpreter" if keep_scopes else backend)
        return runner.run_rnn_op(self, bindings, output_all_steps, keep_scopes=keep_scopes)

    def _require_defined(self):
        """Raise StepNetError where the step-net's block is not defined yet."""
        if self.block is None:
            raise StepNetError("the step-net is not defined yet: use `with rnn.stepnet():`")

    def compile(self, backend=None):
        """A callable ``f(**inputs, output_all_steps=True)`` for one backend.

        It returns what ``rnn()`` does. Kernels are polymorphic in the number
        of rows, batch size, sequence lengths and LoD: rebinding inputs never
        recompiles. The callable is made once per step-net and backend.

        Parameters
        ----------
        backend : str, optional
            ``"interpreter"``, ``"numba"`` or ``"cuda"``; None:
            ``default_backend()``.

        Returns
        -------
        stepnet.backends.CompiledStepNet

        Raises
        ------
        BackendError
            The backend is unknown or not available.
        StepNetError
            The step-net is not defined yet, or is nested.
        """
        from .backends import get_backend

        self._require_defined()
        if not self._top:
            raise StepNetError(f"{self.name} is a nested step-net; compile its enclosing one")
        runner = get_backend(backend)
        return runner.compile_rnn_op(self)

    def _call_nested(self, output_all_steps, bindings):
        if bindings:
            raise StepNetError("a nested step-net takes no arrays when called inside its block")
        outer = current_frame()
        if outer is None or outer is not self.parent or outer.closed:
            raise StepNetError(
                f"nested step-net {self.name} must be called inside the block it was defined in"
            )
        eqn = self._make_eqn(self.all_steps_flags(output_all_steps),
                             lambda n, flag: outer.state.fresh(n))
        for v in eqn.outputs:
            outer.define(v)
        outer.eqns.append(eqn)
        values = [Value(v, outer) for v in eqn.outputs]
        return values[0] if len(values) == 1 else tuple(values)
