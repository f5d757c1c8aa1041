"""The interface every per-example form implements: plan, then build.

A form is one way of building `[B, *x.shape]` per-example gradients (or the
quantities reduced from them) for the xs a plan assigns to it. It answers
two questions, at two times:

* `plan(x_tensor, ctx)`, while `plan_per_example` runs: can this form give
  x's per-example gradients on this graph? A `Choice` (what the build will
  need: the rule consumers, the boundary ops, the forward pass to copy) or
  `Refused` (why not, and the op that held it up). Static, no graph built.
* `build(engine, group)`, when a public function needs the tensors: the
  `[B, *x.shape]` of every assignment of `group` (all planned to this form),
  as `{id(assignment): tensor}`. A build may still be refused (pfor cannot
  convert an op): it raises `Refused`, or TF raises its own conversion error
  (`is_refusal` tells which errors count); anything else is a bug and
  propagates.

`fallback(requested)` names the form the engine builds instead when a build
is refused (None: the refusal is the user's error). The engine records the
fallback it took (`Engine.built`) and never changes the plan.

A new form (for example "certified rules": the rules' quantities checked at
run time, the exact form under `tf.cond` when the check fails) is one more
subclass listed in `custagg.per_example.forms.FORMS` and in the chain of the
strategies that may take it (`chain`).
"""

from __future__ import annotations

import collections
import os

import tensorflow as tf

from custagg.graph.copier import CannotCopy


class Refused(Exception):
    """A form declines x (at plan time) or a group (at build time).

    Attributes:
      reason: what kept the form off (a str, or a `separability.Reason`
        carrying the op).
      op: the op that held it up, or None.
    """

    def __init__(self, reason, op=None):
        super(Refused, self).__init__(str(reason))
        self.reason = reason
        self.op = op if op is not None else getattr(reason, "op", None)


# The errors TF raises when it cannot build something a form asked for
# (pfor: "No converter defined for ..."; gradient construction on a copy).
_TF_ERRORS = (ValueError, TypeError, NotImplementedError, LookupError,
              tf.errors.OpError)
_TF_DIR = os.path.dirname(os.path.abspath(tf.__file__))
_TF_PACKAGE_DIRS = tuple(
    os.path.join(os.path.dirname(_TF_DIR), name) + os.sep
    for name in ("tensorflow", "tf_keras", "keras"))


# What a build may raise that `is_refusal` then judges: ours, and TF's.
REFUSAL_TYPES = (Refused,) + _TF_ERRORS


def is_refusal(error):
    """Whether a build's exception is a legitimate refusal: ours (`Refused`,
    or the copies' `CannotCopy`), or one of TF's own errors raised
    inside TensorFlow (the innermost frame is in TF's package). An error
    raised in custagg's code is a bug and must propagate, never turn into a
    slower form."""
    if isinstance(error, Refused):
        return True
    if isinstance(error, CannotCopy):
        return True
    if not isinstance(error, _TF_ERRORS):
        return False
    tb = error.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    where = os.path.abspath(last.tb_frame.f_code.co_filename)
    return where.startswith(_TF_PACKAGE_DIRS)


class Choice(collections.namedtuple(
        "Choice", ["form", "consumers", "boundaries", "forward", "note"])):
    """What a form's `plan` found for one x.

    form: the `Form` that will build x (a form may hand x to a variant of
      itself: the rules to the loop rules, the copies to their while loop).
    consumers: the rule ops and chains ("rules", "loop-rules").
    boundaries: the boundary ops ("boundary").
    forward: the forward pass to copy (`copies.Forward`: the copies).
    note: a reason to add to the plan (why the variant), or None.
    """

    def __new__(cls, form, consumers=(), boundaries=None, forward=None,
                note=None):
        return super(Choice, cls).__new__(cls, form, tuple(consumers),
                                          boundaries, forward, note)


class Form(object):
    """One per-example form (see the module docstring).

    Class attributes:
      name: the key in `FORMS` and in `Plan.forms()`.
      strategy: the strategy it belongs to ("rules", "pfor", "loop").
      what: how the graph is built, in a few words (the plan's table).
      cost: its cost class in backward passes over the batch.
      scope: the name scope its ops are built in (so the graph shows what
        ran), or None for the rules' shared pass.
      refused_as: the prefix of its refusal in the plan's reason.
    """

    name = None
    strategy = None
    what = ""
    cost = ""
    scope = None
    refused_as = ""

    @property
    def slow(self):
        """Whether its cost grows with B^2."""
        return self.cost == "O(B^2)"

    def plan(self, x_tensor, ctx):
        """A `Choice` for x, or raises `Refused`. `ctx`: the
        `planning.PlanContext` of this `plan_per_example` call."""
        raise NotImplementedError

    def build(self, engine, group):
        """`{id(a): [B, *x.shape]}` for the assignments `group`."""
        raise NotImplementedError

    def fallback(self, requested):
        """The form to build when this one's build is refused, or None."""
        del requested
        return None

    def __repr__(self):
        return "<form %s>" % self.name


def takes_every_x(form, x_tensor, ctx):
    """`Form.plan` of a form that needs nothing of the graph (the loop, the
    whole pass): every x, as it is."""
    del x_tensor, ctx
    return Choice(form)
