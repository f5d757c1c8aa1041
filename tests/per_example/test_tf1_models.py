"""Other people's TF1 models (`benchmarks/zoo_models.py`) against the loop.

Issue 24's yardstick. Each model is built once with a dynamic batch (and a
dynamic sequence length where it has one) and run at two batch sizes: B=1
and B=7 by default, B=32 and B=33 under `-m slow` (at the pfor chunk size
and past it). Sequence models get a shorter T at the smaller B, so a shape
frozen at the first run would show. With strategy "auto", for every
variable:

* `per_example_gradients` must equal the loop reference (one
  `tf.compat.v1.gradients(loss[i])` per example, `custagg.testing`);
* `clipped_gradients(..., return_norms=True)` must give the reference's
  norms and its clipped sum, with C the median norm (about half the
  examples clip); `per_example_norms` the same norms (slow cases only);

all fetched in one `Session.run` with the reference (the NCE sampler draws
once per run). float64 to rtol 1e-9 where TF builds the model in float64,
else float32 to 1e-4 (`tf1_models.FLOAT32_ONLY` says why). A variable whose
examples truly interact (`Model.coupled`) must not be on "rules".

Budget: the default cases must stay near 25 s on the 2-core CI machine.
The recurrent models are O(B^2) today (their whole-pass form builds the
pfor of a while loop's gradient, 15-20 s of graph building each), so their
B=1,7 cases run under `-m slow` too until issue 24 puts them on rules.

The plan the engine makes today is not asserted here (issue 24 changes
it); `python -m benchmarks --tf1-models --plans` prints it.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

from benchmarks import zoo_models as tf1_models

import per_example_reference as ref

RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}
DEFAULT_BATCHES = (1, 7)
SLOW_BATCHES = (32, 33)

# Too slow to build for the default run today (see the module docstring).
# in_batch_softmax (a control, exact today) only for the budget.
SLOW_MODELS = {"bilstm_tagger", "ptb_lm", "in_batch_softmax", "bilstm_crf"}

# tf.compat.v1.losses computes every loss in float32
# (`compute_weighted_loss` casts the losses to float32 and back): the
# transformer's float64 loss passes through a float32 Cast, so a backward
# pass weighted by the clip factors (how custagg forms the clipped sum of
# an embedding table it cannot keep on rules) rounds the factors to float32
# there. Per-example gradients and norms (seed 1) stay float64-exact.
CLIP_RTOL = {"transformer": 1e-6}

# Cases that fail today because of an engine bug, by (model, batches):
# strict, so a fix shows up as an XPASS failure to remove. (Issue 24's
# tf.roll model is exact since the copies' failed check takes the exact
# form under tf.cond.)
XFAIL = {}


def _dtype(name):
    return tf.float32 if name in tf1_models.FLOAT32_ONLY else tf.float64


def _cases():
    cases = []
    for batches in (DEFAULT_BATCHES, SLOW_BATCHES):
        for name in tf1_models.MODELS:
            marks = []
            if batches == SLOW_BATCHES or name in SLOW_MODELS:
                marks.append(pytest.mark.slow)
            why = XFAIL.get((name, batches))
            if why:
                marks.append(pytest.mark.xfail(
                    strict=True, reason=why,
                    raises=tf.errors.InvalidArgumentError))
            cases.append(pytest.param(
                name, batches, marks=marks,
                id="%s-B%s" % (name, ",".join(map(str, batches)))))
    return cases


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="tf.compat.v1.layers and the v1 RNN cells need "
                           "the tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name, batches", _cases())
def test_tf1_model_matches_loop(name, batches, graph):
    dtype = _dtype(name)
    rng = np.random.default_rng(sum(map(ord, name)) + batches[-1])
    model = tf1_models.MODELS[name](dtype, rng)
    loss, xs = model.loss, model.xs
    assert loss.shape.as_list() == [None], loss.shape

    plan = custagg.plan_per_example(loss, xs)
    for x, form in zip(xs, plan.forms()):
        if x.name in model.coupled:
            assert form != "rules", str(plan)

    clip = tf.compat.v1.placeholder(loss.dtype, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "per_example": custagg.per_example_gradients(loss, xs),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    if batches == SLOW_BATCHES:
        fetches["norms"] = custagg.per_example_norms(loss, xs)

    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf1_models.initializer())
        for batch in batches:
            steps = (_short_steps(name) if model.dynamic_steps and
                     batch != batches[-1] else None)
            feed = model.feed(rng, batch, steps)
            run = dict(fetches, ref=fetches["ref"][:batch])
            # C the median norm (1 where that is 0: in_batch_softmax at
            # B=1 has loss 0).
            values = ref.run_at_median_clip(sess, run, feed, clip)
            ref.check_model_values(
                values, feed[clip], RTOL[dtype],
                "%s %s B=%d T=%s" % (name, dtype.name, batch, steps),
                clip_rtol=CLIP_RTOL.get(name, RTOL[dtype]))


def _short_steps(name):
    # One less than the model's own T (benchmarks/zoo_models.py).
    return {"transformer": 4, "bilstm_tagger": 3, "ptb_lm": 3,
            "bilstm_crf": 3}[name]
