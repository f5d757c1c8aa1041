"""The per-example rule registry: TF op type -> `Rule`.

The contract
------------
Take an op `z = op(..., p, ...)` whose input `p = op.inputs[ctx.input_index]`
carries a parameter (no batch axis), and a per-example loss `l` of shape
`[B]` whose entries depend on `z` only through the example's own rows of `z`
(no batch coupling downstream; `custagg.batch_axis` checks this). Let
`dz = d(sum_i l_i)/dz` (`ctx.grad`). Because examples do not interact, row
`i` of `dz` is example `i`'s own `d l_i / dz`, so the contribution of this op
to example `i`'s gradient is

    g_i = (d z_i / d p)^T dz_i                    (shape p.shape)

A `Rule` computes, from the op's inputs and `dz` alone (one backward pass),

    per_example(ctx)        -> [B, *p.shape]      g_i stacked
    squared_norms(ctx)      -> [B]                ||g_i||^2
    weighted_sum(ctx, c)    -> p.shape            sum_i c_i g_i   (c: [B])
    squared_sum(ctx)        -> p.shape            sum_i g_i ** 2  (elementwise)
    group_squared_norms(ctx, M) -> [M]            ||sum_{i in m} g_i||^2, microbatch m
                                                  = examples m*B/M ... (m+1)*B/M - 1
    segment_squared_norms(ctx, S) -> [U]          ||sum_{i in u} g_i||^2, user u of fed ids
                                                  (`segments.Segments`: S.ids [B], U = S.count)
    outer(ctx)              -> outer.Outer/None  g_i as sum_t a_it (x) g_it (cross terms)
    output_batch_axis(ctx)  -> int                axis of op.outputs[0] that is the batch
    coupling_start(ctx)     -> (tensor, axis)     where the batch-coupling check starts
    coupling_starts(ctx)    -> [(tensor, axis)]   all of them (default: the one)
    extra_targets(ctx)      -> [tensor]           more gradients from the shared pass
    unsupported(ctx)        -> None or a reason   (attributes the rule does not handle)

Only `per_example` is required; the defaults of the others reduce it, and a
rule overrides them when it can avoid materializing `[B, *p.shape]` (the
outer-product identities `||a (x) g|| = ||a|| ||g||` and
`sum_i c_i a_i (x) g_i = A^T diag(c) G`). `weighted_sum` may return
`IndexedSlices` (embedding tables stay sparse).

Gradients are of the per-example losses as given: a mean loss scales each
example's gradient by 1/B.

Registries are objects so a test (or a user) can build one with a single
rule; `default_registry()` holds the rules in `custagg.rules`.
"""

from __future__ import annotations

import collections
import sys

import tensorflow as tf

from custagg.rules import _reduce
from custagg.rules import segments as segments_lib


class RuleContext(collections.namedtuple(
        "RuleContext", ["op", "input_index", "grad", "batch_size", "cache"])):
    """What a rule receives.

    Attributes:
      op: the forward `tf.Operation` that consumes the parameter.
      input_index: which of `op.inputs` carries the parameter.
      grad: `[B, ...]` dense gradient of the summed loss w.r.t.
        `op.outputs[0]`.
      batch_size: scalar int32 tensor B (static value when known).
      cache: a dict shared by the calls made with this context (or None),
        so a rule that had to materialize per-example gradients for the
        norms can reuse them for the clipped sum (`cached_per_example`).
    """

    def __new__(cls, op, input_index, grad, batch_size, cache=None):
        return super(RuleContext, cls).__new__(cls, op, input_index, grad,
                                               batch_size, cache)

    @property
    def param(self):
        """The parameter input `p`."""
        return self.op.inputs[self.input_index]

    def other_input(self):
        """The input that is not the parameter (two-input ops)."""
        return self.op.inputs[1 - self.input_index]



def cached(ctx, key, build):
    """`build()`, once per context: kept in `ctx.cache[key]` when the
    context has a cache (one shared pass), built afresh when it has none."""
    if ctx.cache is None:
        return build()
    if key not in ctx.cache:
        ctx.cache[key] = build()
    return ctx.cache[key]

