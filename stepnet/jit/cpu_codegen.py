"""The Numba backend's code generator: a whole step-net, time loop included,
as the source of one module that Numba compiles (:mod:`stepnet.jit.numba_cpu`
loads and runs it).

The generated module has one ``rnn_<n>`` function per ``rnn`` equation and a
``program`` function that runs the hoisted work and calls the top rnn. Its
layout:

- **Spaces.** Step values live in a *space*: the entries of one LoD level
  (space 1: the elements of the top-level sequences; space 2: their
  sub-elements; ...). A value that depends only on step inputs and constants
  is computed once for its whole space before any time loop runs (hoisted):
  ``x @ W`` is one GEMM over every token, at every nesting depth. Matmuls that
  share their left operand are merged into one GEMM with concatenated weights.
- **Time loop.** Sequences are sorted by length, so the active batch at step t
  is the prefix ``[0, nb)``; per-step values live in buffers with one row per
  sequence, allocated once per call. ``entries[b]`` is the space index of
  active row b's current element. The per-step recurrent matmuls go to BLAS
  (:mod:`stepnet.jit.blas`); runs of elementwise ops are fused into one loop, with float32
  tanh/sigmoid as vectorizable approximations (numba_runtime).
- **Nesting.** A nested rnn is a function called once per outer step with its
  sequences (the active outer rows' sub-sequences) given by start and length.

``generate_source(program)`` gives the source (it encodes the graph and its
dtypes but no sizes: kernels are cached by a hash of it) and what a call of
its ``program`` takes.

Importing it raises LLVM's vectorizer limits for the process
(``LLVM_VECTORIZER_OPTIONS``, written into every kernel's source;
docs/decisions.md says why).
"""

from __future__ import annotations

import collections
import dataclasses
import textwrap
from dataclasses import dataclass, field

import llvmlite.binding as llvm_binding
import numpy as np

from .. import ir, registry, schedule
from ..errors import UnsupportedError
from . import apart, blas, numba_runtime
from .kernel_plan import KernelPlan, kernel_plan

LLVM_VECTORIZER_OPTIONS = ("-runtime-memory-check-threshold=512",
                           "-vectorize-memory-check-threshold=512")
for _option in LLVM_VECTORIZER_OPTIONS:
    llvm_binding.set_option("stepnet", _option)

# ----------------------------------------------------------------------------
# code generation

# the scalar helpers an op's numba code may call (relu, tanh32, ...): every
# public function of numba_runtime but those a kernel calls apart
# (apart.HELPERS), imported by the generated code
_RUNTIME_HELPERS = sorted(name for name, f in vars(numba_runtime).items() if not name.startswith("_")
                          and callable(f) and getattr(f, "__module__", None) == numba_runtime.__name__
                          and name not in apart.HELPERS)


def runtime_imports() -> list:
    """The lines of a generated module importing those helpers."""
    return ["from stepnet.jit.numba_runtime import (",
            *textwrap.wrap(", ".join(_RUNTIME_HELPERS) + ",", 90, initial_indent="    ",
                           subsequent_indent="    "),
            ")"]


class _Info:
    """Where the generated code finds a var.

    kind: "const" (whole array, no batch axis), "literal", "global" (an array
    over a whole space, row = entry index), "local" (a buffer with one row per
    active sequence), "scalar" (a register inside a fused loop), "ragged" (a
    nested sequence: ``levels`` map entries down to ``data``, a global),
    "rows" (a value over a ragged static input's rows, row ``j``; its
    ``segment`` says which rows are batch row b's).
    """

    def __init__(self, kind, ident=None, var=None, offset=0, width=None, size=None,
                 levels=(), data=None, segment=None):
        self.kind = kind
        self.ident = ident
        self.var = var
        self.offset = offset  # column offset into a merged GEMM's result
        self.width = width  # full last-axis width of the array behind ident
        self.size = size  # rows of a global (code expression)
        self.levels = tuple(levels)
        self.data = data
        self.segment = segment  # a value over a ragged static input's rows: its _Segment

    @property
    def whole(self) -> bool:
        """The array behind ``ident`` holds this var alone (no merged columns)."""
        return self.offset == 0 and self.width == _width(self.var)


class _Module:
    """What the generated module shares: fresh names, typed literals, the rnn
    functions, the program's prologue (hoisted work and allocations) and the
    arrays defined so far, which every rnn function takes by name."""

    def __init__(self):
        self.counter = 0
        self.plan = None  # the kernel's KernelPlan (kernel_plan)
        self.literals = {}  # (repr, dtype) -> name of a module-level constant
        self.module_consts = []  # lines defining them
        self.functions = []  # lines of each rnn function
        self.prologue = []
        self.gargs = []
        self.packed = {}  # weights ident -> packed weights ident
        self.const_vars = {}  # ident -> the program's constant (an ir.Var)
        self.concatenated = {}  # ident -> the constants it joins by columns
        self.small_gemm_dtypes = set()  # dtypes of the products (blas.register_small_gemm)
        self.largest_weights = 0  # elements of the largest weights of a product
        self.rows_by_steps = False  # its top-level net may take its rows by steps (row_step)
        self.extra_returns = []  # data arrays behind ragged last-step outputs
        self.given_outputs = []  # output buffers program() takes from its caller
        self.hoisted_bodies = set()  # bodies whose hoisted work is emitted
        self.same_lod = set()  # pairs of ragged static inputs' levels (by their rows)
        self.segment_outputs = {}  # all-steps outputs over a static's rows: (data, pl, level)
        self.memory_outputs = {}  # last steps of ragged memories: (buffer, level)
        self.chunks = {}  # body -> the _Chunk of each product its rnn function runs by chunks
        self.output_rows = {}  # step values computed into an all-steps output (_outputs_over_rows)
        self.step_rows = set()  # the row counts of the top-level step inputs (expressions)

    def fresh(self, base):
        self.counter += 1
        return f"{base}{self.counter}"

    def literal(self, value, dtype):
        dtype = np.dtype(dtype)
        key = (repr(value), dtype.str)
        if key not in self.literals:
            name = f"K{len(self.literals)}"
            if dtype.kind == "b":
                self.module_consts.append(f"{name} = {bool(value)!r}")
            else:
                number = float(value)
                code = repr(number) if np.isfinite(number) else f"float('{number!r}')"
                self.module_consts.append(f"{name} = np.{dtype.name}({code})")
            self.literals[key] = name
        return self.literals[key]


@dataclass
class _Function:
    """One rnn function while its code is generated: the buffers allocated
    before its time loop, and the all-steps outputs its fused loops write."""

    allocs: list = field(default_factory=list)
    buffers: set = field(default_factory=set)  # idents of the step buffers
    materialized: frozenset = frozenset()  # per-step values stored in buffers
    direct: dict = field(default_factory=dict)  # Var -> all-steps output arrays
    written: set = field(default_factory=set)  # Vars a fused loop wrote there
    segments: dict = field(default_factory=dict)  # ragged Var -> its static's (see _segment)
    in_place: set = field(default_factory=set)  # new values of memories written over the old
    placed: dict = field(default_factory=dict)  # Var -> its column block of a step concat's buffer
    unbuffered: set = field(default_factory=set)  # all-steps outputs stored to the outputs alone


@dataclass
class _Ctx:
    """Where a piece of generated code goes: ``lines``, in ``mode`` ("const"
    and "hoist": the program's prologue; "step": a time step; "program": the
    top call), seeing ``values`` (Var -> _Info); ``fn`` in a step."""

    module: _Module
    values: dict
    mode: str
    lines: list
    fn: _Function | None = None

    def at(self, mode, lines=None):
        return dataclasses.replace(self, mode=mode, lines=self.lines if lines is None else lines)


# ----------------------------------------------------------------------------
# the program


