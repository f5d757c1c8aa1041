"""Which tensors carry the examples, and on which axis: read from the loss.

Axis 0 of the `[B]` per-example loss is the batch by contract. `infer`
walks backward from it through the batch-axis table
(`custagg.batch_axis.table`, read by `inverse`): the loss's op, told that
output k holds the batch at descriptor d, says which of its inputs hold it
and where. Every tensor reached gets its descriptor(s); a *leaf* reached
with a batch descriptor is a batch source, whatever its op type:
placeholders, iterator and queue outputs (`IteratorGetNext`,
`QueueDequeueManyV2`), variable reads and constants holding a batch,
`py_function` outputs with a set shape, the serialized input of
`ParseExample`, ...

A leaf is an op none of whose inputs could hold rows of examples: no
inputs at all (placeholders, constants, ref variables), or only handles and
scalars (a resource, an iterator, a queue, a dequeue count) -- a scalar has
no axis for the batch to be on. `PlaceholderWithDefault` is a leaf too: it
is where a feed replaces its default, so rows are taken there.

Why a weight never becomes a source. The walk only enters input i of an op
when some axis j of that input, pushed forward through the same table
entry, lands where the output holds the batch. For `z = a @ W` with the
batch on axis 0 of z, the table says: a's axis 0 -> z's axis 0, W's axis 0
-> mixes (it is the contracted axis), W's axis 1 -> z's axis 1. No axis of
W lands on z's axis 0, so W carries no batch and the walk does not enter
it; likewise a bias (broadcast from the right onto the feature axis), a
convolution filter, an embedding table (the ids carry the batch, the
params' gathered axis mixes). Only a tensor whose rows line up with the
loss's rows is reached -- which is what "holds a batch" means: a variable
`[B, D]` multiplied elementwise into the activations is one (each row
touches one example), and then it is treated as batch data, as it should.

Nothing is guessed: an op the table does not know, met on the way back,
stops the walk there (`BatchAxes.blocked` says which); its inputs are not
sources. Treating a tensor as shared (not batch data) is always safe: every
form that relies on separation proves or checks it forward, from the
sources found here.
"""

from __future__ import annotations

import collections
import weakref

import tensorflow as tf

from custagg import graph
from custagg import op_kinds
from custagg.batch_axis import separation
from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis import table
from custagg.batch_axis.table import MIXES
from custagg.batch_axis.table import NO_BATCH
from custagg.batch_axis.table import Reason


class BatchAxes(collections.namedtuple(
        "BatchAxes", ["loss", "axes", "sources", "blocked",
                      "blocked_tensors"])):
    """What `infer` found.

    Attributes:
      loss: the `[B]` per-example loss.
      axes: dict `tensor.ref()` -> frozenset of batch descriptors, for every
        tensor the walk reached (the loss's ancestors that carry examples).
      sources: the leaves reached, as `(tensor, descriptor)` pairs in the
        graph's creation order.
      blocked: `Reason`s naming the ops the walk could not go back through:
        not in the table (what may hold batch data nobody found), or known
        with no input holding the batch (mixing, or rows made from shared
        data).
      blocked_tensors: aligned with `blocked`: the tensor (reached with a
        batch descriptor) whose op stopped the walk.
    """

    def source_tensors(self, axis=0):
        """The source tensors holding the batch on `axis`."""
        return [t for t, d in self.sources if d == axis]

    def carries_batch(self, t):
        """Whether `t` was reached with a batch descriptor."""
        return t.ref() in self.axes


def _handle_or_scalar(t):
    """An input that cannot hold rows of examples: a handle (resource, a
    ref-typed string queue handle) or a scalar (no axis for a batch)."""
    if t.dtype == tf.resource or t.dtype != t.dtype.base_dtype:
        return True
    return t.shape.rank == 0


def is_leaf(op):
    """Whether `op`'s outputs take their rows from none of its inputs (see
    the module): a leaf reached with a batch descriptor is a source."""
    if op.type in op_kinds.FEED_POINTS:
        return True     # a feed's rows, not its default's
    if table.known(op) or op.type in op_kinds.V2_LOOPS:
        return False
    return all(_handle_or_scalar(t) for t in op.inputs)


def inverse(op, out_index, desc, shapes=None, _depth=0):
    """Which inputs of `op` hold the batch, given output `out_index` holds
    it at `desc`; the table's entries read backward.

    Input i holds it at candidate descriptor c (each axis of the input,
    `table.candidates`) when `separation.propagate(op, i, c)` puts output
    `out_index`'s batch at `desc`.

    Returns:
      `MIXES` when the table does not know `op`; else a list with, per
      input, a frozenset of descriptors (empty: that input carries no
      batch).
    """
    if not (table.known(op) or op.type in op_kinds.V2_LOOPS):
        return MIXES
    shapes = shapes if shapes is not None else symbolic_shapes.ShapeCache()
    want = table.normalize(op.outputs[out_index], desc)
    result = []
    for i, inp in enumerate(op.inputs):
        got = set()
        cands = table.candidates(inp, want, op.outputs[out_index], shapes)
        if not cands:
            cands = _from_the_right(inp, want, op.outputs[out_index], shapes,
                                    _depth)
        for cand in cands:
            out = separation.propagate(op, i, cand, shapes, data=True)
            if out is MIXES:
                continue
            here = out[out_index] if isinstance(out, list) else out
            if here is MIXES or here is NO_BATCH:
                continue
            if table.same(table.normalize(op.outputs[out_index], here),
                          want, shapes, op):
                got.add(cand)
        result.append(frozenset(got))
    return result


