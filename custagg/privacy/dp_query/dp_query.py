"""The DPQuery interface (TF Privacy 0.9.0's contract, written for custagg).

A DP query turns a sample of records into a noised aggregate:

    global_state = q.initial_global_state()
    params = q.derive_sample_params(global_state)
    state = q.initial_sample_state(template)       # zeros shaped like a record
    for record in records:                           # e.g. microbatch gradients
        state = q.accumulate_record(params, state, record)
    result, global_state, event = q.get_noised_result(state, global_state)

`global_state` carries what changes between samples (an adaptive clip norm);
`event` is the `dp_accounting.DpEvent` of the step, for an accountant. For a
`SumAggregationDPQuery` the sample state is the plain sum of the
preprocessed records, which is what lets custagg's optimizers hand it a
clipped sum computed in one pass instead of accumulating records.

**The fast path** (custagg's addition to the contract). A query whose
sample state after M records follows from the records' clipped sum (and
their `[M]` norms) says so by returning a `ClippedSumForm` from
`clipped_sum_form()`; the DP optimizers' clip-and-noise core
(`custagg.privacy.core`) then forms that sum in one weighted pass from the
rules' norms, builds the sample state with the form, and hands it to the
query's own `get_noised_result`. A query that returns None (the default)
gets TF Privacy's path: materialized microbatch records, one
`accumulate_record` each. `NestedQuery` composes its leaves' forms, one
clipped sum per leaf over its part of the record.
"""

from __future__ import annotations

import abc
import collections

import tensorflow as tf

__all__ = ["ClippedSumForm", "DPQuery", "NestedClippedSumForm",
           "SumAggregationDPQuery", "clipped_sum_form_of"]


class DPQuery(metaclass=abc.ABCMeta):
    """A differentially private aggregation of records (TF Privacy's API).

    Subclasses implement `initial_sample_state`,
    `accumulate_preprocessed_record`, `merge_sample_states` and
    `get_noised_result`; the rest have defaults (no global state, no sample
    parameters, records passed through unchanged, no metrics).
    """

    def initial_global_state(self):
        """State kept across samples (a tf.nest structure); `()` by default."""
        return ()

    def derive_sample_params(self, global_state):
        """Parameters for processing the next sample's records (e.g. the clip
        norm); `()` by default."""
        del global_state
        return ()

    @abc.abstractmethod
    def initial_sample_state(self, template=None):
        """The empty accumulator: for sums, zeros shaped like `template` (a
        structure of tensors, TensorSpecs, arrays or Python scalars)."""

    def preprocess_record(self, params, record):
        """One record made ready to accumulate (e.g. clipped); identity by
        default. Uses only its arguments (it may run on another worker)."""
        del params
        return record

    @abc.abstractmethod
    def accumulate_preprocessed_record(self, sample_state,
                                       preprocessed_record):
        """`sample_state` with one preprocessed record added."""

    def accumulate_record(self, params, sample_state, record):
        """`preprocess_record` then `accumulate_preprocessed_record`."""
        return self.accumulate_preprocessed_record(
            sample_state, self.preprocess_record(params, record))

    @abc.abstractmethod
    def merge_sample_states(self, sample_state_1, sample_state_2):
        """Two partial accumulations combined into one."""

    @abc.abstractmethod
    def get_noised_result(self, sample_state, global_state):
        """`(result, new_global_state, event)`: the private aggregate, the
        state for the next sample and the step's `dp_accounting.DpEvent`."""

    def derive_metrics(self, global_state):
        """Metrics (an OrderedDict of tensors) from privatized state only."""
        del global_state
        return collections.OrderedDict()

    def clipped_sum_form(self):
        """A `ClippedSumForm` when the sample state after M records follows
        from their clipped sum (the DP optimizers' fast path), else None
        (the default: records are accumulated one by one)."""
        return None


