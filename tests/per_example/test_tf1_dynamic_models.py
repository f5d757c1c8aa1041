"""Issue 34's models (`benchmarks/zoo_models.DYNAMIC_MODELS`) against the
loop: shapes the static proof of separation cannot read, taken by the
rules with the run-time certificate.

Public TF1 code re-typed as written: jakeret/tf_unet (images of any size,
`crop_and_concat`'s `tf.slice` at run-time offsets and sizes,
`conv2d_transpose`), igormq/ctc_tensorflow_example (an LSTM over features
of any length, the reshape back by the inputs' B, time-major logits,
`tf.compat.v1.nn.ctc_loss`), kyubyong/neurobind (a regressor whose
`tf.squeeze(tf.layers.dense(enc, 1))` has unknown rank, so its L1 loss
has too), and R-Net-style attention pooling over a dynamic-length encoder.

Each model is built once with a dynamic batch (and image size or sequence
length) and run at two batch sizes, B=1 and B=7 (B=32 and B=33, the
float32 cases and the two slowest models under `-m slow`), the smaller B with a smaller image or shorter sequence, in
float64 and float32: per-example gradients, the clipped sum and its norms
(C the median norm) equal the loop reference (one
`tf.compat.v1.gradients(loss[i])` per example), all fetched in one
`Session.run` (dropout draws once per run). The plan must put every
variable whose ops all have a rule on the rules, statically proved or
certified at run time: nothing of these models couples examples.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.rules import registry as registry_lib

from benchmarks import zoo_models as tf1_models

import per_example_reference as ref

RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}
ON_RULES = ("rules", "loop-rules", "certified")
# The smaller run's image side or sequence length (the model's own default
# for the larger).
SHORT = {"unet": 18, "ctc_lstm": 4, "attention_pooling": 4}
# Over 45 s each on the 2-core machine (the U-Net's transposed convolution
# has no rule yet, so its weight takes the O(B^2) whole pass; the LSTM's
# graph is large): `-m slow` only.
SLOW_MODELS = {"unet", "ctc_lstm"}


def _cases():
    cases = []
    for batches, slow in (((1, 7), False), ((32, 33), True)):
        for name in tf1_models.DYNAMIC_MODELS:
            for dtype in (tf.float64, tf.float32):
                marks = [pytest.mark.slow] if slow or \
                    dtype == tf.float32 or name in SLOW_MODELS else []
                cases.append(pytest.param(
                    name, batches, dtype, marks=marks,
                    id="%s-%s-B%s" % (name, dtype.name,
                                      ",".join(map(str, batches)))))
    return cases


def _has_rules(x, plan, registry):
    """Whether every op that x's value meets (past reads and identities)
    has a registered rule."""
    del plan
    tensor = x.handle if hasattr(x, "handle") else x
    ops = [op for op in tensor.consumers()]
    seen = set()
    while ops:
        op = ops.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in ("ReadVariableOp", "Identity"):
            ops.extend(c for o in op.outputs for c in o.consumers())
            continue
        if registry.lookup(op.type) is None:
            return False
    return True


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="tf.compat.v1.layers and the v1 RNN cells need "
                           "the tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name, batches, dtype", _cases())
def test_dynamic_model_matches_loop(name, batches, dtype, graph):
    rng = np.random.default_rng(sum(map(ord, name)) + batches[-1])
    model = tf1_models.DYNAMIC_MODELS[name](dtype, rng)
    loss, xs = model.loss, model.xs

    plan = custagg.plan_per_example(loss, xs)
    registry = registry_lib.default_registry()
    for x, form in zip(xs, plan.forms()):
        if _has_rules(x, plan, registry):
            assert form in ON_RULES, "%s: %s\n%s" % (x.name, form, plan)

    clip = tf.compat.v1.placeholder(dtype, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "per_example": custagg.per_example_gradients(loss, xs),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf1_models.initializer())
        for batch in batches:
            steps = SHORT.get(name) if batch != batches[-1] else None
            feed = model.feed(rng, batch, steps)
            run = dict(fetches, ref=fetches["ref"][:batch])
            values = ref.run_at_median_clip(sess, run, feed, clip)
            ref.check_model_values(values, feed[clip], RTOL[dtype],
                                   "%s %s B=%d" % (name, dtype.name, batch))