def generate_source(program: ir.Program):
    """The generated module's source and a _Layout of its program() function."""
    sched = schedule.schedule(program)
    module, values = _Module(), {}
    module.plan = kernel_plan(program, sched)
    consts = list(module.plan.consts)
    params, top_inputs = _program_inputs(module, program, values, consts)
    _outputs_over_rows(module, program, values)
    _hoist(_Ctx(module, values, "hoist", module.prologue), sched, chunked=True)
    seqs = ir.rnn_parts(program.eqn)[0]
    top_levels = values[seqs[0]].levels
    ctx = _Ctx(module, values, "program", [])
    module.rows_by_steps = len(top_levels) == 1
    outs = _rnn_call(ctx, sched, "starts", "lengths", "num_seq")
    # a per-step product has at most one row per sequence of its net's level
    # (an inner net may run once over all of its level's sequences)
    max_rows = ", ".join(["num_seq"] + [f"{level}.shape[0] - 1" for level in top_levels[1:]])
    body = [f"starts, lengths = starts_and_lengths({top_levels[0]})",
            "num_seq = lengths.shape[0]"]
    if module.rows_by_steps:  # (``ROWS_IN_ORDER``; a nested net's rows are in order)
        arrays = [data for kind, _, data, levels in top_inputs
                  if kind == "sequence" and levels[0] == top_levels[0]]
        arrays += [o[1] for o in outs if o[0] == "dense_all" and o[1] in module.given_outputs]
        rows = " ".join(f"{a}.shape[0]," for a in arrays)
        body += ["if row_step != 1:", f"    rows_by_steps(starts, lengths, row_step, min(({rows})))"]
    body += [f"max_rows = max({max_rows})" if len(top_levels) > 1 else "max_rows = num_seq"]
    # the rows of the call: its sequences' items (its words, in a nested net)
    body.append(f"call_rows = {top_levels[-1]}[-1] - {top_levels[-1]}[0]")
    body += module.prologue + ctx.lines
    ret = ", ".join([o[1] for o in outs] + module.extra_returns)
    body.append(f"return ({ret},)")
    src = [
        "# generated by stepnet: do not edit",
        "import math",
        "import numpy as np",
        "from numba import njit",
        f"# BLAS: {blas.SIGNATURE}",
        f"# LLVM: {' '.join(LLVM_VECTORIZER_OPTIONS)}",
        "from stepnet.jit.apart import (",
        *textwrap.wrap(", ".join(sorted(("call_apart", "job_apart") + apart.HELPERS)) + ",", 90,
                       initial_indent="    ", subsequent_indent="    "),
        ")",
        "from stepnet.jit.ahead import AHEAD_WORDS, gemm_steps_ahead",
        "from stepnet.jit.atomics import as_read_only, wide_vectors",
        "from stepnet.jit.blas import gemm_own",
        "from stepnet.jit.threads import COLUMNS, RAISED, SHARES",
        *runtime_imports(),
        "",
        "# small_gemm's C entries the kernels call (link_helpers)",
        f"SMALL_GEMM_DTYPES = {tuple(sorted(module.small_gemm_dtypes))!r}",
        "",
    ]
    src += module.module_consts + [""]
    for fn in module.functions:
        src += fn + [""]
    src.append(_DECORATOR)
    # the consts its code reads, then weights concatenated by the caller for
    # merged GEMMs, the small-product rows (blas.small_rows_table), the
    # helper's board (threads.BOARD or threads.ALONE), the data rows' step
    # (``ROWS_IN_ORDER``), the inputs, and the output buffers the caller gives,
    # in the order of the outputs
    given = set(module.given_outputs)
    n = len(consts)
    params = (params[:n] + list(module.concatenated) + ["small_rows", "board", "row_step"] + params[n:]
              + [o[1] for o in outs if o[1] in given])
    src.append(f"def program({', '.join(params)}):")
    src += ["    " + line for line in [_WIDE_VECTORS] + body]
    layout = _Layout(top_inputs, outs, module.concatenated, sched,
                     [o[0] in ("dense_all", "last") and o[1] in given for o in outs],
                     sorted(module.same_lod), module.largest_weights,
                     all(module.plan.cut.values()), module.plan)
    return "\n".join(src) + "\n", layout


@dataclass
class _Layout:
    """What a call of the generated program() takes and returns."""

    top_inputs: list  # per program input: (kind, var, data ident, level idents)
    top_outputs: list  # per rnn output: (kind, ident, ...)
    concatenated: dict  # weights joined by the caller: ident -> constants (ir.Var)
    schedule: schedule.Schedule
    given: list  # per rnn output: whether program() takes its buffer (last parameters)
    same_lod: list  # pairs of ragged static inputs' levels combined row by row
    largest_weights: int  # elements of the largest weights of a product (0: none)
    cuts_sequences: bool  # program() cuts the sequences of each of its nets with the helper
    plan: KernelPlan  # what was decided before the code was written (its consts: the first parameters)


def _program_inputs(module, program, values, consts):
    """program()'s parameters: the constants its code reads (``consts``; one
    that only products read joined to others is not passed), then each input
    (a ragged one as its data and levels); their infos go to ``values``."""
    params = []
    for v in program.consts:
        ident = module.fresh("c")
        module.const_vars[ident] = v
        values[v] = _Info("const", ident, v)
        if v in consts:
            params.append(ident)
            module.gargs.append(ident)
    statics = ir.rnn_parts(program.eqn)[1]
    top_inputs = []
    for v in program.inputs:
        if not v.lod_depth:
            ident = module.fresh("a")
            params.append(ident)
            values[v] = _Info("local", ident, v, width=_width(v))
            top_inputs.append(("dense", v, ident, None))
            continue
        if any(s is v for s in statics) and v.lod_depth > 1:
            raise UnsupportedError(
                f"static input {v.name} is a LoDTensor of {v.lod_depth} levels; the numba "
                "backend takes one level (a sub-sequence per sequence) at most"
            )
        data = module.fresh("x")
        levels = [module.fresh("L") for _ in range(v.lod_depth)]
        params += [data] + levels
        module.gargs += levels + [data]
        dinfo = _Info("global", data, v, size=f"{data}.shape[0]", width=_width(v))
        values[v] = _Info("ragged", None, v, levels=levels, data=dinfo)
        top_inputs.append(("sequence", v, data, levels))
    return params, top_inputs


# ----------------------------------------------------------------------------
# hoisting: the const and hoisted stages of every body, in the prologue


def _outputs_over_rows(module, program, values):
    """``module.output_rows``, ``{step value: its all-steps output's buffer}``
    for the top-level net's dense all-steps outputs, made here (before the
    hoisted stages), and ``module.step_rows``: a value computed before the
    loop over the rows of a one-level step input (every step input has its
    rows) is then computed into the output's buffer (``_new_array``), not
    copied there step by step. A value given as two outputs fills the first."""
    eqn = program.eqn
    seqs = ir.rnn_parts(eqn)[0]
    if not all(v.lod_depth == 1 for v in seqs):
        return
    _all_steps_arrays(_Ctx(module, values, "program", []), eqn)
    module.step_rows = {f"{values[v].data.ident}.shape[0]" for v in seqs}
    for out, res, all_steps in zip(eqn.outputs, eqn.attrs["body"].outputs, eqn.attrs["all_steps"]):
        if all_steps and not res.lod_depth:
            module.output_rows.setdefault(res, values[out].data.ident)


def _hoist(ctx, sched, chunked=False):
    """Emit ``sched``'s const and hoisted stages into the prologue, then those
    of the nested bodies whose sequences are known (once per body).
    ``chunked``: the net runs once over all of its sequences (the top level,
    or a nested net that reads nothing of the enclosing step): its products
    of ``KernelPlan.chunked`` run by chunks of steps in its rnn function."""
    body = sched.body
    if body in ctx.module.hoisted_bodies:
        return
    ctx.module.hoisted_bodies.add(body)
    chunk_stages = ctx.module.plan.chunked.get(sched, frozenset()) if chunked else frozenset()
    seqs = ir.rnn_parts(sched.eqn)[0]
    for step_var, outer in zip(body.step_inputs, seqs):
        oi = ctx.values[outer]
        if oi.kind != "ragged":
            raise UnsupportedError(f"step input {outer.name} is not a sequence")
        if step_var.lod_depth:
            ctx.values[step_var] = _Info("ragged", None, step_var, levels=oi.levels[1:],
                                         data=oi.data)
        else:
            d = oi.data
            ctx.values[step_var] = _Info("global", d.ident, step_var, offset=d.offset,
                                         width=d.width, size=d.size)
    # a body's equations may be another's too (autodiff's recompute): each
    # value is computed once
    for stage in sched.const:
        if stage.outputs[0] not in ctx.values:
            _emit_op(ctx.at("const"), stage.eqns[0])
    split = ctx.module.plan.split[sched]
    for stage in sched.hoisted:
        if stage in split.values():  # a concat only a split product read
            continue
        if not all(v in ctx.values for v in stage.outputs):
            if stage in split:
                _render_split_gemm(ctx.at("hoist"), stage, split[stage])
            elif stage in chunk_stages and ctx.values[stage.left].kind == "global":
                _defer_product(ctx, stage, body)
            else:
                _render_stage(ctx.at("hoist"), sched, stage)
    for stage in sched.step:
        if stage.kind == "rnn" and all(v in ctx.values for v in ir.rnn_parts(stage.eqns[0])[0]):
            _hoist(ctx, sched.nested[stage.eqns[0]])


