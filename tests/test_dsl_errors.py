"""Definition and binding errors of the DSL (DESIGN.md §2 and §8).

Each test checks the exception class and that the message says what is wrong.
"""

import numpy as np
import pytest

import stepnet as sn
from stepnet.errors import Error, ShapeError, StepNetError

RNG = np.random.default_rng(0)
X = sn.LoDTensor.from_lengths(RNG.standard_normal((8, 3)), [[3, 0, 1, 4]])
W = sn.Parameter(RNG.standard_normal((3, 4)), name="W")


def elman(X=X, init=None, name="h"):
    """A small valid step-net; ``init`` defaults to zeros of shape [4]."""
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=init, shape=None if init is not None else [4], name=name)
        h.update(sn.ops.tanh(x @ W + h.pre_state()))
        rnn.add_outputs(h)
    return rnn


def chapters(lengths, seed=0):
    data = np.random.default_rng(seed).standard_normal((sum(lengths[-1]), 3))
    return sn.LoDTensor.from_lengths(data, lengths)


def two_nested_inputs(A, B):
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        a = rnn.add_input(A, name="A")
        b = rnn.add_input(B, name="B")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            u = inner.add_input(a, name="u")
            v = inner.add_input(b, name="v")
            inner.add_outputs(u + v)
        rnn.add_outputs(inner(output_all_steps=False))
    return rnn


def test_error_classes():
    assert issubclass(Error, ValueError)
    assert issubclass(ShapeError, StepNetError) and issubclass(StepNetError, Error)
    assert sn.StepNetError is StepNetError and sn.ShapeError is ShapeError


# -- memories ----------------------------------------------------------------


def test_memory_never_updated():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="memory 'state' is never updated"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        rnn.add_memory(shape=[3], name="state")
        rnn.add_outputs(x)


def test_memory_updated_twice():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="memory 'state' is updated twice"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3], name="state")
        h.update(x)
        h.update(x * 2.0)


@pytest.mark.parametrize("use", [lambda h, x: h + x, lambda h, x: sn.ops.tanh(h),
                                 lambda h, x: x @ np.eye(3) * h])
def test_memory_used_before_update_says_pre_state(use):
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"'state' is used before its update; "
                                          r"use state\.pre_state\(\)"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3], name="state")
        h.update(use(h, x))


def test_memory_update_with_wrong_shape():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=r"memory 'state'.*f64\[B,4\].*f64\[B,3\]"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3], name="state")
        h.update(x @ W)


def test_memory_update_with_wrong_dtype():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match="memory 'state': update has dtype float64 but the "
                                        "memory is float32"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3], name="state", dtype=np.float32)
        h.update(x)


def test_memory_needs_init_or_shape():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"give init= or shape="),
        rnn.stepnet(),
    ):
        rnn.add_input(X)
        rnn.add_memory(name="state")


def test_memory_init_of_the_wrong_shape():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=r"fits neither \[num_sequences, 4\] nor \[4\]"),
        rnn.stepnet(),
    ):
        rnn.add_input(X)
        rnn.add_memory(init=np.zeros((4, 5)), shape=[4], name="state")


def test_per_sequence_init_with_the_wrong_number_of_rows():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=r"add_memory\(state\): init has 3 rows \(one per "
                                        r"sequence\) but the step inputs have 4 sequences"),
        rnn.stepnet(),
    ):
        rnn.add_input(X)
        rnn.add_memory(init=np.zeros((3, 4)), shape=[4], name="state")


def elman_with_shape(shape):
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=shape, name="h")
        h.update(sn.ops.tanh(x @ W + h.pre_state()))
        rnn.add_outputs(h)
    return rnn


@pytest.mark.parametrize("shape", [4, np.int64(4), np.array(4)])
def test_memory_shape_given_as_an_int_is_one_dimensional(shape):
    got = elman_with_shape(shape)(backend="interpreter")
    want = elman_with_shape([4])(backend="interpreter")
    assert got.data.shape == (8, 4)
    np.testing.assert_array_equal(got.data, want.data)
    assert got.lod == want.lod


