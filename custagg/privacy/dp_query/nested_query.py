"""`NestedQuery` / `NestedSumQuery`: one query per part of a structured
record (TF Privacy's classes) -- per-layer clipping in DP-SGD.

    # one clip norm per variable of var_list = [w1, b1, w2, b2]
    query = NestedSumQuery([GaussianSumQuery(1.0, 1.1), GaussianSumQuery(0.1, 0.11),
                            GaussianSumQuery(1.0, 1.1), GaussianSumQuery(0.1, 0.11)])

The query structure must be a prefix of the record structure: each leaf
query receives the whole sub-structure of the record at its position (so a
leaf may cover several variables). In custagg's DP optimizers the record is
the list of gradients aligned with `var_list`, and a nested query of
Gaussian / normalized / adaptive-clip leaves gets each leaf's clipped sum
from custagg's rules (one clip norm per leaf, no per-example records).
"""

from __future__ import annotations

import collections

import tensorflow as tf
from custagg._tf_compat import nest as _nest  # *_up_to helpers

from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query.gaussian_query import composed_event

__all__ = ["NestedQuery", "NestedSumQuery"]


class NestedQuery(dp_query.DPQuery):
    """A nested structure of DPQuery objects applied part by part.

    A record must match the query structure down to the query leaves
    (deeper structure inside a leaf's part is that leaf's business): with
    queries `[q1, q2]`, the record `[t1, (t2, t3)]` sends `t1` to `q1` and
    `(t2, t3)` to `q2`; `(t1, t2)` (another container type) raises
    TypeError and `[t1]` (too few parts) ValueError.

    Args:
      queries: a nested structure (lists, tuples, dicts, namedtuples) of
        DPQuery objects.
    """

    def __init__(self, queries):
        self._queries = queries

    def _map_to_queries(self, method, *inputs, **kwargs):
        def call(query, *args):
            return getattr(query, method)(*args, **kwargs)
        return _nest.map_structure_up_to(self._queries, call, self._queries,
                                         *inputs)

    def initial_global_state(self):
        return self._map_to_queries("initial_global_state")

    def derive_sample_params(self, global_state):
        return self._map_to_queries("derive_sample_params", global_state)

    def initial_sample_state(self, template=None):
        if template is None:
            return self._map_to_queries("initial_sample_state")
        return self._map_to_queries("initial_sample_state", template)

    def preprocess_record(self, params, record):
        return self._map_to_queries("preprocess_record", params, record)

    def accumulate_preprocessed_record(self, sample_state,
                                       preprocessed_record):
        return self._map_to_queries("accumulate_preprocessed_record",
                                    sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1, sample_state_2):
        return self._map_to_queries("merge_sample_states", sample_state_1,
                                    sample_state_2)

    def get_noised_result(self, sample_state, global_state):
        """`(results, new global states, ComposedDpEvent of the leaves')`,
        results and states in the query structure."""
        per_leaf = _nest.flatten_up_to(
            self._queries, self._map_to_queries("get_noised_result",
                                                sample_state, global_state))
        results, states, events = zip(*per_leaf) if per_leaf else ((), (), ())
        return (_nest.pack_sequence_as(self._queries, list(results)),
                _nest.pack_sequence_as(self._queries, list(states)),
                composed_event(events))

    def derive_metrics(self, global_state):
        """The leaves' metrics, named `path/to/leaf/metric`."""
        metrics = collections.OrderedDict()

        def add(path, query, state):
            for name, value in query.derive_metrics(state).items():
                metrics["/".join(str(p) for p in tuple(path) + (name,))] = value
        _nest.map_structure_with_tuple_paths_up_to(self._queries, add,
                                                   self._queries, global_state)
        return metrics

    def leaf_queries(self):
        """The leaf queries, flattened in `tf.nest` order."""
        return _nest.flatten_up_to(self._queries, self._queries)

    def flatten_record_up_to_queries(self, record):
        """The record's part for each leaf query, in `leaf_queries()` order."""
        return _nest.flatten_up_to(self._queries, record)

    def pack_as_queries(self, flat):
        return _nest.pack_sequence_as(self._queries, list(flat))

    def clipped_sum_form(self):
        """A `NestedClippedSumForm` when every leaf has a (not nested)
        form, else None.
        Any NestedQuery subclass (NestedSumQuery included): the nesting
        itself processes nothing."""
        leaves = self.leaf_queries()
        forms = [dp_query.clipped_sum_form_of(q) for q in leaves]
        nested = dp_query.NestedClippedSumForm
        if not leaves or any(f is None or isinstance(f, nested)
                             for f in forms):
            return None
        return dp_query.NestedClippedSumForm(self, forms)


class NestedSumQuery(NestedQuery, dp_query.SumAggregationDPQuery):
    """A NestedQuery all of whose leaves are `SumAggregationDPQuery`s.

    Raises:
      TypeError: a leaf is not a `SumAggregationDPQuery`.
    """

    def __init__(self, queries):
        for q in tf.nest.flatten(queries):
            if not isinstance(q, dp_query.SumAggregationDPQuery):
                raise TypeError(
                    "NestedSumQuery: every leaf must be a "
                    "SumAggregationDPQuery (GaussianSumQuery, NormalizedQuery, "
                    "QuantileAdaptiveClipSumQuery, ...); got %r. Use "
                    "NestedQuery for other queries." % (q,))
        super().__init__(queries)
