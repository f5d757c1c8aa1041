"""The convolution rules' bounded-memory norms and weighted sums.

`per_example_norms` and `clipped_gradients` on Conv2D / depthwise /
separable layers run the rules' chunked norms (a `tf.while_loop` over
chunks of examples) and the one-call weighted sum (the op's own
backprop-filter kernel on the factor-scaled image or dz; per-example
gradients chunk by chunk for dilated filters). Here the chunk is forced
small (2 examples, or 3 computed at run time) so B=5 runs three chunks, the
last one short, and every case is compared with the loop reference on a
static copy of the same model, the custagg side on a dynamic batch
(`[None, ...]` placeholders), float64 and float32 (float32 reaches the
grouped kernel call inside the chunks where oneDNN is on). By default
B=5 in chunks of 2 and B=1 in a run-time chunk; `-m slow` adds the other
two pairs and B in {32, 33}. A last test checks the point of it all
on a graph big enough to tell: the norms' and clipped sums' peak memory
stays below the size of the per-example gradients they reduce.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.rules import conv
from custagg.rules import conv2d

tf1 = tf.compat.v1


def _zero_stuffed(f, dilation):
    """`f` [kh, kw, Cin, C] with dilation-1 zeros between its taps: the
    undilated filter of the same convolution (TF's CPU kernels have no
    filter gradient for a dilated one, so the reference goes through it)."""
    kh, kw = [int(d) for d in f.shape[:2]]
    taps = [[i * dilation, j * dilation] for i in range(kh) for j in range(kw)]
    shape = [(kh - 1) * dilation + 1, (kw - 1) * dilation + 1] + \
        [int(d) for d in f.shape[2:]]
    return tf.scatter_nd(np.array(taps, np.int32),
                         tf.reshape(f, [kh * kw] + shape[2:]), shape)


def _head(z):
    return tf.reduce_sum(tf.sin(z) * tf.cos(1.0 + z), axis=[1, 2, 3])


# name -> (layer, H=W, Cin, Cout or multiplier, kernel, strides, padding,
#          dilation, static H and W)
CASES = {
    "conv2d_same": ("conv2d", 7, 2, 3, 3, [1, 1], "SAME", 1, True),
    "conv2d_valid_stride2": ("conv2d", 9, 3, 2, 3, [2, 2], "VALID", 1, True),
    "conv2d_stride_1x2_kernel_2x3": ("conv2d", 8, 2, 4, (2, 3), [1, 2],
                                     "SAME", 1, True),
    "conv2d_dilation2": ("conv2d", 9, 2, 3, 3, [1, 1], "SAME", 2, True),
    "conv2d_explicit": ("conv2d", 8, 1, 3, 3, [1, 1],
                        [[0, 0], [1, 2], [2, 0], [0, 0]], 1, True),
    "conv2d_dynamic_hw": ("conv2d", 9, 2, 3, 3, [2, 2], "SAME", 1, False),
    "conv2d_many_positions": ("conv2d", 12, 4, 2, 5, [1, 1], "SAME", 1,
                              True),
    # Few positions against the filter: the Gram form inside the chunks.
    "conv2d_gram": ("conv2d", 3, 8, 8, 3, [1, 1], "VALID", 1, True),
    "depthwise_same": ("depthwise", 7, 2, 2, 3, [1, 1], "SAME", 1, True),
    "depthwise_valid_stride2": ("depthwise", 9, 3, 1, 3, [2, 2], "VALID", 1,
                                True),
    "depthwise_dilation2": ("depthwise", 9, 2, 2, 3, [1, 1], "SAME", 2,
                            True),
    "depthwise_dynamic_hw": ("depthwise", 8, 2, 2, 3, [1, 1], "SAME", 1,
                             False),
    "separable": ("separable", 7, 2, 3, 3, [1, 1], "SAME", 1, True),
}


class _Model(object):
    """The case's layer on `x` with the given variables."""

    def __init__(self, case, dtype, rng):
        (self.layer, self.hw, self.cin, self.cout, kernel, self.strides,
         padding, self.dilation, self.static) = case
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        np_dtype = dtype.as_numpy_dtype
        self.dtype = dtype
        if self.layer == "separable":
            self.xs = [tf.Variable(rng.randn(kh, kw, self.cin, 2).astype(
                np_dtype)), tf.Variable(rng.randn(
                    1, 1, 2 * self.cin, self.cout).astype(np_dtype))]
        else:
            self.xs = [tf.Variable(rng.randn(kh, kw, self.cin,
                                             self.cout).astype(np_dtype))]
        self.explicit = []
        self.padding = padding
        if not isinstance(padding, str):
            self.explicit = [p for pair in padding for p in pair]
            self.padding = "EXPLICIT"

    def loss(self, x, dilated=True):
        """The per-example loss; `dilated=False` builds the same function
        with zero-stuffed undilated filters (the reference)."""
        d = self.dilation if dilated else 1
        f = self.xs[0] if dilated else _zero_stuffed(self.xs[0],
                                                     self.dilation)
        attrs = dict(strides=[1] + self.strides + [1], padding=self.padding,
                     explicit_paddings=self.explicit, data_format="NHWC",
                     dilations=[1, d, d, 1])
        if self.layer == "conv2d":
            z = tf.raw_ops.Conv2D(input=x, filter=f, **attrs)
        else:
            z = tf.raw_ops.DepthwiseConv2dNative(input=x, filter=f, **attrs)
        if self.layer == "separable":
            z = tf.nn.conv2d(z, self.xs[1], 1, "VALID")
        return _head(z)


