"""Randomized tests: seeded random programs against TensorFlow's own traversal.

Two generators, each case built from one seed:

* random graphs: custagg.gradients vs tf.compat.v1.gradients on the same
  graph (a mix of elementwise ops, MatMul, gathers from a table (IndexedSlices
  gradients), integer casts, stop_gradient, overridden gradients, IdentityN,
  split/concat, cond and while_loop in v1 or v2 control flow), with random ys,
  xs (inputs and intermediate tensors), stop_gradients, grad_ys and
  unconnected_gradients: the same structure (None where TF gives None,
  IndexedSlices where TF gives them, the same error type where TF raises),
  the same values, and the same second derivatives;
* random per-example models (dense layers, activations, overridden identities
  on weights, integer-cast and stop_gradient branches, embeddings with and
  without a reshaped table, elementwise weights, a batch-free l2 term, conv
  with explicit or SAME padding, inputs as xs, static and dynamic batch
  sizes at and off multiples of 32; the batch fed, behind a
  placeholder_with_default, held in a variable or a constant; row-wise ops
  the batch-axis table may not know (the run-time certificate's case) and
  layers or an in-batch loss that couple examples (the certificate must
  fail and the exact form run)) for every strategy and every public
  function against one tf.compat.v1.gradients(loss[i]) per example
  (tests/per_example_reference.py). strategy="rules" may decline a model
  with its "strategy='rules' cannot ..." error; nothing else may raise. A
  refusal is not a pass: the model is then checked under "auto", and the
  report counts it apart.

Each test prints what it checked (`-s` shows it): how many cases were
compared value by value, how many were refused by "rules" (and checked
under "auto" instead), how many raised the same error in TF and custagg.

The default suite runs a few fixed seeds; `-m slow` runs
`CUSTAGG_RANDOM_CASES` (default 1000) per generator, from seeds 20000 and
40000 (`CUSTAGG_RANDOM_SEED0=k` adds k: fresh seeds). A failure is shrunk by
dropping ops (layers) while it still fails, and reports the seed and the
smallest failing program.

Measured (TF 2.21, seeds 20000-20999 and 40000-40999, as `-m slow` runs
them): random graphs 1000 cases, 0 failures; random per-example models 1000
cases, 0 failures.
"""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference as ref

FAST_CASES = 6
SLOW_CASES = int(os.environ.get("CUSTAGG_RANDOM_CASES", "1000"))
# Fresh seeds: CUSTAGG_RANDOM_SEED0=k moves both slow ranges by k (the
# default 0 gives the ranges measured below).
SEED0 = int(os.environ.get("CUSTAGG_RANDOM_SEED0", "0"))
SHAPE = (3, 4)


@tf.RegisterGradient("CustaggRandomTwice")
def _twice(op, grad):  # pylint: disable=unused-argument
    return 2.0 * grad


# --------------------------------------------------------------------------
# Random graphs

UNARY = ["tanh", "sin", "square", "softplus", "identity", "cast32",
         "intcast", "stop", "override", "rowsum", "split_concat", "while"]
BINARY = ["add", "mul", "sub", "matmul_add", "cond", "identity_n"]
N_INPUTS = 3           # p (placeholder), v (variable), gather of a table


def random_program(seed):
    """A program: ops on [3, 4] float64 tensors, and what to differentiate."""
    rng = np.random.RandomState(seed)
    n_ops = rng.randint(1, 7)
    ops = []
    for k in range(n_ops):
        avail = N_INPUTS + k
        if rng.rand() < 0.55:
            ops.append((UNARY[rng.randint(len(UNARY))],
                        [rng.randint(avail)]))
        else:
            ops.append((BINARY[rng.randint(len(BINARY))],
                        [rng.randint(avail), rng.randint(avail)]))
    total = N_INPUTS + n_ops
    ys = sorted(set(rng.randint(N_INPUTS, total, size=rng.randint(1, 3))))
    xs = sorted(set(rng.randint(0, total, size=rng.randint(1, 4))) | {
        rng.randint(N_INPUTS)})
    stop = [int(rng.randint(total))] if rng.rand() < 0.2 else []
    return {"ops": ops, "ys": [int(y) for y in ys],
            "xs": [int(x) for x in xs], "stop": stop,
            "grad_ys": bool(rng.rand() < 0.3),
            "zero": bool(rng.rand() < 0.3), "cf_v1": bool(rng.rand() < 0.4),
            "second": bool(rng.rand() < 0.5), "seed": seed}