# rows of a product run by chunks of steps (``KernelPlan.chunked``): a
# chunk is this many rows of the group's sequences' steps (or one step of
# more sequences)
_CHUNK_ROWS = 128


@dataclass(frozen=True)
class _Chunk:
    """A hoisted product the top-level rnn function computes per chunk of
    steps: ``left`` rows (its info) times packed weights ``packed`` [k, n]
    into ``ring`` (``b * chunk + cs``: sequence b's row at step cs of the
    chunk), from the left rows gathered into ``gathered``."""

    left: _Info
    packed: str
    k: int
    n: int
    dtype: str
    ring: str
    gathered: str


def _defer_product(ctx, stage, body):
    """Record the product ``stage`` for the rnn function of ``body``, which
    computes it per chunk of steps (``KernelPlan.chunked``); its weights are
    packed once here, in the prologue."""
    module = ctx.module
    dtype = np.dtype(stage.eqns[0].outputs[0].dtype).name
    weights = _product_weights(ctx, stage)
    k, n = stage.left.shape[-1], sum(v.shape[-1] for v in stage.outputs)
    _count_product(module, dtype, k, n)
    packed = module.fresh("wc")
    module.prologue.append(f"{packed} = pack(as_read_only({weights}), max(max_rows, {_CHUNK_ROWS}), "
                           "call_rows, small_rows, board)")
    module.gargs.append(packed)
    chunk = _Chunk(ctx.values[stage.left], packed, k, n, dtype, module.fresh("ring"),
                   module.fresh("gathered"))
    module.chunks.setdefault(body, []).append(chunk)
    _column_blocks(ctx, stage, _Info("chunk", chunk.ring, width=n))


def _chunk_setup(chunks, ahead):
    """The rnn function's chunk length and buffers for ``chunks`` (``ahead``:
    the first one's product is computed a chunk ahead, ``_chunk_products``)."""
    def buffers(c, ring, gathered):
        return [f"{ring} = np.empty((num_seq * chunk, {c.n}), np.{c.dtype})",
                # (rows past a sequence's end keep what they held: zeros at first)
                f"{gathered} = np.zeros((num_seq * chunk, {c.k}), np.{c.dtype})"]

    lines = [f"chunk = max(1, min(num_steps, {_CHUNK_ROWS} // max(num_seq, 1)))"]
    for c in chunks:
        lines += buffers(c, c.ring, c.gathered)
    if ahead:
        ring, gathered, state = _ahead(chunks[0])
        lines += buffers(chunks[0], ring, gathered)
        lines.append(f"{state} = np.zeros(AHEAD_WORDS, np.int64)")
    return lines


def _ahead(chunk):
    """The buffers of ``chunk``'s product for the chunk ahead, and the state
    of ``ahead.gemm_steps_ahead``."""
    return chunk.ring + "_ahead", chunk.gathered + "_ahead", chunk.ring + "_state"


def _ahead_posts(module):
    """The line setting ``ahead_posts``: whether the chunk ahead goes to the
    helper, only where no per-step product shares with it (the two take
    turns on the helper, and W3's kernel ran slower with both than with
    either alone)."""
    alone = " and ".join(f"{packed}[5][SHARES] & COLUMNS == 0" for packed in module.packed.values())
    return f"ahead_posts = {alone or 'True'}"


def _chunk_products(chunks, reverse, ahead):
    """At a chunk's first step, each product of ``chunks`` over the chunk's
    rows (``blas.gemm_steps``). With ``ahead``, the first one's next chunk
    is posted to the helper, which computes it while this thread runs the
    chunk's steps, into buffers of its own that the two swap at the next
    chunk (``ahead.gemm_steps_ahead``): a one-group run's input products
    (a large part of W3's kernel) then take no time of the time loop. Only
    where nothing in the step can raise: the job writes into the function's
    buffers until it is done."""
    lines = ["cs = step % chunk", "if cs == 0:"]
    for i, c in enumerate(chunks):
        arguments = (f"{c.left.ident}, {c.left.offset}, sstart, slen, row_step, step, chunk, nb, "
                     f"{reverse}, {c.gathered}, {c.packed}, {c.ring}")
        if not (ahead and i == 0):
            lines.append(f"    gemm_steps({arguments})")
            continue
        ring, gathered, state = _ahead(c)
        lines += [f"    if gemm_steps_ahead({arguments}, {gathered}, {ring}, {state}, "
                  "ahead_posts):",
                  f"        {c.ring}, {ring} = {ring}, {c.ring}",
                  f"        {c.gathered}, {gathered} = {gathered}, {c.gathered}"]
    return lines


def _render_split_gemm(ctx, stage, concat):
    """``sum a_i @ W_i`` into the product's output: the first part's product,
    then each other part's added (``gemm_hoisted_acc``); ``W_i`` are row
    blocks of the joined weights."""
    eqn = stage.eqns[0]
    out = eqn.outputs[0]
    weights = ctx.values[eqn.inputs[1]].ident
    parts = concat.eqns[0].inputs
    info = _new_array(ctx, out, size=ctx.values[parts[0]].size)
    row = 0
    for i, part in enumerate(parts):
        left = _contiguous(ctx, ctx.values[part])
        k = part.shape[-1]
        _count_product(ctx.module, out.dtype, k, out.shape[-1])
        call = "gemm_hoisted" if i == 0 else "gemm_hoisted_acc"
        ctx.lines.append(_hoisted_product(call, left, f"{weights}[{row}:{row + k}]", info.ident))
        row += k


def _render_stage(ctx, sched, stage):
    _STAGE_RENDERERS[stage.kind](ctx, sched, stage)


def _render_gemm(ctx, sched, stage):
    """``a @ W`` as one BLAS call; a merged stage multiplies by the weights
    joined by columns and each result is a column block of its output."""
    a = stage.left
    ai = ctx.values[a]
    dtype = stage.eqns[0].outputs[0].dtype
    weights = _product_weights(ctx, stage)
    if stage.merged:
        out = ir.Var("merged", dtype, (None, sum(v.shape[-1] for v in stage.outputs)))
    else:
        out = stage.eqns[0].outputs[0]
    left = _contiguous(ctx, ai)
    info = _new_array(ctx, out, size=ai.size)
    ctx.lines.append(_gemm_call(ctx, left, weights, info, a.shape[-1], out.shape[-1], dtype))
    if stage.merged:
        _column_blocks(ctx, stage, info)


def _product_weights(ctx, stage):
    """The ident of a gemm stage's weights (joined by columns where merged)."""
    if stage.merged:
        return _joined_weights(ctx, [e.inputs[1] for e in stage.eqns])
    return ctx.values[stage.eqns[0].inputs[1]].ident


def _column_blocks(ctx, stage, info):
    """Each result of the gemm stage as its column block of the product
    ``info`` holds."""
    offset = 0
    for res in stage.outputs:
        ctx.values[res] = _Info(info.kind, info.ident, res, offset=offset, width=info.width,
                                size=info.size)
        offset += res.shape[-1]


def _joined_weights(ctx, weights):
    """The ident of the weights joined by columns: by the caller when they
    are the program's constants, else once in the prologue."""
    module = ctx.module
    idents = [ctx.values[w].ident for w in weights]
    joined = module.fresh("w")
    if all(w in module.const_vars for w in idents):
        module.concatenated[joined] = [module.const_vars[w] for w in idents]
    else:
        module.prologue.append(
            f"{joined} = np.ascontiguousarray(np.concatenate(({', '.join(idents)},), axis=1))"
        )
    module.gargs.append(joined)
    return joined


def _hoisted_product(call, left, weights, out):
    """A product outside the time loop (``call``: ``gemm_hoisted``, or
    ``gemm_hoisted_acc`` to add it), its operands typed read-only: one
    compiled helper for weights given and weights the kernel made."""
    return f"{call}(as_read_only({left}), as_read_only({weights}), {out}, small_rows, board)"


