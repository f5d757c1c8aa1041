"""Poisson sampling, the sampling DP-SGD's accounting assumes.

`compute_dp_sgd_privacy`, `PrivacyBudget(sampling="poisson")` and the
statement's Poisson figure assume that each step's batch holds each
training example independently with probability q: batch sizes vary
(Binomial(n, q)) and may be 0. Fixed-size batches of a shuffled order are
another mechanism, which that analysis does not cover.

* `poisson_batches(q, seed=None, start_step=0, num_steps=None)`: a
  `tf.data` transformation, `dataset.apply(poisson_batches(q))`: one
  batch per step, every element of the (finite) dataset kept with
  probability q, empty batches included (shape `[0, ...]`). Each step
  reads the whole dataset once (Poisson sampling's cost). Without a seed
  the key is drawn in the pipeline each time its iterator starts (in no
  saved graph); a restarted run's batches are then new draws, as private
  as the lost run's.
* `PoissonSampler(n, q, seed=None)`: the same for feed_dict loops, with
  numpy: `sampler.indices(step)` (the step's example indices, sorted) and
  `sampler.batches(arrays, start_step, num_steps)`.

The batch of step t is a function of `(key, t)`: a run restarted from a
checkpoint resumes with `start_step` = the steps taken
(`PrivacyBudget.steps`), so the batches keep their independence. The key
is part of the mechanism: amplification by sampling assumes the adversary
does not know which examples a step used, so leave `seed=None` (fresh
entropy: `PoissonSampler` keeps it in Python, `poisson_batches` draws it
in the pipeline, never in a GraphDef) for a private run, and give a seed
only for tests and reproductions (it is then a constant of the graph).

The DP optimizers take these batches as they are (a `[None, ...]` batch
dimension, M = B): an empty batch's update is the noise alone, divided by
1 (there is no example to average over) instead of 0.
"""

from __future__ import annotations

import math
import numbers
import os

import numpy as np
import tensorflow as tf

__all__ = ["poisson_batches", "PoissonSampler"]

# Element i of step t draws its inclusion from Philox counter t * 2^32 + i.
_PER_STEP = 1 << 32


def _check_q(q, fn):
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or \
            not math.isfinite(q) or not 0 < q <= 1:
        raise ValueError(
            "%s: `sampling_probability` must be a number in (0, 1] (each "
            "example's probability of being in a step's batch, e.g. expected "
            "batch size / dataset size), got %r." % (fn, q))
    return float(q)


def _check_seed(seed, fn):
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") % (1 << 62)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError("%s: `seed` must be an int or None (fresh entropy), "
                        "got %r." % (fn, seed))
    return int(seed)


def _check_steps(start_step, num_steps, fn):
    if isinstance(start_step, bool) or not isinstance(
            start_step, numbers.Integral) or start_step < 0:
        raise ValueError("%s: `start_step` must be an int >= 0 (the steps "
                         "already taken), got %r." % (fn, start_step))
    if num_steps is not None and (isinstance(num_steps, bool) or
                                  not isinstance(num_steps, numbers.Integral)
                                  or num_steps < 0):
        raise ValueError("%s: `num_steps` must be an int >= 0 or None "
                         "(unbounded), got %r." % (fn, num_steps))


