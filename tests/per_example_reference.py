"""Checks every public per-example function against one tf.gradients per example.

Shared by tests/test_edge_cases.py and tests/traversal/test_randomized.py (and
`forms_behind`, by the plan == execution tests). The
reference is TF's own traversal (`tf.compat.v1.gradients(loss[i], x)` for
each example i, built for the batch size that is fed, so it also serves
dynamic batches), and `None` is expected exactly where
`tf.compat.v1.gradients(tf.reduce_sum(loss), x)` is `None`.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

# The batch sizes a rule's or form's test runs at: one and a few in the
# default run, a multiple of 32 and one past it under `-m slow`.
DEFAULT_BATCHES = (1, 7)
SLOW_BATCHES = (32, 33)
BATCHES = [pytest.param(DEFAULT_BATCHES, id="B1,7"),
           pytest.param(SLOW_BATCHES, id="B32,33", marks=pytest.mark.slow)]

# Each per-example form's name scope in custagg/per_example/forms/ (each form's `scope`).
FORM_SCOPES = {"rules": "per_example_rules", "boundary": "boundary_form",
               "whole-pass": "whole_pass_form", "loop": "per_example_loop",
               "recompute": "recompute_form",
               "recompute-loop": "recompute_loop_form",
               "loop-rules": "loop_rules_form", "certified": "certified"}
# What a form's result is built from: the certified form is the rules' values
# selected by the certificate's tf.cond (whose exact branch is a function
# body, not behind the result's inputs).
BEHIND = {"certified": {"certified", "rules"}}


def forms_behind(t):
    """The forms (keys of FORM_SCOPES) whose name scopes hold ops behind `t`
    (data and control inputs)."""
    found, seen, stack = set(), set(), [t.op]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        for form, scope in FORM_SCOPES.items():
            if "/%s/" % scope in "/" + op.name + "/":
                found.add(form)
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    return found


FUNCTIONS = ("per_example_gradients", "per_example_norms",
             "clipped_gradients", "clipped_per_x", "weighted_gradients",
             "gradient_second_moments")


def build_functions(loss, xs, strategy, functions=FUNCTIONS):
    """{name: fetches} for each public function under `strategy`, plus the
    weights placeholder the weighted sum uses."""
    out = {}
    weights = tf.compat.v1.placeholder(loss.dtype, [None], name="weights")
    for fn in functions:
        if fn == "per_example_gradients":
            out[fn] = custagg.per_example_gradients(loss, xs, strategy=strategy)
        elif fn == "per_example_norms":
            out[fn] = [custagg.per_example_norms(loss, xs, strategy=strategy)]
        elif fn == "clipped_gradients":
            grads, norms = custagg.clipped_gradients(
                loss, xs, 0.5, strategy=strategy, return_norms=True)
            out[fn] = list(grads) + [norms]
        elif fn == "clipped_per_x":
            grads, norms = custagg.clipped_gradients(
                loss, xs, [0.5] * len(xs), strategy=strategy,
                return_norms=True)
            out[fn] = list(grads) + list(norms)
        elif fn == "weighted_gradients":
            out[fn] = custagg.weighted_gradients(loss, xs, weights)
        elif fn == "gradient_second_moments":
            out[fn] = custagg.gradient_second_moments(loss, xs,
                                                      strategy=strategy)
    return out, weights


def references(sess, loss, xs, feed, batch):
    """(connected flags, [B, *x] arrays) from TF's traversal."""
    total = tf.compat.v1.gradients(tf.reduce_sum(loss), xs)
    connected = [g is not None for g in total]
    per_ex = testing.loop_per_example(loss, xs, batch)
    values = sess.run(per_ex, feed)
    return connected, [v.astype(np.float64) for v in values]


