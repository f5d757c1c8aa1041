"""What the one-pass tapped loop runs at each step (issue 26;
per_example/forms/loop_rules.py, `_Hook` and `OnePass`).

The loop rules rebuild each v2 loop once, each tapped op's output passed
through an `IdentityN` with an empty TensorList (eps) carried through the
loop, whose gradient pushes dz_t onto the list's gradient, and take the
gradient of the recomputed loss to those lists. Every node in the
rebuilt body runs T times forward and its gradient T times backward, so on
the Keras GRU (16 steps, hidden 64) a few extra nodes per step were a third
of the clipped sum's time. Pinned here, on the function bodies the graph
holds, against the original loop's own bodies:

* one eps tap per distinct dz: a MatMul that feeds a BiasAdd alone (or
  a sum, as a full-shape addend, that feeds it) shares the BiasAdd's (the
  Keras GRU's two MatMul + BiasAdd pairs: 2 taps, not 4; the Keras LSTM:
  1, not 3), also when a gradient taken before added accumulators to the
  body;
* no loop variable but those lists and one list per pushed input (no
  step, no row counts: the eps lists start empty and the gradient pushes
  onto them);
* no run-time check inside the body (the rows of the pushed inputs are
  checked once after the loop);
* no eps read: no `TensorListGetItem` of zeros added to the output (and
  no `TensorListElementShape` / `TensorListLength`, which while_v2 pushed
  at every step for that read's gradient), no broadcast reductions in the
  backward loop (`BroadcastGradientArgs`) beyond the original's.

Values: every public function against the loop reference (one
tf.gradients per example), float64, B in {1, 7} (`-m slow`: {32, 33}).
"""

import collections

import pytest
import tensorflow as tf

import custagg
from custagg import op_kinds

import test_loop_rules
import test_loops

BATCHES = (1, 7)
LARGE_BATCHES = (32, 33)
SIZES = [pytest.param(BATCHES, id="B1,7"),
         pytest.param(LARGE_BATCHES, id="B32,33", marks=pytest.mark.slow)]

def _bodies(graph):
    """{function name: Counter of its node types} for the loop bodies the
    graph's library holds (forward and gradient bodies, as rewritten by a
    gradient)."""
    out = {}
    for f in graph.as_graph_def().library.function:
        name = f.signature.name
        if "_body_" in name:
            out[name] = collections.Counter(n.op for n in f.node_def)
    return out


def _pick(bodies, one_pass, grad):
    """The largest body of the original loop (`one_pass` False) or of the
    tapped rebuild, forward or gradient (`grad`)."""
    found = [(sum(c.values()), name, c) for name, c in bodies.items()
             if ("loop_rules_one_pass" in name) == one_pass and
             ("_grad_" in name) == grad]
    assert found, sorted(bodies)
    return max(found)[1:]


def _eps_taps(graph):
    """The eps taps in the tapped forward body: its IdentityN nodes whose
    gradient is the loop rules' (`loop_rebuild._eps_tap_grad`)."""
    body = max((f for f in graph.as_graph_def().library.function
                if "loop_rules_one_pass" in f.signature.name and
                "_body_" in f.signature.name and
                "_grad_" not in f.signature.name),
               key=lambda f: len(f.node_def))
    return [n.name for n in body.node_def if n.op == "IdentityN" and
            n.attr["_gradient_op_type"].s == b"CustaggLoopEpsTap"]


def _forward_loops(graph):
    return [op for op in graph.get_operations()
            if op.type in op_kinds.V2_LOOPS and
            "while_grad" not in op.name]


def _build(name, gradient_first):
    loss, xs, feed = test_loops.MODELS[name]()
    if gradient_first:
        # As a training step built before the per-example quantities: the
        # original body then pushes its intermediates (the MatMuls' outputs
        # among them) for its own gradient loop.
        tf.compat.v1.gradients(tf.reduce_sum(loss), xs)
    return loss, xs, feed


# Distinct dz per step: the Keras GRU's kernel -> input bias and recurrent
# kernel -> recurrent bias (2, not 4); the Keras LSTM's `x W + h U` into
# one BiasAdd (1, not 3); a hand-written cell's `concat W + b` (1, not 2).
EPS_TAPS = {"keras_gru_sequence": 2, "keras_lstm_last": 1,
            "hand_while_rnn": 1}
# The rows pushed per step: the GRU's and the LSTM's x_t and h_{t-1}; the
# hand-written cell's concat, and its `+ b`'s other addend (the rows the
# sum's dz is checked to share with the MatMul's, `_gradient_owner`).
PUSHED = {"keras_gru_sequence": 2, "keras_lstm_last": 2, "hand_while_rnn": 2}


@pytest.mark.parametrize("gradient_first", [False, True])
@pytest.mark.parametrize("name", sorted(EPS_TAPS))
def test_one_eps_tap_per_distinct_dz_and_no_step_or_row_counts(
        graph, name, gradient_first):
    loss, xs, _ = _build(name, gradient_first)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[:2] == ["loop-rules"] * 2, str(plan)
    (original,) = _forward_loops(graph)
    custagg.clipped_gradients(loss, xs, 0.5)
    assert len(_eps_taps(graph)) == EPS_TAPS[name], _eps_taps(graph)
    (tapped,) = [op for op in _forward_loops(graph)
                 if "loop_rules_one_pass" in op.name]
    # The hook's lists (while_v2's accumulators for the gradient loop are
    # made inside the loop's own scope), and no int32 loop variable more
    # than the original's.
    hooks = [t.op.name for t in tapped.inputs
             if t.op.type == "EmptyTensorList" and
             t.op.name.rsplit("/", 1)[0].endswith("loop_rules_one_pass")]
    assert len(hooks) == EPS_TAPS[name] + PUSHED[name], hooks

    def ints(loop):
        return [t for t in loop.inputs if t.dtype == tf.int32]

    assert len(ints(tapped)) == len(ints(original)), (ints(original),
                                                      ints(tapped))


@pytest.mark.parametrize("name", ["keras_gru_sequence", "keras_lstm_last",
                                  "hand_while_rnn"])
def test_the_tapped_body_adds_no_checks_or_pushed_shapes(graph, name):
    loss, xs, _ = _build(name, gradient_first=True)
    custagg.clipped_gradients(loss, xs, 0.5)
    bodies = _bodies(graph)
    _, original = _pick(bodies, one_pass=False, grad=False)
    _, tapped = _pick(bodies, one_pass=True, grad=False)
    _, original_grad = _pick(bodies, one_pass=False, grad=True)
    _, tapped_grad = _pick(bodies, one_pass=True, grad=True)
    for op_type in ("Assert", "If", "StatelessIf"):
        assert tapped[op_type] == 0, (op_type, tapped)
    for op_type in ("TensorListElementShape", "TensorListLength",
                    "TensorListGetItem", "AddN"):
        # The original's own (Keras reads its input list the same way).
        assert tapped[op_type] <= original[op_type], (op_type, tapped,
                                                      original)
    assert tapped_grad["BroadcastGradientArgs"] <= \
        original_grad["BroadcastGradientArgs"], (tapped_grad, original_grad)


@pytest.mark.parametrize("batches", SIZES)
@pytest.mark.parametrize("name", ["keras_gru_sequence", "keras_lstm_last",
                                  "hand_while_rnn"])
def test_values_with_a_gradient_taken_first(graph, name, batches):
    loss, xs, feed = _build(name, gradient_first=True)
    test_loop_rules._check_all(  # pylint: disable=protected-access
        loss, xs, feed, batches=batches)
