"""The one batch-axis table: one `Entry` per op type, read by the
separation walk (`axes`) and by the row-wise proof (`sizes`) alike."""

import pytest
import tensorflow as tf

from custagg.batch_axis import proof_values
from custagg.batch_axis import rowwise
from custagg.batch_axis import table

# pylint: disable=protected-access


def test_every_op_type_is_one_entry():
    assert table._TABLE
    for op_type, entry in table._TABLE.items():
        assert isinstance(entry, table.Entry), op_type
        assert entry.axes is not None or entry.sizes is not None, op_type
    # Ops that carry the batch size are elementwise too, in the same entry.
    for op_type in ("Cast", "Identity", "ZerosLike", "OnesLike"):
        assert op_type in table.ELEMENTWISE
        assert table._TABLE[op_type].sizes is not None


def test_a_sizes_only_entry_is_not_known_to_keep_examples_apart(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    filled = tf.fill(tf.stack([tf.shape(x)[0], 3]), 0.0)
    product = tf.matmul(x, tf.ones([3, 2]))
    assert not table.known(filled.op)
    assert table.size_rule(filled.op) is not None
    assert table.known(product.op) and table.size_rule(product.op) is None
    assert table.forward(filled.op, 1, 0) is table.MIXES


def _zeros_from_the_batch_size():
    x = tf.compat.v1.placeholder(tf.float64, [None, 4], name="x")
    zeros = tf.zeros(tf.stack([tf.shape(x)[0], 3]), tf.float64)
    loss = tf.reduce_sum(x, axis=1) + tf.reduce_sum(zeros, axis=1)
    ops = [op for op in tf.compat.v1.get_default_graph().get_operations()
           if op is not x.op]
    return x, ops, loss


def test_the_proof_reads_the_batch_size_from_the_table(graph, monkeypatch):
    """The row-wise proof has no per-op code of its own for sizes: without
    the `Shape` entry's `sizes`, `tf.shape(x)[0]` is no longer read as B
    and the same graph is not proved."""
    x, ops, loss = _zeros_from_the_batch_size()
    assert rowwise.prove([x], ops, loss) is None
    shape = table._TABLE["Shape"]
    monkeypatch.setitem(table._TABLE, "Shape", shape._replace(sizes=None))
    reason = rowwise.prove([x], ops, loss)
    assert reason is not None and "Shape" in reason


@pytest.mark.parametrize("dims, axis", [(("B", "="), 0), (("=", "B"), 1)])
def test_new_rows_put_the_batch_where_the_size_is(graph, dims, axis):
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    op = tf.fill(tf.stack([tf.shape(x)[0], 3]), 0.0).op
    assert proof_values.new_rows(op, proof_values.Dims(dims)) == \
        proof_values.Rows(axis)
    with pytest.raises(proof_values.NotProved, match="batch size on 2"):
        proof_values.new_rows(op, proof_values.Dims(("B", "B")))
