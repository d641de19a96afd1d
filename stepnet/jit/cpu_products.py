"""The products the Numba backend's code generator writes: ``a @ W`` before
the time loop (one BLAS call over every token, or a sum of products for a
concat's parts) and in a time step (on weights packed once per call), the
weights joined by columns for merged products, and the input products run by
chunks of steps inside an rnn function (``KernelPlan.chunked``), each chunk
possibly computed ahead by the helper thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ir
from . import quantized
from .cpu_emit import _Info, _contiguous, _new_array, _operand, _segments

# rows of a product run by chunks of steps (``KernelPlan.chunked``): a
# chunk is this many rows of the group's sequences' steps (or one step of
# more sequences)
_CHUNK_ROWS = 128


@dataclass(frozen=True)
class _Chunk:
    """A hoisted product the top-level rnn function computes per chunk of
    steps: ``left`` rows (its info) times packed weights ``packed`` [k, n]
    into ``ring`` (``b * chunk + cs``: sequence b's row at step cs of the
    chunk), from the left rows gathered into ``gathered``; a quantized one
    by its ``routine`` (``packed``: its prepared weights), an int8 one whose
    readers dequantize it (``KernelPlan.dequantized``) into int32 sums, its
    rows' scales into ``scale``."""

    left: _Info
    packed: str
    k: int
    n: int
    dtype: str
    ring: str
    gathered: str
    routine: str | None = None
    scale: str | None = None


def _defer_product(ctx, sched, stage):
    """Record the product ``stage`` for the rnn function of ``sched``, which
    computes it per chunk of steps (``KernelPlan.chunked``); its weights are
    packed once here, in the prologue (a quantized one's by the caller)."""
    module = ctx.module
    dtype = np.dtype(stage.eqns[0].outputs[0].dtype).name
    k, n = stage.left.shape[-1], sum(v.shape[-1] for v in stage.outputs)
    routine = scale = None
    if stage.kind == "quantized":
        routine, packed = _quantized_weights(ctx, stage)
        if stage in module.plan.dequantized[sched]:
            routine, dtype, scale = "int8_row_sums", "int32", module.fresh("rs")
    else:
        _count_product(module, dtype, k, n)
        packed = module.fresh("wc")
        module.prologue.append(f"{packed} = pack(as_read_only({_product_weights(ctx, stage)}), "
                               f"max(max_rows, {_CHUNK_ROWS}), call_rows, small_rows, board)")
        module.gargs.append(packed)
    chunk = _Chunk(ctx.values[stage.left], packed, k, n, dtype, module.fresh("ring"),
                   module.fresh("gathered"), routine, scale)
    module.chunks.setdefault(sched.body, []).append(chunk)
    sums = None if scale is None else _read_dequantized(scale, packed)
    _column_blocks(ctx, stage, _Info("chunk", chunk.ring, width=None if sums else n, sums=sums))


def _chunk_setup(chunks, ahead):
    """The rnn function's chunk length and buffers for ``chunks`` (``ahead``:
    the first one's product is computed a chunk ahead, ``_chunk_products``)."""
    def buffers(c, ring, gathered):
        made = (f"np.empty((num_seq * chunk, {c.n}), np.{c.dtype})" if c.scale is None
                else f"sums_buffer(num_seq * chunk, {c.n})")
        left = np.dtype(c.left.var.dtype).name
        return [f"{ring} = {made}",
                # (rows past a sequence's end keep what they held: zeros at first)
                f"{gathered} = np.zeros((num_seq * chunk, {c.k}), np.{left})"]

    lines = [f"chunk = max(1, min(num_steps, {_CHUNK_ROWS} // max(num_seq, 1)))"]
    for c in chunks:
        lines += buffers(c, c.ring, c.gathered)
        if c.scale is not None:
            lines.append(f"{c.scale} = np.empty(num_seq * chunk, np.float32)")
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
    alone = " and ".join(f"{packed}[5][SHARES] & COLUMNS == 0" for packed in module.packed.values()
                         if packed not in module.prepared)  # (not a quantized product's)
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
        gather = (f"{c.left.ident}, {c.left.offset}, sstart, slen, row_step, step, chunk, nb, "
                  f"{reverse}, {c.gathered}")
        arguments = f"{gather}, {c.packed}, {c.ring}"
        if c.routine is not None:  # (a quantized product)
            scale = "" if c.scale is None else f", {c.scale}[:nb * chunk]"
            lines += [f"    gather_steps({gather})",
                      f"    {c.routine}({c.gathered}[:nb * chunk], {c.packed}, {c.ring}[:nb * chunk]"
                      f"{scale})"]
            continue
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
    for i, part in enumerate(parts):
        left, row, k = _contiguous(ctx, ctx.values[part]), sum(p.shape[-1] for p in parts[:i]), part.shape[-1]
        _count_product(ctx.module, out.dtype, k, out.shape[-1])
        call = "gemm_hoisted_acc" if i else "gemm_hoisted"
        ctx.lines.append(_hoisted_product(call, left, f"{weights}[{row}:{row + k}]", info.ident))


