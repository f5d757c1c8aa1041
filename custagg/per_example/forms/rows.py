"""Plan-time refusal of the certificate: rule rows that cannot be examples.

The certified form (`rules.CERTIFIED`) reads row r of a rule op's output as
example r's (the row map pi of `certificate.Certificate`). Some rule ops have
rows that no run-time check can map to examples, at any step:

* rows assembled by a concat along the row axis with a block of fixed size
  (nce_loss gathers `concat([labels, sampled_ids])`: B true rows, then S
  sampled rows shared by the whole batch): R = B' + S rows, the S of them
  built from no example;
* rows drawn by a candidate sampler (nce_loss's sampled candidates, one
  block shared by the batch), or made by `Unique` (the distinct ids of a sparse lookup: one row per id, not per
  example);
* rows that fold the batch with another axis the rule did not unfold
  (`[B*T, D]` read as `[B, D]`), when the order of the fold is not proved:
  R = B * T.

A fold whose order is proved is read instead (`fold_of`): the rows of a
reshape `[B, T..., D] -> [-1, D]` of a tensor x whose axis 0 holds the
batch (the batch-axis inference from the loss says so: x on axis 0, or the
reshape's output as `Folded(T, 0)`), followed to the rule through ops that
keep rows one to one (a projection `tf.reshape(rnn_out, [-1, H]) @ W + b`),
are example-major: row r is example r // T (row-major order). The
certificate checks `gc_r = c_{r // T} g1_r` there and the rules sum rows
by that map (`folded_rows.FoldedRows`). A fold of two leading axes whose order
is not proved (a time-major `[T, B, H]`, row r of example r mod B, or a
batch-major one the inference did not reach) is read either way: the
certificate checks both maps at run time and the rules take the one that
holds (`RowFold.either`); a fold of more axes stays refused.

Their run-time check fails on every step, so certifying them would pay the
seeded pass and the exact form every step. `non_example_rows` finds them by
walking back from the rule's start along its row axis through ops that
keep rows one to one (identity-like ops, a gather's ids, a reshape that
only drops unit axes), and answers with the reason, or None. It only
refuses on what it can read from the graph; anything else stays certified
(the run-time check is exact either way: refusing only changes the cost).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import batch_axis
from custagg import op_kinds
from custagg._tf_compat import tensor_util
from custagg.batch_axis import symbolic_shapes

# How far the walk goes back (it follows one chain of ops).
_MAX_DEPTH = 32


class RowFold(collections.namedtuple("RowFold",
                                      ["source", "op", "either"])):
    """Rows that fold the batch: `source` `[A0, A1, ..., D]` reshaped by
    `op` into rows. Example-major (`source` `[B, T..., D]`, axis 0 the
    batch: row r is example r // T, T = rows / B), proved so; or, with
    `either`, a fold of two leading axes whose order is not proved
    (`[B, T, D]` or a time-major `[T, B, D]`: row r of example r // T or
    r mod B): the certificate finds which at run time."""

    def __new__(cls, source, op, either=False):
        return super(RowFold, cls).__new__(cls, source, op, either)


def non_example_rows(start, axis, loss):
    """A `batch_axis.Reason` when the rows of `start` along `axis` cannot
    be the batch's examples (see the module), else None (also for a fold
    whose order is proved: `fold_of`).

    Args:
      start: the rule's start tensor (`Rule.coupling_start`).
      axis: its row axis (an int).
      loss: the `[B]` per-example loss.
    """
    found = _walk(start, axis, start, 0, loss=loss)
    if isinstance(found, RowFold):
        return None
    rows = _static_dim(start, axis)
    batch = _static_dim(loss, 0)
    if rows is not None and batch is not None and rows != batch:
        return batch_axis.Reason(
            "the %d rows of '%s' (axis %d) are not the batch's %d examples"
            % (rows, start.name, axis, batch), start.op)
    return found


def fold_of(start, axis, loss):
    """The `RowFold` whose rows are `start`'s along `axis` (axis 0 only),
    when the fold's order is proved (see the module), else None."""
    if axis != 0:
        return None
    found = _walk(start, axis, start, 0, loss=loss)
    return found if isinstance(found, RowFold) else None


def _static_dim(t, axis):
    if t.shape.rank is None or axis >= t.shape.rank:
        return None
    return tf.compat.dimension_value(t.shape[axis])


