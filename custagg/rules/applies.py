"""Whether a registered rule applies at one op: the question the rules
form asks of each op x meets, and the loop rules of each op in a loop body.

A rule applies at `op` (x at input k) when the registry has one for the op
type, the op's gradient is the standard one (no `gradient_override_map`),
the rule's own static checks pass (`Rule.unsupported`), and, given the loss,
examples stay apart from the rule's start to the loss (`batch_axis.coupling`).
"""

from __future__ import annotations

from custagg import batch_axis
from custagg.rules import registry as registry_lib
from custagg.rules import shortcuts


def rule_reason(op, k, registry, batch_size, loss, loss_ancestors):
    """None when the registry's rule for `op` (x at input k) applies here:
    a rule exists, the op's gradient is the standard one, the rule's static
    checks pass, and examples stay apart from the rule's start to the loss.
    Else a `batch_axis.Reason` (the loop rules ask the same question)."""
    rule = registry.lookup(op.type)
    if rule is None:
        return batch_axis.Reason(
            "no per-example rule for op type '%s' (op '%s')"
            % (op.type, op.name), op)
    if shortcuts.gradient_override(op) is not None:
        return batch_axis.Reason(
            "op '%s' (type %s) has its gradient overridden (to %r); the "
            "%s rule implements the standard gradient" % (
                op.name, op.type, shortcuts.gradient_override(op),
                op.type), op)
    ctx = registry_lib.RuleContext(op, k, None, batch_size)
    why = rule.unsupported(ctx)
    if why:
        return batch_axis.Reason(
            "the %s rule does not handle op '%s': %s" % (
                op.type, op.name, why), op)
    if loss is None:
        return None
    for start, axis in rule.coupling_starts(ctx):
        coupled = batch_axis.coupling(start, axis, loss, loss_ancestors)
        if coupled:
            return batch_axis.Reason(
                "batch coupling between op '%s' and the loss: %s; "
                "per-example rules assume examples do not interact"
                % (op.name, coupled), getattr(coupled, "op", None),
                cause="no static proof that examples stay apart from the "
                      "rule ops to the loss: %s" % coupled)
    return None
