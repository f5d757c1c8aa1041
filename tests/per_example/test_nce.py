"""nce_loss's and sampled_softmax_loss's gathers on rules (issue 24).

Both losses gather the weights and biases at `concat([labels, sampled])`:
the first B*num_true rows are the examples' own, the S sampled rows are
shared by the batch. The gather rule splits them (`gather.NceSplit`):
example b's gradient w.r.t. the sampled rows is its own row of the sampled
logits' gradient against the shared rows. Checked here against the loop
reference (`custagg.testing`, one `tf.compat.v1.gradients(loss[i])` per
example), float64 (the sampler's float32 expected counts are cast and
passed as `sampled_values`), with a dynamic batch fed at B=1 and B=7
(`-m slow`: 32 and 33): per-example gradients, norms and the clipped sum,
all fetched in one `Session.run` with the reference (the sampler draws
once per run). A loss that couples the examples after the NCE (a roll of
the loss vector, told to keep rows apart) fools the plain rules (the
control) and is caught by the static proof when the table is right.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference
from custagg import testing
from custagg.batch_axis import table as table_lib
from custagg.rules import bilinear
from custagg.rules import gather

RTOL = 1e-9
DEFAULT_BATCHES = per_example_reference.DEFAULT_BATCHES
SLOW_BATCHES = per_example_reference.SLOW_BATCHES
BATCHES = per_example_reference.BATCHES

VOCAB, DIM, SAMPLED = 30, 4, 6


def _model(loss_fn="nce", num_true=1, roll=False):
    """Skip-gram on a dynamic batch, float64: an embedding, then `loss_fn`
    ("nce" or "sampled_softmax") with its own weights and biases."""
    inputs = tf.compat.v1.placeholder(tf.int32, [None], name="inputs")
    labels = tf.compat.v1.placeholder(tf.int64, [None, num_true],
                                      name="labels")
    init = tf.compat.v1.random_normal_initializer(seed=7, dtype=tf.float64)
    emb = tf.compat.v1.get_variable("emb", [VOCAB, DIM], tf.float64, init)
    w = tf.compat.v1.get_variable("nce_w", [VOCAB, DIM], tf.float64, init)
    b = tf.compat.v1.get_variable("nce_b", [VOCAB], tf.float64, init)
    sampled, true_expected, sampled_expected = \
        tf.random.log_uniform_candidate_sampler(
            labels, num_true, SAMPLED, True, VOCAB, seed=3)
    values = (sampled, tf.cast(true_expected, tf.float64),
              tf.cast(sampled_expected, tf.float64))
    x = tf.nn.embedding_lookup(emb, inputs)
    fn = tf.compat.v1.nn.nce_loss if loss_fn == "nce" else \
        tf.compat.v1.nn.sampled_softmax_loss
    loss = fn(weights=w, biases=b, labels=labels, inputs=x,
              num_sampled=SAMPLED, num_classes=VOCAB, num_true=num_true,
              sampled_values=values)
    if roll:
        loss = loss + 0.5 * tf.roll(loss, shift=1, axis=0)
    return inputs, labels, loss, [emb, w, b]


# The ids the colliding model's sampler draws from (equally likely, all
# but surely): six draws from three ids repeat one.
COLLIDING_IDS = (0, 3, 5)


def _colliding_model(loss_fn, num_true, remove_hits):
    """`_model` with candidates that collide: a sampler drawing `SAMPLED`
    ids with replacement (`unique=False`) from `COLLIDING_IDS`."""
    inputs = tf.compat.v1.placeholder(tf.int32, [None], name="inputs")
    labels = tf.compat.v1.placeholder(tf.int64, [None, num_true],
                                      name="labels")
    # (Other ids keep a tiny weight: a label's expected count is never 0.)
    unigrams = [1.0 if i in COLLIDING_IDS else 1e-9 for i in range(VOCAB)]
    sampled, true_q, sampled_q = tf.random.fixed_unigram_candidate_sampler(
        labels, num_true, SAMPLED, False, VOCAB, unigrams=unigrams, seed=5)
    init = tf.compat.v1.random_normal_initializer(seed=7, dtype=tf.float64)
    emb = tf.compat.v1.get_variable("emb", [VOCAB, DIM], tf.float64, init)
    w = tf.compat.v1.get_variable("nce_w", [VOCAB, DIM], tf.float64, init)
    b = tf.compat.v1.get_variable("nce_b", [VOCAB], tf.float64, init)
    fn = tf.compat.v1.nn.nce_loss if loss_fn == "nce" else \
        tf.compat.v1.nn.sampled_softmax_loss
    loss = fn(weights=w, biases=b, labels=labels,
              inputs=tf.nn.embedding_lookup(emb, inputs),
              num_sampled=SAMPLED, num_classes=VOCAB, num_true=num_true,
              sampled_values=(sampled, tf.cast(true_q, tf.float64),
                              tf.cast(sampled_q, tf.float64)),
              remove_accidental_hits=remove_hits)
    return inputs, labels, sampled, loss, [emb, w, b]


@pytest.mark.parametrize("remove_hits", [False, True], ids=["hits", "removed"])
@pytest.mark.parametrize("num_true", [1, 2])
@pytest.mark.parametrize("loss_fn", ["nce", "sampled_softmax"])
@pytest.mark.parametrize("batches", BATCHES)
def test_colliding_ids_are_exact(loss_fn, num_true, remove_hits, batches,
                                 graph, monkeypatch):
    """Sampled ids repeated, labels equal to sampled ids (accidental hits,
    kept or removed), labels repeated within an example (num_true=2) and
    across examples, inputs repeated: norms and the clipped sum exact
    against the loop, and built without the `[B, S, D]` per-example rows
    of the sampled weights (the sampled logits' MatMul rule is never asked
    for them)."""
    inputs, labels, sampled, loss, xs = _colliding_model(
        loss_fn, num_true, remove_hits)
    plan = custagg.plan_per_example(loss, xs)
    if num_true == 1:
        assert plan.forms() == ["rules"] * 3, str(plan)
    clip = tf.compat.v1.placeholder(tf.float64, [])
    ref = testing.loop_per_example(loss, xs, max(batches), rows=True)

    def refuse(self, ctx):
        raise AssertionError("the [B, S, D] rows were built")
    with monkeypatch.context() as m:
        m.setattr(bilinear.MatMulRule, "per_example", refuse)
        clipped = custagg.clipped_gradients(loss, xs, clip, return_norms=True)
    fetches = {"clipped": clipped, "sampled": sampled,
               "per_example": custagg.per_example_gradients(loss, xs)}
    rng = np.random.default_rng(sum(batches) + 10 * num_true)
    hits = 0
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b in batches:
            feed = {inputs: rng.integers(0, 3, [b]),
                    labels: rng.choice(COLLIDING_IDS + (1, 9),
                                       [b, num_true]),
                    clip: 1.0}
            feed[labels][0] = COLLIDING_IDS[:num_true]
            run = dict(fetches, ref=ref[:b])
            values = sess.run(run, feed)
            values["reference"] = [np.stack(col) for col in
                                   zip(*values["ref"])]
            values["clip"] = float(np.median(testing.numpy_norms(
                values["reference"])))
            feed[clip] = values["clip"]
            # One run for the reference and custagg: the sampler draws on
            # every run.
            values = sess.run(run, feed)
            values["reference"] = [np.stack(col) for col in
                                   zip(*values["ref"])]
            values["clip"] = feed[clip]
            assert len(set(values["sampled"])) < SAMPLED
            hits += np.isin(feed[labels], values["sampled"]).sum()
            _check_exact(values, "%s num_true=%d remove=%s B=%d" % (
                loss_fn, num_true, remove_hits, b))
    assert hits > 0


@pytest.mark.parametrize("num_true", [1, 2])
@pytest.mark.parametrize("loss_fn", ["nce", "sampled_softmax"])
def test_colliding_ids_group_norms_are_exact(loss_fn, num_true, graph):
    """Microbatch norms (M = 1, 2, 3, 6 at B=6: groups of 6, 3, 2 and 1
    examples, so both of `_SampledLookup.group_squared_norms`'s forms run
    for the weights (S Dp = 24) and the biases (S = 6)) and users' norms
    (fed group ids) with colliding ids, against the loop's group sums (one
    run: one draw)."""
    inputs, labels, sampled, loss, xs = _colliding_model(loss_fn, num_true,
                                                         False)
    users = tf.compat.v1.placeholder(tf.int32, [None], name="users")
    groups = (1, 2, 3, 6)
    fetches = {"ref": testing.loop_per_example(loss, xs, 6, rows=True),
               "sampled": sampled,
               "micro": [custagg.per_example_norms(loss, xs,
                                                   num_microbatches=m)
                         for m in groups],
               "users": custagg.per_example_norms(loss, xs,
                                                  group_ids=users)}
    rng = np.random.default_rng(20 + num_true)
    feed = {inputs: rng.integers(0, 3, [6]),
            labels: rng.choice(COLLIDING_IDS + (1, 9), [6, num_true]),
            users: np.array([4, 4, 0, 2, 0, 4])}
    feed[labels][0] = COLLIDING_IDS[:num_true]
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        values = sess.run(fetches, feed)
    assert len(set(values["sampled"])) < SAMPLED
    assert np.isin(feed[labels], values["sampled"]).any()
    ref = [np.stack(col) for col in zip(*values["ref"])]
    for m, got in zip(groups, values["micro"]):
        sums = [g.reshape((m, 6 // m) + g.shape[1:]).sum(1) for g in ref]
        testing.assert_close(got, testing.numpy_norms(sums), RTOL,
                             "%s num_true=%d M=%d" % (loss_fn, num_true, m))
    # Users in their order of first appearance (`custagg.group_segments`).
    by_user = [np.stack([g[feed[users] == u].sum(0) for u in (4, 0, 2)])
               for g in ref]
    testing.assert_close(values["users"], testing.numpy_norms(by_user), RTOL,
                         "%s num_true=%d users" % (loss_fn, num_true))


def _run(graph, inputs, labels, loss, xs, batches, num_true=1):
    clip = tf.compat.v1.placeholder(tf.float64, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "per_example": custagg.per_example_gradients(loss, xs),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    rng = np.random.default_rng(sum(batches) + num_true)
    out = {}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b in batches:
            # Repeated labels, and labels among the sampled ids (the
            # sampler favours small ids): accidental hits and repeats.
            feed = {inputs: rng.integers(0, VOCAB, [b]),
                    labels: rng.integers(0, 8, [b, num_true])}
            values = per_example_reference.run_at_median_clip(
                sess, dict(fetches, ref=fetches["ref"][:b]), feed, clip)
            # The sampler draws again in the second run: the reference is
            # that run's, as custagg's values are.
            values["reference"] = per_example_reference.stacked(
                values["ref"])
            values["clip"] = feed[clip]
            out[b] = values
    return out


def _gaps(values):
    """The largest relative gap of each quantity to the reference."""
    ref = values["reference"]
    gaps = []
    for j, g in enumerate(ref):
        got = values["per_example"][j]
        got = got if isinstance(got, np.ndarray) else np.asarray(got)
        gaps.append(np.max(np.abs(got - g)) / max(np.max(np.abs(g)), 1e-300))
    return gaps


def _check_exact(values, label):
    per_example_reference.assert_exact(values, label, RTOL)


@pytest.mark.parametrize("loss_fn", ["nce", "sampled_softmax"])
@pytest.mark.parametrize("batches", BATCHES)
def test_sampled_gathers_on_rules_are_exact(loss_fn, batches, graph):
    inputs, labels, loss, xs = _model(loss_fn)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["rules"] * 3, str(plan)
    split = [op for op in graph.get_operations()
             if gather.nce_split(op) is not None]
    assert len(split) == 2, split     # the weights' gather, the biases'
    for b, values in _run(graph, inputs, labels, loss, xs,
                          batches).items():
        _check_exact(values, "%s B=%d" % (loss_fn, b))


def test_several_true_labels_are_exact(graph):
    """num_true=2: the true rows are `[B*2]` (a fold the proof from the
    true rows does not read): exact whichever form the plan takes."""
    inputs, labels, loss, xs = _model("nce", num_true=2)
    custagg.plan_per_example(loss, xs)
    for b, values in _run(graph, inputs, labels, loss, xs, DEFAULT_BATCHES,
                          num_true=2).items():
        _check_exact(values, "num_true=2 B=%d" % b)


def test_coupling_after_the_loss_is_not_on_rules(graph):
    """A roll of the loss vector couples the examples after the NCE: the
    static proof (from the true rows and from the sampled logits) refuses
    the plain rules, and the values are exact."""
    inputs, labels, loss, xs = _model("nce", roll=True)
    plan = custagg.plan_per_example(loss, xs)
    assert "rules" not in plan.forms()[1:], str(plan)
    for b, values in _run(graph, inputs, labels, loss, xs,
                          DEFAULT_BATCHES).items():
        _check_exact(values, "rolled B=%d" % b)


def test_planted_coupling_fools_the_split(graph, monkeypatch):
    """The control: told that Roll keeps rows apart, the static proof
    passes, the split's rules run, and at B=7 they are wrong (so the tests
    above can fail)."""
    monkeypatch.setitem(table_lib._TABLE, "Roll",
                        table_lib.Entry(lambda op, index, axis: axis))
    inputs, labels, loss, xs = _model("nce", roll=True)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["rules"] * 3, str(plan)
    values = _run(graph, inputs, labels, loss, xs, (7,))[7]
    gaps = _gaps(values)
    assert gaps[1] > 1e-3 and gaps[2] > 1e-3, gaps


def test_split_group_quantities_are_exact(graph):
    """The split's other quantities: microbatch norms (M=3 at B=6), norms
    of users' sums (fed group ids), the elementwise second moments and a
    weighted sum, against the loop reference (one run: one draw)."""
    inputs, labels, loss, xs = _model("nce")
    users = tf.compat.v1.placeholder(tf.int32, [None], name="users")
    weights = tf.compat.v1.placeholder(tf.float64, [None], name="weights")
    fetches = {
        "ref": testing.loop_per_example(loss, xs, 6, rows=True),
        "micro": custagg.per_example_norms(loss, xs, num_microbatches=3),
        "users": custagg.per_example_norms(loss, xs, group_ids=users),
        "moments": custagg.gradient_second_moments(loss, xs),
        "weighted": custagg.weighted_gradients(loss, xs, weights),
    }
    rng = np.random.default_rng(8)
    feed = {inputs: rng.integers(0, VOCAB, [6]),
            labels: rng.integers(0, 8, [6, 1]),
            users: np.array([1, 1, 0, 2, 0, 1]),
            weights: rng.uniform(0.5, 2.0, [6])}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        values = sess.run(fetches, feed)
    per_example_reference.assert_group_quantities(
        values, feed[users], RTOL, weights=feed[weights])