def poisson_batches(sampling_probability, seed=None, start_step=0,
                    num_steps=None, max_batch_size=1 << 16):
    """A `tf.data` transformation: Poisson-sampled batches of a dataset.

    Args:
      sampling_probability: q in (0, 1].
      seed: int, or None for fresh entropy (see the module docstring).
      start_step: the first step's index (resume a run at its step count).
      num_steps: batches to emit; None: unbounded.
      max_batch_size: the most examples a batch may hold (default 2^16;
        at least the dataset's size is always safe); a step that chooses
        more fails with an error saying so.

    Returns:
      A function `dataset -> dataset` for `Dataset.apply`. The input is a
      finite dataset of single examples (any structure, fixed rank); the
      output emits one batch per step, each component `[B_t, ...]` with
      `B_t ~ Binomial(n, q)` (0 included), the examples in dataset order.
    """
    fn = "custagg.privacy.sampling.poisson_batches"
    q = _check_q(sampling_probability, fn)
    # seed=None: the key is drawn in the input pipeline when its iterator
    # starts (an unseeded random op; seeded by a graph-level seed where one
    # is set, as the noise's key is), so it is in no GraphDef, `.meta` or
    # `graph.pbtxt` a checkpoint writes, where a constant would be.
    key = None if seed is None else _check_seed(seed, fn)
    _check_steps(start_step, num_steps, fn)
    if isinstance(max_batch_size, bool) or not isinstance(
            max_batch_size, numbers.Integral) or max_batch_size < 1:
        raise ValueError("%s: `max_batch_size` must be a positive int, got "
                         "%r." % (fn, max_batch_size))
    end = (1 << 62) if num_steps is None else start_step + num_steps

    def apply(dataset):
        spec = dataset.element_spec
        def empty():
            return tf.nest.map_structure(
                lambda s: tf.zeros([0] + [d if d is not None else 0
                                          for d in s.shape.as_list()],
                                   s.dtype), spec)

        def one_step(key, step):
            def keep(i, _):
                u = tf.random.stateless_uniform(
                    [], seed=tf.stack([key, step * _PER_STEP + i]),
                    dtype=tf.float64)
                return u < q
            chosen = dataset.enumerate().filter(keep).map(lambda i, x: x)
            # One batch per step, an empty one when nothing was chosen. A
            # batch of max_batch_size + 1 means some would be cut off: an
            # error, not a silent drop (tf.data reserves a batch's size up
            # front, so the bound cannot be unlimited).
            batch = chosen.batch(max_batch_size + 1).concatenate(
                tf.data.Dataset.from_tensors(empty())).take(1)
            return batch.map(check_size)

        def check_size(*batch):
            batch = batch[0] if len(batch) == 1 else batch
            size = tf.shape(tf.nest.flatten(batch)[0])[0]
            check = tf.debugging.assert_less_equal(
                size, max_batch_size, message=(
                    "custagg.privacy.sampling.poisson_batches: a step chose "
                    "more than max_batch_size=%d examples; pass a larger "
                    "max_batch_size (at least the dataset's size)"
                    % max_batch_size))
            with tf.control_dependencies([check]):
                return tf.nest.map_structure(tf.identity, batch)

        def steps(key):
            return tf.data.Dataset.range(start_step, end).flat_map(
                lambda step: one_step(key, step))

        if key is not None:
            return steps(tf.constant(key, tf.int64))
        fresh = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).map(
            lambda _: tf.random.uniform([], 0, 1 << 62, dtype=tf.int64))
        return fresh.flat_map(steps)

    return apply


class PoissonSampler:
    """Poisson-sampled example indices for feed_dict loops (numpy).

    Args:
      n: the number of training examples (int >= 1).
      sampling_probability: q in (0, 1].
      seed: int, or None for fresh entropy.

    `indices(step)` is a function of `(seed, step)` alone.
    """

    def __init__(self, n, sampling_probability, seed=None):
        fn = "custagg.privacy.sampling.PoissonSampler"
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or \
                n < 1:
            raise ValueError("%s: `n` must be a positive int (the number of "
                             "training examples), got %r." % (fn, n))
        self.n = int(n)
        self.sampling_probability = _check_q(sampling_probability, fn)
        self._key = _check_seed(seed, fn)

    def indices(self, step):
        """The sorted `[B_t]` int64 indices of step `step`'s batch."""
        rng = np.random.default_rng([self._key, int(step)])
        return np.flatnonzero(
            rng.random(self.n) < self.sampling_probability).astype(np.int64)

    def batches(self, arrays, start_step=0, num_steps=None):
        """Yields, per step, `arrays` (a tuple of arrays with n rows)
        indexed by the step's indices: `[B_t, ...]` each, B_t may be 0."""
        _check_steps(start_step, num_steps,
                     "custagg.privacy.sampling.PoissonSampler.batches")
        arrays = tuple(np.asarray(a) for a in arrays)
        for a in arrays:
            if len(a) != self.n:
                raise ValueError(
                    "PoissonSampler.batches: every array needs n=%d rows; "
                    "got one with %d." % (self.n, len(a)))
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            idx = self.indices(step)
            yield tuple(a[idx] for a in arrays)
            step += 1