def _expected(fn, connected, per_ex, weights):
    batch = len(weights)
    live = [g for g, c in zip(per_ex, connected) if c]
    if fn == "per_example_gradients":
        return [g if c else None for g, c in zip(per_ex, connected)]
    if fn == "per_example_norms":
        return [testing.numpy_norms(live) if live else np.zeros(batch)]
    if fn == "clipped_gradients":
        sums, norms = (testing.numpy_clipped(live, 0.5) if live
                       else ([], np.zeros(batch)))
        it = iter(sums)
        return [next(it) if c else None for c in connected] + [norms]
    if fn == "clipped_per_x":
        if not per_ex:
            return []
        sums, norms = testing.numpy_clipped(per_ex, [0.5] * len(per_ex),
                                            per_x=True)
        return ([s if c else None for s, c in zip(sums, connected)]
                + [n if c else np.zeros_like(n)
                   for n, c in zip(norms, connected)])
    if fn == "weighted_gradients":
        return [np.tensordot(weights, g, axes=1) if c else None
                for g, c in zip(per_ex, connected)]
    if fn == "gradient_second_moments":
        return [s if c else None for s, c in
                zip(testing.numpy_second_moments(per_ex) if per_ex else [],
                    connected)]
    raise KeyError(fn)


def _dense_shape_ok(got, x_shape):
    """IndexedSlices results must describe x's shape, as TF's do."""
    if hasattr(got, "dense_shape"):
        return tuple(np.asarray(got.dense_shape).tolist()) == tuple(x_shape)
    return True


def check(sess, loss, xs, feed, built, weights_ph, rtol=1e-6, label="",
          refs=None):
    """Runs `built` (from `build_functions`) and compares with the loop.

    `refs`: `references(...)` for this feed, when the caller has them.
    Returns None when everything agrees, else a message.
    """
    batch = int(sess.run(tf.shape(loss)[0], feed))
    connected, per_ex = refs or references(sess, loss, xs, feed, batch)
    weights = np.linspace(-1.0, 2.0, batch)
    feed = dict(feed)
    feed[weights_ph] = weights
    for fn, fetches in built.items():
        want = _expected(fn, connected, per_ex, weights)
        live = [(j, f) for j, f in enumerate(fetches) if f is not None]
        got = dict(zip([j for j, _ in live],
                       sess.run([f for _, f in live], feed)))
        for j, w in enumerate(want):
            where = "%s %s[%d]" % (label, fn, j)
            if w is None:
                if fetches[j] is not None:
                    return "%s: expected None (as tf.gradients), got %s" % (
                        where, fetches[j])
                continue
            if fetches[j] is None:
                return "%s: got None, tf.gradients has a gradient" % where
            if j < len(xs) and fn != "per_example_norms" and \
                    not _dense_shape_ok(got[j], w.shape):
                return "%s: IndexedSlices dense_shape %s, expected %s" % (
                    where, got[j].dense_shape, w.shape)
            why = testing.compare(got[j], w, rtol, where)
            if why:
                return why
    return None


def assert_group_quantities(values, users, rtol, microbatches=3,
                            weights=None):
    """Checks the group quantities of one run against the loop reference.

    Args:
      values: the run's {"ref": `testing.loop_per_example(..., rows=True)`
        values, "micro": `per_example_norms(num_microbatches=microbatches)`,
        "users": `per_example_norms(group_ids=users)`, "moments":
        `gradient_second_moments`, and "weighted":
        `weighted_gradients(weights)` when `weights` is given}.
      users: the fed `[B]` user ids.
      rtol: relative tolerance.
      microbatches: how many microbatches "micro" was built with.
      weights: the fed `[B]` weights of "weighted", or None.
    """
    ref = [np.stack(col) for col in zip(*values["ref"])]

    def sq_norms(sums):
        return sum(np.sum(np.reshape(s, [len(s), -1]) ** 2, 1) for s in sums)
    size = len(ref[0]) // microbatches
    micro = [g.reshape((microbatches, size) + g.shape[1:]).sum(1)
             for g in ref]
    testing.assert_close(values["micro"], sq_norms(micro) ** .5, rtol,
                         "microbatch norms")
    # Users in their order of first appearance (`custagg.group_segments`).
    order = [u for k, u in enumerate(users) if u not in users[:k]]
    by_user = [np.stack([g[users == u].sum(0) for u in order]) for g in ref]
    testing.assert_close(values["users"], sq_norms(by_user) ** .5, rtol,
                         "user norms")
    for j, g in enumerate(ref):
        testing.assert_close(values["moments"][j], np.sum(g ** 2, 0), rtol,
                             "second moments[%d]" % j)
        if weights is not None:
            testing.assert_close(values["weighted"][j],
                                 np.tensordot(weights, g, 1), rtol,
                                 "weighted[%d]" % j)


