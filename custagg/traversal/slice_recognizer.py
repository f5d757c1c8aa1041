"""Which ys are one example of a batch tensor: `loss[k]`, `tf.gather(loss, k)`,
the outputs of `tf.unstack(loss)`.

`custagg.gradients(ys=[loss[i] for i in range(B)], ...,
aggregation_method=CUSTOM)` (the list form) must build in about the time of
the vector form although B is often 512 or more. `SliceFinder.find` runs
once per y, so the work per slice is kept to reading two or three parsed
NodeDefs (`op.node_def` costs a few microseconds; each `op.get_attr` or
`tensor_util.constant_value` call costs 10-100x that); the aggregation then
seeds each source tensor once (`traversal.aggregation.custom_seeds`).
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import op_kinds
from custagg._tf_compat import types_pb2


Slice = collections.namedtuple("Slice", ["source", "index"])

_INT_DTYPES = {types_pb2.DT_INT32: np.int32, types_pb2.DT_INT64: np.int64}


# `Operation.node_def`, parsed from the bytes TF serializes for the op where
# the release has them (`_tf_compat.node_def`): the finder calls it directly,
# saving the property's Python frame twice per example of the list form.
_parse_node_def = _tf_compat.node_def


def _split_input_name(name):
    """NodeDef input "op" / "op:2" -> ("op", 2)."""
    op_name, _, index = name.partition(":")
    return op_name, int(index) if index else 0


def _const_ints(op):
    """The values of the integer Const `op` as a flat list; else None.

    Unlike `tensor_util.constant_value`, the Const is not marked unfeedable
    (that costs a few microseconds per slice): the indices read here are
    the Consts TF's slicing made, which no one feeds.
    """
    if op.type != "Const":
        return None
    proto = op.node_def.attr["value"].tensor
    dtype = proto.dtype
    np_dtype = _INT_DTYPES.get(dtype)
    if np_dtype is None:
        return None
    size = 1
    for dim in proto.tensor_shape.dim:
        size *= dim.size
    content = proto.tensor_content
    if content:
        values = np.frombuffer(content, np_dtype).tolist()
    else:
        values = list(proto.int_val if dtype == types_pb2.DT_INT32
                      else proto.int64_val)
        # A Const stores a run of equal trailing values once.
        if values and len(values) < size:
            values += [values[-1]] * (size - len(values))
    if len(values) != size:
        return None
    return values


def _first_int(node_def):
    """The first value of an integer Const, given its parsed NodeDef (index 0
    of a StridedSlice `begin`, whose dtype TF restricts to int32/int64);
    else None.

    The fast form of `_const_ints(op)[0]`: `loss[k]` is read once per
    example, and every proto field touched costs about a microsecond. The
    caller parses the NodeDef, and the op type is read from it, not from
    `op.type` (another call into TF).
    """
    if node_def.op != "Const":
        return None
    proto = node_def.attr["value"].tensor
    # Int32 values live in int_val, int64 in int64_val (a run of equal
    # values stored once), or all of them in tensor_content.
    values = proto.int_val or proto.int64_val
    if values:
        return values[0]
    content = proto.tensor_content
    np_dtype = _INT_DTYPES.get(proto.dtype)
    if not content or np_dtype is None:
        return None
    return int(np.frombuffer(content, np_dtype, count=1)[0])


class SliceFinder(object):
    """Recognizes ys that are one example of a batch tensor.

    Recognized: `loss[k]` (also `loss[k, :]`, `loss[k, ...]`),
    `tf.gather(loss, k)` with a constant scalar k on axis 0, and the outputs
    of `tf.unstack(loss)` (axis 0). Anything else is a per-example term of
    its own (still correct, seeded and differentiated as a separate y).

    Cost matters here: `find` runs once per example, B times per gradients
    call, against a vector form that builds a dozen ops (~5 ms). A
    StridedSlice is read from its NodeDef alone and its inputs are found by
    name (`op.inputs` would build Tensor objects for all four inputs,
    ~40 us; `op.get_attr` and `tensor_util.constant_value` parse a proto
    per call), and the common path `loss[k]` makes no call it can avoid:
    two NodeDef reads (the slice's, and its `begin` Const's, where k is),
    with the op type taken from the first. That is about 8 us per slice on
    a 2-core CPU, ~6 us of it the two reads (TF serializing NodeDefs that
    are no longer in cache, and parsing them). Reading the Const through
    `op.get_attr` or `TF_TryEvaluateConstant`, or the op type through
    `op.type`, measured slower.
    """

    def __init__(self, graph):
        self._graph = graph
        # The C++ lookup behind get_operation_by_name, without its checks.
        self._op_by_name = _tf_compat.operation_by_name_fn(graph)
        self._sources = {}      # input name -> (tensor, B, rank)
        # Unpack op -> the tensor it unstacks along axis 0 (None: another
        # axis, or not a [B, ...] tensor): its B outputs are B ys.
        self._unpacked = {}

    def find(self, y):
        """`(source, k)` with `0 <= k < B`, or None.

        A negative k is resolved when B is static and not recognized when B
        is dynamic.
        """
        op = y.op
        if op in self._unpacked:
            return self._unpacked_row(y, op)
        # The op type from the NodeDef, which a slice needs anyway (one call
        # into TF fewer than `op.type`).
        node_def = _parse_node_def(op)
        kind = node_def.op
        if kind == "StridedSlice":
            attrs = node_def.attr
            # Axis 0 shrunk to the element at begin[0] (TF then ignores its
            # end, and accepts only stride 1 there); no other axis shrunk or
            # added.
            if (attrs["shrink_axis_mask"].i != 1 or attrs["new_axis_mask"].i
                    or attrs["begin_mask"].i & 1
                    or attrs["ellipsis_mask"].i & 1
                    or op.graph is not self._graph):
                return None
            inputs = node_def.input
            source_name = inputs[0]
            found = self._sources.get(source_name)
            if found is None:
                found = self._source(source_name)
            source, batch, rank = found
            if source is None:
                return None
            begin_name = inputs[1]
            begin_op = self._op_by_name(
                begin_name if ":" not in begin_name
                else _split_input_name(begin_name)[0])
            if rank == 1:
                # Nothing else to check: a rank-1 source has no later axes
                # (TF rejects a spec longer than the rank, an ellipsis aside).
                index = _first_int(_parse_node_def(begin_op))
            else:
                index = self._longer_spec_index(attrs, begin_op, inputs[3])
        else:
            if op.graph is not self._graph:
                return None
            if kind in op_kinds.VALUE_GATHERS:
                index = self._gather_index(op, node_def)
            elif kind == "Unpack":
                source, _, rank = self._source(op.inputs[0].name)
                axis = node_def.attr["axis"].i
                self._unpacked[op] = (
                    source if source is not None and axis in (0, -rank)
                    else None)
                return self._unpacked_row(y, op)
            else:
                return None
            if index is None:
                return None
            source, batch, _ = self._source(op.inputs[0].name)
            if source is None:
                return None
        if index is None:
            return None
        if index < 0:
            if batch is None:
                return None
            index += batch
        if index < 0 or (batch is not None and index >= batch):
            return None
        return source, index

    def _unpacked_row(self, y, op):
        """`(source, k)` for output k of an Unpack along axis 0, else None
        (an Unpack has one output per row: 0 <= k < B holds)."""
        source = self._unpacked[op]
        return None if source is None else (source, y.value_index)

    def _source(self, name):
        """(tensor, static B or None, rank); (None, None, None) when the
        tensor is not [B, ...] of known rank."""
        found = self._sources.get(name)
        if found is None:
            op_name, index = _split_input_name(name)
            source = self._op_by_name(op_name).outputs[index]
            rank = source.shape.rank
            if rank is None or rank < 1:
                found = (None, None, None)
            else:
                found = (source, tf.compat.dimension_value(source.shape[0]),
                         rank)
            self._sources[name] = found
        return found

    def _longer_spec_index(self, attrs, begin_op, strides_name):
        """k when a StridedSlice of a source of rank >= 2 (its masks checked
        for axis 0) takes every later axis whole: `out[k]`, `out[k, :]`."""
        begin = _const_ints(begin_op)
        if not begin:
            return None
        if len(begin) == 1:
            return begin[0]
        strides = _const_ints(self._op_by_name(
            _split_input_name(strides_name)[0]))
        if strides is None:
            return None
        begin_mask, end_mask = attrs["begin_mask"].i, attrs["end_mask"].i
        ellipsis = attrs["ellipsis_mask"].i
        for axis in range(1, len(begin)):
            bit = 1 << axis
            if ellipsis & bit:
                continue
            if not (begin_mask & bit and end_mask & bit
                    and strides[axis] == 1):
                return None
        return begin[0]

    @staticmethod
    def _gather_index(op, node_def):
        """k when the op (NodeDef `node_def`) is `tf.gather(source, k)`,
        constant scalar k on axis 0; else None."""
        if node_def.op == "GatherV2":
            if (node_def.attr["batch_dims"].i != 0
                    or _const_ints(op.inputs[2].op) != [0]):
                return None
        ids = op.inputs[1]
        if ids.shape.rank != 0:
            return None
        value = _const_ints(ids.op)
        # A negative index is an error for tf.gather (unlike loss[-1]): such
        # a y is left to TF's own gradient rather than read as loss[B-1].
        return None if value is None or value[0] < 0 else value[0]


def slice_of(y):
    """`Slice(source, k)` when `y` is example k of `source`, else None.

    See `SliceFinder` for what is recognized.
    """
    found = SliceFinder(y.graph).find(y)
    return None if found is None else Slice(*found)
