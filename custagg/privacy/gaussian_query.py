"""custagg's `GaussianSumQuery`: TF Privacy's constructor and DPQuery methods.

`custagg.privacy.dp_optimizer`'s query-based classes take a `dp_sum_query`
first, as TF Privacy's do. They accept this class and TF Privacy's own
`tensorflow_privacy.privacy.dp_query.gaussian_query.GaussianSumQuery` (when
TF Privacy is installed); for either, the optimizer reads the clip norm and
the noise stddev from `initial_global_state()` and forms the clipped sum in
one pass (no per-microbatch loop). Other DPQuery objects go through their own
`accumulate_record` / `get_noised_result` methods, one microbatch at a time.

    query = GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
    opt = dp_optimizer.DPGradientDescentOptimizer(query, num_microbatches=None,
                                                  learning_rate=0.1)
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import optimizers as _opt

__all__ = ["GaussianSumQuery", "gaussian_sum_params"]


class GaussianSumQuery(object):
    """Clips each record to global L2 norm `l2_norm_clip`, sums, adds noise.

    The sum gets `N(0, stddev^2)` noise on every coordinate. Same
    constructor, global state and methods as TF Privacy's class of this
    name (the DPQuery interface in its graph-mode form).

    Args:
      l2_norm_clip: the bound on each record's global L2 norm.
      stddev: the standard deviation of the noise added to the sum
        (`noise_multiplier * l2_norm_clip` in DP-SGD).
    """

    _GlobalState = collections.namedtuple("_GlobalState",
                                          ["l2_norm_clip", "stddev"])

    def __init__(self, l2_norm_clip, stddev):
        # TF Privacy checks neither; a negative or NaN one would train
        # without the guarantee. l2_norm_clip = 0 clips every record to 0.
        self._l2_norm_clip = _opt._check_positive(  # pylint: disable=protected-access
            l2_norm_clip, "l2_norm_clip", "GaussianSumQuery", allow_zero=True)
        self._stddev = _opt._check_positive(  # pylint: disable=protected-access
            stddev, "stddev", "GaussianSumQuery", allow_zero=True)

    def make_global_state(self, l2_norm_clip, stddev):
        return self._GlobalState(tf.cast(l2_norm_clip, tf.float32),
                                 tf.cast(stddev, tf.float32))

    def initial_global_state(self):
        return self.make_global_state(self._l2_norm_clip, self._stddev)

    def derive_sample_params(self, global_state):
        return global_state.l2_norm_clip

    def initial_sample_state(self, template):
        return tf.nest.map_structure(
            lambda t: tf.zeros(t.shape, tf.as_dtype(t.dtype).base_dtype),
            template)

    def preprocess_record(self, params, record):
        flat = tf.nest.flatten(record)
        if flat:
            params = tf.cast(params, flat[0].dtype)
        clipped, _ = tf.clip_by_global_norm(flat, params)
        return tf.nest.pack_sequence_as(record, clipped)

    def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
        return tf.nest.map_structure(tf.add, sample_state, preprocessed_record)

    def accumulate_record(self, params, sample_state, record):
        return self.accumulate_preprocessed_record(
            sample_state, self.preprocess_record(params, record))

    def merge_sample_states(self, sample_state_1, sample_state_2):
        return tf.nest.map_structure(tf.add, sample_state_1, sample_state_2)

    def get_noised_result(self, sample_state, global_state):
        """`(noised sum, global_state, event)`, as TF Privacy 0.9.

        `event` is a `dp_accounting.GaussianDpEvent` when dp-accounting is
        installed (with static clip and stddev), else None.
        """
        def add_noise(v):
            return v + tf.random.normal(tf.shape(v),
                                        stddev=tf.cast(global_state.stddev,
                                                       v.dtype),
                                        dtype=v.dtype)

        result = tf.nest.map_structure(add_noise, sample_state)
        return result, global_state, self._event()

    def _event(self):
        try:
            import dp_accounting  # pylint: disable=g-import-not-at-top
        except ImportError:
            return None
        if not all(isinstance(x, (int, float))
                   for x in (self._l2_norm_clip, self._stddev)):
            return None
        return dp_accounting.GaussianDpEvent(
            float(self._stddev) / float(self._l2_norm_clip))


def gaussian_sum_params(query):
    """`(l2_norm_clip, stddev)` of a Gaussian sum query, else None.

    Recognizes custagg's `GaussianSumQuery` and TF Privacy's class of the
    same name (by module and name, so TF Privacy need not be importable
    here); any other DPQuery gives None.
    """
    cls = type(query)
    if cls.__name__ != "GaussianSumQuery":
        return None
    if not (isinstance(query, GaussianSumQuery) or
            cls.__module__.startswith("tensorflow_privacy.")):
        return None
    state = query.initial_global_state()
    return state.l2_norm_clip, state.stddev