@pytest.mark.parametrize("shape", [-1, [4, -2], [2.5], 4.0, True, [True], "4", [[4]]])
def test_memory_shape_that_is_not_ints(shape):
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"add_memory\(state\): shape must be an int or a "
                                          r"sequence of non-negative ints, got "),
        rnn.stepnet(),
    ):
        rnn.add_input(X)
        rnn.add_memory(shape=shape, name="state")


# -- ops -----------------------------------------------------------------------


def test_matmul_shape_mismatch_names_op_and_shapes():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=r"matmul.*f64\[B,3\].*f32\[5,2\]"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        x @ np.ones((5, 2), np.float32)


def test_add_shape_mismatch_names_op_and_shapes():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=r"add.*f64\[B,3\].*f64\[5\]"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        x + np.ones(5)


@pytest.mark.parametrize("count", [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a / b,
                                   lambda a, b: sn.ops.sum(a, axis=-1)])
def test_masks_are_not_counted_by_arithmetic(count):
    """NumPy adds masks as an or, sums them as integers, and refuses to
    subtract them; a kernel computes in the mask's own type: refused alike."""
    rnn = sn.create_rnn_op()
    with pytest.raises(ShapeError, match=r"masks? \(bool\), which (is|are) no numbers? here"), rnn.stepnet():
        x = rnn.add_input(X)
        count(sn.ops.less(x, 0.5), sn.ops.less_equal(x, 0.7))
    rnn = sn.create_rnn_op()
    with rnn.stepnet():  # (a mask times a number is one)
        x = rnn.add_input(X)
        rnn.add_outputs(x * sn.ops.less(x, 0.5) + sn.ops.less(x, 0.5) * sn.ops.less(x, 0.7))


# -- where things may be called ------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda rnn: rnn.add_input(X),
    lambda rnn: rnn.add_memory(shape=[3]),
    lambda rnn: rnn.add_static_input(np.zeros((4, 3))),
    lambda rnn: rnn.add_outputs(),
])
def test_declarations_outside_a_stepnet_block(call):
    rnn = sn.create_rnn_op()
    with pytest.raises(StepNetError, match=r"inside `with rnn.stepnet\(\):`"):
        call(rnn)


def test_add_input_after_the_block_has_ended():
    rnn = elman()
    with pytest.raises(StepNetError, match=r"add_input must be called inside"):
        rnn.add_input(X)


def test_declaring_into_another_step_nets_block():
    first, second = sn.create_rnn_op(), sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"add_memory must be called inside"),
        first.stepnet(),
    ):
        first.add_input(X)
        with second.stepnet():
            first.add_memory(shape=[3])


def test_step_value_used_after_its_block():
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(shape=[3], name="h")
        h.update(x)
        rnn.add_outputs(h)
    with pytest.raises(StepNetError, match=r"X_t is used outside its step-net block "
                                           r"\(its block has ended\)"):
        x + 1.0
    with pytest.raises(StepNetError, match="used outside its step-net block"):
        sn.ops.tanh(x)


def test_step_value_used_in_another_step_net():
    first = sn.create_rnn_op()
    with first.stepnet():
        x = first.add_input(X, name="X")
        first.add_outputs(x * 2.0)
    second = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="X_t is used outside its step-net block"),
        second.stepnet(),
    ):
        y = second.add_input(X, name="Y")
        y + x


def test_memory_updated_outside_its_block():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="must be updated inside its own stepnet"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3], name="state")
        inner = sn.create_rnn_op()
        with inner.stepnet():
            h.update(x)


def test_nested_step_net_called_outside_its_block():
    outer = sn.create_rnn_op()
    with outer.stepnet():
        p = outer.add_input(chapters([[2, 1], [1, 2, 0]]))
        inner = sn.create_rnn_op()
        with inner.stepnet():
            inner.add_outputs(inner.add_input(p) * 2.0)
        outer.add_outputs(inner(output_all_steps=False))
    with pytest.raises(StepNetError, match="must be called inside the block it was defined in"):
        inner()


# -- Python control flow ------------------------------------------------------------


