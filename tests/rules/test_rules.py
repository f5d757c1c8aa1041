"""Every per-example rule and strategy against the loop reference.

For each row of `specs.SPECS` and a float type, one graph holds the spec's
variables and three copies of its loss: static B=1, static B=3 and dynamic
B (placeholders `[None, ...]`, run with the same B=1 and B=3 data).
`custagg.testing.loop_per_example` on the static copies (or on the row's
`reference` loss, for ops TF cannot differentiate on the CPU) is the
reference. Checked against it, to rtol 1e-9 (float64) or 1e-4 (float32):

* `per_example_gradients` with the strategies of `STRATEGIES` ("loop" only
  for static B; a row's `limits` leave out what TF cannot run);
* `per_example_norms`, `clipped_gradients` (some examples clipped,
  `return_norms`) and `gradient_second_moments` with "auto", which is the
  rule's own reduction (outer-product identities, sparse rows) when the
  rule applies, on the dynamic copy;
* the plan: "auto" picks the row's strategy and uses the row's op type;
  "rules" on a fallback row raises a ValueError matching `rules_error`
  and suggesting 'auto' and 'pfor'.

Every registered rule must have a row. float64 runs every row; float32 the
first row of each op type and the fallback rows, the rest under
`pytest -m slow`. One graph and one session per case keeps the run short:
TF graph construction is the cost.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import custagg
from custagg import testing

import specs

RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}
BATCHES = (1, 3)

# Strategies run on each copy (None: dynamic B, fed B=1 and B=3). float64
# runs them all; float32 (the same graph code, other rounding) the rule
# paths. Norms, clipped sums and second moments ("auto") run on the
# dynamic copy. pfor and loop do not depend on the float type.
STRATEGIES = {
    tf.float64: {1: ("rules", "pfor", "loop"),
                 3: ("rules", "pfor", "loop", "auto"),
                 None: ("rules", "pfor", "auto")},
    tf.float32: {1: (), 3: ("rules",), None: ("rules", "auto")},
}


# Graphs run as built: Grappler's rewrites cost more than the test's
# arithmetic here and are not what is under test.
SESSION_CONFIG = tf.compat.v1.ConfigProto(
    graph_options=tf.compat.v1.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(
            disable_meta_optimizer=True)))


class _Copy(object):
    """One copy of the spec's loss on fresh placeholders.

    `reference` is the loss the loop reference differentiates: the spec's
    own, or its `Problem.reference` (the same function of the same
    variables, built from ops TensorFlow can differentiate on the CPU).
    """

    def __init__(self, problem, batch, dtype):
        self.placeholders = [specs.placeholder(i, batch, dtype)
                             for i in problem.inputs]
        self.loss = problem.loss(*self.placeholders)
        self.reference = (problem.reference(*self.placeholders)
                          if problem.reference else self.loss)
        self.clip = tf.compat.v1.placeholder(self.loss.dtype, [])

    def feed(self, data, clip=None):
        feed = dict(zip(self.placeholders, data))
        if clip is not None:
            feed[self.clip] = clip
        return feed


def _fetches(spec, copy, xs, strategies, reductions):
    out = {}
    for s in strategies:
        if (s == "rules" and spec.expect != "rules") or s in spec.limits:
            continue
        out["per_example/" + s] = custagg.per_example_gradients(
            copy.loss, xs, strategy=s)
    if reductions:
        out["norms"] = custagg.per_example_norms(copy.loss, xs)
        out["clipped"], out["clipped_norms"] = custagg.clipped_gradients(
            copy.loss, xs, copy.clip, return_norms=True)
        out["moments"] = custagg.gradient_second_moments(copy.loss, xs)
    return out


def _expected(ref):
    """Numpy values of the reductions of `_fetches`, from the reference."""
    norms = testing.numpy_norms(ref)
    clip = 0.7 * float(np.median(norms))   # clips some examples, not all
    clipped, _ = testing.numpy_clipped(ref, clip)
    return clip, {"norms": norms, "clipped": clipped, "clipped_norms": norms,
                  "moments": testing.numpy_second_moments(ref)}


def _compare(got, ref, expected, rtol, where):
    for key, value in got.items():
        want = ref if key.startswith("per_example/") else expected[key]
        if isinstance(value, list):
            assert len(value) == len(want)
            for j, (v, w) in enumerate(zip(value, want)):
                testing.assert_close(v, w, rtol,
                                     "%s %s x%d" % (where, key, j))
        else:
            testing.assert_close(value, want, rtol, "%s %s" % (where, key))


def _check_plan(spec, loss, xs):
    plan = custagg.plan_per_example(loss, xs, strategy="auto")
    for a in plan.assignments:
        if spec.expect == "certified":
            assert a.form == "certified", str(plan)
        else:
            assert a.strategy == spec.expect, str(plan)
        assert spec.expect == "rules" or a.reason, str(plan)
    if spec.expect == "rules":
        used = {c.op.type for a in plan.assignments for c in a.consumers}
        assert spec.op_type in used, str(plan)
    else:
        with pytest.raises(ValueError, match=spec.rules_error) as info:
            custagg.plan_per_example(loss, xs, strategy="rules")
        assert "'auto'" in str(info.value) and "'pfor'" in str(info.value)


def _cases():
    """(spec, dtype) pairs: float64 for every row; float32 for the first row
    of each op type and the fallback rows, the other float32 rows marked
    slow (`pytest -m slow` runs them)."""
    first = {}
    for spec in specs.SPECS:
        first.setdefault(spec.op_type, spec)
    cases = []
    for spec in specs.SPECS:
        cases.append(pytest.param(spec, tf.float64,
                                  id=spec.name + "-float64"))
        quick = first[spec.op_type] is spec or spec.expect != "rules"
        cases.append(pytest.param(
            spec, tf.float32, id=spec.name + "-float32",
            marks=() if quick else pytest.mark.slow))
    return cases


@pytest.mark.parametrize("spec, dtype", _cases())
def test_matches_loop(spec, dtype):
    skip = spec.skip.get(dtype) if isinstance(spec.skip, dict) else spec.skip
    if skip:
        pytest.skip(skip)
    rng = np.random.default_rng(sum(map(ord, spec.name)))
    graph = tf.Graph()
    with graph.as_default():
        problem = spec.build(dtype, rng)
        xs = problem.xs
        # A float32 x (cast to float64 inside) has float32 gradients.
        rtol = max([RTOL[dtype]] + [RTOL[x.dtype.base_dtype] for x in xs])
        copies = {b: _Copy(problem, b, dtype) for b in BATCHES + (None,)}
        _check_plan(spec, copies[None].loss, xs)
        refs = {b: testing.loop_per_example(copies[b].reference, xs)
                for b in BATCHES}
        fetches = {b: _fetches(spec, copies[b], xs, STRATEGIES[dtype][b],
                               reductions=b is None) for b in copies}
        data = {b: [specs.sample(i, b, dtype, rng) for i in problem.inputs]
                for b in BATCHES}
        with tf.compat.v1.Session(graph=graph,
                                  config=SESSION_CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {}
            for b in BATCHES:
                feed.update(copies[b].feed(data[b]))
            ref_values = sess.run(refs, feed)
            got = sess.run({b: fetches[b] for b in BATCHES}, feed)
            for b in BATCHES:
                _compare(got[b], ref_values[b], {}, rtol, "static B=%d" % b)
            for b in BATCHES:
                clip, expected = _expected(ref_values[b])
                got = sess.run(fetches[None], copies[None].feed(data[b], clip))
                _compare(got, ref_values[b], expected, rtol,
                         "dynamic B=%d" % b)


def test_every_registered_rule_has_a_spec():
    covered = {s.op_type for s in specs.SPECS if s.expect == "rules"
               and (not s.skip or isinstance(s.skip, dict))}
    missing = set(custagg.default_registry().op_types()) - covered
    assert not missing, "registered rules without a spec: %s" % sorted(missing)


def test_batch_norm_scale_waits_for_its_output_gradient():
    """The inference-mode scale's `x - mean` reads forward values only: it
    must wait for dy, else it runs in the forward pass and is held, as
    large as the activations, until the backward pass reaches the layer
    (keras_batch_norm_inference's clipped sum, B = 64: 27.7 -> 22.2 MB
    peak against the aggregated gradient's 16.9)."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 5, 2])
        f = tf.Variable(rng.randn(3, 3, 2, 4), dtype=tf.float32)
        scale = tf.Variable(rng.rand(4) + 0.5, dtype=tf.float32)
        offset = tf.Variable(rng.randn(4), dtype=tf.float32)
        h = tf.nn.relu(tf.nn.conv2d(x, f, 1, "SAME"))
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            h, scale, offset, mean=tf.constant(rng.randn(4), tf.float32),
            variance=tf.constant(rng.rand(4) + 0.5, tf.float32),
            is_training=False)
        loss = tf.reduce_sum(tf.square(y), axis=[1, 2, 3])
        with tf.name_scope("norms"):
            custagg.per_example_norms(loss, [scale, offset])
        graph = tf.compat.v1.get_default_graph()
        centered = [op for op in graph.get_operations()
                    if op.name.startswith("norms/") and op.type == "Sub"
                    and op.inputs[0].shape.rank == 4]
        assert centered, "the rule's x - mean was not found"
        for op in centered:
            assert testing.waits_for_backward_pass(op), op.name
