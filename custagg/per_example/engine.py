"""Builds what a plan calls for: the other forms' per-example gradients,
and each quantity (per-example gradients, squared norms, weighted and
squared sums) from whichever form x has.

* `Engine`: quantity dispatch. Rules reduce each quantity from their
  contexts in the rules' one backward pass (`shared_pass.SharedPass`;
  `norm_algebra` for xs with several terms, `chains` through ops without
  batch data); the certified rules do so under a `tf.cond` on the run-time
  certificate (`certificate.Certificate`), else the exact form; other
  forms materialize `[B, *x]` once per form (`Engine.materialized`),
  falling back as the form says when its build is refused
  (`forms.base.is_refusal`). The plan is never changed: fallbacks are
  recorded in `Engine.built` and logged.
"""

from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from custagg import op_kinds
from custagg import sparse
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg.traversal.aggregation import AggregationMethod
from custagg.traversal.gradients import gradients
from custagg.per_example import chains as chains_lib
from custagg.per_example import norm_algebra
from custagg.per_example import planning
from custagg.per_example.certificate import Certificate
from custagg.per_example.forms import EXACT as FORMS_EXACT
from custagg.per_example.forms import EXACT_BEHIND_LOOPS
from custagg.per_example.forms import FORMS
from custagg.per_example.forms import REFUSAL_TYPES
from custagg.per_example.forms import is_refusal
from custagg.per_example.forms import rules as rules_form
from custagg.per_example.shared_pass import SharedPass
from custagg.per_example.shared_pass import first_line
from custagg.rules import registry as registry_lib
from custagg.rules import outer as outer_lib
from custagg.rules import segments as segments_lib

_LOG = logging.getLogger("custagg")


def x_shape(a):
    """x's shape: a static list, or a list of scalar tensors."""
    shape = tf.TensorShape(a.x.shape if hasattr(a.x, "shape")
                           else a.tensor.shape)
    if shape.is_fully_defined():
        return shape.as_list()
    value = a.x.value() if isinstance(a.x, tf.Variable) else a.tensor
    return tf.unstack(tf.shape(value))


def static_x_shape(a):
    return tf.TensorShape(a.x.shape if hasattr(a.x, "shape")
                          else a.tensor.shape)


def x_dtype(a):
    return tf.as_dtype(a.x.dtype).base_dtype