def _gemm_call(ctx, left, weights, info, k, n, dtype):
    """A BLAS call: inside the time loop on weights packed once, else on the
    weights as they are (stepnet's own loop for few rows: ``gemm_hoisted``)."""
    module = ctx.module
    _count_product(module, dtype, k, n)
    if ctx.mode != "step":
        return _hoisted_product("gemm_hoisted", left, weights, info.ident)
    packed = module.packed.get(weights)
    if packed is None:
        packed = module.packed[weights] = module.fresh("wp")
        module.prologue.append(f"{packed} = pack(as_read_only({weights}), max_rows, call_rows, "
                               "small_rows, board)")
        module.gargs.append(packed)
    # (the own loop's C entry called in the kernel first: passing the
    # tuple to a function costs a tenth of a one-row product, blas.gemm_own)
    out = f"{info.ident}[:nb]"
    return (f"if not gemm_own({left}, {packed}[4], {packed}[2], {packed}[5], {out}): "
            f"gemm_packed({left}, {packed}, {out})")


def _count_product(module, dtype, k, n):
    """Note a product by weights [k, n] of ``dtype`` (small_gemm's entries to
    link, the largest weights)."""
    module.small_gemm_dtypes.add(np.dtype(dtype).name)
    module.largest_weights = max(module.largest_weights, k * n)


def _render_single(ctx, sched, stage):
    _emit_op(ctx, stage.eqns[0])


def _render_elementwise(ctx, sched, stage):
    if ctx.mode == "step":
        _emit_fused(ctx, stage.eqns)
    else:  # hoisted: one op per stage
        _emit_op(ctx, stage.eqns[0])


def _render_rnn(ctx, sched, stage):
    e = stage.eqns[0]
    inner = sched.nested[e]
    if ctx.mode == "step":
        _emit_nested(ctx, inner)
        return
    # independent: once over every entry of its space, before any time loop
    _hoist(ctx, inner, chunked=True)
    level = ctx.values[ir.rnn_parts(e)[0][0]].levels[0]
    st, ln = ctx.module.fresh("st"), ctx.module.fresh("ln")
    ctx.lines.append(f"{st}, {ln} = starts_and_lengths({level})")
    _rnn_call(ctx, inner, st, ln, f"{ln}.shape[0]")


_STAGE_RENDERERS = {
    "gemm": _render_gemm,
    "matmul": _render_single,
    "shape": _render_single,
    "elementwise": _render_elementwise,
    "rnn": _render_rnn,
}


# ----------------------------------------------------------------------------
# arrays, loops and element references


def _new_array(ctx, var, size=None):
    """Allocate the array that holds ``var`` (as ctx.mode says) and record it."""
    module = ctx.module
    ident = module.fresh("v")
    dt = f"np.{np.dtype(var.dtype).name}"
    if ctx.mode == "const":
        ctx.lines.append(f"{ident} = np.empty({tuple(var.shape)!r}, {dt})")
        module.gargs.append(ident)
        info = _Info("const", ident, var)
    elif ctx.mode == "hoist" and var in module.output_rows and size in module.step_rows:
        ident = module.output_rows.pop(var)  # (an argument already)
        info = _Info("global", ident, var, width=_width(var), size=size)
    elif ctx.mode == "hoist":
        ctx.lines.append(f"{ident} = np.empty({_shape(size, var.shape[1:])}, {dt})")
        module.gargs.append(ident)
        info = _Info("global", ident, var, width=_width(var), size=size)
    elif var.lod_depth:  # a row per row of the ragged static input it comes from
        segment = _segment(ctx, var)
        ctx.fn.allocs.append(f"{ident} = np.empty({_shape(segment.rows, var.shape[1:])}, {dt})")
        info = _Info("rows", ident, var, width=_width(var), segment=segment)
    else:
        ctx.fn.allocs.append(f"{ident} = np.empty({_shape('num_seq', var.shape[1:])}, {dt})")
        ctx.fn.buffers.add(ident)
        info = _Info("local", ident, var, width=_width(var))
    ctx.values[var] = info
    return info


@dataclass(frozen=True)
class _Segment:
    """Where a batch row's rows of a ragged static input lie: ``starts[b]``
    to ``stops[b]`` (arrays filled before the time loop) in the data whose
    offsets are ``level``."""

    starts: str
    stops: str
    level: str

    @property
    def rows(self) -> str:
        return f"{self.level}[-1]"


def _segment(ctx, var):
    """The _Segment of the ragged static input that ``var`` comes from."""
    return ctx.fn.segments[var]


def _note_segment(ctx, e):
    """Record the segment of ``e``'s ragged result: its ragged operands' (one
    static input's; several must have the same LoD, checked before a run)."""
    segments = [ctx.values[v].segment for v in e.inputs
                if isinstance(v, ir.Var) and v.lod_depth and ctx.values[v].kind in ("rows", "scalar")]
    if not segments:
        raise UnsupportedError(f"numba backend: {e.op} computing {e.outputs[0].name} reads a "
                               "ragged value that is not a static input's (use the interpreter)")
    for other in segments[1:]:
        if other != segments[0]:
            ctx.module.same_lod.add((segments[0].level, other.level))
    if e.outputs[0].lod_depth:
        ctx.fn.segments[e.outputs[0]] = segments[0]
    return segments[0]


def _contiguous(ctx, info):
    """An expression for a C-contiguous [rows, K] array holding a 2-D var."""
    if ctx.mode == "hoist" and info.kind == "global" and info.whole:
        return info.ident
    if ctx.mode == "step" and info.kind == "local" and info.whole:
        return f"{info.ident}[:nb]"
    tmp = _new_array(ctx, ir.Var("tmp", info.var.dtype, info.var.shape), size=info.size)
    _emit_copy(ctx, info, tmp)
    return f"{tmp.ident}[:nb]" if ctx.mode == "step" else tmp.ident


def _emit_copy(ctx, src, dst):
    shape = dst.var.shape
    loops, idx = _loop_nest(shape, ctx.mode, dst.size, segment=dst.segment)
    ctx.lines += _nest(loops, [
        f"{_ref(dst, idx, ctx.mode, shape)} = {_ref(src, idx, ctx.mode, shape)}"
    ])


def _loop_nest(shape, mode, size=None, bounds=None, segment=None):
    """Loops over ``shape`` (over ``range(lo, hi)`` on an axis ``bounds`` maps
    to ``(lo, hi)``); in a step, ``e`` is row b's entry (loaded once per row,
    so LLVM vectorizes the inner loop), and for a ragged value (``segment``:
    its _Segment) ``j`` runs over row b's own rows."""
    loops, idx = [], []
    for d, n in enumerate(shape):
        if n is None:
            var = "b" if mode == "step" else "r"
            bound = "nb" if mode == "step" else size
        elif bounds and d in bounds:
            var, bound = f"i{d}", "{}, {}".format(*bounds[d])
        else:
            var, bound = f"i{d}", str(n)
        loops.append(f"for {var} in range({bound}):")
        if n is None and mode == "step":
            loops.append("e = entries[b]")
            if segment is not None:
                loops.append(f"for j in range({segment.starts}[b], {segment.stops}[b]):")
        idx.append(var)
    return loops, idx


def _ref(info, idx, mode, loop_shape, row="b"):
    """Code reading element ``idx`` (loop indices over ``loop_shape``) of a var,
    with NumPy broadcasting; ``row``: a local buffer's row."""
    if info.kind in ("literal", "scalar"):
        return info.ident
    shape = info.var.shape
    lead = len(loop_shape) - len(shape)
    parts = []
    for d, n in enumerate(shape):
        i = idx[lead + d]
        if n is None:
            if info.kind == "global":
                i = "e" if mode == "step" else "r"
            elif info.kind == "chunk":
                i = "b * chunk + cs"
            elif info.kind == "rows":
                i = "j"
            else:
                i = row
        elif n == 1 and loop_shape[lead + d] != 1:
            i = "0"
        if d == len(shape) - 1 and info.offset:
            i = f"{info.offset} + {i}"
        parts.append(i)
    if not parts:  # a 0-d array (a value computed once from constants): read and written at ()
        return f"{info.ident}[()]" if info.kind == "const" else info.ident
    return f"{info.ident}[{', '.join(parts)}]"


def _operand(ctx, v, dtype):
    if isinstance(v, ir.Literal):
        return _Info("literal", ctx.module.literal(v.value, dtype))
    return ctx.values[v]


# ----------------------------------------------------------------------------
# one op as its own loop nest


