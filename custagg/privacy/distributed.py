"""DP-SGD on TensorFlow's own distributed runtime: noise once per global step.

With W synchronous replicas each replica clips its own examples, but the
Gaussian noise of DP-SGD must enter the global sum exactly once, with total
standard deviation `sigma = noise_multiplier * l2_norm_clip`, and the result
must be divided by the global number of microbatches (the global batch when
each example is its own microbatch):

    update = (sum over all replicas and microbatches of clip(g_m)
              + N(0, sigma^2 I)) / M_global

Adding the full noise on every replica multiplies its std by sqrt(W);
leaving it out voids the guarantee.

**Where the noise goes (the choice made here).** One draw of
`N(0, sigma^2 I)` per global step, by one party, after (or, equivalently,
exactly where nothing can be dropped) the aggregation:

* `tf.compat.v1.train.SyncReplicasOptimizer`: the chief adds it to the
  aggregated gradient, inside the update op that only the chief's queue
  runner runs, once per global step.
* `tf.distribute.MirroredStrategy` / `MultiWorkerMirroredStrategy`: replica 0
  adds it before the all-reduce. The all-reduce is an exact sum over every
  replica (none is ever dropped), so this is the same total as adding it
  after.

We did not split the noise into W shares of `N(0, sigma^2 / W)`: the total is
right only if exactly W shares reach the sum. `SyncReplicasOptimizer` drops
stale gradients and, with backup workers (`replicas_to_aggregate <
total_num_replicas`), aggregates a subset; each dropped share silently
removes noise that the privacy accounting counted. Seeded shares also need a
distinct seed per replica (equal seeds make the shares identical and the
total std `sqrt(W) * sigma`). One draw has neither problem, costs one
normal sample per parameter instead of W, and with a seed it is a function of
`(seed, global_step)` only, the same for any W.

**Which wraps which.**

    SyncReplicasOptimizer(                    # accumulates, averages over R
        DistributedDPOptimizer(               # adds the noise once (chief)
            DPOptimizer(GradientDescentOptimizer(lr), C, sigma)))  # clips

`DistributedDPOptimizer` takes over the noise of the DP optimizer it wraps
(custagg's `DPOptimizer` / `ClippedOptimizer` or a TF Privacy-style class of
`custagg.privacy.dp_optimizer` with a Gaussian sum query) through the
optimizer's public `hand_over_noise()`: that optimizer still clips and
divides by its local M, but adds no noise of its own. The noise is drawn by
the clip-and-noise core's `core.add_noise`, as every DP optimizer's is. The
accumulator of `SyncReplicasOptimizer` averages the R = `replicas_to_aggregate`
local results, so the mean is `sum clip(g_m) / (R * M_local)`: normalised by
the global batch when every replica has the same batch size (it must). The
noise added by the chief is therefore `N(0, sigma^2) / (R * M_local)`.

Under a strategy, no `SyncReplicasOptimizer`: `DistributedDPOptimizer`
directly, built and minimized inside `strategy.scope()` /
`strategy.extended.call_for_each_replica`; it scales each replica's gradient
by 1/R (R = `num_replicas_in_sync`) so the all-reduce SUM of the TF1
optimizer gives the mean over the global batch.

Example (between-graph replication, one ps):

    cluster = tf.train.ClusterSpec(spec)
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
            worker_device="/job:worker/task:%d" % task, cluster=cluster)):
        loss = ...                       # [B_local] per-example losses
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = custagg.distributed.sync_replicas_dp_optimizer(
            custagg.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                l2_norm_clip=1.0, noise_multiplier=1.1),
            num_workers=2)
        train_op = opt.minimize(loss, global_step=step)
    # num_tokens=0: no token before the first step, so each worker adds
    # exactly one gradient to each global step (lockstep).
    hooks = [opt.make_session_run_hook(is_chief=task == 0, num_tokens=0)]
    config = custagg.distributed.worker_session_config(task)
    if task != 0:
        custagg.distributed.wait_until_initialized(server.target, config, 300)
    with tf.compat.v1.train.MonitoredTrainingSession(
            master=server.target, is_chief=task == 0, hooks=hooks,
            config=config) as sess:
        ...
"""