def _apply(name, args, graph, consts):
    a = args[0]
    b = args[1] if len(args) > 1 else None
    if name == "tanh":
        return tf.tanh(a)
    if name == "sin":
        return tf.sin(a)
    if name == "square":
        return tf.square(a)
    if name == "softplus":
        return tf.nn.softplus(a)
    if name == "identity":
        return tf.identity(a)
    if name == "cast32":
        return tf.cast(tf.cast(a, tf.float32), tf.float64)
    if name == "intcast":
        return tf.cast(tf.cast(a * 3.0, tf.int32), tf.float64)
    if name == "stop":
        return tf.stop_gradient(a)
    if name == "override":
        with graph.gradient_override_map({"Identity": "CustaggRandomTwice"}):
            return tf.identity(a)
    if name == "rowsum":
        return tf.reduce_sum(a, 1, keepdims=True) * consts["ones"]
    if name == "split_concat":
        left, right = tf.split(a, 2, axis=1)
        return tf.concat([right, left * 2.0], 1)
    if name == "while":
        _, h = tf.while_loop(lambda i, h: i < 2,
                             lambda i, h: (i + 1, tf.tanh(h) * a),
                             [tf.constant(0), a])
        return h
    if name == "add":
        return a + b
    if name == "mul":
        return a * b
    if name == "sub":
        return a - b
    if name == "matmul_add":
        return tf.matmul(a, consts["m"]) + b
    if name == "cond":
        return tf.cond(consts["pred"], lambda: a * 2.0, lambda: tf.sin(b))
    if name == "identity_n":
        return tf.identity_n([a, b])[0]
    raise KeyError(name)


def build_program(prog, graph):
    """The program's tensors (inputs first), built in `graph`."""
    rng = np.random.RandomState(prog["seed"] + 7)
    consts = {
        "ones": tf.ones(SHAPE, tf.float64),
        "m": tf.constant(rng.normal(size=(4, 4)), tf.float64),
        "pred": tf.compat.v1.placeholder_with_default(
            bool(rng.rand() < 0.5), []),
    }
    p = tf.compat.v1.placeholder_with_default(
        rng.normal(size=SHAPE), SHAPE, name="p")
    v = tf.compat.v1.get_variable(
        "v", initializer=tf.constant(rng.normal(size=SHAPE)),
        use_resource=True)
    table = tf.compat.v1.get_variable(
        "table", initializer=tf.constant(rng.normal(size=(5, 4))),
        use_resource=True)
    nodes = [p, v, tf.gather(table, [4, 0, 4])]
    leaves = [p, v, table]
    for name, args in prog["ops"]:
        nodes.append(_apply(name, [nodes[i] for i in args], graph, consts))
    return nodes, leaves


def _xs(prog, nodes, leaves):
    # Inputs are differentiated as the leaves (the table, not its gather).
    return [leaves[i] if i < N_INPUTS else nodes[i] for i in prog["xs"]]


def _first_order(fn, prog, nodes, leaves):
    ys = [nodes[i] for i in prog["ys"]]
    kwargs = {}
    if prog["grad_ys"]:
        kwargs["grad_ys"] = [tf.constant(
            np.linspace(-1, 1, 12).reshape(SHAPE) * (k + 1), tf.float64)
            for k in range(len(ys))]
    if prog["stop"]:
        kwargs["stop_gradients"] = [nodes[i] for i in prog["stop"]]
    if prog["zero"]:
        kwargs["unconnected_gradients"] = tf.UnconnectedGradients.ZERO
    return fn(ys, _xs(prog, nodes, leaves), **kwargs)


