"""Peak memory of one TensorFlow step, from TF's own allocator records.

A step run with FULL_TRACE returns every kernel's allocations and frees
(negative `alloc_bytes`) in its `RunMetadata.step_stats`, time-stamped:
their running sum in time order is the bytes of tensors live during the
step, its maximum the step's peak. Why this figure, and its check
(tests/test_benchmarks_memory.py): docs/benchmarks.md, "Peak memory".
"""

import collections


def _events(step_stats):
    """The step's allocation records as (time, 0 for an allocation or 1 for a
    free, order, bytes, allocator, op name, op type), in time order; at equal
    times allocations count before frees, so a peak errs high, not low."""
    events = []
    for node in (node for dev in step_stats.dev_stats for node in dev.node_stats):
        op_type = node.timeline_label.split(" = ")[-1].split("(")[0]
        for mem in node.memory:
            for rec in mem.allocation_records:
                events.append((rec.alloc_micros, 0 if rec.alloc_bytes > 0 else 1, len(events),
                               rec.alloc_bytes, mem.allocator_name, node.node_name, op_type))
    return sorted(events)


def peak_from_step_stats(step_stats):
    """(peak_bytes, by_allocator) of a step from its `StepStats` (FULL_TRACE):
    `by_allocator` maps an allocator name ("cpu", "mklcpu", ...) to the peak
    of its live bytes; `peak_bytes` is their sum (an upper bound if they peak
    at different times; on this CPU build "mklcpu" takes nearly everything)."""
    live, by_allocator = collections.Counter(), {}
    for ev in _events(step_stats):
        live[ev[4]] += ev[3]
        by_allocator[ev[4]] = max(by_allocator.get(ev[4], 0), live[ev[4]])
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
    peak, by the op that allocated them: [(bytes, op name, op type)], largest
    first. A kernel's tracking allocator records its allocations and their
    frees, so the running sum per op is what its outputs and temporaries hold."""
    events = _events(step_stats)
    live = peak = 0
    peak_at = -1
    for i, ev in enumerate(events):
        live += ev[3]
        if live > peak:
            peak, peak_at = live, i
    by_node, types = collections.Counter(), {}
    for ev in events[:peak_at + 1]:
        by_node[ev[5]] += ev[3]
        types[ev[5]] = ev[6]
    return sorted(((n, name, types[name]) for name, n in by_node.items() if n > 0), reverse=True)


def step_peak_bytes(sess, fetches, feed_dict=None):
    """(peak_bytes, by_allocator) as `peak_from_step_stats` of one more run
    of `fetches` in `sess` (a training step is applied once more)."""
    return peak_from_step_stats(traced_step_stats(sess, fetches, feed_dict))


def mb(nbytes):
    """Bytes as MB (10**6), rounded for tables; None stays None."""
    return None if nbytes is None else round(nbytes / 1e6, 3)
