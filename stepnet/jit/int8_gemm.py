"""Quantized products for int8 inference: ``out = dequant(quant_rows(a) @ wq)``.

``quantize_rows`` quantizes each row of float32 activations symmetrically to
int8 with its own scale (``amax / 127``, rounded half to even, as NumPy's
``rint``); ``int8_sums`` multiplies such rows by int8 weights ``wq``
[k, n] quantized per column (``wscale``), summing exactly in int32, and
``int8_product`` writes ``float32(acc) * (scale[i] * wscale[j])`` (or a
kernel's run computes that as it reads the sums): the same bits as NumPy
computing that formula, whatever the path or the blocks (integer sums do not
depend on their order).

The product sums groups of k in one instruction (docs/quantization.md):
with VNNI four bytes (``vpdpbusd``: unsigned by signed, so each activation
goes in as ``q + 128`` and each column's sums start from minus its
*correction* ``128 * sum(wq[:, j])``; int32 sums wrap alike), else two
int16 (``pmaddwd``; ``vpmaddubsw``'s byte sums saturate).
``pack_int8`` lays the weights out as groups of ``_GROUP`` rows of k:
``[P, ceil(k / _GROUP) + 1, _GROUP * _WIDTH]``, panel p holding columns
``_WIDTH * p`` on, each group's weights of a column side by side (zeros past
k and n), then a row of the sums' starts (int32): one vector load
gives a group of ``_LANES`` columns; a panel is contiguous and 64-byte
aligned. A row's group of activations, one int32 (``_groups``), is broadcast
to every lane. A block of ``_ROWS`` rows x ``_WIDTH`` columns of int32 sums
lives in registers over a chunk of k (``_group_rows``: the loop written in
LLVM IR with the x86 intrinsic, which Numba's vectorized loops never give),
sized to the vector registers (with AVX2's 16: 2 rows x 5 vectors of sums,
5 of weights and one broadcast). Each chunk of a panel of weights
(``_CHUNK`` groups x ``_WIDTH`` columns, 20 KiB) stays in the first-level
cache while every row of a panel of ``_PANEL_ROWS`` rows passes over it,
their sums added up in memory (the caller's array) from one chunk to the
next.

With AMX (``amx-int8``, in a process Linux lets use the tiles:
``own_loop.compiled_features``), a product of ``_TILE_LEAST`` rows or more
runs on the tiles instead (``_tile_sums``): blocks of 32 rows x 32 columns,
four tiles of sums (loaded with the starts) over steps of 16 groups, reading the same packed panels
(a group's row of a panel is a tile's row: 16 columns x 4 bytes) and the
same ``q + 128`` activations, k padded to whole tiles (``_ROUND``); bf16
products likewise (``tdpbf16ps``, with ``amx-bf16``).

The path is chosen when the module is compiled, from the CPU Numba compiles
for (the host, or ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``): AMX (above),
VNNI (AVX-512 or AVX-VNNI), AVX-512BW, AVX2, else plain loops over pairs
(``_pair_loops``); ``int8_path`` names it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cache  # noqa: F401  (Numba's cache of these helpers goes under STEPNET_CACHE_DIR)
from .atomics import pointer_to, wide_vectors
from .own_loop import aligned_empty, compiled_features

def _choose_path(features) -> tuple:
    """``(name, lanes, group, intrinsic)``: the path for ``features``, the
    int32 lanes of its vectors, the rows of k it sums at once and its LLVM
    intrinsic (None: plain loops), its operands as <N x i32> (LLVM upgrades
    that older form where it now names bytes or words)."""
    if "avx512bw" in features:
        if "avx512vnni" in features:
            return "avx512-vnni vpdpbusd", 16, 4, "llvm.x86.avx512.vpdpbusd.512"
        return "avx512bw vpmaddwd", 16, 2, "llvm.x86.avx512.pmaddw.d.512"
    if "avx2" in features:
        if "avxvnni" in features:
            return "avx-vnni vpdpbusd", 8, 4, "llvm.x86.avx512.vpdpbusd.256"
        return "avx2 vpmaddwd", 8, 2, "llvm.x86.avx2.pmadd.wd"
    return "portable loop", 8, 2, None


_FEATURES = compiled_features()
_PATH, _LANES, _GROUP, _INTRINSIC = _choose_path(_FEATURES)
_VNNI = _GROUP == 4
# AMX: blocks of _TILE_ROWS rows x 32 columns in four tiles of 16 x 16 sums,
# each step over 16 groups of k (a tile of activations: 16 rows x 64
# bytes); the groups of a row of activations and of a panel of weights
# padded to _ROUND (zeros: they add nothing)
_AMX = _VNNI and _LANES == 16 and "amx-int8" in _FEATURES
_ROUND = 16 if _AMX else 1
_TILE_ROWS = 32
# the fewest rows a product gives AMX: a tile's step takes as long for one
# row as for 16, and configuring the tiles costs about a microsecond: the
# vector loop is the faster below about 8 rows
_TILE_LEAST = 8
# the packed weights' elements: a group's weights of a column as 4 bytes or 2 int16
_PACKED = np.int8 if _VNNI else np.int16
# a block of sums: _ROWS rows x _VECS vectors (of _LANES int32 columns).
# AVX2's 16 registers hold 2 x 5 sums, 5 vectors of weights and a
# broadcast: the fewest broadcasts and adds per pmaddwd that fit (they,
# not the multiplies, bound the loop; 6 x 2 and 2 x 4 ran slower); AVX-512's
# 32 hold 4 x 4 sums, their weights, a broadcast and the products
_ROWS = 4 if _LANES == 16 else 2
_VECS = 4 if _LANES == 16 else 5
# the columns of a panel of packed weights (a block's)
_WIDTH = _VECS * _LANES
# the elements of a row of a panel (a group of k for each column: 4 bytes)
_GROUP_WIDTH = _GROUP * _WIDTH
# the groups of k a block sums at a time: a chunk of a panel of weights
# (_CHUNK x _WIDTH groups of 4 bytes, 20 KiB) stays in the first-level cache
_CHUNK = 20480 // (4 * _WIDTH)
# the rows of activations whose groups (``_groups``) are made at once, each
# panel of weights passing over all of them
_PANEL_ROWS = 96

# bf16 products by ``vdpbf16ps`` (pairs of bfloat16 multiplied exactly, added
# to float32 sums): on AVX-512 CPUs with AVX512_BF16
BF16 = "avx512bf16" in _FEATURES and _LANES == 16
# ... or by AMX's ``tdpbf16ps`` (its tiles laid out as int8's)
_AMX_BF16 = _AMX and "amx-bf16" in _FEATURES


def int8_path() -> str:
    """The path compiled for the products (``"avx2 vpmaddwd"``,
    ``"avx512-vnni vpdpbusd"``, ``"portable loop"``, ...)."""
    return f"amx tdpbusd ({_TILE_LEAST} rows and more), else {_PATH}" if _AMX else _PATH


def bf16_path() -> str:
    """The path compiled for bf16 products, or what runs them without one."""
    vector = "avx512-bf16 vdpbf16ps" if BF16 else None
    if _AMX_BF16:
        return f"amx tdpbf16ps ({_TILE_LEAST} rows and more), else {vector}"
    return vector or "float32 products of bf16-rounded values (no bf16 instructions used)"


# LLVM's attribute for the widest vectors it must keep whole in a function
_LEGAL_WIDTH = '"min-legal-vector-width"="512"'


def _rows_codegen(name, group, sum_type):
    """``_group_rows``'s code: int32 sums of the path's groups, or float32
    (``sum_type``) of bfloat16 pairs; ``name`` the intrinsic. A switch on the
    rows (1 to ``_ROWS``), each case the loop over the groups with its sums
    in registers, from ``acc`` (or the starts) before it, to ``acc`` after."""
    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vec32, vec16 = ir.VectorType(i32, _LANES), ir.VectorType(ir.IntType(16), 2 * _LANES)
        vsum = ir.VectorType(sum_type, _LANES)
        fused = "pmadd" not in name  # (vpdpbusd, vdpbf16ps: the products added to the sums)
        rows, w0, a0, stride, groups, acc0, acc_stride, begin, fresh = (context.cast(
            builder, args[i], signature.args[i], types.int64) for i in (0, 2, 4, 5, 6, 8, 9, 10, 11))
        fresh = builder.trunc(fresh, ir.IntType(1))
        w = context.make_array(signature.args[1])(context, builder, args[1]).data
        starts = builder.bitcast(builder.gep(w, [begin]), vsum.as_pointer())
        a = builder.bitcast(context.make_array(signature.args[3])(context, builder, args[3]).data,
                            i32.as_pointer())
        acc = builder.gep(context.make_array(signature.args[7])(context, builder, args[7]).data, [acc0])
        offsets = [builder.add(builder.mul(acc_stride, ir.Constant(i64, r)), ir.Constant(
            i64, v * _LANES)) for r in range(_ROWS) for v in range(_VECS)]
        intrinsic = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            vsum, [vsum, vec32, vec32] if fused else [vec16, vec16]), name)
        if _LANES == 16:  # (else LLVM splits the 512-bit vectors where it prefers 256-bit ones)
            set.add(builder.function.attributes, _LEGAL_WIDTH)
        mask = ir.Constant(ir.VectorType(i32, _LANES), None)
        done = builder.append_basic_block("q8.done")
        switch = builder.switch(rows, done)
        for count in range(1, _ROWS + 1):
            start = builder.append_basic_block(f"q8.rows{count}")
            switch.add_case(ir.Constant(i64, count), start)
            loop = builder.append_basic_block(f"q8.loop{count}")
            tail = builder.append_basic_block(f"q8.store{count}")
            builder.position_at_end(start)
            first = [builder.load(builder.bitcast(builder.gep(acc, [offsets[index]]),
                                                  vsum.as_pointer()), align=4)
                     for index in range(count * _VECS)]
            first = [builder.select(fresh, builder.load(builder.gep(starts, [ir.Constant(
                i64, index % _VECS)]), align=4), x) for index, x in enumerate(first)]
            builder.cbranch(builder.icmp_signed(">", groups, ir.Constant(i64, 0)), loop, tail)
            builder.position_at_end(loop)
            t = builder.phi(i64)
            t.add_incoming(ir.Constant(i64, 0), start)
            sums = [builder.phi(vsum) for _ in range(count * _VECS)]
            for s, value in zip(sums, first, strict=True):
                s.add_incoming(value, start)
            row = builder.add(w0, builder.mul(t, ir.Constant(i64, group * _WIDTH)))
            weights = [builder.load(builder.bitcast(builder.gep(w, [builder.add(row, ir.Constant(
                i64, group * _LANES * v))]), vec32.as_pointer()), align=1) for v in range(_VECS)]
            new = []
            for r in range(count):
                x = builder.load(builder.gep(a, [builder.add(builder.add(a0, t), ir.Constant(
                    i64, 0) if r == 0 else builder.mul(stride, ir.Constant(i64, r)))]), align=4)
                x = builder.shuffle_vector(builder.insert_element(ir.Constant(vec32, ir.Undefined), x,
                                                                  ir.Constant(i32, 0)),
                                           ir.Constant(vec32, ir.Undefined), mask)
                if fused:  # (VNNI: unsigned activations, signed weights)
                    new += [builder.call(intrinsic, [sums[r * _VECS + v], x, weights[v]])
                            for v in range(_VECS)]
                else:
                    x = builder.bitcast(x, vec16)
                    new += [builder.add(sums[r * _VECS + v], builder.call(
                        intrinsic, [x, builder.bitcast(weights[v], vec16)])) for v in range(_VECS)]
            following = builder.add(t, ir.Constant(i64, 1))
            t.add_incoming(following, loop)
            for s, value in zip(sums, new, strict=True):
                s.add_incoming(value, loop)
            builder.cbranch(builder.icmp_signed("<", following, groups), loop, tail)
            builder.position_at_end(tail)
            values = [builder.phi(vsum) for _ in new]
            for index, value in enumerate(values):
                value.add_incoming(first[index], start)
                value.add_incoming(new[index], loop)
            for index, value in enumerate(values):
                target = builder.gep(acc, [offsets[index]])
                builder.store(value, builder.bitcast(target, vsum.as_pointer()), align=4)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return codegen


@intrinsic
def _group_rows(typingctx, rows, w, w0, a, a0, stride, groups, acc, acc0, acc_stride, begin, fresh):
    """acc[acc0:acc0 + rows * _WIDTH] += the sums of ``rows`` rows (1 to
    ``_ROWS``) of ``groups`` groups of activations ``a`` (int32, flat: row
    r's from ``a0 + r * stride``) by as many rows of groups of a panel of
    packed weights ``w`` (flat) from ``w0``: row r's sums of the panel's
    column c at ``acc[acc0 + r * acc_stride + c]`` (where ``fresh``, from the
    panel's starts: its row of _WIDTH sums at ``w[begin]``); int32
    sums of the path's groups, or float32 sums of bfloat16 pairs (``vdpbf16ps``)."""
    if not all(isinstance(x, types.Array) for x in (w, a, acc)) or a.dtype != types.int32:
        return None
    signature = types.void(rows, w, w0, a, a0, stride, groups, acc, acc0, acc_stride, begin, fresh)
    if w.dtype == types.uint16 and acc.dtype == types.float32:
        return signature, _rows_codegen("llvm.x86.avx512bf16.dpbf16ps.512", 2, ir.FloatType())
    if w.dtype == (types.int8 if _VNNI else types.int16) and acc.dtype == types.int32:
        return signature, _rows_codegen(_INTRINSIC, _GROUP, ir.IntType(32))
    return None


def _tile_call(builder, name, *args):
    """A call of AMX's intrinsic ``name`` (its tiles named by i8 constants)."""
    args = [ir.Constant(ir.IntType(8), a) if isinstance(a, int) else a for a in args]
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name)
    builder.call(function, args)


@intrinsic
def _tiles(typingctx, on):
    """AMX's tiles configured (``on``: tiles 0 to 7 of 16 rows x 64 bytes)
    or released. A thread's configuration is its own."""
    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        on, off = builder.append_basic_block("tiles.on"), builder.append_basic_block("tiles.off")
        done = builder.append_basic_block("tiles.done")
        builder.cbranch(builder.trunc(args[0], ir.IntType(1)), on, off)
        builder.position_at_end(on)
        config = [1] + [0] * 15 + [64, 0] * 8 + [0] * 16 + [16] * 8 + [0] * 8  # (palette 1)
        slot = cgutils.alloca_once(builder, ir.ArrayType(i8, 64))
        builder.store(ir.Constant(ir.ArrayType(i8, 64), [ir.Constant(i8, b) for b in config]), slot)
        _tile_call(builder, "llvm.x86.ldtilecfg", builder.bitcast(slot, i8.as_pointer()))
        builder.branch(done)
        builder.position_at_end(off)
        _tile_call(builder, "llvm.x86.tilerelease")
        builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(on), codegen


def _address(context, builder, array_type, array, offset):
    """The address of element ``offset`` of a 1-D array, as an i8 pointer."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), ir.IntType(8).as_pointer())


@intrinsic
def _tile_block(typingctx, w, w0, a, a0, stride, steps, acc, acc0, acc_stride, begin):
    """acc[acc0 + acc_stride r + c] = the sums of ``_TILE_ROWS`` rows r of
    ``16 * steps`` groups of activations ``a`` (int32, flat: row r's from
    ``a0 + r * stride``) by 32 columns c of a panel of packed weights ``w``
    (flat, from ``w0``, 4 bytes a column a group), from the columns' starts
    (at ``w[begin]``, a row read 16 times: stride 0): int32 sums of int8 groups
    (``tdpbusd``), or float32 sums of bfloat16 pairs (``tdpbf16ps``); tiles
    0-3 the sums, 4-5 the activations, 6-7 the weights (``_tiles``
    configures them)."""
    if not all(isinstance(x, types.Array) for x in (w, a, acc)) or a.dtype != types.int32 or (
            {types.int32: types.int8, types.float32: types.uint16}.get(acc.dtype) != w.dtype):
        return None
    name = {types.int32: "llvm.x86.tdpbusd", types.float32: "llvm.x86.tdpbf16ps"}[acc.dtype]

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        w, a, acc = args[0], args[2], args[6]
        w0, a0, stride, steps, acc0, acc_stride, begin = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 3, 4, 5, 7, 8, 9))
        row_bytes = builder.mul(stride, ir.Constant(i64, 4))
        w_row = ir.Constant(i64, 4 * _WIDTH)  # (a group's 4 bytes for each column)
        starts = _address(context, builder, signature.args[0], w, begin)
        for tile in range(4):
            _tile_call(builder, "llvm.x86.tileloadd64", tile,
                       builder.gep(starts, [ir.Constant(i64, 64 * (tile % 2))]), ir.Constant(i64, 0))
        start = builder.block
        loop, done = builder.append_basic_block("tiles.loop"), builder.append_basic_block("tiles.done")
        builder.cbranch(builder.icmp_signed(">", steps, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        t = builder.phi(i64)
        t.add_incoming(ir.Constant(i64, 0), start)
        x = _address(context, builder, signature.args[2], a, builder.add(a0, builder.mul(
            t, ir.Constant(i64, 16))))
        y = _address(context, builder, signature.args[0], w, builder.add(w0, builder.mul(
            t, ir.Constant(i64, 16 * 4 * _WIDTH * 8 // signature.args[0].dtype.bitwidth))))
        _tile_call(builder, "llvm.x86.tileloadd64", 4, x, row_bytes)
        _tile_call(builder, "llvm.x86.tileloadd64", 5, builder.gep(x, [builder.mul(
            row_bytes, ir.Constant(i64, 16))]), row_bytes)
        _tile_call(builder, "llvm.x86.tileloadd64", 6, y, w_row)
        _tile_call(builder, "llvm.x86.tileloadd64", 7, builder.gep(y, [ir.Constant(i64, 64)]), w_row)
        for tile, rows, columns in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)):
            _tile_call(builder, name, tile, rows, columns)
        following = builder.add(t, ir.Constant(i64, 1))
        t.add_incoming(following, loop)
        builder.cbranch(builder.icmp_signed("<", following, steps), loop, done)
        builder.position_at_end(done)
        out = _address(context, builder, signature.args[6], acc, acc0)
        out_row = builder.mul(acc_stride, ir.Constant(i64, 4))
        for tile in range(4):  # (tiles 2 and 3: rows 16 on; 1 and 3: columns 16 on)
            at = builder.add(builder.mul(out_row, ir.Constant(i64, 16 * (tile // 2))),
                             ir.Constant(i64, 64 * (tile % 2)))
            _tile_call(builder, "llvm.x86.tilestored64", tile, builder.gep(out, [at]), out_row)
        return context.get_dummy_value()

    return types.void(w, w0, a, a0, stride, steps, acc, acc0, acc_stride, begin), codegen


@njit(inline="always")
def _tile_sums(w, w0, a, groups, rows, acc, acc0, acc_stride):
    """acc[acc0 + r * acc_stride + c] = the sums of ``rows`` rows r of
    ``groups`` groups ``a`` (``a`` and ``acc`` hold whole blocks of
    ``_TILE_ROWS`` rows) by a panel's columns c of weights (``w`` from
    ``w0``), from its starts, by AMX's tiles."""
    line = 4 * _WIDTH // w.itemsize  # (a row of the panel)
    for i in range(0, rows, _TILE_ROWS):
        for half in range(2):
            right = half * 128 // w.itemsize
            _tile_block(w, w0 + right, a, i * groups, groups, groups // 16, acc,
                        acc0 + i * acc_stride + half * 32, acc_stride, w0 + groups * line + right)