def _second_order(fn, grads, xs):
    terms = [tf.reduce_sum(tf.square(tf.convert_to_tensor(g)))
             for g in grads if g is not None]
    if not terms:
        return None
    return fn(tf.add_n(terms), xs)


def _build_side(fn, prog):
    graph = tf.Graph()
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    if prog["cf_v1"]:
        tf.compat.v1.disable_control_flow_v2()
    try:
        with graph.as_default():
            tf.compat.v1.set_random_seed(prog["seed"])
            nodes, leaves = build_program(prog, graph)
            try:
                grads = _first_order(fn, prog, nodes, leaves)
                second = (_second_order(fn, grads, _xs(prog, nodes, leaves))
                          if prog["second"] else None)
            except Exception as e:  # pylint: disable=broad-except
                return graph, ("error", type(e).__name__, str(e)[:200])
            init = tf.compat.v1.global_variables_initializer()
    finally:
        if was_v2:
            tf.compat.v1.enable_control_flow_v2()
    return graph, ("ok", init, grads, second)


def _describe(gs):
    return ["None" if g is None else type(g).__name__ for g in gs]


def _run_side(graph, side):
    _, init, grads, second = side
    fetch = [g for g in grads if g is not None]
    fetch2 = [g for g in (second or []) if g is not None]
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        vals = sess.run(fetch + fetch2)
    return ([ref.testing.to_numpy(v) for v in vals[:len(fetch)]],
            [ref.testing.to_numpy(v) for v in vals[len(fetch):]])


def check_program(prog):
    """None when custagg agrees with TF on `prog`, else what differs."""
    tf_graph, tf_side = _build_side(tf.compat.v1.gradients, prog)
    ca_graph, ca_side = _build_side(custagg.gradients, prog)
    if tf_side[0] == "error" or ca_side[0] == "error":
        if tf_side[0] != ca_side[0] or tf_side[1] != ca_side[1]:
            return "TF: %s; custagg: %s" % (tf_side[:3], ca_side[:3])
        return SAME_ERROR
    for order, (a, b) in enumerate([(tf_side[2], ca_side[2]),
                                    (tf_side[3] or [], ca_side[3] or [])]):
        if _describe(a) != _describe(b):
            return "order %d structure: TF %s, custagg %s" % (
                order + 1, _describe(a), _describe(b))
    try:
        tf_vals = _run_side(tf_graph, tf_side)
    except tf.errors.OpError as e:
        try:
            _run_side(ca_graph, ca_side)
        except tf.errors.OpError as e2:
            return SAME_ERROR if type(e) is type(e2) else \
                "run errors differ"
        return "TF fails at run time (%s), custagg does not" % type(e).__name__
    ca_vals = _run_side(ca_graph, ca_side)
    for order in range(2):
        for j, (a, b) in enumerate(zip(tf_vals[order], ca_vals[order])):
            if a.shape != b.shape or not np.allclose(
                    a, b, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(a).max())):
                return "order %d, gradient %d: values differ (max %.3g)" % (
                    order + 1, j, float(np.max(np.abs(a - b))))
    return None


def _shrink_program(prog, why):
    """Drops ops (re-pointing their users at their first input) while the
    program still fails; returns (program, reason)."""
    changed = True
    while changed:
        changed = False
        for k in range(len(prog["ops"])):
            cand = _drop_op(prog, k)
            if cand is None:
                continue
            w = check_program(cand)
            if _failed(w):
                prog, why, changed = cand, w, True
                break
    return prog, why


