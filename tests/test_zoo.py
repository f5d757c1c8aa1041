"""The model zoo (`zoo_models.py`) against the obvious reference, for every strategy.

Each model is built once, with a dynamic batch, and run at the batch sizes
in `BATCHES` (1 and 5, the default run) or `LARGE_BATCHES` (`-m slow`: below,
at and above the pfor chunk (32) and a multiple of it). The reference is one `tf.compat.v1.gradients(loss[i])` per
example on the same graph (TensorFlow's traversal, nothing clever), fetched
in the same `Session.run` as custagg's results, so a dropout mask is the
same for both. Checked for "auto", "rules", "pfor" and "loop":
`per_example_gradients`, `per_example_norms`, `clipped_gradients`
(`return_norms`), `gradient_second_moments`, and `weighted_gradients`
(one backward pass, no strategy). float64 to rtol 1e-9, float32 to 1e-4.

The plan is checked too: every variable that is not truly coupled gets
"rules"; a coupled one (batch statistics) is not on the statically proved
rules (at most on the certified ones, whose run-time check fails), and
strategy="rules" on it raises an error naming the op.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

from benchmarks import zoo_models as zoo

# The default run checks B in {1, 5}; `-m slow` runs each model again at
# 31, 32, 33 and 64 (the loop reference at 64 costs most of a test).
BATCHES = (1, 5)
LARGE_BATCHES = (31, 32, 33, 64)
RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}
STRATEGIES = ("auto", "rules", "pfor", "loop")
EVERY_STRATEGY = frozenset(["layers_mlp", "keras_cnn",
                            "keras_batch_norm_training"])


def _cases():
    cases = []
    for name in zoo.ZOO:
        for dtype in (tf.float64, tf.float32):
            if dtype == tf.float64 and name in zoo.FLOAT32_ONLY:
                continue
            # float32 runs the rules paths (the same graphs, other
            # rounding); float64 every strategy.
            every = dtype == tf.float64 or name in zoo.FLOAT32_ONLY
            for batches in (BATCHES, LARGE_BATCHES):
                # The default run builds pfor and loop on EVERY_STRATEGY's
                # models only (their graphs cost most of this file); `-m
                # slow` on every model.
                strategies = STRATEGIES if every and (
                    batches == LARGE_BATCHES or name in EVERY_STRATEGY) \
                    else ("auto", "rules")
                cases.append(pytest.param(
                    name, dtype, strategies, batches,
                    marks=() if batches == BATCHES else pytest.mark.slow,
                    id="%s-%s%s" % (name, dtype.name, "" if batches ==
                                    BATCHES else "-large")))
    return cases


def _fetches(loss, xs, strategy, clip, weights):
    return {
        "per_example": custagg.per_example_gradients(loss, xs, strategy),
        "norms": custagg.per_example_norms(loss, xs, strategy),
        "clipped": custagg.clipped_gradients(loss, xs, clip, strategy,
                                             return_norms=True),
        "moments": custagg.gradient_second_moments(loss, xs, strategy),
    }


def _scale(arrays):
    return max(float(np.max(np.abs(a))) if a.size else 0.0 for a in arrays)


def _check(got, per_example, clip_value, weights_value, rtol, label):
    # Entries zero up to rounding (an attention key bias) are judged on the
    # scale of all the model's per-example gradients.
    scale = _scale(per_example)
    for j, g in enumerate(per_example):
        testing.assert_close(got["per_example"][j], g, rtol,
                             "%s per_example[%d]" % (label, j), scale)
    norms = testing.numpy_norms(per_example)
    testing.assert_close(got["norms"], norms, rtol, label + " norms")
    sums, _ = testing.numpy_clipped(per_example, clip_value)
    clipped, clip_norms = got["clipped"]
    testing.assert_close(clip_norms, norms, rtol, label + " clip norms")
    sum_scale = _scale(sums)
    for j, s in enumerate(sums):
        testing.assert_close(clipped[j], s, rtol, "%s clipped[%d]" % (label, j),
                             sum_scale)
    moments = testing.numpy_second_moments(per_example)
    for j, m in enumerate(moments):
        testing.assert_close(got["moments"][j], m, rtol,
                             "%s moments[%d]" % (label, j), _scale(moments))


@pytest.mark.skipif(not zoo.has_keras_layers(),
                    reason="tf.compat.v1.layers / Keras 2 layers need the "
                           "tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name, dtype, strategies, batches", _cases())
def test_zoo_matches_loop(name, dtype, strategies, batches):
    rng = np.random.default_rng(sum(map(ord, name)))
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(7)
        model = zoo.ZOO[name](dtype, rng)
        loss, xs = model.loss, model.xs
        assert loss.shape.as_list() == [None], loss.shape

        # The plan: rules for every variable that is not truly coupled; a
        # coupled one is never on the statically proved rules (it may be
        # on the rules certified at run time, whose check then fails and
        # takes the exact form: the conv before a fused batch norm, whose
        # input the walk from the loss stops short of).
        plan = custagg.plan_per_example(loss, xs)
        for x, strategy, form in zip(xs, plan.strategies(), plan.forms()):
            if x.name in model.coupled:
                assert form not in ("rules", "loop-rules"), (x.name,
                                                             str(plan))
            else:
                assert strategy == "rules", str(plan)
        free = [x for x in xs if x.name not in model.coupled]
        if model.coupled:
            coupled = [x for x in xs if x.name in model.coupled]
            with pytest.raises(ValueError, match="strategy='rules'") as info:
                custagg.plan_per_example(loss, coupled, strategy="rules")
            assert "op '" in str(info.value)

        clip = tf.compat.v1.placeholder(loss.dtype, [])
        weights = tf.compat.v1.placeholder(loss.dtype, [None])
        rows = testing.loop_per_example(loss, xs, max(batches), rows=True)
        fetches = {}
        for strategy in strategies:
            use = free if strategy == "rules" else xs
            fetches[strategy] = _fetches(loss, use, strategy, clip, weights)
        weighted = custagg.weighted_gradients(loss, xs, weights)

        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batches:
                feed = model.feed(rng, batch)
                feed[weights] = rng.normal(size=[batch])
                # Clip about half of the examples: the median norm.
                feed[clip] = 1.0
                values = sess.run({"ref": rows[:batch], "got": fetches,
                                   "weighted": weighted}, feed)
                per_example = [np.stack(col) for col in zip(*values["ref"])]
                clip_value = float(np.median(testing.numpy_norms(
                    per_example)))
                feed[clip] = clip_value
                values = sess.run({"ref": rows[:batch], "got": fetches,
                                   "weighted": weighted}, feed)
                per_example = [np.stack(col) for col in zip(*values["ref"])]
                expected = [np.tensordot(feed[weights], g, axes=1)
                            for g in per_example]
                for j, g in enumerate(expected):
                    testing.assert_close(
                        values["weighted"][j], g, RTOL[dtype],
                        "%s B=%d weighted[%d]" % (name, batch, j),
                        _scale(expected))
                for strategy in strategies:
                    idx = [j for j, x in enumerate(xs)
                           if strategy != "rules" or
                           x.name not in model.coupled]
                    _check(values["got"][strategy],
                           [per_example[j] for j in idx], clip_value,
                           feed[weights], RTOL[dtype],
                           "%s %s B=%d" % (name, strategy, batch))
