"""The kernel plan: what the Numba backend decides about a kernel before it
writes its code (stepnet/jit/kernel_plan.py)."""

import numpy as np
import pytest

import stepnet as sn
from nets import nested_encoder, small_gru
from stepnet import schedule

pytest.importorskip("numba")

from stepnet.jit import cpu_codegen  # noqa: E402
from stepnet.jit.kernel_plan import KernelPlan, kernel_plan  # noqa: E402


def _gru_program(hidden=256):
    layer = sn.nn.GRU(16, hidden, seed=3)
    return layer.step_net(0, 0).program(True)


def test_a_gru_plans_its_input_products_by_chunks_and_reads_the_joined_weights():
    """A GRU's three input products are one merged product of 3H columns over
    every token, computed by chunks of steps in its rnn function; its per-gate
    weights are read only joined (by the caller), so the kernel takes the
    joined ones, not the parts."""
    program = _gru_program()
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    (chunked,) = plan.chunked[sched]
    assert chunked.kind == "gemm" and chunked.merged
    assert sum(v.shape[-1] for v in chunked.outputs) == 3 * 256
    merged_weights = {e.inputs[1] for s in sched.hoisted + sched.step if s.merged for e in s.eqns}
    assert merged_weights and not merged_weights & set(plan.consts)
    assert set(plan.consts) <= set(program.consts)
    source, layout = cpu_codegen.generate_source(program)
    assert layout.plan.consts == plan.consts
    assert "products by chunks of steps" in str(plan)


def test_small_products_stay_before_the_loop():
    program = _gru_program(hidden=32)  # (3 x 32 columns: under the chunks' minimum)
    sched = schedule.schedule(program)
    assert kernel_plan(program, sched).chunked[sched] == frozenset()


def test_a_plan_naming_work_its_net_does_not_schedule_is_refused():
    program = _gru_program()
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    step_stage = sched.step[0]
    bad = plan._replace(chunked={sched: frozenset({step_stage})})
    with pytest.raises(AssertionError):
        bad.check()
    bad = plan._replace(concats={**plan.concats, sched: (sched.hoisted[0],)})
    with pytest.raises(AssertionError):
        bad.check()
    assert isinstance(plan.check(), KernelPlan)


def test_explain_prints_the_kernel_plan(capsys):
    """``compiled.explain()`` prints the kernel's plan after the call's."""
    rnn = small_gru(np.random.default_rng(0), [[5, 7]], hidden=96)
    compiled = rnn.compile("numba")
    found = compiled.explain()
    out = capsys.readouterr().out
    assert str(found) in out and "kernel: constants read: " in out
    assert out.index(str(found)) < out.index("kernel: constants read: ")


def test_the_plan_decides_which_sequences_are_cut_and_which_outputs_are_unbuffered():
    """The helper's cut of a net's sequences is the plan's: a net of 64 units
    cuts them, one of 8 units (weights under the minimum) does not, and a
    net giving its sequences' rows as an output (a nested net's ragged
    output) never does; an all-steps output
    only a fused run computes is stored by that run alone. The generated code
    follows the plan."""
    rng = np.random.default_rng(0)
    for hidden, cut in ((64, True), (8, False)):
        program = small_gru(rng, [[5, 7]], hidden=hidden).program(True)
        sched = schedule.schedule(program)
        plan = kernel_plan(program, sched)
        assert plan.cut == {sched: cut}
        assert plan.unbuffered[sched] == frozenset()  # (its output is its memory)
        source, layout = cpu_codegen.generate_source(program)
        assert layout.plan.cuts_sequences == cut and ("group_cut(board" in source) == cut
        assert ("its sequences cut with the helper" in str(plan)) == cut
    for outputs, cut in ((("h", "words"), False), (("h",), True)):
        nested = nested_encoder(rng, hidden=64, outputs=outputs).rnn.program(True)
        sched = schedule.schedule(nested)
        plan = kernel_plan(nested, sched)
        # the top net, and its nested nets run once before its time loop (cut)
        assert plan.cut[sched] == cut and len(plan.cut) > 1
        assert all(c for net, c in plan.cut.items() if net is not sched)
        source, layout = cpu_codegen.generate_source(nested)
        assert source.count("group_cut(board") == sum(plan.cut.values())
        assert layout.plan.cuts_sequences == cut


def test_an_output_only_a_fused_run_computes_is_stored_by_it_alone():
    rng = np.random.default_rng(1)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 4)).astype(np.float32), [[4, 5]])
    U = rng.standard_normal((4, 4)).astype(np.float32)
    rnn = sn.create_rnn_op()
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=np.zeros((2, 4), np.float32), name="h")
        h.update(sn.ops.tanh(x + h.pre_state() @ U))
        y = sn.ops.sigmoid(h.pre_state() + x)
        rnn.add_outputs(h, y)
    program = rnn.program(True)
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    assert [v.name for v in plan.unbuffered[sched]] == [sched.body.outputs[1].name]
    assert "outputs stored by their run alone" in str(plan)
    np.testing.assert_allclose(rnn(backend="numba")[1].data, rnn(backend="interpreter")[1].data,
                               rtol=1e-6, atol=1e-6)


def test_outputs_computed_before_the_loop_go_into_their_buffers():
    """An all-steps output a hoisted stage computes (a product of a value of
    the step input) is computed into the output's buffer before the loop,
    not copied there a step at a time; a merged product's column block, a
    value only a step computes, and the outputs of a net of nested sequences
    are not. The code follows the plan, and the numbers are the
    interpreter's."""
    rng = np.random.default_rng(2)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((9, 4)).astype(np.float32), [[4, 5]])
    W, V, U = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(3))
    rnn = sn.create_rnn_op(output_num=3)
    with rnn.stepnet():
        x = rnn.add_input(X, name="X")
        h = rnn.add_memory(init=np.zeros((2, 4), np.float32), name="h")
        p, q = x @ W, x @ V  # (one product of the weights joined: column blocks)
        h.update(sn.ops.tanh(p + q + h.pre_state()))
        rnn.add_outputs(h, p, sn.ops.exp(x) @ U)
    program = rnn.program(True)
    sched = schedule.schedule(program)
    plan = kernel_plan(program, sched)
    assert plan.into_outputs == {sched.body.outputs[2]}, str(plan)  # (not p, a column block; not h)
    assert "outputs computed before the loop into their buffers" in str(plan)
    source, layout = cpu_codegen.generate_source(program)
    assert layout.plan.into_outputs == plan.into_outputs
    for got, want in zip(rnn(backend="numba"), rnn(backend="interpreter")):
        np.testing.assert_allclose(got.data, want.data, rtol=1e-5, atol=1e-6)
    nested = nested_encoder(rng, hidden=8).rnn.program(True)
    assert kernel_plan(nested, schedule.schedule(nested)).into_outputs == frozenset()