def _chunk_of(size, monkeypatch):
    """Forces the rules' chunk to `size` examples: a Python int, or with
    "tensor" a run-time value (the dynamic-shape path)."""
    if size == "tensor":
        monkeypatch.setattr(conv.ConvBase, "_chunk_size",
                            lambda self, ctx: tf.constant(3))
    else:
        monkeypatch.setattr(conv.ConvBase, "_chunk_size",
                            lambda self, ctx: size)


def _reference(sess, ref, feed):
    """Initializes the variables and runs the loop reference `ref`: its
    norms, a clip norm that clips some examples but not all (0.7 of the
    median norm) and the clipped sums at that norm."""
    sess.run(tf1.global_variables_initializer())
    ref_values = sess.run(ref, feed)
    want_norms = testing.numpy_norms(ref_values)
    c = 0.7 * float(np.median(want_norms))
    return want_norms, c, testing.numpy_clipped(ref_values, c)[0]


def _check(name, batch, dtype, chunk, monkeypatch):
    case = CASES[name]
    _chunk_of(chunk, monkeypatch)
    rng = np.random.RandomState(sum(map(ord, name)) + batch)
    model = _Model(case, dtype, rng)
    hw, cin = case[1], case[2]
    static_x = tf1.placeholder(dtype, [batch, hw, hw, cin])
    dynamic_x = tf1.placeholder(
        dtype, [None, hw, hw, cin] if model.static else [None, None, None,
                                                         cin])
    ref = testing.loop_per_example(
        model.loss(static_x, dilated=model.dilation == 1), model.xs)
    loss = model.loss(dynamic_x)
    plan = custagg.plan_per_example(loss, model.xs)
    assert all(a.form == "rules" for a in plan.assignments), str(plan)
    clip = tf1.placeholder(dtype, [])
    norms = custagg.per_example_norms(loss, model.xs)
    clipped, clipped_norms = custagg.clipped_gradients(
        loss, model.xs, clip, return_norms=True)
    data = rng.randn(batch, hw, hw, cin).astype(dtype.as_numpy_dtype)
    rtol = 1e-9 if dtype == tf.float64 else 1e-4
    with tf1.Session() as sess:
        want_norms, c, want_clipped = _reference(sess, ref, {static_x: data})
        got = sess.run([norms, clipped, clipped_norms],
                       {dynamic_x: data, clip: c})
    testing.assert_close(got[0], want_norms, rtol, name + " norms")
    testing.assert_close(got[2], want_norms, rtol, name + " clipped norms")
    for j, (g, w) in enumerate(zip(got[1], want_clipped)):
        testing.assert_close(g, w, rtol, "%s clipped sum x%d" % (name, j))