def _from_the_right(t, want, output, shapes, depth=0):
    """For an input `t` of unknown rank: the batch axis counted from the
    end (broadcasting aligns from the right), when that is the only reading
    under which `t` can hold the rows, else [].

    Only an intermediate tensor qualifies, and only when the same reading
    traces back to a tensor of known rank that holds the batch there
    (`x / keep_prob` with an unshaped `keep_prob`: the unknown rank comes
    from `keep_prob`, the rows from `x`). A leaf of unknown rank, or an
    intermediate made from leaves of unknown rank and constants alone (a
    scalar `1 - keep_prob`), is never read as batch data: nothing is
    guessed.
    """
    # Folded and ListOf descriptors are tuples, never ints.
    if (t.shape.rank is not None or is_leaf(t.op) or depth > 8 or
            not isinstance(want, int)):
        return []
    if want < 0:
        cand = want
    elif output.shape.rank is not None:
        cand = want - output.shape.rank
    else:
        return []
    ins = inverse(t.op, t.value_index, cand, shapes, _depth=depth + 1)
    if ins is MIXES:
        return []
    # An input of unknown rank has descriptors only when this same check
    # held one level further back, so any input with one traces to rows.
    return [cand] if any(ins) else []


def _mixes_inside(op, index, desc):
    """For a loop: whether the batch at input `index` (`desc`) is kept by
    some op of the body before one mixes it (for messages: a weight fails
    at its first use, data the body mixes flows some way first)."""
    if op.type not in op_kinds.V2_LOOPS or op.inputs[index].dtype in (
            tf.resource, tf.variant):
        return False
    why = separation.loop_reason(op, index, desc)
    if why is None or getattr(why, "op", None) is None:
        return False
    try:
        body = graph.func_graph(op, "body")
    except graph.FunctionNotFound:
        return False
    return why.op not in body.inputs[index].consumers()


# graph -> {(loss ref, graph version): BatchAxes}: weak on the graph and
# keyed on its version (it grows as ops are added), so an answer is reused
# only for the graph exactly as it was asked about.
_FOUND = weakref.WeakKeyDictionary()


def infer(loss):
    """The batch axes of the tensors behind `loss`, read backward from it.

    Args:
      loss: the per-example loss, a graph tensor of rank >= 1 whose axis 0
        is the batch.

    Returns:
      A `BatchAxes`.
    """
    key = (loss.ref(), loss.graph.version)
    cache = _FOUND.setdefault(loss.graph, {})
    if key not in cache:
        cache.clear()
        cache[key] = _infer(loss)
    return cache[key]


def _infer(loss):
    shapes = symbolic_shapes.ShapeCache()
    axes = collections.defaultdict(set)
    sources, blocked, blocked_tensors = [], [], []
    queue = collections.deque([(loss, 0)])
    seen = set()
    while queue:
        t, desc = queue.popleft()
        if (t.ref(), desc) in seen:
            continue
        seen.add((t.ref(), desc))
        axes[t.ref()].add(desc)
        op = t.op
        if op.type in op_kinds.MAKERS:
            # Rows made from a shape (zeros, an empty list): all equal,
            # made, not read -- neither a source nor a stop. Whether a copy
            # of one example makes them right is the row-wise proof's
            # question (it follows the batch size into their shapes).
            continue
        if is_leaf(op):
            # A list made empty (TensorArray, TensorListReserve) holds no
            # examples: its items are written later, from the sources.
            if not isinstance(desc, table.ListOf):
                sources.append((t, desc))
            continue
        ins = inverse(op, t.value_index, desc, shapes)
        if ins is MIXES:
            blocked_tensors.append(t)
            if op.type in op_kinds.V2_LOOPS:
                text = "op '%s' (type %s) mixes examples%s" % (
                    op.name, op.type, _inside(op, desc))
            else:
                text = table.mixes_text(op)
            blocked.append(Reason(text, op))
            continue
        for inp, descs in zip(op.inputs, ins):
            if inp.shape.rank is None and inp.dtype != tf.resource and \
                    not descs:
                # No axis to try: whether it holds the batch is not known.
                blocked_tensors.append(inp)
                blocked.append(Reason(
                    "input '%s' (op type %s) of op '%s' has unknown rank, so "
                    "custagg cannot tell whether it holds the batch; give it "
                    "a shape such as [None, ...]" % (inp.name, inp.op.type,
                                                     op.name), inp.op))
        if not any(ins):
            # Known, yet no input holds the rows: the op mixes examples
            # (a reshape across the batch) or makes rows from shared data
            # (a tile): either way no source lies behind it.
            blocked.append(Reason(
                "op '%s' (type %s) mixes examples or makes its rows from "
                "no batch data (no input holds the batch where output %d "
                "has it)%s" % (op.name, op.type, t.value_index,
                               _inside(op, desc)), op))
            blocked_tensors.append(t)
        for inp, descs in zip(op.inputs, ins):
            queue.extend((inp, d) for d in descs)
    order = {op: k for k, op in enumerate(loss.graph.get_operations())}
    sources.sort(key=lambda p: (order.get(p[0].op, -1), p[0].value_index))
    return BatchAxes(loss, {k: frozenset(v) for k, v in axes.items()},
                     sources, blocked, blocked_tensors)


