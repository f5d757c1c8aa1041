"""Per-example gradients, norms, clipped and weighted sums.

  api         the front door: the public functions (`custagg.<name>`)
  planning    `Plan` / `Assignment`: what runs and why (never changed once
              returned), and the planner
  forms/      each form behind one interface (plan, then build): rules,
              loop rules, boundary, copies (recompute), whole pass, loop;
              `forms.copies`: the per-example copies of the forward pass
  engine      the rules' shared backward pass and the quantity dispatch
  chains      gradients through ops that see no batch data
  norm_algebra  norms of sums of terms without materializing
  vectorized  chunked pfor, the boundary and whole-pass builders

See docs/architecture.md.
"""

from custagg.per_example.api import STRATEGIES  # noqa: F401
from custagg.per_example.api import clipped_gradients  # noqa: F401
from custagg.per_example.api import gradient_second_moments  # noqa: F401
from custagg.per_example.api import per_example_gradients  # noqa: F401
from custagg.per_example.api import per_example_norms  # noqa: F401
from custagg.per_example.api import plan_per_example  # noqa: F401
from custagg.per_example.api import weighted_gradients  # noqa: F401
from custagg.per_example.planning import Assignment  # noqa: F401
from custagg.per_example.planning import Plan  # noqa: F401