@njit(inline="always")
def _pair_loops(rows, w, w0, a, a0, stride, pairs, acc, acc0, acc_stride, begin, fresh):
    """``_group_rows`` over pairs as plain loops (any CPU)."""
    starts = carray(pointer_to(w.ctypes.data + begin * w.itemsize, np.int32), _WIDTH)
    for r in range(rows if fresh else 0):
        acc[acc0 + r * acc_stride:acc0 + r * acc_stride + _WIDTH] = starts
    for t in range(pairs):
        row = w0 + t * _GROUP_WIDTH
        for r in range(rows):
            x = np.int64(a[a0 + r * stride + t])
            x0 = np.int32(((x & 0xFFFF) ^ 0x8000) - 0x8000)
            x1 = np.int32(x >> 16)
            at = acc0 + r * acc_stride
            for c in range(_WIDTH):
                acc[at + c] += x0 * np.int32(w[row + 2 * c]) + x1 * np.int32(w[row + 2 * c + 1])


_rows_block = _pair_loops if _INTRINSIC is None else _group_rows


@njit(cache=True, nogil=True)
def pack_int8(wq):
    """int8 weights ``wq`` [k, n] (C-contiguous) as ``int8_product``
    reads them: [P, G + 1, _GROUP * _WIDTH] of ``_PACKED``, P = ceil(n /
    _WIDTH) panels, G = ceil(k / _GROUP) groups (``_lay_out``); row G of
    panel p holds the int32 starts of its columns' sums: ``-128 * sum(wq[:,
    _WIDTH p + c])`` with VNNI (the correction), else zeros."""
    k, n = wq.shape
    groups = _padded(k, _GROUP)
    count = (n + _WIDTH - 1) // _WIDTH
    out = aligned_empty(count * (groups + 1) * _GROUP_WIDTH, np.empty(0, _PACKED)).reshape(
        (count, groups + 1, _GROUP_WIDTH))
    _lay_out(wq, _GROUP, out)
    for p in range(count if _VNNI else 0):
        starts = _starts(out, p, groups)
        for c in range(min(_WIDTH, n - p * _WIDTH)):
            starts[c] = np.int32(-128) * np.sum(wq[:, p * _WIDTH + c].astype(np.int32))
    return out