class Engine(object):
    """Builds the tensors a plan calls for.

    Attributes:
      built: `{x name: (form, reason)}` for each x whose planned form's
        build was refused, with the form that ran instead.
    """

    def __init__(self, plan, pfor_chunk_size):
        self.plan = plan
        self.loss = plan.loss
        self.batch_size = plan.batch_size
        self.chunk = pfor_chunk_size
        self.shared = SharedPass(plan)
        self.built = {}
        self._materialized = {}     # id(assignment) -> [B, *x]
        self._certificate = None
        self._certified_memo = {}   # quantity key -> {id(a): value}

    x_shape = staticmethod(x_shape)
    static_x_shape = staticmethod(static_x_shape)
    x_dtype = staticmethod(x_dtype)

    # -- the forms other than rules: materialized once, with fallbacks --

    def materialized(self, a):
        """`[B, *x]` of an x planned to a form other than the rules."""
        if id(a) not in self._materialized:
            group = [b for b in self.plan.assignments if b.form == a.form
                     and id(b) not in self._materialized]
            self._build(FORMS[a.form], group)
        return self._materialized[id(a)]

    def _build(self, form, group):
        """Builds `group` in `form`, or in the forms its refusals fall back
        to; records and logs each fallback."""
        out = self.build_form(form, group)
        for a in group:
            self._materialized[id(a)] = tf.cast(out[id(a)], x_dtype(a))

    def build_form(self, form, group):
        """`{id(a): [B, *x]}` of `group` built in `form` (or the forms its
        refusals fall back to), nothing stored: also what a failed run-time
        check builds under `tf.cond`."""
        errors = []
        while True:
            try:
                with tf.name_scope(form.scope):
                    out = form.build(self, group)
                break
            except REFUSAL_TYPES as e:
                if not is_refusal(e):
                    raise           # a bug: never hidden as a slower form
                nxt = form.fallback(self.plan.requested)
                errors.append((form, e))
                if nxt is None:
                    if len(errors) > 1:
                        raise no_strategy(group, errors) from e
                    raise
                why = "%s could not build: %s" % (form.name, first_line(e))
                _LOG.info("custagg: %s: %s; building %s instead",
                          ", ".join(a.name for a in group), why, nxt.name)
                for a in group:
                    self.built[a.name] = (nxt.name, why)
                planning.warn_slow(self.plan, group, [nxt.name] * len(group))
                form = nxt
        return out

    def exact(self, group):
        """The exact form's `[B, *x]` of `group`, as a list aligned with it
        (built where it is called: inside a `tf.cond` branch it runs only
        on a step that takes that branch).

        Where the shared pass rebuilt the loops (`SharedPass.one_pass`,
        already built: the certified forms build it before their
        `tf.cond`), the exact form differentiates the loss recomputed from
        the rebuilt loops, at the copies of xs that lie after them: the
        same values, and a `tf.cond` branch captures every tensor it reads
        as an input computed on every step, so an exact form on the
        original loss would run the original loops forward (and hold
        their activations) on a certified step too (issue 26). There the
        exact form is the loop over the examples (`EXACT_BEHIND_LOOPS`:
        pfor's conversion of the loops takes minutes to build)."""
        one = self.shared.built_one_pass()
        if one is None:
            out = self.build_form(FORMS_EXACT, group)
            return [tf.cast(out[id(a)], x_dtype(a)) for a in group]
        on_copies = [a.on_tensor(one.tensor_of(a.tensor)) for a in group]
        saved = self.loss, self.batch_size
        self.loss = self.shared.loss()
        # A tensor, so the loop form builds one while loop, never B passes.
        self.batch_size = tf.convert_to_tensor(self.shared.batch_size())
        try:
            out = self.build_form(EXACT_BEHIND_LOOPS, on_copies)
        finally:
            self.loss, self.batch_size = saved
        return [tf.cast(out[id(b)], x_dtype(a))
                for a, b in zip(group, on_copies)]

    # -- the certified rules --

    def certificate(self, a):
        """A scalar bool: the run-time certificate of separation of every
        rule op of x (planned "certified"), from one seeded backward pass
        shared by all certified xs (`Certificate`)."""
        if self._certificate is None:
            found = [c for b in self.plan.assignments
                     if b.form == "certified"
                     for c in rules_form.rule_consumers(b.consumers)]
            self._certificate = Certificate(self, found)
        return self._certificate.ok_of(
            list(rules_form.rule_consumers(a.consumers)))

    @contextlib.contextmanager
    def _branch(self):
        """Rule contexts with caches of their own while a `tf.cond` branch
        is built (`SharedPass.branch_caches`)."""
        saved = self.shared.branch_caches
        self.shared.branch_caches = {}
        try:
            yield
        finally:
            self.shared.branch_caches = saved

    def coupled_group(self, a, within=None):
        """The certified xs (of `within`, default the plan's) whose static
        proof stopped at the same op as x's (`Assignment.blocker`): a
        coupling there fails their checks together, so their exact form is
        built once for all of them (`certified`). x alone when it names no
        op."""
        pool = self.plan.assignments if within is None else within
        if a.blocker is None:
            return [a]
        return [b for b in pool if b.form == "certified"
                and b.blocker is a.blocker]

    def certified(self, group, fast, exact):
        """One quantity of the certified xs of `group` (one `coupled_group`):
        `fast(a)` (from the rules) for each x whose own certificate holds
        at this step, else x's value from `exact(group)` (a list aligned
        with group).

        One `tf.cond` on the group's checks: a step where all hold runs
        the rules only; otherwise the exact form is built once for the
        group and each x still takes its rules under its own `tf.cond`
        where its check holds. Each value is built inside the branch that
        returns it, so a step runs only what it takes: a certified step
        never runs the exact form, a failing x's rules (whose rows may not
        even be B) never run, and xs whose static proof stopped elsewhere
        (other groups) never join this group's exact form.

        Returns:
          A list aligned with `group`.
        """
        oks = [self.certificate(a) for a in group]
        built = {}

        def rules_branch():
            with self._branch():
                built["fast"] = [fast(a) for a in group]
            return built["fast"]

        def exact_branch():
            with self._branch():
                exact_values = exact(group)
            out = []
            for a, ok, e, like in zip(group, oks, exact_values,
                                      built["fast"]):
                e = _same_kind(e, like)
                if len(group) == 1:
                    out.append(e)
                    continue

                def own_rules(a=a):
                    with self._branch():
                        return fast(a)
                out.append(tf.cond(ok, own_rules, lambda e=e: _identity(e),
                                   name="certified_x"))
            return out
        every = oks[0] if len(oks) == 1 else tf.reduce_all(tf.stack(oks))
        out = tf.cond(every, rules_branch, exact_branch, name="certified")
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def _certified_quantity(self, a, key, fast, exact):
        """`certified` for x's group, built once per quantity `key` and
        group (the values of the group's other xs kept for their calls)."""
        memo = self._certified_memo.setdefault(key, {})
        if id(a) not in memo:
            group = self.coupled_group(a)
            for b, v in zip(group, self.certified(group, fast, exact)):
                memo[id(b)] = v
        return memo[id(a)]

    # -- rules --

    def to_x(self, t, a, batched):
        """A rule result in the op input's layout -> x's layout and dtype."""
        dtype = x_dtype(a)
        if isinstance(t, indexed_slices_lib.IndexedSlices):
            rows_of = tf.get_static_value(t.dense_shape)
            if rows_of is not None and static_x_shape(a).is_fully_defined() \
                    and list(rows_of) != static_x_shape(a).as_list():
                # Rows of a reshaped table are not rows of x: dense, as
                # TF's Reshape gradient gives.
                t = tf.convert_to_tensor(t)
            else:
                return indexed_slices_lib.IndexedSlices(
                    tf.cast(t.values, dtype), t.indices, t.dense_shape)
        lead = [tf.shape(t)[0]] if batched else []
        return tf.cast(tf.reshape(t, lead + x_shape(a)), dtype)

    def _chains(self, a):
        return [c for c in a.consumers if isinstance(c, rules_form.Chain)]

    def rules_per_example(self, a):
        """`[B, *x]` of an x on rules: its rules' and chains' sum."""
        parts = [self.to_x(rule.per_example(ctx), a, True)
                 for rule, ctx in self.shared.contexts(a)]
        for chain in self._chains(a):
            parts.extend(chains_lib.per_example(self, chain, a))
        return tf.add_n(parts) if len(parts) > 1 else parts[0]

    def _terms(self, a, groups=None):
        """x's per-example gradients as `norm_algebra` terms; with `groups`
        (M) the microbatch sums, `[M]` leading instead of `[B]`."""
        def group(t):
            return t if groups is None else registry_lib.group_sum(t, groups)
        terms = []
        for rule, ctx in self.shared.contexts(a):
            outer = rule.outer(ctx)
            if outer is not None:
                if groups is not None:
                    outer = outer.grouped(groups)
                terms.append(("outer", outer, outer_lib.static_dims(
                    ctx.param)))
            else:
                terms.append(("dense", group(self.to_x(
                    rule.per_example(ctx), a, True)), None))
        for chain in self._chains(a):
            if chains_lib.is_scalar(chain):
                c, v = chains_lib.scaled(self, chain, a)
                terms.append(("scaled", group(c), v))
            else:
                for part in chains_lib.per_example(self, chain, a):
                    terms.append(("dense", group(part), None))
        return terms

    def _checked(self, t, a, what):
        """`t`, a rules result with one row per example, checked to have B
        rows (the loss's): a rule that took other rows for examples (a fold
        of `[B, T, D]` into `B*T` rows it did not see) raises instead of
        clipping or weighting each row as if it were an example."""
        if not isinstance(t, tf.Tensor) or t.shape.rank == 0:
            return t
        rows = tf.compat.dimension_value(t.shape[0])
        batch = tf.compat.dimension_value(self.loss.shape[0])
        name = getattr(a.x, "name", a.x)
        hint = ("a rule took another axis, or rows of a fold it did not see, "
                "for the examples; strategy='pfor' avoids the rules")
        if rows is not None and batch is not None:
            if rows != batch:
                raise ValueError(
                    "custagg: the rules gave %s of %s for %d rows, but the "
                    "batch has %d examples (%s)." % (what, name, rows, batch,
                                                     hint))
            return t
        check = tf.debugging.assert_equal(
            tf.shape(t)[0], self.shared.rows(),
            message="custagg: the rules gave %s of %s for another number of "
                    "rows than the batch's examples (%s)" % (what, name, hint))
        with tf.control_dependencies([check]):
            return tf.identity(t)

    # -- quantities --

    def per_example(self, a):
        """`[B, *x]`, or None for an unconnected x."""
        if a.strategy is None:
            return None
        if a.form == "certified":
            out = self._certified_quantity(
                a, "per_example",
                lambda b: tf.cast(self._rules_per_example(b), x_dtype(b)),
                self.exact)
            out.set_shape(tf.TensorShape([None]).concatenate(
                static_x_shape(a)))
            return out
        if _on_rules(a):
            return self._rules_per_example(a)
        return self.materialized(a)

    def _rules_per_example(self, a):
        return self._checked(self.rules_per_example(a), a,
                             "per-example gradients")

    def squared_norms(self, a, groups=None):
        """[B] squared norms of x's per-example gradients (loss dtype), or
        with `groups` (M, or a `segments.Segments` of U users) the [M] ([U])
        squared norms of the group sums:
        each rule's own identity for one consumer, the terms' inner
        products for several, else from the materialized gradients."""
        if a.form == "certified":
            return self._certified_quantity(
                a, ("norms", _groups_key(groups)),
                lambda b: self._rules_squared_norms(b, groups),
                lambda group: [self._norms_of(g, groups)
                               for g in self.exact(group)])
        if _on_rules(a):
            return self._rules_squared_norms(a, groups)
        return self._norms_of(self.per_example(a), groups)

    def _norms_of(self, g, groups):
        """Squared norms of materialized `[B, *x]` (of their group sums)."""
        g = tf.cast(g, self.loss.dtype)
        if groups is not None:
            g = registry_lib.group_sum(g, groups)
        return registry_lib.squared_norms_of(g)

    def _rules_squared_norms(self, a, groups):
        dtype = self.loss.dtype
        if not self._chains(a):
            pairs = self.shared.contexts(a)
            if len(pairs) == 1:      # one consumer: the rule's own identity
                rule, ctx = pairs[0]
                if groups is None:
                    sq = rule.squared_norms(ctx)
                elif isinstance(groups, segments_lib.Segments):
                    sq = rule.segment_squared_norms(ctx, groups)
                else:
                    sq = rule.group_squared_norms(ctx, groups)
                sq = tf.cast(sq, dtype)
                return sq if groups is not None else \
                    self._checked(sq, a, "norms")
            if not pairs:
                return tf.zeros(self.shared.rows()[None] if groups is None
                                else [group_count(groups)], dtype)
        # A shared weight, or weight decay next to a layer: cross terms.
        cross = norm_algebra.squared_norms_of_terms(
            self._terms(a, groups), dtype)
        if cross is not None:
            return cross if groups is not None else \
                self._checked(cross, a, "norms")
        return self._norms_of(self._rules_per_example(a), groups)

    def weighted_sums(self, group, weights):
        """sum_b weights[b] g_b for each x of `group` (one weights vector),
        as `{id(assignment): tensor}`."""
        out = {}
        by_pass = []
        for a in group:
            if a.form == "certified":
                if id(a) not in out:
                    # One weighted pass for x's group (of this call).
                    together = self.coupled_group(a, group)
                    out.update(zip([id(b) for b in together], self.certified(
                        together,
                        lambda b: self._rules_weighted_sum(b, weights),
                        lambda g: self.weighted_pass(g, weights))))
                continue
            if _on_rules(a):
                out[id(a)] = self._rules_weighted_sum(a, weights)
                continue
            done = self._materialized.get(id(a))
            if done is not None and not _gathered(a.tensor):
                # Per-example gradients already built (for the norms):
                # their weighted sum costs B * |x| multiply-adds, where
                # another backward pass would run the batch's forward and
                # backward passes again.
                out[id(a)] = tf.tensordot(tf.cast(weights, done.dtype), done,
                                          axes=1)
            else:
                by_pass.append(a)
        if by_pass:
            out.update(zip([id(a) for a in by_pass],
                           self.weighted_pass(by_pass, weights)))
        return out

    def weighted_pass(self, group, weights):
        """`sum_b weights[b] g_b` of each x of `group` by one backward pass
        weighted per example: exact whatever the graph (the weights are
        constants: d/dx sum_b w_b l_b). Of the loss the shared pass
        differentiates: where the loop rules rebuilt the loops it is the
        loss recomputed from them (the same values), so a weighted pass
        does not run the original loops again."""
        return gradients(self.shared.loss(), [a.tensor for a in group],
                         aggregation_method=AggregationMethod.CUSTOM,
                         gradient_factors=weights)

    def _rules_weighted_sum(self, a, weights):
        parts = [self.to_x(rule.weighted_sum(ctx, weights), a, False)
                 for rule, ctx in self.shared.contexts(a)]
        for chain in self._chains(a):
            # Linear in the cotangent: the chain's weighted sum is the op's
            # gradient of its outputs' weighted sums.
            inner = self.weighted_sums(chain.inner, weights)
            parts.extend(chains_lib.vjp(
                self, chain, [sparse.dense(inner[id(i)]) for i in chain.inner],
                a, False))
        return _sum_parts(parts)

    def squared_sum(self, a):
        """`sum_b g_b ** 2` (elementwise), x's shape."""
        if a.form == "certified":
            return self._certified_quantity(
                a, "squared_sum", self._rules_squared_sum,
                lambda group: [tf.reduce_sum(tf.square(g), axis=0)
                               for g in self.exact(group)])
        if _on_rules(a):
            return self._rules_squared_sum(a)
        return tf.reduce_sum(tf.square(self.per_example(a)), axis=0)

    def _rules_squared_sum(self, a):
        if not self._chains(a):
            parts = self.shared.contexts(a)
            if len(parts) == 1:
                rule, ctx = parts[0]
                return self.to_x(rule.squared_sum(ctx), a, False)
        return tf.reduce_sum(tf.square(self._rules_per_example(a)), axis=0)


