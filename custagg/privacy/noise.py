"""A Gaussian noise stream that a checkpoint carries: noise never repeats.

TF's stateful random ops (`tf.random.normal`) restart their sequence in
every new `Session`: with a graph-level seed, a run restored from a
checkpoint (or a `MonitoredTrainingSession` recovering from a crash) draws
the first run's noise again, and anyone holding two released updates can
subtract them and read a gradient difference without noise
(/work/shared/TF-FACTS.md, "Random state across sessions").

`NoiseStream` draws instead `stateless_gaussian(shape, seed=(key + d,
counter))` (below: Box-Muller over `tf.random.stateless_uniform` in
float32, `tf.random.stateless_normal` in float64), a pure function of

* `key`: an int64 variable, set once when it is initialized: from the
  graph-level seed and the stream's name when a seed is set (eagerly, and
  TF's op seed: two streams of one name never share a key; two runs from
  scratch with the same `tf.compat.v1.set_random_seed` draw the same noise),
  else from fresh entropy (an unseeded random op, run only by the
  initializer, so the key is in no GraphDef). `seed=int` makes the key that
  int (a constant; the stream `(seed, counter)` of custagg's
  `DPOptimizer(seed=...)`);
* `counter`: an int64 variable incremented once per evaluation of a draw;
  the draw uses the incremented value;
* `d`: a constant per (replica, tensor index), so two replicas of a
  `tf.distribute` strategy (or two workers given distinct `replica=`) and
  two tensors of one draw never share a Philox key.

Both variables are non-trainable global variables (saved by `Saver`,
restored by `MonitoredTrainingSession`), also listed in the collection
`NOISE_STATE_COLLECTION`; where no initializer covered them (one run before
the draw was built, as in TF Privacy's own tests), the first draw gives
them their initial values. They are the noise's secret: a checkpoint that
holds them lets its reader regenerate every noise draw, so a released model
should be saved without them (`tf.compat.v1.train.Saver(var_list=...)`
over the model's variables; docs/privacy.md, "Threat model").

One training thread per stream: two `session.run` calls evaluating the same
draw concurrently may read the same counter value.

Example:

    stream = NoiseStream("my_noise")
    noise_w, noise_b = stream.normal([grad_w, grad_b], stddev=1.1)
"""

from __future__ import annotations

import contextlib
import hashlib
import numbers
import os
import weakref

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
# The sampler: the draws' values (public here, as they always were).
from custagg.privacy.gaussian import add_stateless_gaussian
from custagg.privacy.gaussian import joint_gaussian
from custagg.privacy.gaussian import stateless_gaussian

__all__ = ["NoiseStream", "NOISE_STATE_COLLECTION", "add_stateless_gaussian",
           "joint_gaussian", "noise_state_variables", "plus",
           "stateless_gaussian", "stream_of"]

# The graph collection holding every stream's key and counter variables.
NOISE_STATE_COLLECTION = "custagg_noise_state"

# Keys lie in [0, 2^62) and offsets `d` in [0, 2^62): their sum never
# overflows int64. Multiplying by an odd constant is a bijection mod 2^62,
# so distinct (site, replica, index) triples get distinct offsets.
_KEY_BITS = 62
_MIX = 0x1D8E4E27C47D124F  # odd
_REPLICA_BITS, _INDEX_BITS = 30, 20
# Draw sites of one stream in one graph (the rest of the 62 bits).
_MAX_SITES = 1 << (_KEY_BITS - _REPLICA_BITS - _INDEX_BITS)


def _offset(replica, index, site=0):
    """`d(replica, index, site)`: distinct for replica < 2^30, index <
    2^20, site < 2^12; site 0 gives the offsets of a stream's first draw
    site as they always were."""
    return ((((site << _REPLICA_BITS) + replica) << _INDEX_BITS) + index) \
        * _MIX % (1 << _KEY_BITS)


