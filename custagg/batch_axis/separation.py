"""Do examples stay apart from a tensor to the loss? The forward walk.

Rules are exact only when example b's loss depends on an op's output only
through row b (no batch statistics, no reductions or reshapes across the
batch). `coupling(start, batch_axis, loss)` follows every differentiable
path from `start` to `loss` through the batch-axis table
(`custagg.batch_axis.table`) and returns None when the batch reaches axis
0 of the `[B]` loss on every path, else a `Reason` naming the first op that
mixes examples. `walk_body` is the same walk inside a v2 loop body (into
the next iteration); `propagate` is the table plus v2 loops, whose bodies
it follows.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import graph
from custagg import op_kinds
from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis import table
from custagg.batch_axis.table import MIXES
from custagg.batch_axis.table import NO_BATCH
from custagg.batch_axis.table import Reason


def propagate(op, index, desc, shapes=None, data=False):
    """`table.forward`, with v2 loops followed through their bodies.

    Args:
      op, index, desc, shapes: as `table.forward`.
      data: inside loop bodies, follow every tensor (integer and boolean
        ones too: a sequence length compared with the step), not only those
        a gradient flows along. Batch-source inference asks this.

    Returns:
      `MIXES`; or one descriptor for every output; or a list with one per
      output (`NO_BATCH` where that output does not depend on the input).
    """
    if op.type in op_kinds.V2_LOOPS:
        out, _ = _while(op, index, table.normalize(op.inputs[index], desc),
                        data)
        return out
    return table.forward(op, index, desc, shapes)


def loop_reason(op, index, desc, data=True):
    """Why the batch at input `index` of While `op` does not come out of
    it whole (a `Reason` naming the op in the body), or None."""
    _, reason = _while(op, index, table.normalize(op.inputs[index], desc),
                       data)
    return reason


def _while(op, index, batch, data=False):
    """A v2 loop: the batch followed through its body (every iteration) to
    each output, one descriptor per output (`MIXES` if an output would get
    two, or the body mixes examples); and the reason when `MIXES`."""
    try:
        body = graph.func_graph(op, "body")
    except graph.FunctionNotFound as e:
        return MIXES, Reason(str(e), op)
    if len(body.inputs) != len(op.inputs) or \
            len(body.outputs) != len(op.outputs):
        return MIXES, Reason("the body of op '%s' has another signature "
                             "than the loop" % op.name, op)
    # Not the accumulators a gradient (or Keras) added: they collect
    # intermediates, nested lists included, for a gradient of the loop.
    live = graph.upstream([
        out for k, out in enumerate(body.outputs)
        if not graph.is_accumulator(op, body, k)], control=True)
    reached, reason = walk_body(body, [(body.inputs[index], batch)], live,
                                data)
    if reason is not None:
        return MIXES, reason
    out = []
    for k in range(len(op.outputs)):
        got = reached.get(k, set())
        if len(got) > 1:
            return MIXES, Reason(
                "loop variable %d of op '%s' holds the batch on two axes"
                % (k, op.name), op)
        out.append(got.pop() if got else NO_BATCH)
    return out, None


def walk_body(body, starts, live, data=False):
    """Follows the batch from `starts` ((body tensor, descriptor) pairs)
    through a loop body's ops in `live`, into the next iterations (an
    output is the next iteration's input at the same position).

    With `data`, every tensor is followed (see `propagate`); else only the
    float and list tensors a gradient flows along.

    Returns `({output position: {descriptors}}, None)`, or `(None, Reason)`
    naming the op that mixes examples or is not known to keep them apart.
    """
    positions = collections.defaultdict(list)
    for k, out in enumerate(body.outputs):
        positions[out.ref()].append(k)
    reached = collections.defaultdict(set)

    def next_iteration(t, desc):
        for k in positions.get(t.ref(), ()):
            reached[k].add(desc)
            yield body.inputs[k], desc

    def outputs(c):
        if c not in live:
            return []
        if data:
            return list(c.outputs)
        if graph.blocks_gradient(c):
            return []
        return [o for o in c.outputs
                if o.dtype.is_floating or o.dtype == tf.variant]

    reason = _follow(starts, outputs, also=next_iteration, data=data)
    return (None, reason) if reason is not None else (reached, None)


def coupling(start, batch_axis, loss, loss_ancestors=None):
    """None if examples stay apart from `start` to `loss`, else a reason.

    Only paths a gradient flows back along are followed
    (`graph.gradient_paths`).

    Args:
      start: the rule op's output tensor.
      batch_axis: the descriptor of the batch in `start`.
      loss: the per-example loss `[B]`.
      loss_ancestors: `graph.ancestors(loss)` (computed if None).
    """
    live = graph.gradient_paths(loss, loss_ancestors)

    def outputs(c):
        if graph.blocks_gradient(c):
            return []
        return [out for out in c.outputs if out.ref() in live]

    return _follow([(start, batch_axis)], outputs, loss=loss)


def _follow(starts, outputs, loss=None, also=None, data=False):
    """The one forward walk of a batch descriptor through the table.

    Args:
      starts: (tensor, descriptor) pairs.
      outputs: op -> the outputs of that op to follow (empty: not
        followed).
      loss: where the batch must arrive on axis 0 (not walked past).
      also: (tensor, descriptor) -> more pairs to visit (a loop body's
        next iteration).

    Returns:
      None, or the `Reason` of the first op that mixes examples.
    """
    shapes = symbolic_shapes.ShapeCache()
    seen = set()
    queue = collections.deque(starts)
    while queue:
        t, desc = queue.popleft()
        if (t.ref(), desc) in seen:
            continue
        seen.add((t.ref(), desc))
        if also is not None:
            queue.extend(also(t, desc))
        if loss is not None and t is loss:
            if table.normalize(t, desc) != 0:
                return Reason("the batch reaches axis %s of the loss, not "
                              "axis 0" % (desc,), t.op)
            continue
        for consumer in t.consumers():
            outs = outputs(consumer)
            if not outs:
                continue
            if graph.has_replaced_gradient(consumer):
                return Reason(
                    "op '%s' (type %s) has a replaced gradient function "
                    "(tf.custom_gradient or gradient_override_map), which "
                    "may mix examples" % (consumer.name, consumer.type),
                    consumer)
            nexts, reason = step(consumer, t, desc, outs, shapes, data)
            if reason is not None:
                return reason
            queue.extend(nexts)
    return None


def step(op, t, desc, outs, shapes=None, data=False):
    """Where the batch goes from `t` (batch at `desc`) through `op`.

    Returns `(pairs, reason)`: the `(output, descriptor)` pairs of `outs`
    the batch reaches (outputs it provably does not reach left out), or a
    `Reason` naming `op` when op mixes examples or is not known to keep
    them apart.
    """
    pairs = []
    for index, inp in enumerate(op.inputs):
        if inp is not t:
            continue
        out_desc = propagate(op, index, desc, shapes, data)
        if out_desc is MIXES:
            return [], Reason(table.mixes_text(op), op)
        for out in outs:
            here = (out_desc[out.value_index]
                    if isinstance(out_desc, list) else out_desc)
            if here is MIXES:
                return [], Reason(
                    "output %d of op '%s' (type %s) mixes examples"
                    % (out.value_index, op.name, op.type), op)
            if here is not NO_BATCH:
                pairs.append((out, here))
    return pairs, None