def _walk(t, axis, start, depth, cols=None, loss=None):
    """`cols`: what is known of t's axes after the rows (a MatMul's
    contraction size, which a reshape's static shape may not say)."""
    if depth > _MAX_DEPTH:
        return None
    op = t.op
    where = "the rows of '%s' (axis %d)" % (start.name, axis)
    # (Not any random op: ids drawn per example, `[B]` of them, may well
    # be rows of examples. A candidate sampler draws one shared block.)
    if op.type in op_kinds.CANDIDATE_SAMPLERS:
        return batch_axis.Reason(
            "%s are drawn by op '%s' (type %s): sampled rows, not examples"
            % (where, op.name, op.type), op)
    if op.type == "Unique" and t.value_index == 0:
        return batch_axis.Reason(
            "%s are the distinct ids made by op '%s' (type Unique): one "
            "row per id, not per example" % (where, op.name), op)
    if op.type == "ConcatV2" and axis == 0:
        return _concat(op, where, start, depth, loss)
    if op.type in op_kinds.SAME_ROWS and op.inputs:
        return _walk(op.inputs[0], axis, start, depth + 1, loss=loss)
    if op.type in op_kinds.GATHERS and axis == 0:
        ids = op.inputs[1]
        gather_axis = 0 if op.type != "GatherV2" else \
            tensor_util.constant_value(op.inputs[2])
        if gather_axis is not None and int(gather_axis) == 0 and \
                ids.shape.rank is not None and ids.shape.rank >= 1:
            # Output rows (axis 0) are the ids' rows.
            return _walk(ids, 0, start, depth + 1, loss=loss)
        return None
    if op.type == "MatMul" and axis == 0 and t.value_index == 0:
        if op.get_attr("transpose_a"):
            return None
        # The rows' length is the contraction size, the weight's.
        w = op.inputs[1]
        inner = _static_dim(w, 1 if op.get_attr("transpose_b") else 0)
        return _walk(op.inputs[0], 0, start, depth + 1,
                     None if inner is None else
                     [symbolic_shapes.Dim.of(inner)], loss=loss)
    if op.type == "Reshape" and axis == 0:
        return _reshape(op, where, start, depth, cols, loss)
    if op.type == "Transpose" and t.value_index == 0:
        perm = tensor_util.constant_value(op.inputs[1])
        if perm is not None and int(perm[axis]) == axis:
            return _walk(op.inputs[0], axis, start, depth + 1, loss=loss)
        return None
    if op.type == "BiasAdd" and axis == 0:
        return _walk(op.inputs[0], 0, start, depth + 1, loss=loss)
    if op.type in op_kinds.BROADCASTING and axis == 0:
        # The rows come from the one input of the output's rank whose
        # axis 0 is not a broadcast 1 (a bias or a scale has no rows).
        rank = t.shape.rank
        full = [x for x in op.inputs if x.shape.rank == rank and
                _static_dim(x, 0) != 1]
        if rank and len(full) == 1:
            return _walk(full[0], 0, start, depth + 1, loss=loss)
    return None


def _concat(op, where, start, depth, loss=None):
    """Rows concatenated along axis 0: a block of fixed size is no
    example's; a sampled block neither."""
    n = op.get_attr("N")
    concat_axis = tensor_util.constant_value(op.inputs[n])
    if concat_axis is None or int(concat_axis) != 0 or n < 2:
        return None
    for inp in op.inputs[:n]:
        inner = _walk(inp, 0, start, depth + 1, loss=loss)
        if isinstance(inner, RowFold):
            # A fold next to other rows: row r is no longer r // T.
            return batch_axis.Reason(
                "%s are concatenated by op '%s' with rows of a fold ('%s')"
                % (where, op.name, inner.op.name), op)
        if inner is not None:
            return inner
    for inp in op.inputs[:n]:
        size = _static_dim(inp, 0)
        if size:
            return batch_axis.Reason(
                "%s are concatenated by op '%s' with a block of %d rows "
                "('%s') whose number does not change with the batch: "
                "rows not indexed by the batch" % (where, op.name, size,
                                                   inp.name), op)
    return None


def _reshape(op, where, start, depth, cols=None, loss=None):
    """A reshape whose output axis 0 takes input axes 0..k (the output's
    other axes hold exactly the input's axes after k, as symbolic shapes
    read them): the rows are the input's when the axes 1..k are all 1, a
    fold of the batch with them when one of them may not be."""
    x, y = op.inputs[0], op.outputs[0]
    shapes = symbolic_shapes.ShapeCache()
    xs, ys = shapes.shape(x), shapes.shape(y)
    if xs is None or ys is None or not ys or len(xs) < len(ys):
        return None
    if cols is not None and len(cols) == len(ys) - 1:
        ys = ys[:1] + [c if d.static is None else d
                       for d, c in zip(ys[1:], cols)]
    after = symbolic_shapes.product(ys[1:])
    if after is None:
        return None
    for k in range(len(xs)):
        rest = symbolic_shapes.product(xs[k + 1:])
        if rest is None or rest != after:
            continue
        merged = symbolic_shapes.product(xs[1:k + 1])
        if merged == symbolic_shapes.ONE:
            return _walk(x, 0, start, depth + 1, loss=loss)
        if _example_major(op, loss):
            return RowFold(x, op)
        if k == 1:
            # `[A0, A1, D...] -> [A0 * A1, D...]`: example- or time-major,
            # which the certificate reads at run time (`FoldedRows`).
            return RowFold(x, op, either=True)
        return batch_axis.Reason(
            "%s fold the batch with axes %s of '%s' (shape %s; op '%s' "
            "reshapes it to rows): the rule reads each row as an example" % (
                where, list(range(1, k + 1)), x.name, x.shape, op.name), op)
    return None


def _example_major(op, loss):
    """Whether reshape `op` folds its input's batch axis 0 with the next
    axes into rows, example-major: the table reads the reshape of a batch
    on axis 0 as `Folded(T, 0)`, and the batch-axis inference from the loss
    found the batch on the input's axis 0 or the output as that fold."""
    if loss is None or loss.shape.rank is None or loss.shape.rank < 1:
        return False
    desc = batch_axis.forward(op, 0, 0)
    if not (isinstance(desc, batch_axis.Folded) and desc.axis == 0):
        return False
    lead, batch = _static_dim(op.inputs[0], 0), _static_dim(loss, 0)
    if lead is not None and batch is not None and lead != batch:
        return False        # axis 0 is not the batch's B examples
    found = batch_axis.infer(loss).axes
    if 0 in found.get(op.inputs[0].ref(), ()):
        return True
    return any(isinstance(d, batch_axis.Folded) and d.axis == 0
               for d in found.get(op.outputs[0].ref(), ()))
