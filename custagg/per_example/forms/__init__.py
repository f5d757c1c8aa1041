"""The per-example forms, each an object behind one interface (`base.Form`:
plan, then build), and which strategies may take which.

  rules.RULES              "rules"           about 1 backward pass
  rules.LOOP_RULES         "loop-rules"      about 2 (loops run once more)
  rules.CERTIFIED          "certified"       about 2 (+ the exact form on a
                                             step whose run-time check fails)
  pfor.BOUNDARY            "boundary"        O(B)
  pfor.COPIES              "recompute"       O(B)
  pfor.COPIES_LOOP         "recompute-loop"  O(B)
  pfor.WHOLE_PASS          "whole-pass"      O(B^2)
  loop.LOOP                "loop"            O(B^2)

A new form is a `base.Form` subclass, an entry of `FORMS`, and a place in
`CHAINS` (the forms a strategy tries, in order, at plan time).
"""

from custagg.per_example.forms import base
from custagg.per_example.forms import loop
from custagg.per_example.forms import pfor
from custagg.per_example.forms import rules
from custagg.per_example.forms.base import Choice  # noqa: F401
from custagg.per_example.forms.base import Form  # noqa: F401
from custagg.per_example.forms.base import REFUSAL_TYPES  # noqa: F401
from custagg.per_example.forms.base import Refused  # noqa: F401
from custagg.per_example.forms.base import is_refusal  # noqa: F401

FORMS = {f.name: f for f in (rules.RULES, rules.LOOP_RULES, rules.CERTIFIED,
                             pfor.BOUNDARY,
                             pfor.COPIES, pfor.COPIES_LOOP, pfor.WHOLE_PASS,
                             loop.LOOP)}

# The forms each strategy tries for an x at plan time, in order; the first
# that does not refuse x takes it. (A form's `plan` may hand x to a variant:
# the rules to the loop rules, the copies to their while loop.)
_PFOR = (pfor.BOUNDARY, pfor.COPIES, pfor.WHOLE_PASS)
CHAINS = {
    "auto": (rules.RULES, rules.CERTIFIED) + _PFOR,
    "rules": (rules.RULES,),
    "pfor": _PFOR,
    "loop": (loop.LOOP,),
}


# The exact form a certified step takes when its run-time check fails (and
# the copies when their loss check fails): exact for any graph pfor
# converts, falling back to the loop when it does not.
EXACT = pfor.WHOLE_PASS
# ... and behind rebuilt loops (`SharedPass.one_pass`): the loop over the
# examples. pfor's conversion of a while loop and of its gradient loop is
# what made the whole pass slow to build (the bi-LSTM CRF tagger's clipped
# sum: 60 s to build and 32 s to its first step, against 8 s and 10 s),
# and a certified step never runs it; a step whose check fails runs B
# backward passes, 2-3x the pfor's time (0.25 s vs 0.1 s at B=32).
EXACT_BEHIND_LOOPS = loop.LOOP