def _drop_op(prog, k):
    idx = N_INPUTS + k
    repl = prog["ops"][k][1][0]

    def remap(i):
        i = repl if i == idx else i
        return i - 1 if i > idx else i

    ops = [(name, [remap(i) for i in args])
           for j, (name, args) in enumerate(prog["ops"]) if j != k]
    ys = sorted(set(remap(i) for i in prog["ys"]) - set(range(N_INPUTS)))
    if not ys:
        return None
    return dict(prog, ops=ops, ys=ys,
                xs=sorted(set(remap(i) for i in prog["xs"])),
                stop=[remap(i) for i in prog["stop"]])


# What a check returns besides None (compared value by value and equal) and
# a failure message: outcomes that are no value comparison of the case as
# drawn, counted apart in the report.
SAME_ERROR = "same error"           # TF and custagg raised the same error
REFUSED = "refused by rules"        # checked under "auto" instead


def _failed(why):
    return why is not None and why not in (SAME_ERROR, REFUSED)


def _cases(seeds, make, check, shrink, what):
    """(failure reports, counts) for the cases `make(seed)`: a report for
    each case `check` rejects, with the smallest failing case `shrink`
    finds; counts of each outcome ("compared" for a value-by-value match)."""
    failures, counts = [], collections.Counter()
    for seed in seeds:
        case = make(seed)
        why = check(case)
        if _failed(why):
            counts["failed"] += 1
            small, why = shrink(case, why)
            failures.append("seed %d: %s\n  smallest failing %s: %s" % (
                seed, why, what, small))
        else:
            counts[why or "compared"] += 1
    return failures, counts


def _report(what, counts):
    """The line a test prints: what it checked, by outcome."""
    line = "%s: %d cases: %s" % (what, sum(counts.values()), ", ".join(
        "%d %s" % (n, k) for k, n in sorted(counts.items())))
    print(line)
    return line


def _graph_cases(seeds):
    return _cases(seeds, random_program, check_program, _shrink_program,
                  "program")


@pytest.mark.parametrize("seed", range(FAST_CASES))
def test_random_graph(seed):
    failures, counts = _graph_cases([1000 + seed])
    _report("random graph seed %d" % (1000 + seed), counts)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_random_graphs_many():
    failures, counts = _graph_cases(
        range(SEED0 + 20000, SEED0 + 20000 + SLOW_CASES))
    _report("random graphs", counts)
    assert not failures, "\n".join(failures[:5])
    # Cases where both sides raised check only that they agree on raising:
    # most cases must compare values.
    assert counts["compared"] >= SLOW_CASES // 2, counts


# --------------------------------------------------------------------------
# Random per-example models

LAYERS = ["dense", "act", "override_w", "intcast_branch", "stop_branch",
          "scale_w", "embed", "embed_reshape", "l2"]


def random_model(seed):
    rng = np.random.RandomState(seed)
    batch = [1, 2, 3, 5, 32, 33][rng.choice(6, p=[.2, .25, .25, .24, .03,
                                                   .03])]
    layers = [LAYERS[rng.randint(len(LAYERS))]
              for _ in range(rng.randint(1, 4))]
    return {"seed": seed, "batch": int(batch),
            "dynamic": bool(rng.rand() < 0.35),
            "conv": [None, "explicit", "same"][rng.choice(3, p=[.7, .2, .1])],
            "layers": layers, "input_x": bool(rng.rand() < 0.25),
            "strategy": custagg.STRATEGIES[seed % 4],
            "functions": [ref.FUNCTIONS[i] for i in sorted(set(
                rng.randint(len(ref.FUNCTIONS), size=2)))],
            # Drawn last, so the fields above stay what they were for a seed.
            "source": SOURCES[rng.choice(len(SOURCES), p=[.55, .15, .15,
                                                          .15])],
            "mix": MIXES[rng.choice(len(MIXES), p=[.5] + [.1] * 5)],
            "inbatch_loss": bool(rng.rand() < 0.1)}