class ClippedSumForm(object):
    """How a sum query's sample state follows from clipped sums.

    For records `r_1 .. r_M` (a record: the gradients of one microbatch,
    aligned with `var_list`), the fast path computes `sum_m clip_C(r_m)`
    with `clip_C(r) = r min(1, C / ||r||)` (global norm over the record) and
    the `[M]` norms `||r_m||`, then asks this form for the sample state.

    Args:
      clip: `params -> C`, the clip norm in the query's sample params
        (`derive_sample_params`'s result); a scalar.
      sample_state: `(params, clipped_sum, norms) -> sample state`, what
        accumulating the M records gives; default: the clipped sum itself
        (a plain clipped sum query).
      adaptive: True when the query's global state changes from step to
        step (an adaptive clip): in graph mode the optimizers keep it in
        variables.
      gaussian: True when `get_noised_result` is exactly `clipped_sum +
        N(0, stddev^2)` with `(l2_norm_clip, stddev)` read from
        `initial_global_state()` (a `GaussianSumQuery`): the core then adds
        the noise itself (`core.add_noise`, one draw per step) and a
        multi-worker wrapper can take it over.
    """

    def __init__(self, clip, sample_state=None, adaptive=False,
                 gaussian=False):
        self._clip = clip
        self._sample_state = sample_state
        self.adaptive = bool(adaptive)
        self.gaussian = bool(gaussian)

    def leaves(self, params, num_parts):
        """`[(leaf form, leaf params, part)]`: each leaf's share of a record
        of `num_parts` tensors; `part` is an index, or a structure of
        indices, into the record (one leaf: all of it)."""
        return [(self, params, list(range(num_parts)))]

    def pack(self, leaf_states):
        """The query's sample state from its leaves' (in `leaves` order)."""
        return leaf_states[0]

    def clip(self, params):
        return self._clip(params)

    def sample_state(self, params, clipped_sum, norms):
        if self._sample_state is None:
            return clipped_sum
        return self._sample_state(params, clipped_sum, norms)


class NestedClippedSumForm(ClippedSumForm):
    """The form of a `NestedQuery` whose leaves all have forms: each leaf
    clips and sums its own part of the record (per-layer clipping when each
    part is one variable).

    Args:
      nested: the `NestedQuery` (its `flatten_record_up_to_queries` and
        `pack_as_queries` split records and join states).
      forms: the leaves' forms, in `nested.leaf_queries()` order.
    """

    def __init__(self, nested, forms):
        super().__init__(clip=None,
                         adaptive=any(f.adaptive for f in forms))
        self._nested = nested
        self._forms = list(forms)

    def leaves(self, params, num_parts):
        leaf_params = self._nested.flatten_record_up_to_queries(params)
        parts = self._nested.flatten_record_up_to_queries(
            list(range(num_parts)))
        return list(zip(self._forms, leaf_params, parts))

    def pack(self, leaf_states):
        return self._nested.pack_as_queries(leaf_states)


def clipped_sum_form_of(query):
    """`query.clipped_sum_form()`, or None for a query without the method --
    except TF Privacy's own `GaussianSumQuery` (recognized by module and
    name, so TF Privacy need not be importable), whose form is the Gaussian
    one. Exact class only: a subclass may process records its own way."""
    method = getattr(query, "clipped_sum_form", None)
    if method is not None:
        return method()
    cls = type(query)
    if cls.__name__ == "GaussianSumQuery" and \
            cls.__module__.startswith("tensorflow_privacy."):
        return ClippedSumForm(clip=lambda params: params, gaussian=True)
    return None


def zeros_like_spec(x):
    """`tf.zeros` shaped like a tensor, TensorSpec, array or Python number."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        x = tf.convert_to_tensor(x)
    return tf.zeros(x.shape, tf.as_dtype(x.dtype).base_dtype)


def _add_unless_none(total, x):
    # A record may miss a part (a variable with no gradient): keep the sum.
    return total if x is None else tf.add(total, x)


class SumAggregationDPQuery(DPQuery):
    """A DPQuery whose sample state is the sum of preprocessed records."""

    def initial_sample_state(self, template=None):
        return tf.nest.map_structure(zeros_like_spec, template)

    def accumulate_preprocessed_record(self, sample_state,
                                       preprocessed_record):
        return tf.nest.map_structure(_add_unless_none, sample_state,
                                     preprocessed_record)

    def merge_sample_states(self, sample_state_1, sample_state_2):
        return tf.nest.map_structure(tf.add, sample_state_1, sample_state_2)