def _emit_op(ctx, e):
    """One op (not a GEMM, not fused) as its own loop nest over its result:
    an elementwise op from its scalar code, a shape op or a reduction from
    its record's ``gather`` or ``reduction`` form (stepnet/registry.py)."""
    out = e.outputs[0]
    size = None
    if ctx.mode == "hoist":  # the rows of the space: those of a global operand
        size = next(ctx.values[v].size for v in e.inputs
                    if isinstance(v, ir.Var) and ctx.values[v].kind == "global")
    ragged = any(isinstance(v, ir.Var) and v.lod_depth for v in e.inputs)
    segment = _note_segment(ctx, e) if ragged else None
    rows = segment if out.lod_depth else None
    info = _new_array(ctx, out, size=size)
    ins = [_operand(ctx, v, registry.literal_dtype(e)) for v in e.inputs]
    loops, idx = _loop_nest(out.shape, ctx.mode, size, segment=rows)
    record = registry.get(e.op)
    dst = _ref(info, idx, ctx.mode, out.shape)
    if record.segment is not None:  # over each batch row's rows of its ragged operand
        combine, initial = record.segment
        start, _ = _loop_nest(out.shape, ctx.mode)
        over_rows, _ = _loop_nest(out.shape, ctx.mode, segment=segment)
        src = _ref(ins[0], idx, ctx.mode, out.shape)
        ctx.lines += _nest(start, [f"{dst} = {ctx.module.literal(initial, out.dtype)}"])
        ctx.lines += _nest(over_rows, [f"{dst} = {combine.format(acc=dst, x=src)}"])
    elif schedule.is_elementwise(e):
        expr = _scalar_expr(ctx, e, [_ref(i, idx, ctx.mode, out.shape) for i in ins])
        ctx.lines += _nest(loops, [f"{dst} = {expr}"])
    elif record.gather is not None:
        zero = ctx.module.literal(0.0, out.dtype)
        for case in record.gather(idx, [v.shape for v in e.inputs], **e.attrs):
            if case.axis is not None and out.shape[case.axis] is None:
                raise UnsupportedError(f"numba backend: {e.op} along the batch axis")
            bounds = {} if case.axis is None else {case.axis: (case.lo, case.hi)}
            case_loops, _ = _loop_nest(out.shape, ctx.mode, size, bounds, segment=rows)
            src = zero if case.operand is None else _read_at(ctx, ins, e, case.operand, case.index)
            ctx.lines += _nest(case_loops, [f"{dst} = {src}"])
    elif record.reduction is not None:
        extent, sources = record.reduction(idx, [v.shape for v in e.inputs], **e.attrs)
        term = " * ".join(_read_at(ctx, ins, e, k, index) for k, index in enumerate(sources))
        ctx.lines += _nest(loops, [f"acc = {ctx.module.literal(0.0, out.dtype)}",
                                   f"for k in range({extent}):", f"    acc += {term}",
                                   f"{dst} = acc"])
    else:
        raise UnsupportedError(f"numba backend: no code generation for op {e.op!r}")


def _read_at(ctx, ins, e, k, index):
    """Operand ``k`` of ``e`` read at ``index`` (code per operand axis; an
    axis of size 1 is read at 0)."""
    shape = e.inputs[k].shape
    index = ["0" if n == 1 else i for n, i in zip(shape, index)]
    return _ref(ins[k], index, ctx.mode, shape)


def _scalar_expr(ctx, e, args):
    """Op ``e`` on one element, ``args`` its operands' code: the op's
    ``numba`` code (its record in stepnet/ops/)."""
    code = registry.get(e.op).numba
    dtype = e.outputs[0].dtype
    if code is None:
        raise UnsupportedError(f"numba backend: no code generation for op {e.op!r}")
    if callable(code):
        return code(*args, **{k: ctx.module.literal(v, dtype) for k, v in e.attrs.items() if v is not None})
    return code.format(*args, bits="32" if np.dtype(dtype) == np.float32 else "64")


# ----------------------------------------------------------------------------
# the time loop: one function per rnn equation


def _rnn_call(ctx, sched, start_expr, len_expr, count_expr):
    """Emit the function for ``sched``'s rnn and, into ctx.lines, its call.

    Returns per rnn output (kind, ident, ...) for the caller of program().
    """
    eqn = sched.eqn
    _, statics, inits = ir.rnn_parts(eqn)
    _all_steps_arrays(ctx, eqn)
    fname, params, fn_lines, result_infos = _rnn_function(ctx, sched)
    args, outs, hoisted_lasts = [start_expr, len_expr], [], []
    # the top-level net's rows may be by steps (program()'s ``row_step``); a
    # nested net's are its level's, a sequence's one after another
    row_step = "row_step" if start_expr == "starts" and ctx.module.rows_by_steps else "1"
    for v in list(inits) + list(statics):
        if isinstance(v, ir.Var) and ctx.values[v].kind not in ("const", "ragged"):
            args.append(_batched_arg(ctx, ctx.values[v]))  # (a ragged static is a global)
    body = eqn.attrs["body"]
    for out, res, all_steps, ri in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"],
                                       result_infos):
        if out in ctx.module.memory_outputs:
            buffer, level = ctx.module.memory_outputs[out]
            outs.append(("segment_memory", buffer, (level,)))
        elif out in ctx.module.segment_outputs:
            od, pl, top = ctx.module.segment_outputs[out]
            ctx.module.extra_returns.append(pl)
            outs.append(("segment_all", od, (top,)))
        elif all_steps and res.lod_depth:
            oi = _Info("ragged", None, out, levels=(_seq_levels(ctx, eqn)[0],) + ri.levels,
                       data=ri.data)
            ctx.values[out] = oi
            outs.append(("ragged_all", oi.data.ident, oi.levels))
        elif all_steps:
            oi = ctx.values[out]
            outs.append(("dense_all", oi.data.ident, oi.levels))
        elif res.lod_depth:
            outs.append(_ragged_last_arg(ctx, ri, args))
        else:
            outs.append(_last_arg(ctx, out, res, count_expr, args, hoisted_lasts))
    # The function takes every array defined before its call (consts, data,
    # hoisted values, packed weights, output buffers) by name.
    gargs = list(ctx.module.gargs)
    fn = [f"def {fname}({', '.join(params + ['row_step'] + gargs)}):",
          "    " + _WIDE_VECTORS] + fn_lines
    fn.insert(0, _RNN_DECORATOR)
    ctx.module.functions.append(fn)
    # program()'s own nets (the top-level one, and the nested ones that need
    # nothing of its steps, run before its time loop: ``_render_rnn``)
    at_program = ctx.mode in ("program", "hoist")
    if at_program and ctx.module.plan.cut[sched]:
        ctx.lines += _shared_call(ctx, fname, args, [row_step] + gargs, len_expr)
    else:
        ctx.lines.append(f"call_apart({fname}, ({', '.join(args + [row_step] + gargs)}))")
    ctx.module.gargs.extend(hoisted_lasts)
    return outs


def _shared_call(ctx, fname, args, gargs, len_expr):
    """The lines calling rnn function ``fname`` over its sequences in two
    parts, ``0:cut`` on this thread and ``cut:`` on the helper thread
    (``threads.group_cut``, ``threads.run_jobs``): its per-sequence
    arguments ``args`` (the sequences' starts and lengths, their initial
    memories, static inputs and last-step outputs) cut, ``gargs`` (arrays
    of all rows, constants) whole; the rnn function called apart
    (``apart.job_apart``, ``apart.call_apart``: its code is compiled once,
    not again into program()'s). (Nothing here depends on the weights'
    sizes, so layers whose weights differ only in their input widths share
    one kernel.)"""
    own = ", ".join([f"{a}[:cut]" for a in args] + gargs)
    other = ", ".join([f"{a}[cut:]" for a in args] + gargs)
    return [f"cut = group_cut(board, {len_expr})",
            f"own = job_apart({fname}, ({own}))",
            f"other = job_apart({fname}, ({other}))",
            f"if run_jobs(board, own, other, cut < {len_expr}.shape[0]) == RAISED:",
            f"    call_apart({fname}, ({', '.join(args + gargs)}))"]  # (a part raised: raise it here)