@pytest.mark.parametrize("branch", [
    lambda x: bool(x),
    lambda x: 1 if x > 0 else 0,
    lambda x: x and x,
    lambda x: not x,
])
def test_bool_of_a_step_value_says_use_where(branch):
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"cannot drive Python control flow.*sn\.ops\.where"),
        rnn.stepnet(),
    ):
        branch(rnn.add_input(X))


# -- outputs -------------------------------------------------------------------


def test_output_num_mismatch():
    rnn = sn.create_rnn_op(output_num=2)
    with (
        pytest.raises(StepNetError, match=r"output_num=2 but add_outputs declared 1 outputs"),
        rnn.stepnet(),
    ):
        x = rnn.add_input(X)
        h = rnn.add_memory(shape=[3])
        h.update(x)
        rnn.add_outputs(h)


def test_no_outputs():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match=r"has no outputs: call add_outputs"),
        rnn.stepnet(),
    ):
        rnn.add_input(X)


# -- LoD agreement -----------------------------------------------------------------


def test_step_inputs_with_unequal_lod_top_level():
    other = sn.LoDTensor.from_lengths(np.zeros((8, 3)), [[3, 1, 0, 4]])
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="step inputs A and B have different LoD"),
        rnn.stepnet(),
    ):
        rnn.add_input(X, name="A")
        rnn.add_input(other, name="B")


def test_step_inputs_with_unequal_lod_nested():
    A = chapters([[2, 1], [1, 2, 3]])
    B = chapters([[2, 1], [2, 1, 3]])  # same chapters, different paragraphs
    with pytest.raises(StepNetError, match="step inputs A_t and B_t .* have different LoD"):
        two_nested_inputs(A, B)


def test_rebinding_a_step_input_to_unequal_lod():
    A = chapters([[2, 1], [1, 2, 3]])
    rnn = two_nested_inputs(A, A)
    with pytest.raises(StepNetError, match="step inputs A_t and B_t .* have different LoD"):
        rnn(B=chapters([[2, 1], [2, 1, 3]]))
    with pytest.raises(StepNetError, match="step inputs A and B have different LoD at level 0"):
        rnn(B=chapters([[1, 2], [1, 2, 3]]))


# -- rebinding ---------------------------------------------------------------------


def test_rebinding_with_a_different_feature_shape():
    with pytest.raises(ShapeError, match=r"input X: rebound with 1 LoD level\(s\) and feature "
                                         r"shape \[5\]; it was defined with 1 and \[3\]"):
        elman()(X=sn.LoDTensor.from_lengths(np.zeros((3, 5)), [[1, 2]]))


def test_rebinding_with_a_different_lod_depth():
    with pytest.raises(ShapeError, match=r"rebound with 2 LoD level\(s\).*defined with 1"):
        elman()(X=chapters([[1, 2], [1, 1, 1]]))
    with pytest.raises(ShapeError, match=r"rebound with 0 LoD level\(s\).*defined with 1"):
        elman()(X=sn.LoDTensor(np.zeros((3, 3))))  # (none at all)


def test_rebinding_with_a_plain_array():
    with pytest.raises(ShapeError, match="input X: expects a LoDTensor, got ndarray"):
        elman()(X=np.zeros((3, 3)))


def test_rebinding_to_more_sequences_with_a_per_sequence_init():
    rnn = elman(init=np.ones((4, 4)), name="h0")  # one init row per sequence of X
    fewer = sn.LoDTensor.from_lengths(np.zeros((3, 3)), [[1, 2]])
    with pytest.raises(ShapeError, match=r"memory h0: its initial value has 4 rows \(one per "
                                         r"sequence\) but X now has 2 sequences; rebind h0 too"):
        rnn(X=fewer)
    # rebinding both works
    assert rnn(X=fewer, h0=np.ones((2, 4))).lod == [[0, 1, 3]]


def test_rebinding_an_init_of_the_wrong_shape():
    with pytest.raises(ShapeError, match=r"memory h: init of shape \[3, 5\] fits neither"):
        elman()(h=np.zeros((3, 5)))


