"""Other people's TF1 models (`benchmarks/tf1_models.py`) against the loop.

Issue 24's yardstick. Each model is built once with a dynamic batch (and a
dynamic sequence length where it has one) and run at two batch sizes: B=1
and B=7 by default, B=32 and B=33 under `-m slow` (one at the pfor chunk
size, one past it). Sequence models get a different T at each B, so a
shape frozen at the first run would show. strategy "auto" must give, for
every variable:

* `per_example_gradients` equal to the loop reference (one
  `tf.compat.v1.gradients(loss[i])` per example, `custagg.testing`);
* `per_example_norms` equal to the reference's norms;
* `clipped_gradients(..., return_norms=True)` equal to the clipped sum of
  the reference (C = the median norm, so about half the examples clip);

fetched in the same `Session.run` as the reference (the NCE sampler draws
once per run). float64 to rtol 1e-9 where TF builds the model in float64,
else float32 to 1e-4 (`FLOAT32_ONLY` says why). A variable whose examples
truly interact (`Model.coupled`) must not be on "rules".

The plan the engine makes today is not asserted here (it is what issue 24
changes); `python -m benchmarks --tf1-models --plans` prints it.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

from benchmarks import tf1_models

RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}
DEFAULT_BATCHES = (1, 7)
SLOW_BATCHES = (32, 33)


# tf.compat.v1.losses computes every loss in float32
# (`compute_weighted_loss` casts the losses to float32 and back): the
# transformer's float64 loss passes through a float32 Cast, so a backward
# pass weighted by the clip factors (how custagg forms the clipped sum of
# an embedding table it cannot keep on rules) rounds the factors to float32
# there. Per-example gradients and norms (seed 1) stay float64-exact.
CLIP_RTOL = {"transformer": 1e-6}


def _dtype(name):
    return tf.float32 if name in tf1_models.FLOAT32_ONLY else tf.float64


# Cases that fail today because of an engine bug (issue 24), by
# (model, batches): kept strict so a fix shows up.
XFAIL = {}


def _cases():
    cases = []
    for batches, marks in ((DEFAULT_BATCHES, ()),
                           (SLOW_BATCHES, (pytest.mark.slow,))):
        for name in tf1_models.MODELS:
            why = XFAIL.get((name, batches))
            case_marks = list(marks)
            if why:
                case_marks.append(pytest.mark.xfail(strict=True, reason=why))
            cases.append(pytest.param(
                name, batches, marks=case_marks,
                id="%s-B%s" % (name, ",".join(map(str, batches)))))
    return cases


def _scale(arrays):
    return max([float(np.max(np.abs(a))) if a.size else 0.0
                for a in arrays] + [0.0])


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="tf.compat.v1.layers and the v1 RNN cells need "
                           "the tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name, batches", _cases())
def test_tf1_model_matches_loop(name, batches, graph):
    dtype = _dtype(name)
    rtol = RTOL[dtype]
    rng = np.random.default_rng(sum(map(ord, name)) + batches[-1])
    model = tf1_models.MODELS[name](dtype, rng)
    loss, xs = model.loss, model.xs
    assert loss.shape.as_list() == [None], loss.shape

    plan = custagg.plan_per_example(loss, xs)
    for x, form in zip(xs, plan.forms()):
        if x.name in model.coupled:
            assert form != "rules", str(plan)

    clip = tf.compat.v1.placeholder(loss.dtype, [])
    rows = testing.loop_per_example(loss, xs, max(batches), rows=True)
    got = {
        "per_example": custagg.per_example_gradients(loss, xs),
        "norms": custagg.per_example_norms(loss, xs),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }

    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf1_models.initializer())
        for batch in batches:
            # Sequence models: T shorter by one at the smaller batch.
            steps = (None if not model.dynamic_steps or batch == batches[-1]
                     else _short_steps(name))
            feed = model.feed(rng, batch, steps)
            # The clip norm: the reference's median norm on this feed.
            feed[clip] = 1.0
            ref = sess.run(rows[:batch], feed)
            per_example = [np.stack(col) for col in zip(*ref)]
            norms = testing.numpy_norms(per_example)
            feed[clip] = float(np.median(norms))
            values = sess.run({"ref": rows[:batch], "got": got}, feed)
            _check(values, feed[clip], rtol, CLIP_RTOL.get(name, rtol),
                   "%s %s B=%d T=%s" % (name, dtype.name, batch, steps))


def _short_steps(name):
    # One less than each model's own default T (benchmarks/tf1_models.py).
    return {"transformer": 4, "bilstm_tagger": 3, "ptb_lm": 3}[name]


def _check(values, clip_value, rtol, clip_rtol, label):
    per_example = [np.stack(col) for col in zip(*values["ref"])]
    got = values["got"]
    # Entries zero up to rounding are judged on the scale of all the model's
    # per-example gradients.
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
        testing.assert_close(clipped[j], s, clip_rtol,
                             "%s clipped[%d]" % (label, j), sum_scale)