def assert_exact(values, label, rtol):
    """Checks one run's per-example gradients (when fetched), norms and
    clipped sum against the loop reference: `values` holds "reference"
    (per x, `[B, *x]`), "per_example" (optional), "clip" and "clipped"
    (`clipped_gradients(..., return_norms=True)`'s values)."""
    ref = values["reference"]
    for j, g in enumerate(ref[:len(values.get("per_example", ()))]):
        testing.assert_close(values["per_example"][j], g, rtol,
                             "%s per_example[%d]" % (label, j))
    sums, _ = testing.numpy_clipped(ref, values["clip"])
    clipped, norms = values["clipped"]
    testing.assert_close(norms, testing.numpy_norms(ref), rtol,
                         label + " norms")
    for j, s in enumerate(sums):
        testing.assert_close(clipped[j], s, rtol,
                             "%s clipped[%d]" % (label, j))


def stacked(rows):
    """`[B]` per-example gradient lists -> one `[B, ...]` array per x."""
    return [np.stack(col) for col in zip(*rows)]


def max_abs(arrays):
    """The largest magnitude over `arrays` (0 when all are empty): the scale
    on which entries zero up to rounding are judged."""
    return max([float(np.max(np.abs(a))) if a.size else 0.0
                for a in arrays] + [0.0])


def check_model_values(values, clip_value, rtol, label, clip_rtol=None):
    """A model's fetched `values` against its loop reference `values["ref"]`
    (`[B]` lists of per-example gradients): "per_example", "clipped"
    (sums, norms) at `clip_value`, and "per_example" and "norms" when
    fetched. `clip_rtol` (default `rtol`) for the clipped sums."""
    per_example = stacked(values["ref"])
    # Entries zero up to rounding (an attention key bias) are judged on the
    # scale of all the model's per-example gradients.
    scale = max_abs(per_example)
    for j, g in enumerate(per_example if "per_example" in values else ()):
        testing.assert_close(values["per_example"][j], g, rtol,
                             "%s per_example[%d]" % (label, j), scale)
    norms = testing.numpy_norms(per_example)
    sums, _ = testing.numpy_clipped(per_example, clip_value)
    clipped, clip_norms = values["clipped"]
    testing.assert_close(clip_norms, norms, rtol, label + " clip norms")
    if "norms" in values:
        testing.assert_close(values["norms"], norms, rtol, label + " norms")
    sum_scale = max_abs(sums)
    for j, s in enumerate(sums):
        testing.assert_close(clipped[j], s, rtol if clip_rtol is None
                             else clip_rtol,
                             "%s clipped[%d]" % (label, j), sum_scale)


def run_at_median_clip(sess, run, feed, clip):
    """`sess.run(run, feed)` with `feed[clip]` = C, the median of the
    reference's per-example norms (`run["ref"]`), so about half the
    examples clip; 1 where that median is 0 (a loss of 0 at B=1). Runs
    twice: the first run finds C."""
    feed[clip] = 1.0
    values = sess.run(run, feed)
    feed[clip] = float(np.median(testing.numpy_norms(
        stacked(values["ref"])))) or 1.0
    return sess.run(run, feed)