class Rule(object):
    """Per-example maths of one op type (see the module docstring)."""

    # Whether the rule reads the values of the op's inputs other than the
    # parameter (a MatMul's activation), or only their shapes, the op's
    # attributes and the output gradient (a bias). Inside a loop body
    # (per_example/forms/loop_rules.py) each read input is kept for every
    # iteration, `[T, B, ...]`: a rule that reads none says False.
    reads_other_inputs = True
    # The inputs whose gradient is the output's, unchanged (a BiasAdd's
    # value: dz). Inside a loop body the op feeding such an input alone
    # then reads its dz from this op's tap: one `[T, B, ...]` tensor less.
    passes_gradient_to = ()

    def unsupported(self, ctx):
        """A reason string when this op instance is not handled, else None."""
        del ctx
        return None

    def output_batch_axis(self, ctx):
        del ctx
        return 0

    def coupling_start(self, ctx):
        """(tensor, batch axis) from which examples must stay apart to the loss.

        Default: the op's output and `output_batch_axis`. A rule that reads
        past a reshape folding the batch into rows starts after the unfold.
        """
        return ctx.op.outputs[0], self.output_batch_axis(ctx)

    def coupling_starts(self, ctx):
        """Every (tensor, batch axis) from which examples must stay apart to
        the loss: `[coupling_start(ctx)]`, or more for a rule whose
        per-example gradient reads rows of several tensors (nce_loss's
        gather: its true rows and the sampled logits, `gather.NceSplit`).
        Only rules with one start can be certified at run time."""
        return [self.coupling_start(ctx)]

    def extra_targets(self, ctx):
        """Tensors besides `op.outputs[0]` at which the rule reads the
        summed loss's gradient, computed in the same shared backward pass
        (`ctx.cache["extra"]`, a list aligned with these). Default: none."""
        del ctx
        return ()

    def per_example(self, ctx):
        raise NotImplementedError

    def cached_per_example(self, ctx):
        """`per_example(ctx)`, built once per context when it has a cache."""
        return cached(ctx, "per_example", lambda: self.per_example(ctx))

    def has_per_example(self, ctx):
        """Whether per-example gradients were already built for `ctx`."""
        return ctx.cache is not None and "per_example" in ctx.cache

    def squared_norms(self, ctx):
        return squared_norms_of(self.cached_per_example(ctx))

    def weighted_sum(self, ctx, weights):
        g = self.cached_per_example(ctx)
        return tf.tensordot(tf.cast(weights, g.dtype), g, axes=1)

    def squared_sum(self, ctx):
        return tf.reduce_sum(tf.square(self.cached_per_example(ctx)), axis=0)

    def group_squared_norms(self, ctx, num_groups):
        """`[M]` squared norms of the microbatch gradients `sum_{i in m} g_i`
        (M = `num_groups` consecutive groups of B/M examples, TF Privacy's
        microbatches). Default: the per-example gradients summed per group;
        rules with an identity for the group sum override it."""
        g = group_sum(self.cached_per_example(ctx), num_groups)
        return squared_norms_of(g)

    def segment_squared_norms(self, ctx, segments):
        """`[U]` squared norms of the group gradients `sum_{i in u} g_i`,
        the groups given by fed ids (`segments.Segments`, any group sizes,
        U known at run time). Default: the per-example gradients summed per
        group; rules with an identity for the group sum override it. A rule
        overriding only `group_squared_norms` keeps this exact default."""
        return squared_norms_of(segments.sum(self.cached_per_example(ctx)))

    def outer(self, ctx):
        """The per-example gradients as an `outer.Outer` (sums of outer
        products, never materialized), or None. Lets a variable used by
        several ops get its norms from cross terms."""
        del ctx
        return None


def squared_norms_of(t):
    """`[B, ...]` -> `[B]`: each example's sum of squares, in one pass
    (`_reduce.per_example_squared_norms`: no `[B, ...]` of squares written
    first, which was the clipped MLP's peak at B = 512)."""
    return _reduce.per_example_squared_norms(
        tf.reshape(t, tf.stack([tf.shape(t)[0], -1])))


def group_sum(t, num_groups):
    """`[B, ...]` -> `[M, ...]`: row m sums rows m*B/M ... (m+1)*B/M - 1
    (TF Privacy's `tf.reshape(loss, [M, -1])` grouping). M must divide B.
    With `num_groups` a `segments.Segments` (fed ids), `[U, ...]` sums by
    segment."""
    if isinstance(num_groups, segments_lib.Segments):
        return num_groups.sum(t)
    if isinstance(t, tf.IndexedSlices):
        t = tf.convert_to_tensor(t)
    rest = t.shape[1:]
    if rest.is_fully_defined():
        shape = [num_groups, -1] + rest.as_list()
    else:
        shape = tf.concat([[num_groups, -1], tf.shape(t)[1:]], 0)
    return tf.reduce_sum(tf.reshape(t, shape), axis=1)


def _caller_location(depth):
    # sys._getframe, not inspect.stack(): the latter reads source files for
    # every frame and cost seconds per registration.
    frame = sys._getframe(depth)  # pylint: disable=protected-access
    return "%s:%d" % (frame.f_code.co_filename, frame.f_lineno)


class RuleRegistry(object):
    """Maps TF op types to `Rule` instances."""

    def __init__(self):
        self._rules = {}
        self._where = {}

    def register(self, op_type, rule, overwrite=False, _depth=2):
        """Registers `rule` for `op_type`.

        Raises:
          KeyError: `op_type` already has a rule (and `overwrite` is False);
            the message says where the first one was registered.
        """
        if not isinstance(rule, Rule):
            raise TypeError("custagg: a rule must be a custagg.Rule instance; "
                            "got %r for op type %r." % (rule, op_type))
        if op_type in self._rules and not overwrite:
            raise KeyError(
                "custagg: a per-example rule for op type %r is already "
                "registered (at %s). Pass overwrite=True to replace it."
                % (op_type, self._where[op_type]))
        self._rules[op_type] = rule
        self._where[op_type] = _caller_location(_depth)

    def lookup(self, op_type):
        """The `Rule` for `op_type`, or None."""
        return self._rules.get(op_type)

    def op_types(self):
        return sorted(self._rules)

    def copy(self):
        other = RuleRegistry()
        other._rules = dict(self._rules)
        other._where = dict(self._where)
        return other

    def __contains__(self, op_type):
        return op_type in self._rules


_DEFAULT = RuleRegistry()


def default_registry():
    """The registry holding custagg's built-in rules (and yours)."""
    # Importing the rules package registers the built-in rules once.
    import custagg.rules  # pylint: disable=g-import-not-at-top,unused-import
    return _DEFAULT


def register_rule(*op_types, registry=None, overwrite=False):
    """Class decorator: registers an instance of the class for `op_types`.

    Example:
      >>> @custagg.register_rule("MyMatMul")
      ... class MyMatMulRule(custagg.Rule):
      ...     def per_example(self, ctx):
      ...         ...  # [B, *ctx.param.shape]
    """
    if not op_types:
        raise ValueError("custagg.register_rule: name at least one op type.")

    def decorate(cls):
        target = _DEFAULT if registry is None else registry
        instance = cls()
        for op_type in op_types:
            target.register(op_type, instance, overwrite=overwrite, _depth=3)
        return cls

    return decorate