def _all_steps_arrays(ctx, eqn):
    """The global arrays of ``eqn``'s dense all-steps outputs, one row per entry."""
    body = eqn.attrs["body"]
    for out, res, all_steps in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"]):
        if all_steps and not res.lod_depth and out not in ctx.values:  # (made once)
            level = _seq_levels(ctx, eqn)[0]
            ident = ctx.module.fresh("o")
            dt = f"np.{np.dtype(out.dtype).name}"
            if ctx.mode == "program":  # the caller's buffer (a group's rows of it)
                ctx.module.given_outputs.append(ident)
            else:
                ctx.module.prologue.append(
                    f"{ident} = np.empty({_shape(level + '[-1]', res.shape[1:])}, {dt})"
                )
            ctx.module.gargs.append(ident)
            data = _Info("global", ident, res, width=_width(res), size=f"{level}[-1]")
            ctx.values[out] = _Info("ragged", None, out, levels=(level,), data=data)


def _ragged_last_arg(ctx, ri, args):
    if ctx.mode != "program":
        raise UnsupportedError(
            "numba backend: a nested step-net's last step of a ragged output "
            "is not supported (use backend='interpreter')"
        )
    ident = ctx.module.fresh("e")
    ctx.lines.append(f"{ident} = np.empty(num_seq, np.int64)")
    args.append(ident)
    ctx.module.extra_returns.append(ri.data.ident)
    return ("ragged_last", ident, ri.levels, ri.data.ident)


def _last_arg(ctx, out, res, count_expr, args, hoisted_lasts):
    """The buffer a dense last-step output is written to: the caller's result,
    one row per entry of the enclosing space (hoisted), or a step buffer."""
    if ctx.mode == "step":
        info = _new_array(ctx, out)
        args.append(f"{info.ident}[:nb]")
        return ("last", info.ident)
    ident = ctx.module.fresh("last")
    dt = f"np.{np.dtype(out.dtype).name}"
    if ctx.mode == "program":  # the caller's buffer (a group's rows of it)
        ctx.module.given_outputs.append(ident)
    else:
        ctx.lines.append(f"{ident} = np.empty({_shape(count_expr, res.shape[1:])}, {dt})")
    args.append(ident)
    if ctx.mode == "hoist":
        hoisted_lasts.append(ident)
        ctx.values[out] = _Info("global", ident, out, width=_width(out), size=f"({count_expr})")
    return ("last", ident)


def _seq_levels(ctx, eqn):
    return ctx.values[ir.rnn_parts(eqn)[0][0]].levels


def _batched_arg(ctx, vi):
    """An expression for an [n, ...] array of a batched operand, in batch order."""
    if ctx.mode == "program":
        return vi.ident
    if vi.kind == "local" and vi.whole:
        return f"{vi.ident}[:nb]"
    tmp = _new_array(ctx.at("step"), ir.Var("tmp", vi.var.dtype, vi.var.shape))
    _emit_copy(ctx.at("step"), vi, tmp)
    return f"{tmp.ident}[:nb]"


def _rnn_function(ctx, sched):
    """The code of the function running ``sched``'s rnn: ``(name, params,
    body lines, the infos of the body's outputs)``. Its per-step values live
    in a scope of its own (the same body may be called twice)."""
    eqn = sched.eqn
    fn = _Function(materialized=frozenset(sched.materialized))
    fctx = _Ctx(ctx.module, collections.ChainMap({}, ctx.values), "step", [], fn)
    fname = ctx.module.fresh("rnn_")
    params = ["seq_start", "seq_len"]
    top = ctx.mode == "program"
    setup = _function_setup(fctx, eqn, params, top=top)
    chunks = ctx.module.chunks.get(sched.body, ())
    # (a nested net's call in the step may raise: its allocations)
    ahead = bool(chunks) and not any(e.op == "rnn" for e in sched.body.eqns)
    if chunks:
        setup += _chunk_setup(chunks, ahead)
    last_params = _last_step_params(fctx, eqn, params, setup)
    step = _step_body(fctx, sched, last_params, chunks, ahead)
    if ahead:  # (after the step: its per-step products' weights are packed)
        setup.append(_ahead_posts(ctx.module))
    lines = ["    " + line for line in setup + fn.allocs]
    lines += ["    nb = num_seq", "    for step in range(num_steps):"]
    lines += ["        " + line for line in step]
    lines += ["    return 0"]
    results = [fctx.values.get(res) for res in eqn.attrs["body"].outputs]
    return fname, params, lines, results


def _function_setup(fctx, eqn, params, top):
    """Sort the sequences; copy initial memories and static inputs in sorted
    order (their params join ``params``)."""
    body = eqn.attrs["body"]
    _, statics, inits = ir.rnn_parts(eqn)
    module = fctx.module
    setup = [
        "num_seq = seq_len.shape[0]",
        "order, slen, sstart = sort_by_length(seq_start, seq_len)",
        "num_steps = slen[0] if num_seq > 0 else 0",
        "entries = np.empty(num_seq, np.int64)",
    ]
    ragged = eqn.attrs.get("ragged_memories", {})
    for k, (mem, init) in enumerate(zip(body.memories, inits)):
        if k in ragged:
            continue  # after the static input that gives its rows
        ident = module.fresh("m")
        dt = f"np.{np.dtype(mem.pre.dtype).name}"
        setup.append(f"{ident} = np.empty({_shape('num_seq', mem.pre.shape[1:])}, {dt})")
        src, src_row, src_shape = _init_source(fctx, init, mem.pre, params)
        setup += _row_assign(ident, "b", src, src_row, mem.pre.shape[1:], src_shape)
        fctx.values[mem.pre] = _Info("local", ident, mem.pre, width=_width(mem.pre))
    for sv, outer in zip(body.static_inputs, statics):
        oi = fctx.values[outer]
        if oi.kind == "const":
            fctx.values[sv] = oi
            continue
        if outer.lod_depth or sv.lod_depth:
            if oi.kind != "ragged" or not top or outer.lod_depth != 1:
                raise UnsupportedError(
                    f"numba backend: ragged static input {outer.name} of a nested step-net "
                    "(use backend='interpreter')")
            level = oi.levels[0]
            ms, me = module.fresh("ms"), module.fresh("me")
            setup += [f"{ms} = np.empty(num_seq, np.int64)", f"{me} = np.empty(num_seq, np.int64)"]
            setup += _nest(["for b in range(num_seq):"], [f"{ms}[b] = {level}[order[b]]",
                                                          f"{me}[b] = {level}[order[b] + 1]"])
            segment = _Segment(ms, me, level)
            fctx.values[sv] = _Info("rows", oi.data.ident, sv, width=_width(sv), segment=segment)
            fctx.fn.segments[sv] = segment
            continue
        p = module.fresh("s_in")
        params.append(p)
        ident = module.fresh("s")
        dt = f"np.{np.dtype(sv.dtype).name}"
        setup.append(f"{ident} = np.empty({_shape('num_seq', sv.shape[1:])}, {dt})")
        setup += _row_assign(ident, "b", p, "order[b]", sv.shape[1:])
        fctx.values[sv] = _Info("local", ident, sv, width=_width(sv))
    for k, i in ragged.items():
        _ragged_memory(fctx, body.memories[k], inits[k], body.static_inputs[i])
    return setup


def _ragged_memory(fctx, mem, init, static):
    """A memory over a ragged static input's rows (a gradient accumulator): a
    buffer laid out as that input's data, made before the call (it is the
    memory's last-step output), read and written at the active rows' rows."""
    module, segment = fctx.module, fctx.fn.segments[static]
    if not isinstance(init, ir.Literal):
        raise UnsupportedError(f"numba backend: ragged memory {mem.name} starts from a value")
    ident = module.fresh("rm")
    dt = f"np.{np.dtype(mem.pre.dtype).name}"
    value = module.literal(init.value, mem.pre.dtype)
    module.prologue.append(f"{ident} = np.full({_shape(segment.rows, mem.pre.shape[1:])}, "
                           f"{value}, {dt})")
    module.gargs.append(ident)
    fctx.values[mem.pre] = _Info("rows", ident, mem.pre, width=_width(mem.pre), segment=segment)
    fctx.fn.segments[mem.pre] = segment


def _init_source(fctx, init, pre, params):
    """The expression for row b's initial value of a memory."""
    if isinstance(init, ir.Literal):
        return fctx.module.literal(init.value, pre.dtype), None, None
    ii = fctx.values[init]
    if ii.kind == "const":
        return ii.ident, None, init.shape
    p = fctx.module.fresh("init")
    params.append(p)
    return p, "order[b]", None