def test_rebinding_a_static_input_with_the_wrong_rows():
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        s = rnn.add_static_input(np.zeros((4, 3)), name="S")
        rnn.add_outputs(x + s)
    with pytest.raises(ShapeError, match="static input S: has 2 rows but the step inputs have "
                                         "4 sequences"):
        rnn(S=np.zeros((2, 3)))
    with pytest.raises(ShapeError, match=r"static input S: defined by an array of one row per "
                                         r"sequence, got a LoDTensor of 1 level\(s\)"):
        rnn(S=X)


def test_unknown_rebinding_name():
    with pytest.raises(StepNetError, match=r"unknown input name\(s\) \['Y'\]; this step-net "
                                           r"takes \['X', 'h'\]"):
        elman()(Y=X)


# -- dtypes --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64])
def test_unsupported_input_dtype(dtype):
    Xi = sn.LoDTensor.from_lengths(np.zeros((3, 3), dtype), [[1, 2]])
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(ShapeError, match=f"dtype {np.dtype(dtype)} is not supported"),
        rnn.stepnet(),
    ):
        rnn.add_input(Xi)


def test_the_other_byte_order_says_what_to_do():
    X = sn.LoDTensor.from_lengths(np.zeros((3, 3), ">f4"), [[1, 2]])
    rnn = sn.create_rnn_op()
    with (pytest.raises(ShapeError, match=r"dtype >f4 is float32 in the other byte order than "
                                          r"this machine's; pass it as .astype\(np.float32\)"),
          rnn.stepnet()):
        rnn.add_input(X)
    with pytest.raises(ShapeError, match=r"input X: dtype >f4 is float32 in the other byte order"):
        elman()(X=X)


def test_unsupported_dtype_on_rebinding():
    Xi = sn.LoDTensor.from_lengths(np.zeros((3, 3), np.int64), [[1, 2]])
    with pytest.raises(ShapeError, match="input X: dtype int64 is not supported"):
        elman()(X=Xi)


def test_rebinding_another_float_dtype_says_what_to_do():
    X32 = sn.LoDTensor.from_lengths(RNG.standard_normal((8, 3)).astype(np.float32), [[3, 0, 1, 4]])
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X32, name="X")
        h = rnn.add_memory(shape=[3], name="h")
        h.update(sn.ops.tanh(x + h.pre_state()))
        rnn.add_outputs(h)
    with pytest.raises(ShapeError, match=r"^input X: rebound with dtype float64, defined as "
                                         r"float32; cast the array \(X\.astype\(np\.float32\)\) "
                                         r"or define the net in float64$"):
        rnn(X=X)
    assert rnn(X=X.astype(np.float32)).dtype == np.float32  # the advice works
    with pytest.raises(ShapeError, match=r"defined as float64; cast the array "
                                         r"\(X\.astype\(np\.float64\)\) or define the net in "
                                         r"float32$"):
        elman()(X=X32)


def test_add_input_needs_a_lod_tensor():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="expects a LoDTensor, got ndarray"),
        rnn.stepnet(),
    ):
        rnn.add_input(np.zeros((3, 3)))


def test_names_must_be_unique():
    rnn = sn.create_rnn_op()
    with (
        pytest.raises(StepNetError, match="name 'X' is used twice"),
        rnn.stepnet(),
    ):
        rnn.add_input(X, name="X")
        rnn.add_memory(shape=[3], name="X")


def test_a_missing_optional_dependency_names_what_needs_it_and_the_install():
    from stepnet.errors import optional_import

    with pytest.raises(sn.UnsupportedError, match=r"stepnet.thing needs no_such_module_x: pip install x"):
        optional_import("no_such_module_x", "stepnet.thing", "pip install x")
    assert optional_import("numpy", "stepnet", "pip install numpy") is np


def test_every_entry_refuses_an_undefined_step_net_alike():
    rnn = sn.create_rnn_op()
    entries = [rnn, lambda: rnn.program(True), lambda: rnn.compile("numba"), lambda: sn.vjp(rnn)]
    for entry in entries:
        with pytest.raises(StepNetError, match="the step-net is not defined yet: use `with rnn.stepnet"):
            entry()