def _skip_unsupported(name, dtype):
    case = CASES[name]
    if case[0] == "depthwise" and case[5][0] != case[5][1] and \
            not conv._tf_compat.is_mkl_enabled():
        pytest.skip("TF's own CPU depthwise kernel needs equal strides")
    if case[0] == "depthwise" and case[7] > 1 and dtype == tf.float64:
        pytest.skip("TF's float64 CPU depthwise kernel has no dilations "
                    "(the float32 case runs)")


@pytest.mark.parametrize("batch, chunk", [
    # Default: 5 examples in chunks of 2 (two whole chunks and a partial
    # one), and B=1 in a chunk known only at run time; the other two pairs
    # under -m slow.
    pytest.param(5, 2, id="5-2"), pytest.param(1, "tensor", id="1-tensor"),
    pytest.param(1, 2, id="1-2", marks=pytest.mark.slow),
    pytest.param(5, "tensor", id="5-tensor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_norms_and_clipped_sums_match_loop(name, batch, dtype, chunk,
                                                   monkeypatch):
    _skip_unsupported(name, dtype)
    _check(name, batch, dtype, chunk, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [32, 33])
@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_at_and_off_a_multiple_of_32(name, batch, monkeypatch):
    _skip_unsupported(name, tf.float64)
    _check(name, batch, tf.float64, 7, monkeypatch)


def test_chunk_size_static_and_dynamic_agree(sess, monkeypatch):
    """The chunk size from the budget: a Python int with static H and W, a
    run-time tensor without them, the same value; at least one example."""
    rule = conv2d.Conv2DRule()
    f = tf.Variable(tf.ones([3, 3, 4, 8]))
    sizes, images = [], []
    for shape in ([None, 10, 10, 4], [None, None, None, 4]):
        x = tf1.placeholder(tf.float32, shape)
        z = tf.nn.conv2d(x, f, 1, "SAME")
        ctx = conv.registry.RuleContext(z.op, 1, tf.ones_like(z),
                                        tf.shape(x)[0])
        images.append(x)
        sizes.append(rule._chunk_size(ctx))
    per = rule._chunk_elements_per_example(ctx, 100, 400)
    assert sizes[0] == max(1, rule._CHUNK_MAX_ELEMENTS // per) > 1
    assert not isinstance(sizes[1], int)
    feed = {images[1]: np.zeros([2, 10, 10, 4], np.float32)}
    sess.run(tf1.global_variables_initializer())
    assert sess.run(sizes[1], feed) == sizes[0]
    monkeypatch.setattr(rule, "_CHUNK_MAX_ELEMENTS", 1)
    assert rule._chunk_size(ctx).graph is sess.graph
    assert sess.run(rule._chunk_size(ctx), feed) == 1


def test_even_chunks_fewest_chunks_of_the_smallest_size(sess):
    """As many chunks as `most` needs, each of the smallest size covering
    the batch in that many; the tensor form (run-time batch) agrees."""
    cases = [(b, m) for b in range(1, 130) for m in range(1, 70)]
    for batch, most in cases:
        size = conv.even_chunks(most, batch)
        chunks = -(-batch // most)
        assert isinstance(size, int) and 1 <= size <= most, (batch, most)
        assert -(-batch // size) == chunks, (batch, most, size)
        assert (size - 1) * chunks < batch, (batch, most, size)
    assert (conv.even_chunks(29, 32), conv.even_chunks(29, 512)) == (16, 29)
    b, m = tf1.placeholder(tf.int32, []), tf1.placeholder(tf.int32, [])
    size = conv.even_chunks(m, b)
    assert not isinstance(size, int)
    for batch, most in cases[::37] + [(0, 5), (5, 0)]:
        want = conv.even_chunks(max(most, 1), max(batch, 1)) if batch else 1
        assert sess.run(size, {b: batch, m: most}) == want, (batch, most)


def _loop_body_consts(graph, scope):
    """The int32 scalar constants in the chunk loops under `scope`: in the
    bodies of its `While` ops (v2 loops: functions of the graph's
    library), or in the graph under its `..._chunks/` frames (v1 loops)."""
    def scalar(t):
        return (t.dtype == tf.int32.as_datatype_enum and
                not t.tensor_shape.dim and t.int_val)
    library = {f.signature.name: f
               for f in graph.as_graph_def().library.function}
    values = set()
    for op in graph.get_operations():
        if not op.name.startswith(scope):
            continue
        if op.type in ("While", "StatelessWhile"):
            for node in library[op.get_attr("body").name].node_def:
                t = node.attr["value"].tensor
                if node.op == "Const" and scalar(t):
                    values.add(int(t.int_val[0]))
        elif op.type == "Const" and "_chunks/" in op.name and scalar(
                op.node_def.attr["value"].tensor):
            values.add(int(op.node_def.attr["value"].tensor.int_val[0]))
    return values


@pytest.mark.parametrize("v1", [False, True], ids=["v2_loops", "v1_loops"])
def test_both_chunk_loops_cut_the_batch_evenly(graph, monkeypatch, request,
                                               v1):
    """B = 32 under a rule chunk of at most 29: the norms' loop and the
    clipped sums' loop both step by 16 examples (two chunks), not 29 (29
    and a remainder of 3, whose full chunk set the peak)."""
    if v1:
        request.getfixturevalue("control_flow_v1")
    _chunk_of(29, monkeypatch)
    monkeypatch.setattr(conv.ConvBase, "_CHUNK_CLIP_MIN_POSITIONS", 0)
    x = tf1.placeholder(tf.float32, [32, 16, 16, 1])
    loss, xs = _two_conv_net(x, tf.float32, np.random.RandomState(3))
    custagg.per_example_norms(loss, xs[:1], name="norms_only")
    custagg.clipped_gradients(loss, xs, 1.0, name="clipped_only")
    for scope in ("norms_only/", "clipped_only/"):
        steps = _loop_body_consts(graph, scope)
        assert 16 in steps and 29 not in steps, (scope, sorted(steps))


def test_weighted_sum_is_one_backprop_filter_call(graph):
    """No per-example gradients for an undilated filter's weighted sum: one
    Conv2DBackpropFilter (on the scaled image here: it is smaller than dz)
    and no batched matmul or while loop."""
    x = tf1.placeholder(tf.float32, [None, 8, 8, 2])
    f = tf.Variable(tf.ones([3, 3, 2, 6]))
    z = tf.nn.conv2d(x, f, 1, "SAME")
    ctx = conv.registry.RuleContext(z.op, 1, tf.ones_like(z), tf.shape(x)[0],
                                    {})
    before = set(graph.get_operations())
    conv2d.Conv2DRule().weighted_sum(ctx, tf.ones([tf.shape(x)[0]]))
    types = [op.type for op in graph.get_operations() if op not in before]
    assert types.count("Conv2DBackpropFilter") == 1, types
    assert not {"BatchMatMulV2", "While", "StatelessWhile", "Enter"} & set(
        types), types


@pytest.mark.parametrize("layer", ["conv2d", "depthwise"])
def test_peak_memory_within_the_aggregated_gradients(layer):
    """B=128, a 5x5 filter on 16x16x8 images: the whole-batch window patches
    are 128 x 256 x 200 floats (26 MB), 2.5x the aggregated gradient's
    traced peak (benchmarks/memory.py). The norms' and the clipped sum's
    peaks stay within 1.1x of the aggregated gradient's (+64 KiB); before
    the chunks they were 4-6x."""
    from benchmarks import memory
    batch, hw, cin, cout, k = 128, 16, 8, 16 if layer == "conv2d" else 2, 5
    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.RandomState(0)
        x = tf1.placeholder(tf.float32, [None, hw, hw, cin])
        f = tf.Variable(rng.randn(k, k, cin, cout).astype(np.float32))
        z = (tf.nn.conv2d(x, f, 1, "SAME") if layer == "conv2d" else
             tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME"))
        loss = _head(z)
        fetches = {"floor": tf1.gradients(tf.reduce_sum(loss), [f]),
                   "norms": custagg.per_example_norms(loss, [f]),
                   "clip": custagg.clipped_gradients(loss, [f], 1.0)}
        config = tf1.ConfigProto(intra_op_parallelism_threads=1,
                                 inter_op_parallelism_threads=1)
        with tf1.Session(config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            feed = {x: rng.randn(batch, hw, hw, cin).astype(np.float32)}
            peaks = {key: memory.step_peak_bytes(sess, fetch, feed)[0]
                     for key, fetch in fetches.items()}
    patches = batch * hw * hw * k * k * cin * 4
    assert patches > 2 * peaks["floor"], peaks      # the test can tell
    for key in ("norms", "clip"):
        assert peaks[key] <= 1.1 * peaks["floor"] + 64 * 1024, peaks


# --- clipped sums from the norms' chunk kernels ------------------------------

def _two_conv_net(x, dtype, rng, shared_bias=False):
    """A small mnist_deep: conv 3x3 1->3 (Cin=1), pool, conv 3x3 3->4, a
    dense layer with bias on top; per-example loss `[B]`. Returns (loss,
    xs); the convolutions' filters come first."""
    np_dtype = dtype.as_numpy_dtype
    w1 = tf.Variable(rng.randn(3, 3, 1, 3).astype(np_dtype))
    w2 = tf.Variable(rng.randn(3, 3, 3, 4).astype(np_dtype))
    dense = tf.Variable(0.3 * rng.randn(4 * 4 * 4, 2).astype(np_dtype))
    bias = tf.Variable(rng.randn(2).astype(np_dtype))
    h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME") + 0.1)
    h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = tf.tanh(tf.nn.conv2d(h, w2, [1, 2, 2, 1], "SAME"))
    logits = tf.matmul(tf.reshape(h, [-1, 4 * 4 * 4]), dense) + bias
    return tf.reduce_sum(tf.sin(logits), axis=1), [w1, w2, dense, bias]


def _check_two_conv(batch, dtype, chunk, monkeypatch, cost_model=False):
    """`cost_model=False`: both convolutions in the joint chunk loop (the
    bound on output positions off); True: as the rules choose (the second
    convolution's 16 positions keep its weighted backprop-filter call)."""
    _chunk_of(chunk, monkeypatch)
    if not cost_model:
        monkeypatch.setattr(conv.ConvBase, "_CHUNK_CLIP_MIN_POSITIONS", 0)
    rng = np.random.RandomState(100 + batch)
    static_x = tf1.placeholder(dtype, [batch, 16, 16, 1])
    dynamic_x = tf1.placeholder(dtype, [None, 16, 16, 1])
    ref_loss, ref_xs = _two_conv_net(static_x, dtype,
                                     np.random.RandomState(7))
    loss, xs = _two_conv_net(dynamic_x, dtype, np.random.RandomState(7))
    ref = testing.loop_per_example(ref_loss, ref_xs)
    clip = tf1.placeholder(dtype, [])
    graph = tf1.get_default_graph()
    before = set(graph.get_operations())
    clipped, norms = custagg.clipped_gradients(loss, xs, clip,
                                               return_norms=True)
    new = [op for op in graph.get_operations() if op not in before]
    # The convolutions' sums come from the chunk loop: no weighted filter
    # gradient outside it (TF's Conv2D gradient in the shared pass builds
    # one too, unfetched: the session prunes it).
    outside = [op for op in new if op.type == "Conv2DBackpropFilter"
               and "clipped_chunks" not in op.name
               and "per_example_rules/gradients/" not in op.name]
    if cost_model:
        # The second convolution's weighted sum is one call on its 8x8
        # image, outside the loop; the first's (16x16) is not.
        assert [op.inputs[0].shape[1] for op in outside] == [8], \
            [op.name for op in outside]
    else:
        assert not outside, [op.name for op in outside]
    assert any("clipped_chunks" in op.name for op in new)
    data = rng.randn(batch, 16, 16, 1).astype(dtype.as_numpy_dtype)
    rtol = 1e-9 if dtype == tf.float64 else 1e-4
    with tf1.Session() as sess:
        want_norms, c, want = _reference(sess, ref, {static_x: data})
        got_clipped, got_norms = sess.run([clipped, norms],
                                          {dynamic_x: data, clip: c})
    testing.assert_close(got_norms, want_norms, rtol, "norms")
    for j, (g, w) in enumerate(zip(got_clipped, want)):
        testing.assert_close(g, w, rtol, "clipped sum x%d" % j)


@pytest.mark.parametrize("chunk", [2, "tensor"], ids=str)
@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
def test_clipped_sum_from_chunk_kernels_two_convs_and_dense(
        batch, dtype, chunk, monkeypatch):
    """Two convolutions (the first with Cin=1) and a dense layer: the
    convolutions' weighted sums from the joint chunk loop, with each
    chunk's clip factors from all four variables' norms (the dense ones
    computed before the loop), against the loop reference."""
    _check_two_conv(batch, dtype, chunk, monkeypatch)


def test_clipped_sum_from_chunk_kernels_joint_budget(monkeypatch):
    """The joint bound on all convolutions' kernels of a chunk (one
    example per chunk here, below the rules' own chunks) gives the same
    values."""
    from custagg.per_example import api
    monkeypatch.setattr(api, "_CHUNK_KERNELS_MAX_ELEMENTS", 1)
    _check_two_conv(7, tf.float64, 5, monkeypatch)


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
def test_clipped_sum_chunk_loop_only_where_it_saves(dtype, monkeypatch):
    """The cost model (`_CHUNK_CLIP_MIN_POSITIONS`): the first convolution
    (256 output positions) takes its share from the chunk kernels, the
    second (16 positions: the pass over its kernels would cost more than
    the filter-gradient call) keeps one weighted call; exact either way."""
    _check_two_conv(7, dtype, 2, monkeypatch, cost_model=True)


def test_chunk_clip_ready_reads_the_positions(graph):
    """64 output positions or fewer, or positions not static: not in the
    joint loop; more: in it."""
    rule = conv2d.Conv2DRule()
    f = tf.Variable(tf.ones([3, 3, 4, 8]))
    ready = {}
    for side in (8, 9, None):
        x = tf1.placeholder(tf.float32, [None, side, side, 4])
        z = tf.nn.conv2d(x, f, 1, "SAME")
        ctx = conv.registry.RuleContext(z.op, 1, tf.ones_like(z),
                                        tf.shape(x)[0], {})
        ready[side] = rule.chunk_clip_ready(ctx)
    assert ready == {8: False, 9: True, None: False}


@pytest.mark.slow
@pytest.mark.parametrize("batch", [32, 33])
def test_clipped_sum_from_chunk_kernels_at_and_off_32(batch, monkeypatch):
    _check_two_conv(batch, tf.float64, 7, monkeypatch)


def test_clipped_sum_from_chunk_kernels_not_with_groups_or_per_x(graph):
    """Microbatches and per-x clip norms keep the weighted backprop-filter
    call (their factors are not per example, or not from the total), and
    so do depthwise filters."""
    x = tf1.placeholder(tf.float32, [None, 16, 16, 1])
    loss, xs = _two_conv_net(x, tf.float32, np.random.RandomState(0))
    for kwargs in ({"num_microbatches": 2},):
        before = set(graph.get_operations())
        custagg.clipped_gradients(loss, xs, 1.0, **kwargs)
        names = [op.name for op in graph.get_operations()
                 if op not in before]
        assert not any("clipped_chunks" in n for n in names), kwargs
    before = set(graph.get_operations())
    custagg.clipped_gradients(loss, xs, [1.0, 1.0, 1.0, 1.0])
    assert not any("clipped_chunks" in op.name for op in
                   graph.get_operations() if op not in before)
    # Depthwise filters keep their one-call weighted sum.
    f = tf.Variable(tf.ones([3, 3, 1, 2]))
    dw_loss = _head(tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME"))
    before = set(graph.get_operations())
    custagg.clipped_gradients(dw_loss, [f], 1.0)
    new = [op for op in graph.get_operations() if op not in before]
    assert not any("clipped_chunks" in op.name for op in new)
    assert any(op.type == "DepthwiseConv2dNativeBackpropFilter"
               and "per_example_rules/gradients/" not in op.name
               for op in new)


# --- a one-element filter's sum in the chunk loop (issue 34) -----------------

def _signal_model(dtype):
    """A 1-D signal model written as `tf.compat.v1.layers` code writes it:
    a `[None, T, 1]` placeholder (dynamic batch, one input channel), a
    1x1 `conv1d` gate with one filter (its kernel `[1, 1, 1]` has ONE
    element), a `conv1d` of 4 filters and a dense head."""
    x = tf1.placeholder(dtype, [None, 12, 1])
    init = tf1.random_normal_initializer(seed=5)
    gate = tf1.layers.conv1d(x, 1, 1, use_bias=False, kernel_initializer=init,
                             name="gate")
    h = tf1.layers.conv1d(x * tf.sigmoid(gate), 4, 3, activation=tf.tanh,
                          kernel_initializer=init, name="conv")
    logits = tf1.layers.dense(tf1.layers.flatten(h), 2,
                              kernel_initializer=init, name="head")
    loss = tf.reduce_sum(tf.sin(logits), axis=1)
    return x, loss, tf1.trainable_variables()


@pytest.mark.parametrize("folded", ["0", ""], ids=["no-fold", "default"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
def test_conv1d_one_element_filter_dynamic_batch(dtype, folded, monkeypatch):
    """`clipped_gradients` raised at graph construction ("enters the loop
    with shape (1,), but has shape (None,) after one iteration"): the gate's
    one-element filter sum, a chunk-loop variable, lost its static shape
    where the per-example kernels come from the windows (float64, or
    float32 without the folded kernels). Exact against the loop reference
    at B in {1, 3, 7}, each in chunks of 2."""
    if not tf1.layers or not callable(tf1.layers.conv1d):
        pytest.skip("tf.compat.v1.layers is not available")
    monkeypatch.setenv("CUSTAGG_FOLDED_CONV", folded)
    _chunk_of(2, monkeypatch)
    graph = tf.Graph()
    with graph.as_default():
        x, loss, xs = _signal_model(dtype)
        plan = custagg.plan_per_example(loss, xs)
        assert all(a.form == "rules" for a in plan.assignments), str(plan)
        clip = tf1.placeholder(dtype, [])
        clipped, norms = custagg.clipped_gradients(loss, xs, clip,
                                                   return_norms=True)
        refs = {b: testing.loop_per_example(loss, xs, batch=b)
                for b in (1, 3, 7)}
        rtol = 1e-9 if dtype == tf.float64 else 1e-4
        rng = np.random.RandomState(11)
        with tf1.Session() as sess:
            for batch, ref in refs.items():
                feed = {x: rng.randn(batch, 12, 1)}
                want_norms, c, want = _reference(sess, ref, feed)
                feed[clip] = c
                got_clipped, got_norms = sess.run([clipped, norms], feed)
                testing.assert_close(got_norms, want_norms, rtol,
                                     "B=%d norms" % batch)
                for j, (g, w) in enumerate(zip(got_clipped, want)):
                    testing.assert_close(g, w, rtol, "B=%d clipped sum x%d"
                                         % (batch, j))
