"""A proof that a forward pass is row-wise: loss[b] depends on example b only.

The per-example copies (`per_example.forms.copies`) give example b's gradient only
if b's loss computed from its rows alone equals row b of the batch's loss:

    loss(inputs)[b] == loss(inputs[b:b+1])[0]     for every b and weights.

Without a proof, every run checks that equality on the batch (the batch's
forward pass once more, about a third of an aggregated gradient). `prove`
tries to establish it from the graph instead, and says why not when it
cannot; the run-time check then stays. It is an abstract interpretation of
the ops between the batch inputs and the loss, in creation order, where
each tensor that depends on batch data gets one of these values:

* `Rows(d)`: example b's entries are the slice `b` of batch descriptor `d`
  (an axis, a `table.Folded` axis, or a `table.ListOf` for
  TensorLists) and depend on example b's rows alone, so the copy of
  example b computes exactly that slice;
* `SAME`: a value equal in the batch and in every copy (a length taken
  from a non-batch axis, a loop counter compared with it);
* `Dims(entries)`: an int vector of dimensions, each "B" (the batch size,
  which is 1 in a copy), "=" (the same in both) or "?" (anything else
  built from B); `SIZE` is the scalar B. A batch size is only accepted
  where it becomes the batch axis of a new tensor (`tf.zeros(tf.stack(
  [tf.shape(x)[0], H]))`, `tf.fill`, `tf.broadcast_to`, a TensorList's
  element shape, a reshape the symbolic shapes prove); used any other way
  (`loss / tf.cast(tf.shape(x)[0], ...)`, `tf.range(batch)`) the proof
  fails, since a copy sees 1 where the batch sees B.

Ops the per-op tables of `custagg.batch_axis.table` know move a `Rows` value's
axis; any op they do not know, a batch-dependent value reaching an op
argument that is not listed here, a broadcast that could spread one row
over the batch, random numbers, v1 control flow, conds, and batch-dependent
ops the loss waits for only through control edges (side effects) end the
proof with a reason naming the op. Loops (`While`) are followed to a fixed
point over their variables, with a condition that must be `SAME`; function
calls are followed into their bodies.

Failing is always safe: the copies stay exact, and the run-time check
keeps catching couplings nobody proved absent. The proof only removes the
check where it succeeds.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import graph
from custagg import op_kinds
from custagg.batch_axis import separation
from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis import table
from custagg.batch_axis.proof_values import AS_ROWS
from custagg.batch_axis.proof_values import SAME
from custagg.batch_axis.proof_values import UNKNOWN
from custagg.batch_axis.proof_values import Dims
from custagg.batch_axis.proof_values import NotProved
from custagg.batch_axis.proof_values import Rows
from custagg.batch_axis.proof_values import op_text
from custagg.batch_axis.proof_values import sized
from custagg.batch_axis.table import MIXES
from custagg.batch_axis.table import NO_BATCH


class Unexplained(Exception):
    """Batch data no source explains meets the rows: an op's input lines up
    with its output's batch axis (the table says so) but is not computed
    from the batch sources, so a copy would read it whole. The copies are
    not exact there, whatever the run-time check says; the message names
    the op."""


_ELEMENTWISE = table.ELEMENTWISE
# (op type, input index) of TensorList element shapes: used only to make
# unset items (zeros of that shape), so a batch size there is accepted when
# it is the items' batch axis.
_ELEMENT_SHAPE = {("TensorListGetItem", 2), ("TensorListPopBack", 1),
                  ("TensorListStack", 1), ("TensorListGather", 2),
                  ("TensorListFromTensor", 1)}


def prove(inputs, ops, loss):
    """None when `loss` is proved row-wise in the batch `inputs`, else the
    reason (a sentence naming the op).

    Args:
      inputs: the batch inputs (`custagg.batch_axis.infer`), batch on axis 0.
      ops: the ops on paths from them to the loss, in creation order.
      loss: the per-example loss `[B]`.

    Raises:
      Unexplained: batch data the sources do not explain meets the rows
        (the copies must not run; see the class).
    """
    try:
        _control_effects(inputs, [loss], "the loss")
        values = {t.ref(): Rows(0) for t in inputs}
        _Interpreter(values).run(ops)
        got = values.get(loss.ref())
        if got != Rows(0):
            raise NotProved("the batch does not reach axis 0 of the loss "
                            "along rows (%s)" % (got,))
    except NotProved as e:
        return str(e)
    return None


def _waited_for(outputs):
    """The ops `outputs` wait for, through data and control edges (not into
    what a harmless effect, an assert, checks)."""
    return graph.upstream(outputs, control=True,
                          stop_types=op_kinds.HARMLESS_EFFECTS)


def _control_effects(batch_inputs, outputs, where):
    """Batch-dependent ops that `outputs` wait for through control edges
    only (an assign of a batch statistic before a variable read) could
    change what a copy computes: not proved."""
    touched = graph.downstream(batch_inputs)
    data = set()
    for t in outputs:
        data |= graph.ancestors(t)
    for op in _waited_for(outputs) - data:
        if op in touched and op.type not in op_kinds.HARMLESS_EFFECTS:
            raise NotProved("%s depends on batch data and %s waits for it "
                            "through a control dependency"
                            % (op_text(op), where))
    return data


def _join(a, b, t):
    """The value of a loop variable that is `a` before an iteration and `b`
    after it, or NotProved."""
    if a == b:
        return a
    if {a, b} <= {None, SAME}:
        return SAME
    # An empty TensorList (the same everywhere) that the body fills with
    # rows: a list of rows.
    if t.dtype == tf.variant and a in (None, SAME) and isinstance(b, Rows):
        return b
    raise NotProved("loop variable '%s' is %s before an iteration and %s "
                    "after it" % (t.name, a, b))


class _Interpreter(object):
    """Abstract values (`values`: tensor ref -> value) of the ops it runs;
    tensors without a value do not depend on batch data."""

    def __init__(self, values):
        self.values = values
        self.shapes = symbolic_shapes.ShapeCache()

    def value(self, t):
        got = self.values.get(t.ref())
        if got == UNKNOWN:
            raise NotProved("'%s' is used, and the proof cannot say what it "
                            "holds per example" % t.name)
        return got

    def run(self, ops):
        for op in ops:
            ins = [self.value(t) for t in op.inputs]
            if all(v is None for v in ins):
                continue
            outs = self.op(op, ins)
            for t, v in zip(op.outputs, outs):
                if v is not None:
                    self.values[t.ref()] = v

    # ----------------------------------------------------------------------

    def op(self, op, ins):
        """The outputs' values of `op` given its inputs' (`ins`)."""
        if op.type in op_kinds.V1_CONTROL_FLOW:
            raise NotProved("%s is v1 control flow, which the proof does not "
                            "follow" % op_text(op))
        if op.type in op_kinds.RANDOM:
            raise NotProved("%s draws random numbers" % op_text(op))
        if op.type in op_kinds.V2_LOOPS:
            return self.loop(op, ins)
        if op.type in op_kinds.CALLS:
            return self.call(op, ins)
        if all(v in (None, SAME) for v in ins):
            return [SAME] * len(op.outputs)
        sizes = table.size_rule(op)
        if sizes is not None:
            # The batch size may flow here (the table's `sizes` entry).
            out = sizes(op, ins)
            if out is not AS_ROWS:
                return out
        return self.rows_op(op, ins)

    def rows_op(self, op, ins):
        """Ops the separability tables know, with Rows inputs."""
        descs = [set() for _ in op.outputs]
        for index, v in enumerate(ins):
            if v is None or v == SAME:
                continue
            if isinstance(v, Dims) and (op.type, index) in _ELEMENT_SHAPE:
                continue        # checked below, against the items' axis
            if isinstance(v, Dims) and op.type == "Reshape" and index == 1:
                continue        # the symbolic shapes read the target
            if not isinstance(v, Rows):
                raise NotProved(
                    "%s takes a value built from the batch size at input %d, "
                    "which a copy of one example would see as 1"
                    % (op_text(op), index))
            out = separation.propagate(op, index, v.desc, self.shapes)
            if out is MIXES:
                raise NotProved("%s mixes examples or is not known to keep "
                                "them apart" % op_text(op))
            for k in range(len(op.outputs)):
                here = out[k] if isinstance(out, list) else out
                if here is MIXES:
                    raise NotProved("output %d of %s mixes examples"
                                    % (k, op_text(op)))
                if here is NO_BATCH:
                    descs[k].add(UNKNOWN)
                elif isinstance(here, table.Stacked):
                    raise NotProved(
                        "%s stacks copies of the batch on one axis (rows "
                        "k*B + b), which the row-wise proof does not "
                        "follow" % op_text(op))
                else:
                    descs[k].add(table.normalize(op.outputs[k], here))
        result = []
        for k, got in enumerate(descs):
            if UNKNOWN in got or len(got) > 1:
                result.append(UNKNOWN)
            elif got:
                result.append(Rows(got.pop()))
            else:
                result.append(SAME)
        if op.type == "Reshape" and isinstance(ins[1], Dims) and \
                not isinstance(ins[0], Rows):
            raise NotProved("%s reshapes a tensor without rows to a shape "
                            "built from the batch size" % op_text(op))
        for index, v in enumerate(ins):
            if isinstance(v, Dims) and (op.type, index) in _ELEMENT_SHAPE:
                self.batch_at(op, v, _item_axis(op, ins[0]))
        if (op.type in _ELEMENTWISE or op.type in op_kinds.BATCH_MATMULS) and \
                len(op.inputs) > 1:
            self.no_broadcast(op, ins, result[0])
        self.no_hidden_rows(op, ins, result)
        return result

    def no_hidden_rows(self, op, ins, result):
        """Raises `Unexplained` when an input that is not computed from the
        batch sources sits where the table puts the batch of an output that
        is rows (`xent(labels, logits)` with logits from data the walk from
        the loss could not reach): each copy would read all its rows."""
        for k, out in enumerate(result):
            if not isinstance(out, Rows) or isinstance(out.desc,
                                                       table.ListOf):
                continue
            for j, (t, v) in enumerate(zip(op.inputs, ins)):
                if v not in (None, SAME) or t.dtype == tf.resource:
                    continue
                for cand in table.candidates(t, out.desc, op.outputs[k],
                                             self.shapes):
                    if isinstance(cand, table.ListOf):
                        continue
                    got = table.forward(op, j, cand, self.shapes)
                    here = got[k] if isinstance(got, list) else got
                    if here is MIXES or here is NO_BATCH or table.normalize(
                            op.outputs[k], here) != out.desc:
                        continue
                    axis = cand.axis if isinstance(
                        cand, (table.Folded, table.Stacked)) else cand
                    if tf.compat.dimension_value(t.shape[axis]) == 1:
                        continue
                    raise Unexplained(
                        "input %d of %s ('%s') lines up with the batch on "
                        "axis %s but is not computed from the batch sources "
                        "found from the loss (data behind an op that mixes "
                        "examples, or that custagg does not know), so a "
                        "per-example copy would read all of its rows"
                        % (j, op_text(op), t.name, axis))

    def no_broadcast(self, op, ins, out):
        """A broadcasting op spreads an operand's row over the batch when
        the operand has a size other than 1 on the output's batch axis
        without being rows there (a `[64, D]` constant against `[None, D]`
        activations): each copy would see all 64 rows."""
        if not isinstance(out, Rows) or isinstance(out.desc,
                                                    table.ListOf):
            raise NotProved("%s broadcasts onto an axis the proof cannot "
                            "place" % op_text(op))
        folded = isinstance(out.desc, table.Folded)
        axis = out.desc.axis if folded else out.desc
        out_rank = op.outputs[0].shape.rank
        if op.type in op_kinds.BATCH_MATMULS and out_rank is not None and \
                axis >= out_rank - 2:
            return      # a matrix axis: MatMul's own table placed it
        for index, (t, v) in enumerate(zip(op.inputs, ins)):
            rank = t.shape.rank
            if rank is None or out_rank is None:
                raise NotProved("%s broadcasts operands of unknown rank"
                                % op_text(op))
            pos = axis - (out_rank - rank)
            if op.type == "Select" and index == 0 and rank == 1 and \
                    out_rank > 1:
                pos = axis      # v1 where: entry r picks row r (table)
                if pos > 0:
                    continue
            if pos < 0:
                continue
            if isinstance(v, Rows) and v.desc == (
                    table.Folded(out.desc.middle, pos) if folded
                    else pos):
                continue
            if tf.compat.dimension_value(t.shape[pos]) == 1:
                continue
            raise NotProved(
                "input %d of %s is not rows on the batch axis and may have "
                "more than one entry there, so broadcasting would give each "
                "copy other entries than its row" % (index, op_text(op)))

    def batch_at(self, op, dims, axis):
        """Every "B" of `dims` is at `axis` (an int), none is "?"."""
        if "?" in dims.entries or any(
                e == "B" and k != axis for k, e in enumerate(dims.entries)):
            raise NotProved("%s gets a shape built from the batch size with "
                            "the batch off the axis its rows are on"
                            % op_text(op))

    # ----------------------------------------------------------------------
    # Loops and calls

    def loop(self, op, ins):
        """A v2 While: its variables' values at a fixed point of the body;
        the condition must be the same in the batch and in the copies (the
        same number of iterations)."""
        body, cond = _function(op, "body"), _function(op, "cond", outputs=1)
        keep = graph.own_loop_variables(op, body)
        # The accumulators a gradient added collect intermediates; nothing
        # the loss needs may read them.
        others = {k: UNKNOWN for k in range(len(op.inputs)) if k not in keep}
        state = {k: ins[k] for k in keep}
        for _ in range(len(keep) + 2):
            bound = dict(others)
            bound.update(state)
            outs = _run_graph(body, bound, [body.outputs[k] for k in keep])
            new = {k: _join(state[k], out, op.inputs[k])
                   for k, out in zip(keep, outs)}
            if new == state:
                break
            state = new
        else:
            raise NotProved("the values of %s's loop variables do not "
                            "settle" % op_text(op))
        bound = dict(others)
        bound.update(state)
        go = _run_graph(cond, bound, [cond.outputs[0]])
        if go[0] not in (None, SAME):
            raise NotProved("the condition of %s depends on batch data, so "
                            "the batch and a copy may run other numbers of "
                            "iterations" % op_text(op))
        return [state.get(k, UNKNOWN) for k in range(len(op.outputs))]

    def call(self, op, ins):
        """A function call: its body, with the arguments' values."""
        func = _function(op, "f")
        return _run_graph(func, dict(enumerate(ins)), func.outputs)


