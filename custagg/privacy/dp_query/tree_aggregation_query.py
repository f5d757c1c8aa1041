"""DP queries with tree-aggregated (correlated) noise, for DP-FTRL (Kairouz,
McMahan, Song, Thakkar, Thakurta, Xu 2021, "Practical and Private (Deep)
Learning without Sampling or Shuffling", arXiv:2103.00039). TF Privacy
0.9.0's `tree_aggregation_query` names and interface, written for custagg.

Both queries clip each record (`clip_fn(flat_record, clip_value)`) and sum
a sample, x_i; across calls of `get_noised_result` they privatize the
running sums s_i = x_0 + ... + x_i with the noise N_i of
`tree_aggregation` (a tree node per dyadic interval of calls):

* `TreeCumulativeSumQuery` returns s_i + N_i.
* `TreeResidualSumQuery` returns x_i + N_i - N_{i-1}: a drop-in for a
  Gaussian sum query whose results get summed downstream (SGD sums its
  updates), so the sum of its first i+1 results is s_i + N_i.

The privacy of the whole stream follows from the tree's node noise
(accountants: TF Privacy's `tree_aggregation_accountant`); a single call's
`DpEvent` is `UnsupportedDpEvent`, as in TF Privacy.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import tensorflow as tf

from custagg import errors
from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import tree_aggregation

__all__ = ["TreeCumulativeSumQuery", "TreeResidualSumQuery"]


def _unsupported_event():
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    return dp_accounting.UnsupportedDpEvent()


def _l2_clip_fn(record_as_list, clip_norm):
    clipped, _ = tf.clip_by_global_norm(record_as_list, clip_norm)
    return clipped


def _zeros_like_specs(specs):
    return tf.nest.map_structure(
        lambda s: tf.zeros(s.shape, tree_aggregation.spec_dtype(s)),
        specs)


def _check_non_negative(value, arg, cls_name):
    where = cls_name + ".build_l2_gaussian_query"
    errors.check_argument(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        where, arg, "a Python number", value, TypeError)
    errors.check_argument(value >= 0, where, arg, "non-negative", value)


def _like(clip, flat):
    # The state's clip value is float32; records may be float64.
    if isinstance(clip, (tf.Tensor, tf.Variable)) and flat:
        dtype = flat[0].dtype.base_dtype
        if dtype.is_floating and clip.dtype.base_dtype != dtype:
            return tf.cast(clip, dtype)
    return clip


class _TreeSumQuery(dp_query.SumAggregationDPQuery):
    """What both tree queries share: clipping, the aggregator, the builder."""

    def __init__(self, record_specs, noise_generator, clip_fn, clip_value,
                 use_efficient=True):
        if not callable(clip_fn):
            raise TypeError("%s: `clip_fn` must be a callable "
                            "clip_fn(flat_record, clip_value) -> flat list; "
                            "got %r." % (type(self).__name__, clip_fn))
        self._clip_fn = clip_fn
        self._clip_value = clip_value
        self._record_specs = record_specs
        aggregator = (tree_aggregation.EfficientTreeAggregator
                      if use_efficient else tree_aggregation.TreeAggregator)
        self._tree_aggregator = aggregator(noise_generator)

    def derive_sample_params(self, global_state):
        """The clip value."""
        return global_state.clip_value

    def preprocess_record_l2_impl(self, params, record):
        """`(record clipped to global L2 norm params, its norm before)`."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(record)]
        clipped, norm = tf.clip_by_global_norm(flat, _like(params, flat))
        return tf.nest.pack_sequence_as(record, clipped), norm

    def preprocess_record(self, params, record):
        """The record clipped by `clip_fn(flat record, params)` (a tensor
        clip value cast to the record's dtype, so float64 records clip)."""
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(record)]
        return tf.nest.pack_sequence_as(
            record, self._clip_fn(flat, _like(params, flat)))

    def derive_metrics(self, global_state):
        return collections.OrderedDict(
            tree_agg_dpftrl_clip=global_state.clip_value)

    @classmethod
    def build_l2_gaussian_query(cls, clip_norm, noise_multiplier,
                                record_specs, noise_seed=None,
                                use_efficient=True):
        """The query with L2 clipping to `clip_norm` and Gaussian node noise
        of stddev `clip_norm * noise_multiplier`.

        Args:
          clip_norm: each record's L2 norm bound (>= 0).
          noise_multiplier: node noise stddev / clip_norm (>= 0).
          record_specs: structure of `tf.TensorSpec`s, one per record part.
          noise_seed: int seed of the noise; None: drawn at
            `initial_global_state`.
          use_efficient: Honaker's estimator (`EfficientTreeAggregator`)
            instead of the plain tree.
        """
        _check_non_negative(clip_norm, "clip_norm", cls.__name__)
        _check_non_negative(noise_multiplier, "noise_multiplier",
                            cls.__name__)
        generator = tree_aggregation.GaussianNoiseGenerator(
            noise_std=clip_norm * noise_multiplier, specs=record_specs,
            seed=noise_seed)
        return cls(record_specs=record_specs, noise_generator=generator,
                   clip_fn=_l2_clip_fn, clip_value=clip_norm,
                   use_efficient=use_efficient)


