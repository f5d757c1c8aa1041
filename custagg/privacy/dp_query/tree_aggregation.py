"""Tree aggregation of noise for private cumulative sums (TF Privacy's
`tree_aggregation` module: names and interface of 0.9.0, written for custagg).

Releasing the running sums s_0, s_1, ..., s_t of a stream privately with
independent noise per release costs noise growing like sqrt(t). The binary
tree mechanism (Dwork, Naor, Pitassi, Rothblum 2010; Chan, Shi, Song 2011)
gives every dyadic interval of steps one noise value (a tree node) and noises
s_t with the sum of the nodes of the dyadic decomposition of [0, t]: at most
ceil(log2(t + 2)) nodes, and each step is in one node per level.

Leaves are numbered t = 0, 1, ...; the nodes covering [0, t] sit at the
levels of the set bits of t + 1 (level l covers 2^l steps). The state keeps
exactly those nodes, lowest level first:

    TreeState.level_buffer       structure of [n, *shape] tensors, node values
    TreeState.level_buffer_idx   [n] int32, the levels, increasing
    TreeState.value_generator_state

Moving to leaf t + 1 adds a leaf at level 0 and, like adding 1 in binary,
merges the run of occupied levels 0..k-1 into one node at level k.

`TreeAggregator` gives every node fresh noise (variance sigma^2 per node).
`EfficientTreeAggregator` (Honaker 2015, "Efficient Use of Differentially
Private Binary Trees") lets a node at level k also average its children:
u_k = v_k + (u_left + u_right) / 2 with fresh v_k. Then E[u_k] counts the
node's steps c_k = 2 - 2^-k times, Var[u_k] = c_k sigma^2, and the node
divided by c_k is unbiased with variance sigma^2 / c_k (sigma^2 at a leaf,
-> sigma^2 / 2 high up).

Every function here works in graph mode (tf.compat.v1 Session) and eagerly:
the buffer's length is dynamic and the merge is a `tf.while_loop`.
"""

from __future__ import annotations

import abc
import collections
from typing import Any, NamedTuple

import tensorflow as tf

from custagg import errors
from custagg.privacy import noise as noise_lib

__all__ = ["ValueGenerator", "GaussianNoiseGenerator",
           "StatelessValueGenerator", "TreeState", "get_step_idx",
           "TreeAggregator", "EfficientTreeAggregator"]


class ValueGenerator(metaclass=abc.ABCMeta):
    """A stateful source of values: `next(state) -> (value, new_state)`."""

    @abc.abstractmethod
    def initialize(self):
        """The generator's initial state (a tf.nest structure)."""

    @abc.abstractmethod
    def next(self, state):
        """`(value, new_state)`: the next value and the advanced state."""


def spec_dtype(spec):
    dtype = tf.as_dtype(getattr(spec, "dtype", tf.float32))
    # Noise is real-valued: an integer spec still gets float32 noise.
    return dtype if dtype.is_floating else tf.float32


