"""Peak memory of one TensorFlow step, from TF's own allocator records.

Why this method (and not a fresh process's max RSS): a session step run with
`RunOptions(trace_level=FULL_TRACE)` returns, in its `RunMetadata.step_stats`,
every op kernel's allocations AND deallocations through TF's allocators, each
with a time stamp (`AllocatorMemoryUsed.allocation_records`; a free is a
negative `alloc_bytes`). Summing them in time order gives the bytes of tensors
live during the step; its maximum is the step's peak. That figure

* belongs to one step of one fetch: the floor and the system are measured in
  the same process and graph, one after the other, without their memory
  mixing (a process's max RSS is one number for everything the process did:
  TF's import, graph construction, the check run, the floor's run);
* counts what the step allocates beyond what exists before it: variables and
  fed arrays are not in it (both are the same for the floor and the system);
  outputs are (they are live when the step ends);
* does not depend on load or on the C library keeping freed pages (RSS does:
  glibc's arenas hold freed memory, so RSS only ever grows within a process).

What it misses: memory that kernels take outside TF's allocators (oneDNN and
Eigen scratch buffers inside one kernel; these are per kernel and short
lived, and the same kinds of kernels run in the floor). The check in
tests/test_benchmarks_memory.py allocates known temporaries and asserts the
figure is at least their size and within a stated factor of it.

The traced step is run once, apart from the timed runs (tracing slows a step).
"""

import collections


def peak_from_step_stats(step_stats):
    """Peak live bytes of a step, from its `StepStats` proto.

    Args:
      step_stats: `RunMetadata.step_stats` of a step run with FULL_TRACE.

    Returns:
      (peak_bytes, by_allocator): `peak_bytes` is an int, the sum over
      allocators of each allocator's peak of live bytes during the step (an
      upper bound if several allocators peak at different times; on this CPU
      build one allocator, "mklcpu", takes nearly everything);
      `by_allocator` maps an allocator name ("cpu", "mklcpu", ...) to its peak.
      Each allocator's peak is the maximum of the running sum of its
      allocation records in time order; at equal time stamps allocations
      count before frees, so the peak errs high rather than low.
    """
    events = collections.defaultdict(list)
    order = 0
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            for mem in node.memory:
                for rec in mem.allocation_records:
                    order += 1
                    events[mem.allocator_name].append(
                        (rec.alloc_micros, 0 if rec.alloc_bytes > 0 else 1, order,
                         rec.alloc_bytes))
    by_allocator = {}
    for name, evs in events.items():
        evs.sort()
        live = peak = 0
        for _, _, _, nbytes in evs:
            live += nbytes
            peak = max(peak, live)
        by_allocator[name] = peak
    return sum(by_allocator.values()), by_allocator


def traced_step_stats(sess, fetches, feed_dict=None):
    """Runs `fetches` once with FULL_TRACE; returns the step's `StepStats`."""
    import tensorflow as tf
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    sess.run(fetches, feed_dict, options=options, run_metadata=metadata)
    return metadata.step_stats


def live_at_peak(step_stats):
    """The tensors live when the step's live bytes (all allocators together)
    peak, by the op that allocated them: a list of (bytes, op name, op type),
    largest first. A kernel's tracking allocator records both its own
    allocations and their frees (whenever they happen), so the running sum
    per op is what that op's outputs and temporaries hold at a time."""
    events = []
    order = 0
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            op_type = node.timeline_label.split(" = ")[-1].split("(")[0]
            for mem in node.memory:
                for rec in mem.allocation_records:
                    order += 1
                    events.append((rec.alloc_micros, 0 if rec.alloc_bytes > 0 else 1,
                                   order, rec.alloc_bytes, node.node_name, op_type))
    events.sort()
    live = peak = 0
    peak_at = -1
    for i, ev in enumerate(events):
        live += ev[3]
        if live > peak:
            peak, peak_at = live, i
    by_node = collections.Counter()
    types = {}
    for ev in events[:peak_at + 1]:
        by_node[ev[4]] += ev[3]
        types[ev[4]] = ev[5]
    return sorted(((n, name, types[name]) for name, n in by_node.items() if n > 0),
                  reverse=True)


def step_peak_bytes(sess, fetches, feed_dict=None):
    """Runs `fetches` once with FULL_TRACE and returns the step's peak bytes.

    Args:
      sess: a `tf.compat.v1.Session`.
      fetches: anything `sess.run` accepts; it is run once more (so a training
        step is applied once more: measure on a copy if that matters).
      feed_dict: the step's feeds.

    Returns:
      (peak_bytes, by_allocator) as `peak_from_step_stats`.
    """
    return peak_from_step_stats(traced_step_stats(sess, fetches, feed_dict))


def mb(nbytes):
    """Bytes as MB (10**6), rounded for tables; None stays None."""
    return None if nbytes is None else round(nbytes / 1e6, 3)


def largest_allocations(step_stats, count=8):
    """The ops that allocated the most bytes in a traced step, to say where a
    peak comes from: a list of (bytes, op name, op type) for the `count` ops
    with the largest `total_bytes`, largest first."""
    rows = []
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            total = sum(mem.total_bytes for mem in node.memory)
            if total:
                rows.append((total, node.node_name, node.timeline_label.split(" = ")[-1]
                             .split("(")[0]))
    rows.sort(reverse=True)
    return rows[:count]