@njit(inline="always")
def _padded(k, group):
    """The groups of ``group`` rows of k a row of activations or a panel of
    weights holds: whole tiles' with AMX (``_ROUND``)."""
    return ((k + group - 1) // group + _ROUND - 1) // _ROUND * _ROUND


@njit(inline="always")
def _lay_out(w, group, out):
    """``out[p, t, group * c + h]`` = ``w[group * t + h, _WIDTH * p + c]``,
    zeros past w's rows and columns (and in out's rows past them)."""
    k, n = w.shape
    out[:] = 0
    for p in range(out.shape[0]):
        first = p * _WIDTH
        for kk in range(k):
            for c in range(min(_WIDTH, n - first)):
                out[p, kk // group, group * c + kk % group] = w[kk, first + c]


@njit(inline="always")
def _starts(packed, p, groups):
    """Panel p's starts of its sums (row ``groups``, as int32)."""
    at = packed.ctypes.data + (p * packed.shape[1] + groups) * _GROUP_WIDTH * packed.itemsize
    return carray(pointer_to(at, np.int32), _WIDTH)


@njit(inline="always")
def _groups(q, first, last, a, groups):
    """``a[(i - first) * groups + t]`` = q[i]'s group t as one int32 (the
    first of k in the low bits), for rows first:last: with VNNI four bytes
    ``q + 128`` (q's rows hold whole words), else two int16 (zeros past k);
    zeros in the groups past k's (AMX's padding)."""
    k = q.shape[1]
    for i in range(first, last):
        base = (i - first) * groups
        line = q[i]
        if _VNNI:  # (q + 128: each byte's top bit flipped; bytes past k meet zero weights)
            words = carray(pointer_to(q.ctypes.data + i * q.strides[0], np.int32), (k + 3) // 4)
            for t in range((k + 3) // 4):
                a[base + t] = words[t] ^ np.int32(-0x7F7F7F80)
            a[base + (k + 3) // 4:base + groups] = 0
        else:  # (a loop LLVM vectorizes)
            for t in range(k // 2):
                low = np.int32(line[2 * t]) & np.int32(0xFFFF)
                a[base + t] = np.int32(low | (np.int32(line[2 * t + 1]) << np.int32(16)))
            if k % 2:
                a[base + groups - 1] = np.int32(line[k - 1]) & np.int32(0xFFFF)


@njit(cache=True, nogil=True)
def int8_product(q, scale, packed, wscale, out):
    """out[:m] = q @ wq dequantized: float32(sums) * (scale[i] * wscale[j]),
    the product of the scales first, the int32 sums exact (``int8_sums``,
    ``packed`` = ``pack_int8(wq)``), by panels of ``_PANEL_ROWS`` rows."""
    m, n = q.shape[0], out.shape[1]
    assert m == 0 or n == 1 or out.strides[1] == 4
    sums = sums_buffer(min(m, _PANEL_ROWS), n)
    for first in range(0, m, _PANEL_ROWS):
        last = min(first + _PANEL_ROWS, m)
        int8_sums(q[first:last], packed, sums[:last - first])
        for i in range(first, last):
            line, row, s = _row(out, i, np.float32), sums[i - first], scale[i]
            for j in range(n):
                line[j] = np.float32(row[j]) * (s * wscale[j])


@njit(cache=True, nogil=True)
def int8_sums(q, packed, sums):
    """sums[i, j] = q[i] @ wq[:, j] (int32, exact), ``packed`` =
    ``pack_int8(wq)``, not dequantized: a caller computes ``float32(sums)
    * (scale[i] * wscale[j])`` where it reads them (``int8_product``, a
    kernel's elementwise run). ``sums``: int32 (``sums_buffer``), rows
    contiguous and holding whole panels (zeros past n). By panels of
    ``_PANEL_ROWS`` rows, their groups made once (``_groups``), then every
    panel of weights over them (``_panels``)."""
    wide_vectors()
    m, k = q.shape
    groups = _padded(k, _GROUP)
    stride = sums.strides[0] // 4
    assert m == 0 or sums.shape[1] >= packed.shape[0] * _WIDTH and (
        m == 1 or stride >= sums.shape[1]) and (
        not _VNNI or q.strides[1] == 1 and q.strides[0] >= 4 * ((k + 3) // 4))
    flat = carray(pointer_to(sums.ctypes.data, np.int32), max(m - 1, 0) * stride + sums.shape[1])
    most = min(m, _PANEL_ROWS)
    tiles = _AMX and m >= _TILE_LEAST  # (a constant False where the CPU has no AMX: pruned)
    if tiles:
        most = (most + _TILE_ROWS - 1) // _TILE_ROWS * _TILE_ROWS
        _tiles(True)
    a = np.empty(most * groups, np.int32)
    spare = np.empty(_TILE_ROWS * _WIDTH if tiles else 0, np.int32)
    for first in range(0, m, _PANEL_ROWS):
        last = min(first + _PANEL_ROWS, m)
        _groups(q, first, last, a, groups)
        _panels(_rows_block, packed, a, groups, last - first, tiles, flat, first * stride, stride,
                spare)
    if tiles:
        _tiles(False)


@njit(inline="always")
def _panels(block_sums, packed, a, groups, rows, tiles, acc, acc0, stride, spare):
    """acc[acc0 + r * stride + j] = the sums of ``rows`` rows r of groups
    ``a`` by every panel of ``packed`` (column j), from its starts: by
    ``block_sums`` (``_panel_sums``), or on AMX's tiles (``tiles``) by whole
    blocks of rows, a last part one into ``spare``, its rows then copied."""
    w, width, whole = packed.reshape(packed.size), packed.shape[2], rows // _TILE_ROWS * _TILE_ROWS
    for p in range(packed.shape[0]):
        w0, at = p * packed.shape[1] * width, acc0 + p * _WIDTH
        if not tiles:
            _panel_sums(block_sums, w, w0, width, a, groups, rows, acc, at, stride)
            continue
        _tile_sums(w, w0, a, groups, whole, acc, at, stride)
        if whole < rows:
            _tile_sums(w, w0, a[whole * groups:], groups, 1, spare, 0, _WIDTH)
            for r in range(rows - whole):
                row = at + (whole + r) * stride
                acc[row:row + _WIDTH] = spare[r * _WIDTH:(r + 1) * _WIDTH]


@njit(nogil=True)
def sums_buffer(rows, n):
    """An array for ``int8_sums``'s sums of ``rows`` rows by n columns of
    weights: int32 [rows, whole panels of columns and a cache line more],
    its rows on 64-byte boundaries (a block's row of sums is one cache
    line, not two), each row a line past 4 KiB from the one before (rows
    4 KiB apart fall into one set of the first-level cache, where the
    stores of a block of rows evict each other)."""
    width = (n + _WIDTH - 1) // _WIDTH * _WIDTH + 16
    return aligned_empty(rows * width, np.empty(0, np.int32)).reshape((rows, width))


@njit(inline="always")
def _panel_sums(block_sums, w, w0, width, a, groups, rows, acc, acc0, acc_stride):
    """acc[acc0 + r * acc_stride + c] = the sums of ``rows`` rows r of
    ``groups`` groups ``a`` by a panel's columns c of weights (``w`` from
    ``w0``, ``width`` elements a row, its starts' row after the groups) by
    ``block_sums``, ``_CHUNK`` groups at a time (the chunk stays in the
    first-level cache while the rows pass, the first's sums from the
    starts), ``_ROWS`` rows at a time."""
    for t0 in range(0, max(groups, 1), _CHUNK):  # (no groups: one pass, the starts alone)
        for i in range(0, rows, _ROWS):
            block_sums(min(_ROWS, rows - i), w, w0 + t0 * width, a, i * groups + t0, groups,
                       min(_CHUNK, groups - t0), acc, acc0 + i * acc_stride, acc_stride,
                       w0 + groups * width, t0 == 0)


@njit(inline="always")
def _row(x, i, dtype):
    """Row ``i`` of the 2-D array ``x`` (its elements contiguous, the rows
    possibly strided) as a C-contiguous 1-D array of ``dtype`` (of the same
    size): LLVM then vectorizes its loops without checking the stride."""
    return carray(pointer_to(x.ctypes.data + i * x.strides[0], dtype), x.shape[1])


# the bits of float32's infinity: the magnitudes' bits order as the
# magnitudes do, NaNs' above it
_INF_BITS = np.int32(0x7F800000)


@njit(cache=True, nogil=True, error_model="numpy")
def quantize_rows(a, q, scale):
    """Each row i of ``a`` (float32 [m, k], ``a.strides[1] == 4``) quantized
    symmetrically into ``q[i]`` (int8): ``scale[i]`` = amax / 127 (amax: the
    row's largest magnitude) in float32, q = clip(rint(a * (127 / amax)),
    -127, 127) in float64; a row of zeros gives zeros and a scale of 0, a row with
    an infinity or a NaN zeros and a scale of NaN. amax is the largest of
    the magnitudes' bits as integers (an integer maximum vectorizes, a
    float one that must keep NaNs does not)."""
    wide_vectors()
    m, k = a.shape
    assert m == 0 or k == 1 or a.strides[1] == 4
    top = np.float32(127)
    for i in range(m):
        bits = _row(a, i, np.int32)
        most = np.int32(0)
        for j in range(k):
            most = np.int32(max(most, np.int32(bits[j] & np.int32(0x7FFFFFFF))))
        line = q[i]
        if most >= _INF_BITS or most == 0:
            scale[i] = np.float32(0) if most == 0 else np.float32(np.nan)
            for j in range(k):
                line[j] = 0
            continue
        amax = np.int32(most).view(np.float32)
        scale[i] = amax / top
        inv = 127.0 / np.float64(amax)  # (in float64: 127 / amax overflows float32 below 4e-37)
        row = _row(a, i, np.float32)
        for j in range(k):
            x = np.rint(np.float64(row[j]) * inv)
            line[j] = np.int8(min(max(x, -127.0), 127.0))


@njit(cache=True, nogil=True)
def pack_bf16(bits):
    """bf16 weights (uint16 bits [k, n]) as ``bf16_product`` reads them:
    [P, ceil(k / 2) + 1, 2 * _WIDTH], pairs of k (``_lay_out``), then a
    row of the sums' starts (float32 zeros)."""
    k, n = bits.shape
    count, pairs = (n + _WIDTH - 1) // _WIDTH, _padded(k, 2)
    out = aligned_empty(count * (pairs + 1) * 2 * _WIDTH, np.empty(0, np.uint16)).reshape(
        (count, pairs + 1, 2 * _WIDTH))
    _lay_out(bits, 2, out)
    return out


@njit(inline="always")
def bf16_bits(bits):
    """float32 bits (uint32) rounded to bfloat16's (to nearest, ties to
    even; a NaN stays a NaN, made quiet), in the upper half."""
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        bits = bits | np.uint32(0x00400000)
    else:
        bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return bits & np.uint32(0xFFFF0000)


@njit(cache=True, nogil=True)
def bf16_product(a, packed, out):
    """out[:m] = a's elements rounded to bfloat16 (``bf16_bits``) @ the
    weights ``packed`` = ``pack_bf16(w)``, each pair of k multiplied exactly
    and added to float32 sums (``vdpbf16ps``: bfloat16 subnormals count as
    zeros), by panels of rows and ``_panels`` as ``int8_sums``, the float32
    sums in the rows of a ``sums_buffer``."""
    wide_vectors()
    m, k = a.shape
    n, pairs = out.shape[1], packed.shape[1] - 1  # (the pairs, then the starts' row)
    assert m == 0 or (k == 1 or a.strides[1] == 4) and (n == 1 or out.strides[1] == 4)
    most = min(m, _PANEL_ROWS)
    tiles = _AMX_BF16 and m >= _TILE_LEAST
    if tiles:
        most = (most + _TILE_ROWS - 1) // _TILE_ROWS * _TILE_ROWS
        _tiles(True)
    x = np.zeros(most * pairs, np.int32)  # (zeros: the pairs past k's)
    acc = sums_buffer(most, n).view(np.float32)
    spare = np.empty(_TILE_ROWS * _WIDTH if tiles else 0, np.float32)
    for first in range(0, m, _PANEL_ROWS):
        last = min(first + _PANEL_ROWS, m)
        for i in range(first, last):  # (two rounded values to an int32, the first low)
            row = _row(a, i, np.uint32)
            for t in range((k + 1) // 2):
                high = bf16_bits(row[2 * t + 1]) if 2 * t + 1 < k else np.uint32(0)
                x[(i - first) * pairs + t] = np.int32((bf16_bits(row[2 * t]) >> 16) | high)
        _panels(_group_rows, packed, x, pairs, last - first, tiles, acc.reshape(acc.size), 0,
                acc.shape[1], spare)
        for i in range(first, last):
            line, sums = _row(out, i, np.float32), acc[i - first]
            for j in range(n):
                line[j] = sums[j]
    if tiles:
        _tiles(False)