def _function(op, attr, outputs=None):
    """The FuncGraph of `op`'s function attr `attr`, with one input per
    input of `op` and `outputs` outputs (None: one per output of `op`)."""
    try:
        func = graph.func_graph(op, attr)
    except graph.FunctionNotFound as e:
        raise NotProved(str(e))
    want = len(op.outputs) if outputs is None else outputs
    if len(func.inputs) != len(op.inputs) or len(func.outputs) != want:
        raise NotProved("the %s function of %s has a signature the proof "
                        "does not know" % (attr, op_text(op)))
    return func


def _item_axis(op, first):
    """The batch axis of the items of the list op `op` reads or makes
    (`first`: its input 0's value), or None."""
    if not isinstance(first, Rows):
        return None
    if isinstance(first.desc, table.ListOf):
        return first.desc.axis
    if op.type == "TensorListFromTensor" and isinstance(first.desc, int):
        return first.desc - 1
    return None


def _run_graph(func, bound, outputs):
    """The values of `outputs` of FuncGraph `func` with `func.inputs[k]`
    holding `bound[k]`; ops the outputs wait for through control edges
    only must not depend on batch data."""
    values = {func.inputs[k].ref(): v for k, v in bound.items()
              if v is not None}
    batch_inputs = [func.inputs[k] for k in bound if bound[k] is not None]
    data = _control_effects(batch_inputs, outputs, "the function")
    _Interpreter(values).run([op for op in func.get_operations()
                              if op in data])
    return [values.get(t.ref()) for t in outputs]