# Where the batch comes from. Not fed: a placeholder_with_default on the
# batch, a variable holding it (shape left open when the batch is dynamic),
# a constant. The batch is found from the loss, whatever holds it.
SOURCES = ["placeholder", "with_default", "variable", "constant"]
# One more layer after the drawn ones, on [B, d]. None: nothing. Row-wise
# ops the batch-axis table may not know (the static proof then fails and the
# run-time certificate must pass: "cumsum", "reverse_cols", "roll_pair", a
# roll along the batch and back); or layers that truly couple examples (the
# certificate must fail and the exact form run: "batch_center" subtracts
# the batch mean, "roll_mix" adds the next example's row).
MIXES = [None, "cumsum", "reverse_cols", "roll_pair", "batch_center",
         "roll_mix"]


def _source(spec, rng, feed, data, dtype, shape):
    """The batch `data` ([B, ...] numpy) as the graph's input tensor."""
    lead = None if spec["dynamic"] else spec["batch"]
    kind = spec.get("source", "placeholder")
    if kind == "placeholder":
        x = tf.compat.v1.placeholder(dtype, [lead] + shape, name="x")
        feed[x] = data
        return x
    if kind == "with_default":
        return tf.compat.v1.placeholder_with_default(
            tf.constant(data, dtype), [lead] + shape, name="x")
    if kind == "variable":
        v = tf.compat.v1.Variable(
            tf.constant(data, dtype), trainable=False, name="x_batch",
            validate_shape=not spec["dynamic"], use_resource=True)
        return tf.identity(v.read_value() if not spec["dynamic"] else
                           tf.reshape(v.read_value(), [-1] + shape), name="x")
    return tf.constant(data, dtype, name="x")


def _mix(kind, h):
    """The `MIXES` layer `kind` on h [B, d]."""
    if kind == "cumsum":
        return tf.math.cumsum(h, axis=1)
    if kind == "reverse_cols":
        return tf.reverse(h, [1])
    if kind == "roll_pair":
        return tf.roll(tf.roll(h, 1, axis=0), -1, axis=0)
    if kind == "batch_center":
        return h - 0.5 * tf.reduce_mean(h, axis=0, keepdims=True)
    if kind == "roll_mix":
        return h + 0.5 * tf.roll(h, 1, axis=0)
    return h


def build_model(spec, graph):
    rng = np.random.RandomState(spec["seed"] + 11)
    n = 0
    feed = {}
    variables = []

    def var(shape):
        nonlocal n
        n += 1
        v = tf.compat.v1.get_variable(
            "w%d" % n, initializer=tf.constant(
                rng.normal(size=shape) * 0.7, tf.float64), use_resource=True)
        variables.append(v)
        return v

    lead = None if spec["dynamic"] else spec["batch"]
    if spec["conv"]:
        x = _source(spec, rng, feed, rng.normal(size=(spec["batch"], 4, 4, 2)),
                    tf.float64, [4, 4, 2])
        pad = ([[0, 0], [1, 0], [0, 2], [0, 0]] if spec["conv"] == "explicit"
               else "SAME")
        h = tf.nn.conv2d(x, var([2, 2, 2, 2]), strides=1, padding=pad)
        h = tf.reshape(h, [-1, int(np.prod(h.shape.as_list()[1:]))])
    else:
        x = _source(spec, rng, feed, rng.normal(size=(spec["batch"], 3)),
                    tf.float64, [3])
        h = x
    extra = []
    for layer in spec["layers"]:
        d = h.shape.as_list()[1]
        if layer == "dense":
            h = tf.matmul(h, var([d, 3])) + var([3])
        elif layer == "act":
            h = tf.tanh(h)
        elif layer == "override_w":
            with graph.gradient_override_map(
                    {"Identity": "CustaggRandomTwice"}):
                w = tf.identity(var([d, 3]))
            h = tf.matmul(h, w)
        elif layer == "intcast_branch":
            w = tf.cast(tf.cast(var([d, d]) * 3.0, tf.int32), tf.float64)
            h = h + tf.matmul(h, w)
        elif layer == "stop_branch":
            h = tf.matmul(h, tf.stop_gradient(var([d, 3])))
        elif layer == "scale_w":
            h = h * var([d])
        elif layer in ("embed", "embed_reshape"):
            ids = tf.compat.v1.placeholder(tf.int32, [lead, 2])
            feed[ids] = rng.randint(0, 6, size=(spec["batch"], 2))
            if layer == "embed":
                table = var([6, d])
            else:
                table = tf.reshape(var([3, 2 * d]), [6, d])
            h = h + tf.reduce_sum(tf.gather(table, ids), 1)
        elif layer == "l2":
            extra.append(0.1 * tf.nn.l2_loss(var([d])))
    h = _mix(spec.get("mix"), h)
    loss = tf.reduce_sum(tf.square(h), 1)
    if spec.get("inbatch_loss"):
        # In-batch negatives: each example's loss sees every row of h.
        loss = loss - 0.1 * tf.reduce_logsumexp(
            tf.matmul(h, h, transpose_b=True), axis=1)
    for e in extra:
        loss = loss + e
    xs = list(variables)
    if spec["input_x"] or not xs:
        xs.append(x)
    return loss, xs, feed