from __future__ import annotations

import time

import tensorflow as tf

from custagg.privacy import checks
from custagg.privacy import core
from custagg.privacy import noise as noise_lib

__all__ = ["DistributedDPOptimizer", "sync_replicas_dp_optimizer",
           "local_cluster_spec", "worker_session_config",
           "wait_until_initialized"]

_Optimizer = tf.compat.v1.train.Optimizer


def local_cluster_spec(worker_ports, ps_ports=()):
    """`{"ps": ["127.0.0.1:p", ...], "worker": [...]}` for loopback ports.

    Args:
      worker_ports: one port per worker task.
      ps_ports: one port per parameter-server task (none for strategies).

    Returns:
      A dict for `tf.train.ClusterSpec` (or TF_CONFIG's "cluster").
    """
    spec = {"worker": ["127.0.0.1:%d" % p for p in worker_ports]}
    if ps_ports:
        spec["ps"] = ["127.0.0.1:%d" % p for p in ps_ports]
    return spec


def worker_session_config(task_index, config=None):
    """A session config whose devices are the ps tasks and this worker only,
    so that a worker never waits for the other workers to be up."""
    config = config or tf.compat.v1.ConfigProto()
    config.device_filters[:] = ["/job:ps", "/job:worker/task:%d" % task_index]
    return config


def wait_until_initialized(target, config, timeout_s, poll_s=0.2):
    """Blocks until the chief has initialized the graph's global variables.

    `MonitoredTrainingSession` on a non-chief checks readiness every 30 s;
    calling this first (before the graph is finalized) makes a non-chief
    start within `poll_s` of the chief.

    Raises:
      TimeoutError: not initialized after `timeout_s` seconds.
    """
    not_ready = tf.compat.v1.report_uninitialized_variables(
        tf.compat.v1.global_variables())
    deadline = time.monotonic() + timeout_s
    with tf.compat.v1.Session(target, config=config) as sess:
        while len(sess.run(not_ready)):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    "custagg.distributed: the chief did not initialize the "
                    "variables within %.0f s" % timeout_s)
            time.sleep(poll_s)


class _NoiseSource(object):
    """The noise of a wrapped DP optimizer, taken over by the wrapper.

    Attributes:
      stddev: sigma (a scalar tensor or number), the std on the clipped sum;
        0 for a clip-only optimizer.
      num_microbatches: the optimizer's M (None: one example each).
    """

    def __init__(self, optimizer):
        name = type(optimizer).__name__
        # Both DP faces say M as the property num_microbatches.
        self.num_microbatches = getattr(optimizer, "num_microbatches", None)
        hand_over = getattr(optimizer, "hand_over_noise", None)
        self._stddev = None if hand_over is None else hand_over()
        if self._stddev is None:
            raise TypeError(
                "DistributedDPOptimizer: optimizer must be custagg's "
                "DPOptimizer / ClippedOptimizer (or a DP...GaussianWrapper "
                "of custagg.optimizers), or a custagg.privacy.dp_optimizer "
                "class with a GaussianSumQuery; got %s. Other DPQuery "
                "objects add their noise inside get_noised_result, which "
                "cannot be moved to after the aggregation." % name)

    def stddev(self, dtype):
        return self._stddev(dtype)


def _local_units(loss, num_microbatches):
    """M_local: microbatches of this replica's batch, as a float32 scalar."""
    if num_microbatches is not None:
        return tf.constant(float(num_microbatches))
    batch = tf.compat.dimension_value(loss.shape[0]) if (
        loss.shape.rank) else None
    if batch is not None:
        return tf.constant(float(batch))
    return tf.cast(tf.shape(loss)[0], tf.float32)


