"""`GaussianSumQuery`: clip each record's global L2 norm, sum, add noise.

TF Privacy 0.9.0's class of this name (same constructor, `_GlobalState`,
`make_global_state`, `preprocess_record_impl`), written for custagg:

    query = GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
    opt = dp_optimizer.DPGradientDescentOptimizer(query, learning_rate=0.1)

In custagg's DP optimizers this query never sees a record: the optimizer
reads the clip norm from `derive_sample_params`, forms the clipped sum of
the microbatch gradients in one pass and passes it to `get_noised_result`
as the sample state (a sum query's sample state is exactly that sum).
"""

from __future__ import annotations

import collections
import tensorflow as tf

from custagg.privacy.dp_query import dp_query
from custagg.privacy import checks
from custagg.privacy import core
from custagg.privacy import noise as noise_lib

__all__ = ["GaussianSumQuery"]


def gaussian_event(noise_multiplier):
    """`dp_accounting.GaussianDpEvent(noise_multiplier)`, or None without
    dp-accounting. A tensor multiplier is kept as its static value when it
    has one (so accountants can use it), else as the tensor."""
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    if isinstance(noise_multiplier, (tf.Tensor, tf.Variable)):
        static = tf.get_static_value(noise_multiplier)
        if static is not None:
            noise_multiplier = float(static)
    return dp_accounting.GaussianDpEvent(noise_multiplier)


def composed_event(events):
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    return dp_accounting.ComposedDpEvent(events=list(events))


def non_private_event():
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    return dp_accounting.NonPrivateDpEvent()


class GaussianSumQuery(dp_query.SumAggregationDPQuery):
    """Sum of records clipped to global L2 norm `l2_norm_clip`, plus noise.

    Every coordinate of the sum gets `N(0, stddev^2)` noise. In DP-SGD,
    `stddev = noise_multiplier * l2_norm_clip`.

    Args:
      l2_norm_clip: bound on each record's global L2 norm (over all its
        tensors).
      stddev: standard deviation of the noise added to the sum.
    """

    _GlobalState = collections.namedtuple("_GlobalState",
                                          ["l2_norm_clip", "stddev"])

    def __init__(self, l2_norm_clip, stddev):
        # TF Privacy checks neither; a negative or NaN one would train
        # without the guarantee. l2_norm_clip = 0 clips every record to 0.
        self._l2_norm_clip = checks.check_positive(
            l2_norm_clip, "l2_norm_clip", "GaussianSumQuery", allow_zero=True)
        self._stddev = checks.check_positive(
            stddev, "stddev", "GaussianSumQuery", allow_zero=True)

    def make_global_state(self, l2_norm_clip, stddev):
        """The global state for a clip norm and a noise stddev (float32)."""
        return self._GlobalState(tf.cast(l2_norm_clip, tf.float32),
                                 tf.cast(stddev, tf.float32))

    def initial_global_state(self):
        return self.make_global_state(self._l2_norm_clip, self._stddev)

    def derive_sample_params(self, global_state):
        """The clip norm."""
        return global_state.l2_norm_clip

    def clipped_sum_form(self):
        """The Gaussian form: the clip is the sample params, the sample
        state the clipped sum. Exact class only: a subclass may process
        records its own way (it overrides this method to opt in)."""
        # pylint: disable-next=unidiomatic-typecheck
        if type(self) is not GaussianSumQuery:
            return None
        return dp_query.ClippedSumForm(clip=lambda params: params,
                                       gaussian=True)

    def preprocess_record_impl(self, params, record):
        """`(record clipped to global norm params, its norm before clipping)`.

        The record's tensors must share a dtype; the clip norm is cast to it.
        """
        flat = [None if t is None else tf.convert_to_tensor(t)
                for t in tf.nest.flatten(record)]
        clip = params
        present = [t for t in flat if t is not None]
        if present:
            clip = tf.cast(params, tf.as_dtype(present[0].dtype).base_dtype)
        clipped, norm = tf.clip_by_global_norm(flat, clip)
        return tf.nest.pack_sequence_as(record, clipped), norm

    def preprocess_record(self, params, record):
        return self.preprocess_record_impl(params, record)[0]

    def get_noised_result(self, sample_state, global_state):
        """`(sum + N(0, stddev^2) noise, global_state, GaussianDpEvent)`."""
        sample_state = tf.nest.map_structure(tf.convert_to_tensor,
                                             sample_state)
        flat = tf.nest.flatten(sample_state)
        if tf.get_static_value(global_state.stddev) == 0:
            # No noise: no draw (and no stream variables to initialize).
            return sample_state, global_state, gaussian_event(
                self._noise_multiplier(global_state))
        # The optimizers' one noise draw (custagg.privacy.core), from this
        # query's checkpointed (key, counter) stream (a restored run never
        # repeats a draw), drawn once the whole sum exists (not when the
        # step starts, to stay live through the backward pass).
        stream = noise_lib.stream_of(self, "GaussianSumQuery_noise")
        noised = core.add_noise(flat, global_state.stddev, stream)
        result = tf.nest.pack_sequence_as(sample_state, noised)
        return result, global_state, gaussian_event(self._noise_multiplier(
            global_state))

    def _noise_multiplier(self, global_state):
        clip = tf.get_static_value(global_state.l2_norm_clip)
        stddev = tf.get_static_value(global_state.stddev)
        if clip is not None and stddev is not None:
            return float(stddev) / float(clip) if clip else float("inf")
        return global_state.stddev / global_state.l2_norm_clip