def check_model(spec):
    """None when every public function matches the loop reference; REFUSED
    when strategy="rules" declined the model with its documented error and
    the same model then matched under "auto"; else a failure message."""
    why = _check_model(spec)
    if why is REFUSED:
        again = _check_model(dict(spec, strategy="auto"))
        return REFUSED if again is None else "under auto after the rules' " \
            "refusal: %s" % again
    return why


def _check_model(spec):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(spec["seed"])
        loss, xs, feed = build_model(spec, graph)
        try:
            built = ref.build_functions(loss, xs, spec["strategy"],
                                        spec["functions"])
        except ValueError as e:
            if spec["strategy"] == "rules" and str(e).startswith(
                    "custagg: strategy='rules' cannot"):
                return REFUSED   # a clear refusal, as documented
            return "raised %s: %s" % (type(e).__name__, e)
        except Exception as e:  # pylint: disable=broad-except
            return "raised %s: %s" % (type(e).__name__, e)
        fetches, weights = built
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            try:
                return ref.check(sess, loss, xs, feed, fetches, weights,
                                 rtol=1e-7, label=spec["strategy"])
            except tf.errors.OpError as e:
                return "run time %s: %s" % (type(e).__name__,
                                            str(e).splitlines()[0])


def _shrink_model(spec, why):
    changed = True
    while changed:
        changed = False
        for k in range(len(spec["layers"])):
            cand = dict(spec, layers=spec["layers"][:k] + spec["layers"][k + 1:])
            w = check_model(cand)
            if _failed(w):
                spec, why, changed = cand, w, True
                break
        for key, plain in (("mix", None), ("inbatch_loss", False),
                           ("source", "placeholder")):
            if spec.get(key, plain) != plain and not changed:
                cand = dict(spec, **{key: plain})
                w = check_model(cand)
                if _failed(w):
                    spec, why, changed = cand, w, True
        if spec["conv"] and not changed:
            cand = dict(spec, conv=None)
            w = check_model(cand)
            if _failed(w):
                spec, why, changed = cand, w, True
    return spec, why


def _model_cases(seeds):
    return _cases(seeds, random_model, check_model, _shrink_model, "model")


@pytest.mark.parametrize("seed", range(FAST_CASES))
def test_random_per_example_model(seed):
    failures, counts = _model_cases([5000 + seed])
    _report("random per-example model seed %d (%s)" % (
        5000 + seed, random_model(5000 + seed)["strategy"]), counts)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_random_per_example_models_many():
    failures, counts = _model_cases(
        range(SEED0 + 40000, SEED0 + 40000 + SLOW_CASES))
    _report("random per-example models", counts)
    assert not failures, "\n".join(failures[:5])
