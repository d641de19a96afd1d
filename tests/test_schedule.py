"""stepnet.schedule: the one schedule every compiled backend renders.

check() holds on the schedules of the built-in layers, nested nets, random
step-nets and their backward step-nets, and fails on broken schedules; the
printed form shows the merged GEMMs.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stepnet_strategies import build_random_stepnet
from nets import gru_net, nested_encoder, weight

import stepnet as sn
from stepnet import autodiff, ir
from stepnet import schedule as sched_mod
from stepnet.errors import StepNetError, UnsupportedError
from stepnet.schedule import Schedule, Stage, check, fusion_order, schedule


def _program(rnn, output_all_steps=True):
    return rnn.program(rnn.all_steps_flags(output_all_steps))


def _check_all(program):
    """The schedule of ``program``, its forward with workspace and its
    backward programs all check."""
    result = schedule(program)
    check(result)
    check(schedule(autodiff.forward_program(program)))
    try:
        programs, _ = autodiff.backward_program(program, (True,) * len(program.eqn.outputs))
    except UnsupportedError:
        return result
    for p in programs:
        check(schedule(p))
    return result


def _nested(rng, dependent=False):
    """README's two-level net; ``dependent``: the inner net also reads the
    outer state (so it runs per outer step)."""
    return nested_encoder(rng, [[2, 3], [3, 2, 4, 1, 4]], features=8, hidden=6,
                          inner_reads_outer=dependent, outputs=("h", "words")).rnn


def _gru_cell(rng):
    """A PyTorch-style GRU cell written in the DSL (three input products,
    three recurrent ones)."""
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 4)).astype(np.float32), [[5, 0, 4]])
    return gru_net(X, rng)


LAYERS = [
    lambda: sn.nn.GRU(5, 7),
    lambda: sn.nn.GRU(5, 7, linear_before_reset=True),
    lambda: sn.nn.LSTM(5, 7),
    lambda: sn.nn.LSTM(5, 7, peephole=True, proj_size=3),
    lambda: sn.nn.RNN(5, 7, direction="reverse"),
    lambda: sn.nn.AUGRU(5, 7),
    lambda: sn.nn.MGU(5, 7),
]


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("output_all_steps", [True, False])
def test_check_passes_on_layers(make, output_all_steps):
    layer = make()
    for d in range(layer.num_directions):
        _check_all(_program(layer.step_net(0, d), output_all_steps))


@pytest.mark.parametrize("dependent", [False, True])
def test_check_passes_on_nested_nets(rng, dependent):
    result = _check_all(_program(_nested(rng, dependent)))
    inner = [e for e in result.body.eqns if e.op == "rnn"]
    assert len(result.nested) == len(inner) == 2
    if dependent:  # reads the outer state: called once per outer step
        assert not result.independent_rnns
        assert [s.kind for s in result.step].count("rnn") == 2
    else:  # once over every paragraph, before the outer loop
        assert set(result.independent_rnns) == set(inner)
    for e in inner:  # the words' input product is hoisted either way
        [gemm] = [s for s in result.nested[e].hoisted if s.kind == "gemm"]
        assert gemm.left is e.attrs["body"].step_inputs[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_check_passes_on_random_stepnets(data):
    rnn, _ = build_random_stepnet(data.draw)
    for output_all_steps in (True, False):
        _check_all(_program(rnn, output_all_steps))


def test_gru_cell_prints_one_merged_gemm_hoisted_and_one_per_step(rng):
    result = schedule(_program(_gru_cell(rng)))
    check(result)
    text = str(result)
    hoisted = text[text.index("hoisted"):text.index("step (per time step)")]
    step = text[text.index("step (per time step)"):]
    # x @ Wr, x @ Wz, x @ Wn: one GEMM over every token; h @ Ur, h @ Uz,
    # h @ Un: one GEMM per step
    assert hoisted.count("gemm[merged 3]: ") == 1 and hoisted.count("gemm") == 1
    assert "= x_t @ (" in hoisted
    assert step.count("gemm[merged 3]: ") == 1 and step.count("gemm") == 1
    assert "= h_prev @ (" in step
    assert "swaps: h<->" in text
    [merged] = [s for s in result.step if s.merged]
    assert merged.left is result.body.memories[0].pre
    # the bias added to x @ W before the step's product joins the gates' run:
    # one loop per step
    assert [s.kind for s in result.step] == ["gemm", "elementwise"]


def test_an_elementwise_run_joins_the_next_only_when_nothing_between_reads_it(rng):
    """``r * h`` feeds the second product of a classic GRU (linear_before_reset
    off): it stays a run of its own before that product; the layer's biases,
    summed once per call, join the run after the product."""
    layer = sn.nn.GRU(5, 7)
    result = schedule(_program(layer.step_net(0, 0), True))
    check(result)
    kinds = [s.kind for s in result.step]
    assert kinds == ["gemm", "elementwise", "gemm", "elementwise"]
    second = result.step[2]
    assert second.left in result.step[1].outputs
    assert any(s.kind == "elementwise" and s.eqns[0].op == "add" for s in result.const)


def test_elementwise_ops_are_hoisted_only_for_a_hoisted_gemm(rng):
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 4)).astype(np.float32), [[2, 4]])
    W, U = weight(rng, 4, 3), weight(rng, 3, 3)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        h = rnn.add_memory(shape=[3], name="h")
        scaled = sn.ops.tanh(x) * 2.0       # read by a hoisted GEMM: hoisted
        pre = scaled @ W + 1.0              # the bias add fuses into the step
        h.update(sn.ops.tanh(pre + h.pre_state() @ U))
        rnn.add_outputs(h)
    result = schedule(_program(rnn))
    check(result)
    assert [s.kind for s in result.hoisted] == ["elementwise", "elementwise", "gemm"]
    # the bias add joins the run after the step's product
    assert [s.kind for s in result.step] == ["gemm", "elementwise"]


def test_ops_on_constants_and_static_inputs(rng):
    X = sn.LoDTensor.from_lengths(rng.standard_normal((6, 4)).astype(np.float32), [[2, 4]])
    S = rng.standard_normal((2, 4)).astype(np.float32)
    W = weight(rng, 3, 4)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="x")
        s = rnn.add_static_input(S, name="s")
        h = rnn.add_memory(shape=[3], name="h")
        Wt = sn.ops.transpose(W)            # constants alone: once per call
        h.update(sn.ops.tanh(x @ Wt + s @ Wt + h.pre_state()))
        rnn.add_outputs(h)
    result = schedule(_program(rnn))
    check(result)
    assert [s.eqns[0].op for s in result.const] == ["transpose"]
    assert [s.kind for s in result.hoisted] == ["gemm"]  # x @ Wt
    assert result.step[0].kind == "gemm" and result.step[0].left.name.startswith("s")


# ----------------------------------------------------------------------------
# broken schedules fail


def _replace(result, **changes):
    return dataclasses.replace(result, **changes)


@pytest.fixture
def gru(rng):
    result = schedule(_program(_gru_cell(rng)))
    check(result)
    return result


def test_check_fails_on_a_missing_or_repeated_equation(gru):
    with pytest.raises(StepNetError, match="exactly once"):
        check(_replace(gru, step=gru.step[:-1]))
    with pytest.raises(StepNetError, match="exactly once"):
        check(_replace(gru, step=gru.step + gru.step[-1:]))


def test_check_fails_on_stages_out_of_dependency_order(gru):
    with pytest.raises(StepNetError, match="before its stage runs"):
        check(_replace(gru, step=gru.step[::-1]))
    # a per-step value read by a hoisted stage
    with pytest.raises(StepNetError, match="not available there"):
        check(_replace(gru, hoisted=gru.hoisted + gru.step[:2], step=gru.step[2:]))


def test_check_fails_on_a_merged_gemm_without_a_shared_left_operand(gru):
    gemm, run = gru.step  # the per-step product, then the gates' run
    bad = Stage("gemm", gemm.eqns + gru.hoisted[0].eqns)
    with pytest.raises(StepNetError, match="left operand"):
        check(_replace(gru, hoisted=(), step=(bad, run)))
    not_gemm = Stage("gemm", run.eqns)
    with pytest.raises(StepNetError, match="not a product by a constant"):
        check(_replace(gru, step=(gemm, not_gemm)))


def test_check_fails_on_a_value_read_outside_its_stage_not_materialized(gru):
    with pytest.raises(StepNetError, match="not materialized"):
        check(_replace(gru, materialized=gru.materialized[1:]))
    last = gru.body.memories[0].post
    with pytest.raises(StepNetError, match="an output or memory update"):
        check(_replace(gru, materialized=tuple(v for v in gru.materialized if v is not last)))


def test_check_fails_on_a_bad_swap_or_stage(gru):
    merged, run = gru.step
    mem = gru.body.memories[0]
    fake = ir.Memory("h", mem.pre, merged.eqns[0].outputs[0])
    with pytest.raises(StepNetError, match="swapped memory"):
        check(_replace(gru, swaps=(fake,)))
    with pytest.raises(StepNetError, match="elementwise stage holds"):
        check(_replace(gru, step=(Stage("elementwise", merged.eqns + run.eqns),)))
    assert isinstance(_replace(gru), Schedule)


# ----------------------------------------------------------------------------
# helpers autodiff uses


def test_fusion_order_groups_elementwise_ops_topologically(rng):
    f32 = np.float32
    a = ir.Var("a", np.dtype(f32), (None, 3))
    W = ir.Var("W", np.dtype(f32), (3, 3))
    b, c, d, e = (ir.Var(n, np.dtype(f32), (None, 3)) for n in "bcde")
    eqns = (ir.Eqn("matmul", (a, W), (b,)), ir.Eqn("tanh", (b,), (c,)),
            ir.Eqn("neg", (a,), (d,)), ir.Eqn("add", (c, d), (e,)))
    order = fusion_order(eqns)
    assert [x.op for x in order] == ["neg", "matmul", "tanh", "add"]
    assert sched_mod.group_by_left([eqns[0], eqns[0]], lambda x: x.inputs[0]) == [
        (eqns[0], eqns[0])]


@pytest.mark.parametrize("backend", ["numba", "cuda", "interpreter"])
def test_compiled_step_net_prints_the_schedule_it_renders(rng, backend):
    if backend not in sn.backends():
        pytest.skip(f"{backend} is not available")
    rnn = _gru_cell(rng)
    sched = rnn.compile(backend).schedule
    assert isinstance(sched, sched_mod.Schedule)
    assert str(sched) == str(sched_mod.schedule(rnn.program(True)))
    text = str(sched)
    # the three input products are one hoisted GEMM, the recurrent ones one per step
    assert "gemm[merged 3]" in text.split("step (per time step)")[0]
    assert "gemm[merged 3]" in text.split("step (per time step)")[1]