def _rows_by_weights(ctx, e):
    """A hoisted matmul of rows of a nested net's every step (all its level's
    rows, one after another) by weights as one BLAS call over them; False
    for any other op."""
    if ctx.mode != "hoist" or e.op != "matmul":
        return False
    left, weights, out = _operand(ctx, e.inputs[0], None), ctx.values.get(e.inputs[1]), e.outputs[0]
    if not (left.kind == "rows" and left.whole and weights is not None and weights.kind == "const"
            and len(e.inputs[0].shape) == len(e.inputs[1].shape) == 2):
        return False
    _segments(ctx)[out] = left.segment
    info = _new_array(ctx, out)
    rows = f"{left.segment.level}[0]:{left.segment.level}[-1]"
    _count_product(ctx.module, out.dtype, *e.inputs[1].shape)
    ctx.lines.append(_hoisted_product("gemm_hoisted", f"{left.ident}[{rows}]", weights.ident,
                                      f"{info.ident}[{rows}]"))
    return True


def _render_gemm(ctx, sched, stage):
    """``a @ W`` as one BLAS call; a merged stage multiplies by the weights
    joined by columns and each result is a column block of its output."""
    dtype = stage.eqns[0].outputs[0].dtype
    weights = _product_weights(ctx, stage)
    _product_into(ctx, stage, dtype, lambda left, info: _gemm_call(
        ctx, left, weights, info, stage.left.shape[-1], info.var.shape[-1], dtype))


def _product_into(ctx, stage, dtype, call):
    """A product stage's result array (a merged stage's results its column
    blocks), and the line ``call(left, info)`` computing it from the left
    operand's contiguous rows."""
    ai = ctx.values[stage.left]
    if stage.merged:
        out = ir.Var("merged", dtype, (None, sum(v.shape[-1] for v in stage.outputs)))
    else:
        out = stage.eqns[0].outputs[0]
    left = _contiguous(ctx, ai)
    info = _new_array(ctx, out, size=ai.size)
    ctx.lines.append(call(left, info))
    if stage.merged:
        _column_blocks(ctx, stage, info)


def _render_quantized(ctx, sched, stage):
    """A quantized product (``matmul_int8``, ``matmul_bf16``): its routine
    over the step's rows, or over every token before the time loop; an int8
    one whose readers dequantize it (``KernelPlan.dequantized``) into int32
    sums and its rows' scales (``int8_row_sums``)."""
    rows, prepared = _quantized_weights(ctx, stage)
    step = "[:nb]" if ctx.mode == "step" else ""
    if stage not in ctx.module.plan.dequantized[sched]:
        _product_into(ctx, stage, np.float32,
                      lambda left, info: f"{rows}({left}, {prepared}, {info.ident}{step})")
        return
    module, size = ctx.module, ctx.values[stage.left].size
    sums, scale = module.fresh("s"), module.fresh("rs")
    rows = size if ctx.mode == "hoist" else "num_seq"
    lines = [f"{sums} = sums_buffer({rows}, {sum(v.shape[-1] for v in stage.outputs)})",
             f"{scale} = np.empty({rows}, np.float32)"]
    if ctx.mode == "hoist":
        ctx.lines += lines
        module.gargs += [sums, scale]
    else:
        ctx.fn.allocs += lines
    left = _contiguous(ctx, ctx.values[stage.left])
    ctx.lines.append(f"int8_row_sums({left}, {prepared}, {sums}{step}, {scale}{step})")
    _column_blocks(ctx, stage, _Info("global" if ctx.mode == "hoist" else "local", sums, size=size,
                                     sums=_read_dequantized(scale, prepared)))


def _read_dequantized(scale, prepared):
    """An ``_Info``'s ``sums``: int32 sums read dequantized, by the code of
    their rows' ``scale`` and of ``prepared`` int8 weights' columns' scales
    (``int8_prepare``)."""
    return scale, f"{prepared}[1]"


def _quantized_weights(ctx, stage):
    """A quantized product's routine and its weights, always the program's
    constants (``sn.quantize`` makes them), prepared by the caller (joined
    by columns for a merged stage, kept while the same arrays come:
    ``quantized.prepared``)."""
    module = ctx.module
    op = stage.eqns[0].op
    _count_product(module, None, stage.left.shape[-1], sum(v.shape[-1] for v in stage.outputs))
    operands = [[ctx.values[e.inputs[i]].ident for e in stage.eqns]
                for i in range(1, len(stage.eqns[0].inputs))]
    key = f"{op}{operands}"
    prepared = module.packed.get(key)
    if prepared is None:
        prepared = module.packed[key] = module.fresh("wq")
        module.prepared[prepared] = (op, [[module.const_vars[i] for i in parts] for parts in operands])
        module.gargs.append(prepared)
    return quantized.ROUTINES[op][1].__name__, prepared  # (a kernel calls it apart by its name)


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
                                size=info.size, sums=info.sums)
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
    """Note a product by weights [k, n] (the largest: ``plan.shares``) of
    ``dtype`` (small_gemm's entries to link; None: a quantized product)."""
    if dtype is not None:
        module.small_gemm_dtypes.add(np.dtype(dtype).name)
    module.largest_weights = max(module.largest_weights, k * n)