def _on_rules(a):
    """Whether x's quantities come from the rules' contexts directly (the
    certified rules' come from them too, inside a `tf.cond` per quantity:
    `Engine.certified`)."""
    return a.form in ("rules", "loop-rules")


def _identity(t):
    """`tf.identity` of a tensor or IndexedSlices (a branch's own output)."""
    if isinstance(t, indexed_slices_lib.IndexedSlices):
        return indexed_slices_lib.IndexedSlices(
            tf.identity(t.values), tf.identity(t.indices),
            None if t.dense_shape is None else tf.identity(t.dense_shape))
    return tf.identity(t)


def _groups_key(groups):
    """A dict key for a grouping (None, an int M, or a `Segments`)."""
    return groups if groups is None or isinstance(groups, int) \
        else id(groups)


def _same_kind(t, like):
    """The exact branch's value `t` in the form of the rules branch's `like`
    (a `tf.cond` needs the same structure from both): IndexedSlices with
    indices and dense shape of like's dtypes, or a dense tensor of like's
    dtype."""
    if isinstance(like, indexed_slices_lib.IndexedSlices):
        if not isinstance(t, indexed_slices_lib.IndexedSlices):
            t = tf.convert_to_tensor(t)
            t = indexed_slices_lib.IndexedSlices(
                t, tf.range(tf.shape(t, out_type=like.indices.dtype)[0]),
                tf.shape(t, out_type=tf.int64))
        shape = None
        if like.dense_shape is not None:
            # (like's tensors live in the other branch: only its constant
            # dense shape may be read from here.)
            shape = tf.cast(t.dense_shape if t.dense_shape is not None
                            else tf.constant(tf.get_static_value(
                                like.dense_shape)), like.dense_shape.dtype)
        return indexed_slices_lib.IndexedSlices(
            tf.cast(t.values, like.values.dtype),
            tf.cast(t.indices, like.indices.dtype), shape)
    return tf.cast(sparse.dense(t), like.dtype)