class GaussianNoiseGenerator(ValueGenerator):
    """I.i.d. `N(0, noise_std^2)` values shaped like `specs`, from stateless
    random ops keyed by a counter (so a state fully determines the noise).

    Args:
      noise_std: the standard deviation (float or scalar tensor).
      specs: a structure of `tf.TensorSpec`s (shape and float dtype of each
        part of a value).
      seed: an integer seed; None draws one each time `initialize` runs,
        from a checkpointed `custagg.privacy.noise.NoiseStream` (its key
        fixed by the graph seed if set, else fresh entropy; its counter
        saved with the checkpoint, so a restored run never repeats a key).

    State: `_GlobalState(seeds, stddev)`, `seeds` an int64 `[2]` tensor
    (key, counter); part i of a value uses (key, counter + i).
    """

    _GlobalState = collections.namedtuple("_GlobalState", ["seeds", "stddev"])

    def __init__(self, noise_std, specs, seed=None):
        where = "GaussianNoiseGenerator"
        errors.check_argument(
            not (isinstance(noise_std, (int, float)) and noise_std < 0),
            where, "noise_std", "non-negative", noise_std)
        errors.check_argument(seed is None or isinstance(seed, int), where,
                              "seed", "a Python int or None", seed, TypeError)
        self._noise_std = noise_std
        self._specs = specs
        self._seed = seed

    def initialize(self):
        if self._seed is None:
            # From a checkpointed (key, counter) stream, not TF's
            # session-local random state: a state rebuilt at every step (the
            # DP optimizers' graph mode) never repeats a key after a restore.
            key = noise_lib.stream_of(
                self, "GaussianNoiseGenerator_noise").fresh_key()
        else:
            key = tf.constant(self._seed, tf.int64)
        seeds = tf.stack([key, tf.constant(0, tf.int64)])
        return self._GlobalState(seeds, tf.cast(self._noise_std, tf.float32))

    def next(self, state):
        flat_specs = tf.nest.flatten(self._specs)
        seeds = tf.cast(state.seeds, tf.int64)
        values = []
        for i, spec in enumerate(flat_specs):
            dtype = spec_dtype(spec)
            values.append(tf.random.stateless_normal(
                spec.shape, seed=seeds + tf.constant([0, i], tf.int64),
                stddev=tf.cast(state.stddev, dtype), dtype=dtype))
        new_seeds = seeds + tf.constant([0, len(flat_specs)], tf.int64)
        return (tf.nest.pack_sequence_as(self._specs, values),
                self._GlobalState(new_seeds, state.stddev))

    def make_state(self, seeds, stddev):
        """A state from an int `[2]` seed tensor and a stddev."""
        seeds = tf.ensure_shape(tf.cast(seeds, tf.int64), [2])
        return self._GlobalState(seeds, tf.cast(stddev, tf.float32))


class StatelessValueGenerator(ValueGenerator):
    """Wraps a no-argument function: each `next` calls it; the state is
    `()`."""

    def __init__(self, value_fn):
        if not callable(value_fn):
            raise TypeError("StatelessValueGenerator: `value_fn` must be a "
                            "no-argument callable, got %r." % (value_fn,))
        self.value_fn = value_fn

    def initialize(self):
        return ()

    def next(self, state):
        return self.value_fn(), state


class TreeState(NamedTuple):
    """The nodes covering [0, t] for the current leaf t.

    Attributes:
      level_buffer: structure of `[n, *shape]` tensors, one row per node.
      level_buffer_idx: `[n]` int32, the nodes' levels (increasing); leaf
        t = sum(2^level) - 1.
      value_generator_state: the noise generator's state.
    """
    level_buffer: Any
    level_buffer_idx: Any
    value_generator_state: Any


def get_step_idx(state):
    """The current leaf index t (int32 scalar): sum(2^levels) - 1."""
    levels = tf.convert_to_tensor(state.level_buffer_idx, tf.int32)
    return tf.reduce_sum(tf.bitwise.left_shift(tf.ones_like(levels),
                                               levels)) - 1


def _as_generator(value_generator, cls_name):
    if isinstance(value_generator, ValueGenerator):
        return value_generator
    if callable(value_generator):
        return StatelessValueGenerator(value_generator)
    raise TypeError("%s: `value_generator` must be a "
                    "tree_aggregation.ValueGenerator (e.g. "
                    "GaussianNoiseGenerator) or a no-argument callable, got "
                    "%r." % (cls_name, value_generator))


