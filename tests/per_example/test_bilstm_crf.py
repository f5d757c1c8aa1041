"""Issue 34's regression: a bi-LSTM CRF tagger with a character-level
bi-LSTM (`benchmarks.zoo_models.bilstm_crf`, re-typed from
guillaumegenthial/sequence_tagging) failed at run time under "auto" with
"a loop rule's op 'lstm_cell/BiasAdd' has other rows than the batch's
examples" at every B.

The mechanism: the character-level loops run on the `[B*T, L, dc]`
characters of every word, so their taps have R = B*T rows, an
example-major fold of the batch. The loop rules assumed R = B (the
two-pass build's `[T, B, N]` eps and its row check, the one pass's dz
stack of `[B, N]` items), and built those tensors outside the certified
form's `tf.cond`, so every step failed, certified or not. Now the taps'
rows are their own (`loop_rebuild.Hook.rows`), `loop_rules.LoopRule`
reads R rows example-major (row r of example r // (R/B)), and the
certificate at the loop's outputs checks that map (any multiple of B).

Also a plain bi-GRU / bi-LSTM classifier with `sequence_length` and a
dynamic T. Each model is built once with a dynamic batch and checked at
several B against the loop reference (`per_example_reference.check_model_values`: per-example
gradients, norms and the clipped sum), float64.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

import per_example_reference as ref
from benchmarks import zoo_models as tf1_models

tf1 = tf.compat.v1

pytestmark = pytest.mark.skipif(
    not tf1_models.has_tf1_layers(),
    reason="the v1 RNN cells need the tf-keras package on this TensorFlow")

RTOL = 1e-9


def _run(model, batches, graph, seed, every_function=True):
    """The model's per-example gradients, norms and clipped sum against the
    loop reference at each of `batches` (one graph, a dynamic B); only the
    clipped sum and its norms without `every_function` (each function's
    graph takes the tagger most of a minute to build and optimize)."""
    loss, xs = model.loss, model.xs
    clip = tf1.placeholder(loss.dtype, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    if every_function:
        fetches["per_example"] = custagg.per_example_gradients(loss, xs)
        fetches["norms"] = custagg.per_example_norms(loss, xs)
    rng = np.random.default_rng(seed)
    with tf1.Session(graph=graph) as sess:
        sess.run(tf1_models.initializer())
        for batch in batches:
            feed = model.feed(rng, batch, 3 if batch != batches[-1] else None)
            run = dict(fetches, ref=fetches["ref"][:batch])
            # C the median norm: about half the examples clip.
            values = ref.run_at_median_clip(sess, run, feed, clip)
            ref.check_model_values(values, feed[clip], RTOL, "B=%d" % batch,
                                   clip_rtol=RTOL)


def _loop_forms(plan, xs):
    """{x name: its plan line} of the xs whose rules are in a loop."""
    lines = str(plan).splitlines()[1:]
    return {x.name: line for x, line in zip(xs, lines) if " in loop " in line}


def test_the_tagger_plans_every_lstm_weight_on_loop_rules(graph):
    model = tf1_models.bilstm_crf(tf.float64, np.random.default_rng(0))
    plan = custagg.plan_per_example(model.loss, model.xs)
    forms = dict(zip([x.name for x in model.xs], plan.forms()))
    assert set(forms.values()) <= {"rules", "loop-rules", "certified"}, \
        str(plan)
    in_loops = _loop_forms(plan, model.xs)
    lstm = [x.name for x in model.xs if "lstm_cell" in x.name]
    assert len(lstm) == 8, lstm      # chars and words, fw and bw, W and b
    assert set(lstm) <= set(in_loops), str(plan)
    assert any("chars/" in name for name in in_loops), str(plan)


# The default run checks the clipped sum and its norms (the DP path; the
# regression failed every function at run time); `-m slow` every function,
# at B 1,7 and 32,33.
@pytest.mark.parametrize("static_steps, batches, every_function", [
    pytest.param(True, (1, 7), False, id="static-T-B1,7-clipped"),
    pytest.param(True, (1, 7), True, id="static-T-B1,7",
                 marks=pytest.mark.slow),
    pytest.param(True, (32, 33), True, id="static-T-B32,33",
                 marks=pytest.mark.slow),
])
def test_the_tagger_matches_the_loop(static_steps, batches, every_function,
                                     graph):
    model = tf1_models.bilstm_crf(tf.float64, np.random.default_rng(1),
                                  static_steps=static_steps)
    _run(model, batches, graph, seed=sum(batches),
         every_function=every_function)


def _birnn_classifier(cell, dynamic_steps=True):
    """Embeddings, a bidirectional `dynamic_rnn` of two `cell`s with
    `sequence_length`, the final states concatenated, a dense layer and
    softmax cross-entropy (`[B]`): a sentence classifier as TF1 tutorials
    write it."""
    vocab, dim, hidden, classes, steps = 13, 4, 5, 3, 5
    ids = tf1.placeholder(tf.int32, [None, None if dynamic_steps else steps])
    lengths = tf1.placeholder(tf.int32, [None])
    labels = tf1.placeholder(tf.int32, [None])
    init = tf1.glorot_uniform_initializer(seed=3, dtype=tf.float64)
    with tf1.variable_scope("clf", initializer=init):
        emb = tf1.get_variable("embedding", [vocab, dim], tf.float64)
        inputs = tf.nn.embedding_lookup(emb, ids)
        _, states = tf1.nn.bidirectional_dynamic_rnn(
            cell(hidden), cell(hidden), inputs, sequence_length=lengths,
            dtype=tf.float64)
        if isinstance(states[0], tf1.nn.rnn_cell.LSTMStateTuple):
            states = [s.h for s in states]
        logits = tf1.layers.dense(tf.concat(states, 1), classes)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)

    def feed(rng, batch, t=None):
        t = t or steps
        return {ids: rng.integers(0, vocab, [batch, t]),
                lengths: rng.integers(1, t + 1, batch),
                labels: rng.integers(0, classes, batch)}
    return tf1_models.Model(loss, tf1.trainable_variables(), feed,
                            dynamic_steps=dynamic_steps)


@pytest.mark.parametrize("cell", ["GRUCell", "LSTMCell"])
def test_a_birnn_classifier_with_dynamic_steps_matches_the_loop(cell, graph):
    model = _birnn_classifier(getattr(tf1.nn.rnn_cell, cell))
    plan = custagg.plan_per_example(model.loss, model.xs)
    assert set(plan.forms()) <= {"rules", "loop-rules", "certified"}, \
        str(plan)
    _run(model, (1, 7), graph, seed=7)