class DistributedDPOptimizer(_Optimizer):
    """A DP optimizer for W synchronous replicas: noise added once in all.

    Wraps a DP optimizer (see the module docstring) and is itself a TF1
    optimizer. Two uses:

    * inside `tf.compat.v1.train.SyncReplicasOptimizer` (built by
      `sync_replicas_dp_optimizer`): `compute_gradients` returns the
      replica's clipped mean without noise; `apply_gradients` receives the
      average over `replicas_to_aggregate` replicas (the chief runs it) and
      adds `N(0, sigma^2) / (R * M_local)` once.
    * under `tf.distribute.MirroredStrategy` / `MultiWorkerMirroredStrategy`
      in graph mode, called in replica context: `apply_gradients` scales
      each replica's gradient by 1/R, replica 0 adds the noise
      `N(0, sigma^2) / (R * M_local)`, and the wrapped TF1 optimizer's
      all-reduce SUM forms the total.

    Every replica must see the same local batch size.

    Args:
      optimizer: custagg's `DPOptimizer` / `ClippedOptimizer`, or a
        `custagg.privacy.dp_optimizer` class with a `GaussianSumQuery`. Its
        own noise is switched off (this wrapper adds it instead).
      replicas_to_aggregate: R for `SyncReplicasOptimizer` use (ignored
        under a strategy, where R is `num_replicas_in_sync`).
      seed: None: a checkpointed `custagg.privacy.noise` stream (a
        restore never repeats a draw). An int: the noise of global step t
        is `noise.stateless_gaussian(seed=(seed, t))`, the same for any
        number of replicas (needs a global step).
      name: the wrapper's name.
    """

    # Set by compute_gradients: this replica's count of clipping units, and
    # the noise's standard deviation on the mean over all replicas.
    _units = None
    _noise_std_on_mean = None

    def __init__(self, optimizer, replicas_to_aggregate=1, seed=None,
                 name=None):
        if not isinstance(optimizer, _Optimizer):
            raise TypeError("DistributedDPOptimizer: optimizer must be a "
                            "tf.compat.v1.train.Optimizer (a custagg DP "
                            "optimizer); got %r." % (optimizer,))
        if isinstance(replicas_to_aggregate, bool) or not isinstance(
                replicas_to_aggregate, int) or replicas_to_aggregate < 1:
            raise ValueError("DistributedDPOptimizer: replicas_to_aggregate "
                             "must be a positive int; got %r."
                             % (replicas_to_aggregate,))
        if seed is not None and (isinstance(seed, bool)
                                 or not isinstance(seed, int)):
            raise ValueError("DistributedDPOptimizer: seed must be an int or "
                             "None; got %r." % (seed,))
        super().__init__(use_locking=False,
                         name=name or "Distributed" + optimizer.get_name())
        self._optimizer = optimizer
        self._noise = _NoiseSource(optimizer)
        self._replicas = replicas_to_aggregate
        self._seed = seed

    @property
    def optimizer(self):
        """The wrapped DP optimizer (which no longer adds noise itself)."""
        return self._optimizer

    @property
    def noise_stddev_on_update(self):
        """The std of the noise added to the aggregated (mean) gradient:
        `sigma / M_global`; available after `apply_gradients`."""
        if self._noise_std_on_mean is None:
            raise ValueError("DistributedDPOptimizer.noise_stddev_on_update "
                             "is available after apply_gradients().")
        return self._noise_std_on_mean

    def compute_gradients(self, loss, var_list=None, **kwargs):
        """The wrapped optimizer's clipped local mean, without noise."""
        self._units = _local_units(loss, self._noise.num_microbatches)
        return self._optimizer.compute_gradients(loss, var_list=var_list,
                                                 **kwargs)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)
        if self._units is None:
            raise checks.ComputeGradientsNotCalledError(
                "DistributedDPOptimizer.apply_gradients: compute_gradients() "
                "was not called on it, so the gradients were not clipped by "
                "it; call minimize() or compute_gradients() first.")
        replicas, replica_id = self._replicas, 0
        in_replica = (tf.distribute.has_strategy() and
                      not tf.distribute.in_cross_replica_context())
        if in_replica:
            ctx = tf.distribute.get_replica_context()
            replicas = ctx.num_replicas_in_sync
            replica_id = tf.get_static_value(ctx.replica_id_in_sync_group)
            if replica_id is None:
                raise ValueError("DistributedDPOptimizer: the replica id is "
                                 "not known when the graph is built.")
        present = [g for g, _ in grads_and_vars if g is not None]
        if not present:
            raise ValueError("DistributedDPOptimizer.apply_gradients: no "
                             "gradients to apply.")
        dtype = present[0].dtype
        std = (self._noise.stddev(dtype) /
               (tf.cast(self._units, dtype) * float(replicas)))
        self._noise_std_on_mean = std
        if in_replica:
            grads_and_vars = [(None if g is None else g / float(replicas), v)
                              for g, v in grads_and_vars]
        if replica_id == 0:
            grads_and_vars = self._add_noise(grads_and_vars, std, global_step)
        elif self._seed is None:
            # The other replicas draw nothing but hold the stream's
            # variables too (NoiseStream.prepare: a worker without them
            # hangs MultiWorkerMirroredStrategy's initializer).
            with tf.name_scope(self._name + "_noise"):
                self._stream().prepare(colocate_with=grads_and_vars[0][1])
        return self._optimizer.apply_gradients(
            grads_and_vars, global_step=global_step, name=name)

    def _stream(self):
        return noise_lib.stream_of(self, self._name + "_noise", owner=self)

    def _add_noise(self, grads_and_vars, std, global_step):
        grads = [tf.convert_to_tensor(g) if g is not None else None
                 for g, _ in grads_and_vars]
        with tf.name_scope(self._name + "_noise"):
            if self._seed is None:
                # This wrapper's checkpointed (key, counter) stream
                # (custagg.privacy.noise), which a restore continues.
                seed = self._stream()
            else:
                step = global_step
                if step is None:
                    step = tf.compat.v1.train.get_global_step()
                if step is None:
                    raise ValueError(
                        "DistributedDPOptimizer: seeded noise needs a global "
                        "step; pass global_step= or create one with "
                        "tf.compat.v1.train.get_or_create_global_step().")
                seed = tf.stack([tf.constant(self._seed, tf.int64),
                                 tf.cast(step, tf.int64)])
            noised = core.add_noise(grads, std, seed,
                                    colocate_with=grads_and_vars[0][1])
        return [(g, v) for g, (_, v) in zip(noised, grads_and_vars)]

    # The wrapped optimizer owns the slots and variables.
    def get_slot(self, var, name):
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names()

    def variables(self):
        return self._optimizer.variables()


def sync_replicas_dp_optimizer(optimizer, num_workers,
                               replicas_to_aggregate=None, seed=None):
    """`SyncReplicasOptimizer(DistributedDPOptimizer(optimizer))`.

    Args:
      optimizer: a custagg DP optimizer (see `DistributedDPOptimizer`).
      num_workers: total_num_replicas (worker tasks).
      replicas_to_aggregate: gradients averaged per global step (default
        `num_workers`; fewer gives backup workers).
      seed: see `DistributedDPOptimizer`.

    Returns:
      The `tf.compat.v1.train.SyncReplicasOptimizer`; call
      `make_session_run_hook(is_chief)` on it for `MonitoredTrainingSession`.
    """
    r = num_workers if replicas_to_aggregate is None else replicas_to_aggregate
    inner = DistributedDPOptimizer(optimizer, replicas_to_aggregate=r,
                                   seed=seed)
    return tf.compat.v1.train.SyncReplicasOptimizer(
        inner, replicas_to_aggregate=r, total_num_replicas=num_workers)