def _gathered(x_tensor):
    """Whether rows of x are gathered (an embedding table): its summed
    gradient is then `IndexedSlices`, which a backward pass keeps."""
    return any(op.type in op_kinds.GATHERS and
               op.inputs[0] is x_tensor for op in x_tensor.consumers())


def _sum_parts(parts):
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, indexed_slices_lib.IndexedSlices) for p in parts):
        return sparse.concat_slices(parts)
    return tf.add_n([sparse.dense(p) for p in parts])

def group_count(groups):
    """M (an int) or U (a scalar tensor) for a grouping."""
    if isinstance(groups, segments_lib.Segments):
        return groups.count
    return groups


def no_strategy(group, errors):
    """The error for a graph no form can build: names the ops that kept
    each x off the O(B) forms, what each form said, and what to try."""
    ops = sorted({"'%s' (%s)" % (a.blocker.name, a.blocker.type)
                  for a in group if a.blocker is not None})
    tried = "; ".join("%s: %s" % (f.name, first_line(e)) for f, e in errors)
    return ValueError(
        "custagg: no strategy can build per-example gradients of %s%s. "
        "Tried: rules (%s); %s. What to try: give the inputs a [None, ...] "
        "shape so each example's forward pass can be copied, build the model "
        "with control flow v2 (tf.compat.v1.enable_control_flow_v2()), or "
        "register a rule for the op with @custagg.register_rule." % (
            ", ".join(a.name for a in group),
            (", held up by op " + ", ".join(ops)) if ops else "",
            "; ".join(sorted({a.reason.split(";")[0] for a in group
                              if a.reason})) or "not asked for",
            tried))