def _inside(op, like):
    """For a loop: what in its body mixes examples (for the first input
    the body keeps the batch of before mixing it), as a clause; else ""."""
    if op.type not in op_kinds.V2_LOOPS:
        return ""
    for i, inp in enumerate(op.inputs):
        cands = table.candidates(inp, like)
        if any(separation.propagate(op, i, c, data=True) is not MIXES
               for c in cands):
            continue
        for cand in cands:
            if _mixes_inside(op, i, cand):
                return " in its body (input %d, batch on axis %s): %s" % (
                    i, cand, separation.loop_reason(op, i, cand))
    return ""


def untraced(batch_axes, region):
    """`Reason`s for tensors holding the batch that the walk could not
    trace back to a source and that the sources' `region` does not compute
    either: rows nobody can take one example of (the per-example copies
    must refuse)."""
    return [r for t, r in zip(batch_axes.blocked_tensors, batch_axes.blocked)
            if t.op not in region]


def batch_region(loss, loss_ancestors=None, batch_axes=None):
    """Ops among the loss's ancestors that hold or depend on batch data.

    Args:
      loss: the per-example loss `[B]`.
      loss_ancestors: `graph.ancestors(loss)` (computed if None).
      batch_axes: `infer(loss)` (computed if None).

    Returns:
      A set of ops: those with an output the walk from the loss reached
      (it holds rows), the sources', and every op downstream of them.
    """
    if loss_ancestors is None:
        loss_ancestors = graph.ancestors(loss)
    if batch_axes is None:
        batch_axes = infer(loss)
    # Every tensor the walk reached holds rows of the batch, traced to a
    # source or not (behind an op that mixes them, or made by a `Fill`):
    # the boundary form must slice them, never copy them whole into each
    # example.
    ops = {op for op in loss_ancestors for t in op.outputs
           if batch_axes.carries_batch(t)}
    ops |= {t.op for t, _ in batch_axes.sources}
    return ops | graph.downstream(
        [t for op in ops for t in op.outputs], within=loss_ancestors)


def brings_data(op):
    """Whether `op` may bring data into the graph that no input of it
    holds: a feed (a placeholder that is not a scalar), an input pipeline
    (an iterator's or a queue's outputs), or any stateful op other than a
    read of a variable (a random draw, a `py_function`). Constants,
    variables and scalars fed as hyperparameters (`keep_prob`, a learning
    rate: one value for the whole batch) bring none."""
    if op.type in op_kinds.SHARED_LEAVES:
        return False
    if all(_handle_or_scalar(t) for t in op.outputs):
        return False
    if op.type in op_kinds.FEED_POINTS or not op.inputs:
        return True
    if op.type in op_kinds.VARIABLE_READS:
        return False
    return bool(getattr(op.op_def, "is_stateful", True))


def data_region(loss_ancestors):
    """Ops among `loss_ancestors` whose outputs may depend on data fed to
    the graph (`brings_data`), found forward from every such op whether or
    not the walk from the loss reached it.

    `batch_region` holds only what the walk back from the loss reached (and
    what its sources compute): behind an op that stops the walk (a reshape
    by another tensor's `tf.shape`, an op the table does not know) the
    batch's own inputs are not sources, so an op outside `batch_region` is
    not thereby free of examples' data. An op outside this set is: every
    input it has is computed from constants, variables and scalars alone.

    Args:
      loss_ancestors: `graph.ancestors(loss)`.

    Returns:
      A set of ops.
    """
    origins = [op for op in loss_ancestors if brings_data(op)]
    return set(origins) | graph.downstream(
        [t for op in origins for t in op.outputs], within=loss_ancestors)


def no_sources_reason(batch_axes):
    """A sentence saying why no source was found (for errors)."""
    if not batch_axes.blocked:
        return ("no batch data feeds the loss: walking back from axis 0 of "
                "the loss '%s' reached no placeholder, iterator, queue, "
                "variable or constant holding one row per example"
                % batch_axes.loss.name)
    return ("walking back from axis 0 of the loss '%s', the static analysis "
            "stopped before the batch data at: %s" % (
                batch_axes.loss.name, "; ".join(batch_axes.blocked[:3])))