class TreeCumulativeSumQuery(_TreeSumQuery):
    """Releases the private cumulative sum s_i + N_i at call i.

    Args:
      record_specs: structure of `tf.TensorSpec`s (a record's parts).
      noise_generator: `tree_aggregation.ValueGenerator` for a node's noise
        (its scale, with `clip_value`, sets the privacy).
      clip_fn: `clip_fn(flat_record, clip_value) -> flat clipped record`.
      clip_value: the clip bound passed to `clip_fn`.
      use_efficient: `EfficientTreeAggregator` (True) or `TreeAggregator`.
    """

    class GlobalState(NamedTuple):
        """tree_state: the tree at the current call; clip_value;
        samples_cumulative_sum: the noiseless s_{i-1}."""
        tree_state: Any
        clip_value: Any
        samples_cumulative_sum: Any

    def initial_global_state(self):
        return self.GlobalState(
            tree_state=self._tree_aggregator.init_state(),
            clip_value=tf.constant(self._clip_value, tf.float32),
            samples_cumulative_sum=_zeros_like_specs(self._record_specs))

    def get_noised_result(self, sample_state, global_state):
        """`(s_i + N_i, state for call i + 1, UnsupportedDpEvent)`."""
        cumsum = tf.nest.map_structure(tf.add,
                                       global_state.samples_cumulative_sum,
                                       sample_state)
        noise, tree_state = self._tree_aggregator.get_cumsum_and_update(
            global_state.tree_state)
        noised = tf.nest.map_structure(
            lambda s, n: s + tf.cast(n, s.dtype), cumsum, noise)
        return noised, self.GlobalState(
            tree_state=tree_state, clip_value=global_state.clip_value,
            samples_cumulative_sum=cumsum), _unsupported_event()

    def reset_state(self, noised_results, global_state):
        """A new tree whose releases continue from the last release: the
        running sum becomes `noised_results` (public already), so the old
        trees' noise stays in and the new tree noises only new samples."""
        return global_state._replace(
            tree_state=self._tree_aggregator.reset_state(
                global_state.tree_state),
            samples_cumulative_sum=noised_results)


class TreeResidualSumQuery(_TreeSumQuery):
    """Releases x_i + N_i - N_{i-1} at call i (N_{-1} = 0): the increments
    of the tree-noised cumulative sums. Each release is noisier than a
    Gaussian sum's (up to log2 T nodes differ), but sums of releases carry
    only the tree's O(log T) noise.

    Same arguments as `TreeCumulativeSumQuery`.
    """

    class GlobalState(NamedTuple):
        """tree_state: the tree at the current call; clip_value;
        previous_tree_noise: N_{i-1} (zeros before the first call or after
        a reset)."""
        tree_state: Any
        clip_value: Any
        previous_tree_noise: Any

    def _zero_initial_noise(self):
        return _zeros_like_specs(self._record_specs)

    def initial_global_state(self):
        return self.GlobalState(
            tree_state=self._tree_aggregator.init_state(),
            clip_value=tf.constant(self._clip_value, tf.float32),
            previous_tree_noise=self._zero_initial_noise())

    def get_noised_result(self, sample_state, global_state):
        """`(x_i + N_i - N_{i-1}, state for call i + 1,
        UnsupportedDpEvent)`."""
        noise, tree_state = self._tree_aggregator.get_cumsum_and_update(
            global_state.tree_state)
        noised = tf.nest.map_structure(
            lambda x, n, p: x + tf.cast(n - tf.cast(p, n.dtype), x.dtype),
            sample_state, noise, global_state.previous_tree_noise)
        return noised, self.GlobalState(
            tree_state=tree_state, clip_value=global_state.clip_value,
            previous_tree_noise=noise), _unsupported_event()

    def reset_state(self, noised_results, global_state):
        """A new tree and N_{-1} = 0 again (the generator's state carries on,
        so the new tree's noise is fresh). For a restart schedule (e.g. once
        per epoch)."""
        del noised_results
        return self.GlobalState(
            tree_state=self._tree_aggregator.reset_state(
                global_state.tree_state),
            clip_value=global_state.clip_value,
            previous_tree_noise=self._zero_initial_noise())

    def reset_l2_clip_gaussian_noise(self, global_state, clip_norm, stddev):
        """The state with a new clip norm and node noise stddev (the tree
        and its stored nodes kept). Needs a `GaussianNoiseGenerator`."""
        generator = self._tree_aggregator.value_generator
        if not isinstance(generator, tree_aggregation.GaussianNoiseGenerator):
            raise TypeError(
                "TreeResidualSumQuery.reset_l2_clip_gaussian_noise needs the "
                "query's noise generator to be a GaussianNoiseGenerator (as "
                "build_l2_gaussian_query makes); got %r." % (generator,))
        tree_state = global_state.tree_state
        gen_state = generator.make_state(
            tree_state.value_generator_state.seeds, stddev)
        return self.GlobalState(
            tree_state=tree_state._replace(value_generator_state=gen_state),
            clip_value=clip_norm,
            previous_tree_noise=global_state.previous_tree_noise)