def _hashed_key(graph_seed, name):
    digest = hashlib.sha256(("%d/%s" % (graph_seed, name)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % (1 << _KEY_BITS)


def dense_shape(t):
    """The shape of `t` (a tensor, variable or `IndexedSlices`) as a 1-D
    int tensor, without densifying an `IndexedSlices`."""
    if isinstance(t, tf.IndexedSlices) and t.dense_shape is not None:
        return t.dense_shape
    return tf.shape(t)


def stream_of(holder, name, seed=None, owner=None):
    """`holder`'s noise stream, made on first use: one stream per DP
    optimizer or query object, so every step of it continues one
    `(key, counter)` sequence.

    Args:
      holder: the object the stream belongs to (kept as its
        `_noise_stream` attribute).
      name, seed, owner: see `NoiseStream`.
    """
    stream = getattr(holder, "_noise_stream", None)
    if stream is None:
        stream = NoiseStream(name, seed=seed, owner=owner)
        holder._noise_stream = stream
    return stream


def noise_state_variables(graph=None):
    """The key and counter variables of every noise stream in `graph`
    (default: the current one): exclude them from a checkpoint you release."""
    graph = graph or tf.compat.v1.get_default_graph()
    return list(graph.get_collection(NOISE_STATE_COLLECTION))


def _current_replica():
    """The replica id in a `tf.distribute` replica context, else 0."""
    if tf.distribute.has_strategy() and \
            not tf.distribute.in_cross_replica_context():
        rid = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)
        return 0 if rid is None else int(rid)
    return 0


class NoiseStream:
    """Gaussian noise as a function of a (key, counter) pair in variables.

    Args:
      name: the variables' name prefix (`<name>_key`, `<name>_step`); made
        unique in the graph as TF makes names unique (eagerly, streams of
        one name are told apart by TF's op seed).
      seed: None (the key comes from the graph-level seed when one is set,
        else from fresh entropy) or an int (the key; reproducible).
      replica: an int folded into every draw (worker or replica index);
        None: the `tf.distribute` replica id where there is one, else 0.
      owner: a `tf.compat.v1.train.Optimizer` whose non-slot variables the
        key and counter become (listed by its `variables()`, tracked by
        object-based checkpoints); None: plain global variables.
    """

    def __init__(self, name, seed=None, replica=None, owner=None):
        if not isinstance(name, str) or not name:
            raise TypeError("NoiseStream: `name` must be a non-empty string "
                            "(the variables' name prefix), got %r." % (name,))
        if seed is not None and (isinstance(seed, (bool, np.bool_)) or
                                 not isinstance(seed, numbers.Integral)):
            raise TypeError("NoiseStream: `seed` must be an int or None, got "
                            "%r." % (seed,))
        if replica is not None and (
                isinstance(replica, (bool, np.bool_)) or
                not isinstance(replica, numbers.Integral) or
                not 0 <= replica < (1 << _REPLICA_BITS)):
            raise ValueError("NoiseStream: `replica` must be an int in [0, "
                             "2^30) (the worker or replica index) or None, got "
                             "%r." % (replica,))
        self.name = name
        # The int key given as `seed`, or None (the key in a variable).
        self.seed = None if seed is None else int(seed)
        self._replica = None if replica is None else int(replica)
        self._owner = owner
        # graph -> (key, counter); weak, so a stream keeps no graph alive.
        self._state = weakref.WeakKeyDictionary()
        self._eager_state = None
        # graph -> [(variable, its initial value's function)], for `_ready`.
        self._initial = weakref.WeakKeyDictionary()
        # graph -> draw sites built so far (`_site`).
        self._sites = weakref.WeakKeyDictionary()
        self._eager_sites = 0

    def variables(self):
        """The stream's variables in the current graph (after a draw): the
        counter, and the key unless `seed` is an int."""
        key, counter = self._lookup(self._graph_key()) or (None, None)
        return [v for v in (key, counter) if isinstance(v, tf.Variable)]

    @staticmethod
    def _graph_key():
        # Where the variables live: a function's (or a v2 control-flow
        # body's) graph counts as its outer context, so every trace of a
        # tf.function continues one stream instead of starting its own.
        with tf.init_scope():
            return None if tf.executing_eagerly() else \
                tf.compat.v1.get_default_graph()

    def _variables(self, colocate_with):
        """`(key, counter)` of the current graph, created on first use.

        The key is a Python int when `seed` is an int, else a variable.
        """
        graph = self._graph_key()
        found = self._lookup(graph)
        if found is not None:
            return found
        with tf.init_scope():
            g = None if graph is None else tf.compat.v1.get_default_graph()
            with (g.name_scope(None) if g is not None else
                  contextlib.nullcontext()):
                initial = [(lambda: np.int64(0))]
                counter = self._make("%s_step" % self.name, initial[0],
                                     colocate_with)
                if self.seed is not None:
                    key = self.seed
                else:
                    initial.append(self._key_initializer(g))
                    key = self._make("%s_key" % self.name, initial[1],
                                     colocate_with)
        if graph is None:
            self._eager_state = (key, counter)
        else:
            self._state[graph] = (key, counter)
            self._initial[graph] = list(zip((counter, key), initial))
        return key, counter

    def prepare(self, colocate_with=None):
        """Creates the stream's variables in the current graph without a
        draw. Every replica of a `tf.distribute` strategy calls it, the ones
        that add no noise included: MultiWorkerMirroredStrategy initializes
        each variable with a collective broadcast that pairs up across the
        workers, so a variable made on one worker only leaves the other
        waiting in `global_variables_initializer()` forever.

        Args:
          colocate_with: as for `normal`.
        """
        self._variables(colocate_with)

    def _ready(self):
        """Graph mode: ops, one per variable of the stream, that give it its
        initial value when no initializer has (TF Privacy's own tests, and
        code written like them, run `global_variables_initializer()` before
        `compute_gradients` creates the stream), else do nothing. A draw
        waits for them. Not under a `tf.distribute` strategy, whose
        variables are initialized by its own scaffold."""
        graph = self._graph_key()
        if graph is None or tf.distribute.has_strategy():
            return []
        ops = []
        for v, initial in self._initial.get(graph, ()):
            def init(v=v, initial=initial):
                value = tf.cast(initial(), tf.int64)
                with tf.control_dependencies([v.assign(value)]):
                    return tf.constant(True)
            ops.append(tf.cond(tf.compat.v1.is_variable_initialized(v),
                               lambda: tf.constant(True), init))
        return ops

    def _lookup(self, graph):
        return self._eager_state if graph is None else self._state.get(graph)

    def _key_initializer(self, graph):
        graph_seed, op_seed = tf.compat.v1.get_seed(None)
        if graph_seed is not None:
            # In a graph, the stream's unique name tells two streams apart
            # (and not the ops built before it). Eagerly (also a
            # tf.function's variables) names are not made unique: TF's op
            # seed does it, as it does for two random ops, and
            # `tf.random.set_seed` restarts it (a rerun repeats).
            unique = (graph.unique_name("%s_key" % self.name,
                                        mark_as_used=False)
                      if graph is not None else
                      "%s/%d" % (self.name, op_seed))
            value = np.int64(_hashed_key(graph_seed, unique))
            return lambda: value
        if graph is None:
            value = np.int64(int.from_bytes(os.urandom(8), "little")
                             % (1 << _KEY_BITS))
            return lambda: value
        # An unseeded stateful op: fresh entropy each time the initializer
        # runs, and the key's value in no GraphDef.
        return lambda: tf.random.uniform([], 0, 1 << _KEY_BITS,
                                         dtype=tf.int64)

    def _make(self, name, initial_value, colocate_with):
        if self._owner is not None and colocate_with is not None:
            v = _tf_compat.create_non_slot_variable(
                self._owner, initial_value=initial_value, name=name,
                colocate_with=colocate_with)
        else:
            v = tf.compat.v1.Variable(initial_value, trainable=False,
                                      use_resource=True, name=name,
                                      dtype=tf.int64)
        if not tf.executing_eagerly():
            tf.compat.v1.add_to_collection(NOISE_STATE_COLLECTION, v)
        return v

    def _site(self):
        """The next draw site's number in the current graph: 0, 1, ... in
        the order the draws are built (the same order when the same code
        builds the graph again, so a restored stream continues).

        Each draw increments the counter and then reads it, two ops: two
        draws of one stream that run in one `session.run` (two variables of
        a nested query sharing one Gaussian query, two losses of one
        optimizer) may both read the value after both increments. Their
        sites tell their seeds apart, and one site never reads one counter
        value twice (each of its reads follows its own increment)."""
        if tf.executing_eagerly():
            return 0         # draws run one after another as they are called
        graph = self._graph_key()
        if graph is None:    # a tf.function traced from eager code
            site, self._eager_sites = self._eager_sites, self._eager_sites + 1
        else:
            site = self._sites.get(graph, 0)
            self._sites[graph] = site + 1
        if site >= _MAX_SITES:
            raise ValueError(
                "NoiseStream %r: more than %d noise draws built from one "
                "stream in one graph; give the later ones a NoiseStream of "
                "their own." % (self.name, _MAX_SITES))
        return site

    def _seed_pair(self, key, step, index, replica, site=0):
        d = _offset(replica, index, site)
        if isinstance(key, int):
            # Wrapped to int64 as TF would; d = 0 for replica 0, index 0.
            first = (key + d + (1 << 63)) % (1 << 64) - (1 << 63)
            first = tf.constant(first, tf.int64)
        else:
            value = key.read_value() if isinstance(key, tf.Variable) else key
            first = value + tf.constant(d, tf.int64) if d else value
        return tf.stack([first, step])

    def fresh_key(self):
        """A new int64 key in `[0, 2^62)` at each evaluation, a function of
        the stream's `(key, counter)` (the counter incremented): the key of
        a generator that carries its own `(key, counter)` state (the tree
        aggregation's `GaussianNoiseGenerator`), so even where that state
        is rebuilt each step, a restore never repeats its draws."""
        key, counter = self._variables(None)
        replica = self._replica if self._replica is not None else \
            _current_replica()
        site = self._site()
        with tf.control_dependencies(self._ready()):
            step = tf.compat.v1.assign_add(counter, 1)
            return tf.random.stateless_uniform(
                [], seed=self._seed_pair(key, step, 0, replica, site), minval=0,
                maxval=1 << _KEY_BITS, dtype=tf.int64)

    def normal(self, like, stddev, dtype=None, joint=False,
               colocate_with=None):
        """One draw: `N(0, stddev^2)` noise shaped as each entry of `like`.

        Evaluating the returned tensors increments the counter once (all
        entries of one call share the counter value, each with its own
        offset).

        Args:
          like: a list of tensors (noise of each one's shape and dtype),
            shapes (a list of ints, `TensorShape` or 1-D int tensor; needs
            `dtype`), or None (None returned there).
          stddev: the standard deviation, a number or scalar tensor.
          dtype: the noise's dtype for shape entries (tensor entries use
            their own).
          joint: one `[P]` draw over all entries (P their total size) split
            into pieces (`DPOptimizer(seed=int)`'s stream), instead of one
            draw per entry (no `[P]` buffer and copies).
          colocate_with: a variable the stream's variables are placed with
            (with `owner`, required by TF's non-slot variables).

        Returns:
          A list aligned with `like`: noise tensors, None where `like` has
          None.
        """
        return self._draw(like, stddev, dtype, joint, colocate_with,
                          add=False)

    def noised(self, tensors, stddev, joint=False, colocate_with=None):
        """One draw added: `t + N(0, stddev^2)` for each tensor of `tensors`
        (None stays None), the same values as `t + normal(...)`.

        Each dense float32 tensor gets its noise added in its own buffer,
        piece by piece (`add_stateless_gaussian`): the draw's peak is `t`
        and one piece, not `t` beside the whole noise and its temporaries.
        An `IndexedSlices` is added into its noise (`plus`). `joint`: one
        `[P]` draw split, as `normal(joint=True)`, then added.

        Args:
          tensors: a list of tensors, `IndexedSlices` or None.
          stddev, joint, colocate_with: as for `normal`.

        Returns:
          A list aligned with `tensors`: dense tensors, None where None.
        """
        return self._draw(tensors, stddev, None, joint, colocate_with,
                          add=True)

    def _draw(self, like, stddev, dtype, joint, colocate_with, add):
        """`normal`'s draw; with `add`, each entry of `like` (tensors) plus
        its noise."""
        like = list(like)
        entries = []
        for item in like:
            if item is None:
                entries.append(None)
            elif isinstance(item, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
                entries.append((dense_shape(item), item.dtype.base_dtype))
            else:
                if dtype is None:
                    raise TypeError("NoiseStream.normal: `dtype` must be given "
                                    "when `like` holds shapes, got None.")
                shape = item.as_list() if isinstance(item, tf.TensorShape) \
                    else item
                entries.append((shape, tf.as_dtype(dtype)))
        present = [e for e in entries if e is not None]
        if not present:
            return [None] * len(like)
        key, counter = self._variables(colocate_with)
        replica = self._replica if self._replica is not None else \
            _current_replica()
        site = self._site()
        with tf.control_dependencies(self._ready()):
            step = tf.compat.v1.assign_add(counter, 1)
            # The key is read after its initial value is in place.
            key = key if isinstance(key, int) else tf.identity(
                key.read_value())
        if joint:
            pieces = iter(joint_gaussian(
                [shape for shape, _ in present],
                self._seed_pair(key, step, 0, replica, site), stddev,
                present[0][1]))
            noise = [None if e is None else next(pieces) for e in entries]
            return [plus(t, n) if add and n is not None else n
                    for t, n in zip(like, noise)]
        out = []
        index = 0
        for item, e in zip(like, entries):
            if e is None:
                out.append(None)
                continue
            shape, dt = e
            seed = self._seed_pair(key, step, index, replica, site)
            index += 1
            if add and not isinstance(item, tf.IndexedSlices):
                out.append(add_stateless_gaussian(item, seed, stddev))
                continue
            noise = stateless_gaussian(shape, seed, stddev, dt)
            out.append(plus(item, noise) if add else noise)
        return out


def plus(t, noise):
    """`t + noise`; an `IndexedSlices` t is added into the dense noise in
    place (no dense copy of t, no zeros to add it to)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.tensor_scatter_nd_add(noise, tf.expand_dims(t.indices, 1),
                                        t.values)
    return t + noise