class TreeAggregator:
    """Noise for cumulative sums by the binary tree (fresh noise per node).

        agg = TreeAggregator(GaussianNoiseGenerator(sigma, specs, seed=1))
        state = agg.init_state()
        for t in range(T):                 # get_step_idx(state) == t
            noise_t, state = agg.get_cumsum_and_update(state)

    `noise_t` has per-coordinate variance sigma^2 * popcount(t + 1).

    Args:
      value_generator: a `ValueGenerator` or a no-argument callable giving
        one node's value.
    """

    def __init__(self, value_generator):
        self.value_generator = _as_generator(value_generator,
                                             type(self).__name__)

    # --- state --------------------------------------------------------------

    def _get_init_state(self, value_generator_state):
        leaf, value_generator_state = self.value_generator.next(
            value_generator_state)
        buffer = tf.nest.map_structure(
            lambda v: tf.expand_dims(tf.convert_to_tensor(v), 0), leaf)
        return TreeState(level_buffer=buffer,
                         level_buffer_idx=tf.zeros([1], tf.int32),
                         value_generator_state=value_generator_state)

    def init_state(self):
        """The state of leaf 0: one level-0 node drawn from the generator."""
        return self._get_init_state(self.value_generator.initialize())

    def reset_state(self, state):
        """A new tree at leaf 0; the generator's state carries on (new
        noise)."""
        return self._get_init_state(state.value_generator_state)

    # --- noise --------------------------------------------------------------

    def _get_cumsum(self, state):
        levels = tf.convert_to_tensor(state.level_buffer_idx, tf.int32)

        def total(buffer):
            buffer = tf.convert_to_tensor(buffer)
            w = self._level_weights(levels, buffer.dtype)
            if w is not None:
                w = tf.reshape(w, tf.concat(
                    [[-1], tf.ones([tf.rank(buffer) - 1], tf.int32)], 0))
                buffer = buffer * w
            return tf.reduce_sum(buffer, axis=0)

        return tf.nest.map_structure(total, state.level_buffer)

    def _level_weights(self, levels, dtype):
        del levels, dtype
        return None          # plain tree: every node counts once

    def _merge(self, left, right, fresh):
        """A node's value from its children's and a fresh draw."""
        del left, right
        return fresh

    def get_cumsum_and_update(self, state):
        """`(noise for the cumulative sum at the current leaf, state for the
        next leaf)`.

        The noise is the sum of the stored nodes (weighted for the efficient
        tree). The update draws a leaf and merges it, bottom up, with the
        run of occupied levels 0, 1, ..., k-1 into a node at level k.
        """
        noise = self._get_cumsum(state)
        levels = tf.convert_to_tensor(state.level_buffer_idx, tf.int32)
        n = tf.size(levels)
        # Length of the run of levels 0, 1, ..., k-1 at the buffer's start.
        k = tf.reduce_sum(tf.math.cumprod(tf.cast(
            tf.equal(levels, tf.range(n)), tf.int32)))
        flat_buffer = [tf.convert_to_tensor(b)
                       for b in tf.nest.flatten(state.level_buffer)]
        node, gen_state = self.value_generator.next(
            state.value_generator_state)
        flat_node = [tf.convert_to_tensor(v) for v in tf.nest.flatten(node)]

        def cond(j, *_):
            return j < k

        def body(j, gen_state, *flat_node):
            fresh, gen_state = self.value_generator.next(gen_state)
            merged = [self._merge(b[j], u, tf.convert_to_tensor(f))
                      for b, u, f in zip(flat_buffer, flat_node,
                                         tf.nest.flatten(fresh))]
            return (j + 1, gen_state) + tuple(merged)

        loop = tf.while_loop(
            cond, body, (tf.constant(0, tf.int32), gen_state) + tuple(
                flat_node),
            shape_invariants=(
                tf.TensorShape([]),
                tf.nest.map_structure(_shape_of, gen_state))
            + tuple(_shape_of(u) for u in flat_node))
        gen_state, flat_node = loop[1], loop[2:]
        new_buffer = [tf.concat([tf.expand_dims(u, 0), b[k:]], 0)
                      for u, b in zip(flat_node, flat_buffer)]
        new_levels = tf.concat([tf.reshape(k, [1]), levels[k:]], 0)
        new_state = TreeState(
            level_buffer=tf.nest.pack_sequence_as(state.level_buffer,
                                                  new_buffer),
            level_buffer_idx=new_levels,
            value_generator_state=gen_state)
        return noise, new_state


def _shape_of(x):
    return tf.convert_to_tensor(x).shape


class EfficientTreeAggregator(TreeAggregator):
    """The tree with Honaker's (2015) estimator: a node at level k holds
    u_k = v_k + (u_left + u_right) / 2 (v_k fresh) and counts with weight
    1 / (2 - 2^-k) in a cumulative sum.

    A single node at level k (the noise at leaf 2^k - 1) then has variance
    sigma^2 / (2 - 2^-k): less than the plain tree's sigma^2 per node.
    Same interface as `TreeAggregator`.
    """

    def _level_weights(self, levels, dtype):
        return 1.0 / (2.0 - tf.pow(tf.constant(0.5, dtype),
                                   tf.cast(levels, dtype)))

    def _merge(self, left, right, fresh):
        return fresh + 0.5 * (left + right)