def _last_step_params(fctx, eqn, params, setup):
    """Per output: the param its last step is written to (started at the
    memory's init, zeros, or -1 for a ragged one), or None for all steps."""
    body = eqn.attrs["body"]
    last_params = []
    for res, out, all_steps, mem_index in zip(body.outputs, eqn.outputs, eqn.attrs["all_steps"],
                                              eqn.attrs["output_memory"]):
        if all_steps:
            last_params.append(None)
            continue
        if mem_index in eqn.attrs.get("ragged_memories", {}):  # the memory's buffer itself
            info = fctx.values[body.memories[mem_index].pre]
            fctx.module.memory_outputs[out] = (info.ident, info.segment.level)
            last_params.append(_MEMORY_BUFFER)
            continue
        p = fctx.module.fresh("out_last")
        params.append(p)
        last_params.append(p)
        if res.lod_depth:
            setup += _nest(["for b in range(num_seq):"], [f"{p}[b] = -1"])
        elif mem_index >= 0:
            m = fctx.values[body.memories[mem_index].pre].ident
            setup += _row_assign(p, "order[b]", m, "b", res.shape[1:])
        else:
            zero = fctx.module.literal(0.0, res.dtype)
            setup += _row_assign(p, "b", zero, None, res.shape[1:])
    return last_params


_MEMORY_BUFFER = "memory buffer"  # a last-step output that is a ragged memory's buffer


def _step_body(fctx, sched, last_params, chunks=(), ahead=False):
    """One time step: the active prefix, the products of ``chunks`` at a
    chunk's first step, the step's stages, the outputs, the memory updates."""
    eqn, body = sched.eqn, sched.body
    step = ["while nb > 0 and slen[nb - 1] <= step:", "    nb -= 1"]
    pos = "slen[b] - 1 - step" if eqn.attrs["reverse"] else "step"
    step += _nest(["for b in range(nb):"], [f"entries[b] = sstart[b] + ({pos}) * row_step"])
    if chunks:
        step += _chunk_products(chunks, eqn.attrs["reverse"], ahead)
    for res, out, p in zip(body.outputs, eqn.outputs, last_params):
        if p is None and not res.lod_depth:  # one value may be several outputs
            fctx.fn.direct.setdefault(res, []).append(fctx.values[out].data)
    sctx = fctx.at("step", step)
    for mem in fctx.module.plan.in_place[sched]:  # the run computing its new value writes it there
        fctx.fn.in_place.add(mem.post)
        fctx.fn.direct.setdefault(mem.post, []).append(fctx.values[mem.pre])
    epilogues = fctx.module.plan.epilogues[sched]
    folded = {r for rs in epilogues.values() for r in rs}
    fctx.fn.unbuffered.update(fctx.module.plan.unbuffered[sched])
    concats = fctx.module.plan.concats[sched]
    for stage in concats:
        out = stage.outputs[0]
        buffer, offset = _new_array(sctx, out), 0
        for part in stage.eqns[0].inputs:
            fctx.fn.placed[part] = _Info("local", buffer.ident, part, offset=offset,
                                         width=out.shape[-1])
            offset += part.shape[-1]
    for stage in sched.step:
        if stage in epilogues:
            _emit_fused(sctx, stage.eqns, [r.eqns[0] for r in epilogues[stage]])
        elif stage not in folded and stage not in concats:
            _render_stage(sctx, sched, stage)
    step += _write_outputs(fctx, eqn, last_params)
    step += _update_memories(fctx, sched)
    return step


def _write_outputs(fctx, eqn, last_params):
    """Copy each output's step value where it goes (unless written in place)."""
    body, lines = eqn.attrs["body"], []
    for res, out, p in zip(body.outputs, eqn.outputs, last_params):
        ri = fctx.values[res]
        if p == _MEMORY_BUFFER:
            continue  # the buffer holds it
        if p is None and res in fctx.fn.segments:
            lines += _segment_output(fctx, eqn, res, out)
        elif p is None:
            if res.lod_depth or res in fctx.fn.written:
                continue  # written in place by the nested rnn or the fused loop
            oi = fctx.values[out].data
            if ri.ident == oi.ident:
                continue  # computed into the output before the loop (_outputs_over_rows)
            loops, idx = _loop_nest(res.shape, "step")
            lines += _nest(loops, [
                f"{_ref(oi, idx, 'step', res.shape)} = {_ref(ri, idx, 'step', res.shape)}"
            ])
        elif res.lod_depth:
            lines += _nest(["for b in range(nb):", "if slen[b] == step + 1:"],
                           [f"{p}[order[b]] = entries[b]"])
        else:
            loops, idx = _loop_nest(res.shape, "step")
            dst = _ref(_Info("local", p, res), idx, "step", res.shape, row="order[b]")
            lines += _nest(
                ["for b in range(nb):", "if slen[b] == step + 1:"],
                _nest(loops[1:], [f"{dst} = {_ref(ri, idx, 'step', res.shape)}"]),
            )
    return lines


def _segment_output(fctx, eqn, res, out):
    """An all-steps output of a value over a ragged static input's rows:
    each step's rows at its entry's place (``pl[e]``: the rows before entry
    ``e``, counted in the prologue), a two-level output (sequence, step, rows)."""
    module = fctx.module
    segment = fctx.fn.segments[res]
    top = _seq_levels(fctx, eqn)[0]
    pl, od = module.fresh("pl"), module.fresh("od")
    s, t, k = module.fresh("s"), module.fresh("t"), module.fresh("k")
    dt = f"np.{np.dtype(res.dtype).name}"
    module.prologue += [f"{pl} = np.zeros({top}[-1] + 1, np.int64)"]
    module.prologue += _nest([f"for {s} in range(lengths.shape[0]):", f"for {t} in range(lengths[{s}]):"],
                             [f"{pl}[starts[{s}] + {t} + 1] = {segment.level}[{s} + 1] - "
                              f"{segment.level}[{s}]"])
    module.prologue += _nest([f"for {k} in range({top}[-1]):"], [f"{pl}[{k} + 1] += {pl}[{k}]"])
    module.prologue.append(f"{od} = np.empty({_shape(pl + '[-1]', res.shape[1:])}, {dt})")
    module.gargs += [pl, od]
    module.segment_outputs[out] = (od, pl, top)
    loops, idx = _loop_nest(res.shape, "step", segment=segment)
    dst = f"{od}[{', '.join([f'{pl}[e] + j - {segment.starts}[b]'] + idx[1:])}]"
    return _nest(loops, [f"{dst} = {_ref(fctx.values[res], idx, 'step', res.shape)}"])


def _update_memories(fctx, sched):
    """After the outputs (which may read a previous state): a new value in a
    buffer of its own is swapped in (schedule.swaps), anything else is copied
    (through a snapshot where a new value is another memory's old one)."""
    body, lines = sched.body, []
    sctx = fctx.at("step", lines)
    pres = {m.pre for m in body.memories}
    snaps = {}
    for mem in body.memories:
        if mem.post in pres and mem.post not in snaps:
            tmp = _new_array(sctx, ir.Var("snap", mem.post.dtype, mem.post.shape))
            _emit_copy(sctx, fctx.values[mem.post], tmp)
            snaps[mem.post] = tmp
    for mem in body.memories:
        if mem.post in fctx.fn.in_place:
            continue
        src = snaps.get(mem.post, fctx.values[mem.post])
        dst = fctx.values[mem.pre]
        if mem in sched.swaps:
            assert src.kind == "local" and src.ident in fctx.fn.buffers and src.whole
            lines.append(f"{dst.ident}, {src.ident} = {src.ident}, {dst.ident}")
        else:
            _emit_copy(sctx, src, dst)
    return lines


