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
"""

from __future__ import annotations

import abc
import collections

import tensorflow as tf

__all__ = ["DPQuery", "SumAggregationDPQuery"]


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
