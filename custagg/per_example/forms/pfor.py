"""The forms of the "pfor" strategy, cheapest first: boundary, the copies
(vectorized, then in a while loop), the whole backward pass.

* "boundary" (O(B)): pfor over copies of just the ops where x meets batch
  data, seeded with the rows of their output gradients
  (`vectorized.find_boundary`, `vectorized.boundary_per_example`).
* "recompute" (O(B)): pfor over per-example copies of the forward pass
  (`forms.copies`); "recompute-loop" runs the same copies in a while
  loop (a loop whose trip count depends on the example, or a graph pfor
  cannot convert).
* "whole-pass" (O(B^2)): pfor over the whole backward pass seeded with
  `one_hot(i)`: exact for any graph pfor converts, the last resort.

Each falls back at build time (a refusal or TF's conversion error) to the
next; the whole pass and the boundary form fall back to the per-example
loop only under "auto" (asked-for "pfor" reports its error).
"""

from __future__ import annotations

import tensorflow as tf

from custagg import batch_axis
from custagg.graph import pfor as pfor_lib
from custagg.graph.copier import CannotCopy
from custagg.per_example import vectorized
from custagg.per_example.forms import base
from custagg.per_example.forms import copies
from custagg.per_example.forms.loop import LOOP


def _zeros(engine, group):
    return [lambda a=a: tf.zeros(engine.x_shape(a), engine.x_dtype(a))
            for a in group]


class _PforForm(base.Form):
    """The forms built by pfor: ops in the scope "<name>_form", refusals
    read "no <name> form: ", and a refused build under "auto" takes the
    loop."""

    strategy = "pfor"
    cost = "O(B)"

    @property
    def scope(self):
        return self.name.replace("-", "_") + "_form"

    @property
    def refused_as(self):
        return "no %s form: " % self.name

    def fallback(self, requested):
        return LOOP if requested == "auto" else None


class BoundaryForm(_PforForm):
    name = "boundary"
    what = "pfor at the ops where x meets batch data"

    def plan(self, x_tensor, ctx):
        bounds, why = vectorized.find_boundary(
            x_tensor, ctx.loss, ctx.ancestors, ctx.region(), ctx.static_b)
        if bounds is None:
            raise base.Refused(why)
        return base.Choice(self, boundaries=bounds)

    def build(self, engine, group):
        stacked = vectorized.boundary_per_example(
            engine.loss, group, [a.boundaries for a in group],
            engine.batch_size, engine.chunk)
        return dict(zip([id(a) for a in group], stacked))


class CopiesForm(_PforForm):
    """pfor over per-example copies of the forward pass."""

    name = "recompute"
    what = "pfor over per-example copies of the forward pass"

    def plan(self, x_tensor, ctx):
        forward = ctx.forward()
        if isinstance(forward, CannotCopy):
            raise base.Refused(batch_axis.Reason(str(forward), forward.op))
        if x_tensor.op in forward.op_set:
            raise base.Refused(batch_axis.Reason(
                "x ('%s') depends on batch data, and a copy of the forward "
                "pass would copy it too" % x_tensor.name, x_tensor.op))
        varying = ctx.varying_loop(forward)
        if varying is not None:
            # Static: planned as the while loop, so the plan says what runs.
            return base.Choice(COPIES_LOOP, forward=forward, note=(
                "the loop '%s' runs as many iterations as the batch data "
                "asks (a condition on batch data), which pfor's conversion "
                "of the copies does not run correctly" % varying.name))
        if not pfor_lib.vectorizes_exactly(forward.ops, copied=True):
            return base.Choice(COPIES_LOOP, forward=forward, note=(
                "the copies hold an op pfor converts wrongly (a tf.roll "
                "along a negative axis)"))
        return base.Choice(self, forward=forward)

    def _args(self, engine, group):
        tensors = [a.tensor for a in group]
        dtypes = [pfor_lib.grad_dtype(t) for t in tensors]
        batch = copies.batch_size(group[0].forward, engine.batch_size)
        return tensors, _zeros(engine, group), dtypes, batch

    def build(self, engine, group):
        tensors, zeros, dtypes, batch = self._args(engine, group)
        out = copies.per_example_pfor(
            group[0].forward, tensors, zeros, dtypes, batch, engine.chunk,
            copy_gradients, exact=_exact(engine, group))
        return dict(zip([id(a) for a in group], out))

    def fallback(self, requested):
        del requested
        return COPIES_LOOP


class CopiesLoopForm(CopiesForm):
    """The same copies, one example per iteration of a while loop."""

    name = "recompute-loop"
    what = ("a while loop over per-example copies of the forward pass")
    refused_as = "no recompute form: "     # its plan is CopiesForm's

    def build(self, engine, group):
        tensors, zeros, dtypes, batch = self._args(engine, group)
        out = copies.per_example_loop(
            group[0].forward, tensors, zeros, dtypes,
            [engine.static_x_shape(a) for a in group], batch, copy_gradients,
            exact=_exact(engine, group))
        return dict(zip([id(a) for a in group], out))

    def fallback(self, requested):
        del requested
        return WHOLE_PASS


def _exact(engine, group):
    """What a step whose copies fail their loss check builds instead (under
    `tf.cond`, so only such a step runs it): the whole pass, exact."""
    return lambda: engine.exact(group)


def copy_gradients(ys, xs, **kwargs):
    """TF's own gradients for the copies of the forward pass: custagg's
    traversal adds nothing there, and TF's leaves no `zeros_like` of the
    TensorLists a loop accumulates (which pfor cannot vectorize)."""
    return tf.compat.v1.gradients(ys, xs, **kwargs)


class WholePassForm(_PforForm):
    name = "whole-pass"
    what = "pfor over the whole backward pass"
    cost = "O(B^2)"
    plan = base.takes_every_x

    def build(self, engine, group):
        stacked = vectorized.whole_pass_per_example(
            engine.loss, [a.tensor for a in group], _zeros(engine, group),
            engine.batch_size, engine.chunk)
        return dict(zip([id(a) for a in group], stacked))


BOUNDARY = BoundaryForm()
COPIES = CopiesForm()
COPIES_LOOP = CopiesLoopForm()
WHOLE_PASS = WholePassForm()