def _emit_fused(ctx, group, epilogues=()):
    """A run of elementwise ops as one loop; its intermediates stay scalars,
    the materialized ones are stored, all-steps outputs written in place.
    ``epilogues``: reductions of its values (``KernelPlan.epilogues``),
    accumulated in the same loop."""
    shape = group[0].outputs[0].shape
    _, idx = _loop_nest(shape, "step")
    inner, scalars, segment = [], [], None
    read, written = [], []  # the per-token arrays (rows "e") it reads and writes
    for e in group:  # a ragged run loops over its rows (schedule: one LoD depth per run)
        if any(isinstance(v, ir.Var) and v.lod_depth for v in e.inputs):
            segment = _note_segment(ctx, e)
        opdt = registry.literal_dtype(e)
        operands = [_operand(ctx, v, opdt) for v in e.inputs]
        for info in operands:
            if _per_token(info) and info.ident not in read:
                read.append(info.ident)
        args = [_ref(i, idx, "step", shape) for i in operands]
        out = e.outputs[0]
        name = ctx.module.fresh("t")
        inner.append(f"{name} = {_scalar_expr(ctx, e, args)}")
        scalars.append((out, name))
        ctx.values[out] = _Info("scalar", name, out, segment=segment)
    loops, _ = _loop_nest(shape, "step", segment=segment)
    names = dict(scalars)
    before, after = [], []  # around the innermost loop: row sums in registers
    for e in epilogues:
        if e.op == "sum":
            acc = ctx.module.fresh("acc")
            out = e.outputs[0]
            if out.lod_depth:
                _note_segment(ctx, e)
            info = _new_array(ctx, out)
            target = idx[:-1] + (["0"] if e.attrs.get("keepdims", False) else [])
            before.append(f"{acc} = {ctx.module.literal(0.0, out.dtype)}")
            inner.append(f"{acc} += {names[e.inputs[0]]}")
            after.append(f"{_ref(info, target, 'step', out.shape)} = {acc}")
        else:
            inner += _fold(ctx, e, names[e.inputs[0]], idx)
    folded = {e.inputs[0] for e in epilogues}
    skipped = folded | ctx.fn.in_place | ctx.fn.unbuffered
    for out, name in scalars:
        if out in ctx.fn.materialized and out not in skipped:
            info = ctx.fn.placed[out] if out in ctx.fn.placed else _new_array(ctx, out)
            ctx.values[out] = info
            inner.append(f"{_ref(info, idx, 'step', shape)} = {name}")
            if _per_token(info) and info.ident not in written:
                written.append(info.ident)
    for out, name in scalars:
        if out in ctx.fn.written:
            continue
        for target in ctx.fn.direct.get(out, ()):
            inner.append(f"{_ref(target, idx, 'step', shape)} = {name}")
            ctx.fn.written.add(out)
            if _per_token(target) and target.ident not in written:
                written.append(target.ident)
        if out in ctx.fn.unbuffered:  # read from where it was stored, should anything ask
            ctx.values[out] = ctx.fn.direct[out][0]
    loops = _prefetching(ctx, loops, read, written)
    if before or after:
        inner = before + [loops[-1]] + ["    " + line for line in inner] + after
        loops = loops[:-1]
    ctx.lines += _nest(loops, inner)


# per-token arrays a step's loop writes from which it asks for the next
# sequence's rows ahead (``_prefetching``): W9's backward loop, which reads
# 5 per-token arrays and writes 6, runs faster with it; loops writing 2
# (W1's, W2's and W4's forward) run no faster, sometimes slower
_PREFETCH_MIN_WRITTEN = 3


def _prefetching(ctx, loops, read, written):
    """A step's loop nest over its sequences (``_loop_nest``) that writes
    ``_PREFETCH_MIN_WRITTEN`` per-token arrays or more, asking at each
    sequence for the next one's rows of the per-token arrays it reads
    (``read``) and writes (``written``): one call of
    ``numba_runtime.prefetch_rows`` on a table of their addresses and row
    strides made before the steps (one call, not one per array: each call
    site is code Numba and LLVM compile). Each of them is a row in another
    place for every sequence, and a row written is read first: such a loop
    stalls on its stores. Other loops as they are."""
    if "e = entries[b]" not in loops[:-1] or len(written) < _PREFETCH_MIN_WRITTEN:
        return loops
    at = loops.index("e = entries[b]") + 1
    rows = [ident for ident in read if ident not in written] + list(written)
    table = ctx.module.fresh("rows")
    entries = ", ".join(f"(np.int64({ident}.ctypes.data), {ident}.strides[0])" for ident in rows)
    ctx.fn.allocs.append(f"{table} = np.array(({entries},), np.int64)")
    reads = len(rows) - len(written)
    return loops[:at] + [f"prefetch_rows({table}, {reads}, entries, b + 1, nb)"] + loops[at:]


def _per_token(info):
    """Whether a step's loop reads or writes ``info`` at the rows of its
    sequences' tokens (row ``e``: a "global" array over the step's space)."""
    return info.kind == "global" and bool(info.var.shape) and info.var.shape[0] is None


def _fold(ctx, e, scalar, idx):
    """Start segment op ``e``'s result (one row per batch row, lines before
    the loop) and return the line folding ``scalar``, its operand at the
    loop's index ``idx``, into it."""
    out = e.outputs[0]
    combine, initial = registry.get(e.op).segment
    _note_segment(ctx, e)
    info = _new_array(ctx, out)
    start, _ = _loop_nest(out.shape, "step")
    dst = _ref(info, idx, "step", out.shape)
    ctx.lines += _nest(start, [f"{dst} = {ctx.module.literal(initial, out.dtype)}"])
    return [f"{dst} = {combine.format(acc=dst, x=scalar)}"]


def _emit_nested(ctx, inner):
    """A nested rnn called once per step on the active rows' sub-sequences."""
    e = inner.eqn
    level = ctx.values[ir.rnn_parts(e)[0][0]].levels[0]
    starts, lens = ctx.module.fresh("st"), ctx.module.fresh("ln")
    ctx.fn.allocs.append(f"{starts} = np.empty(num_seq, np.int64)")
    ctx.fn.allocs.append(f"{lens} = np.empty(num_seq, np.int64)")
    ctx.lines += _nest(["for b in range(nb):"], [
        f"{starts}[b] = {level}[entries[b]]",
        f"{lens}[b] = {level}[entries[b] + 1] - {level}[entries[b]]",
    ])
    _hoist(ctx.at("hoist", ctx.module.prologue), inner)
    _rnn_call(ctx, inner, f"{starts}[:nb]", f"{lens}[:nb]", "nb")


def _width(var):
    return var.shape[-1] if len(var.shape) > 0 and var.shape[-1] is not None else None


def _shape(lead, rest) -> str:
    """A shape tuple's code: ``(lead, d1, d2)``."""
    return "(" + ", ".join([str(lead)] + [str(d) for d in rest]) + ("," if not rest else "") + ")"


def _row_assign(dst, dst_row, src, src_row, row_shape, src_shape=None):
    """``dst[dst_row] = src[src_row]`` for every sequence b, element by element
    (row assignment compiles slowly in Numba). ``src_row=None``: ``src`` has no
    batch axis and broadcasts (``src_shape``), or is a scalar (``()``)."""
    idx = [f"i{d}" for d in range(len(row_shape))]
    loops = ["for b in range(num_seq):"] + [
        f"for {i} in range({n}):" for i, n in zip(idx, row_shape)
    ]
    dst_ref = f"{dst}[{', '.join([dst_row] + idx)}]"
    if src_row is not None:
        src_ref = f"{src}[{', '.join([src_row] + idx)}]"
    elif src_shape is None:
        src_ref = src  # a scalar
    elif src_shape == ():
        src_ref = f"{src}[()]"
    else:
        lead = len(row_shape) - len(src_shape)
        parts = ["0" if n == 1 and row_shape[lead + d] != 1 else idx[lead + d]
                 for d, n in enumerate(src_shape)]
        src_ref = f"{src}[{', '.join(parts)}]"
    return _nest(loops, [f"{dst_ref} = {src_ref}"])


def _nest(head, body):
    """Nest ``body`` under ``head``: head lines ending in ':' open a block, the
    others are statements at the depth reached so far."""
    lines, depth = [], 0
    for line in head:
        lines.append("    " * depth + line)
        if line.endswith(":"):
            depth += 1
    return lines + ["    " * depth + line for line in body]


# Generated kernels are serial and release the GIL: parallelism comes from
# running groups of sequences on threads (NumbaProgram), not from parfors.
_DECORATOR = "@njit(cache=True, error_model='numpy', nogil=True, no_cfunc_wrapper=True)"
# an rnn function: called apart (stepnet.jit.apart) by program() and by
# other rnn functions, never from Python (it has no entry Python can call;
# neither has program() one for C, which nothing needs)
_RNN_DECORATOR = ("@njit(cache=True, error_model='numpy', nogil=True, no_cfunc_wrapper=True, "
                  "no_cpython_wrapper=True)")
# the first statement of each: LLVM vectorizes it with the CPU's widest
# vectors (atomics.wide_vectors: 512 bits on Intel's AVX-512 cores too)
_WIDE_VECTORS = "wide_vectors()"


