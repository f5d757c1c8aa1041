"""A helper for the restore tests (noise stream, DP optimizers, privacy
budget): steps in a fresh Session of the current graph, started from a
checkpoint or from the initializers, optionally saved afterwards."""

import tensorflow as tf


def session_steps(step, k, restore=None, save=None, after=None):
    """`[step(sess) for k steps]` in a new Session of the default graph.

    Args:
      step: `sess -> value`, one training step.
      k: steps to run.
      restore: a checkpoint path to restore first (else the variables are
        initialized).
      save: a checkpoint path to save to after the steps.
      after: `sess -> value` run once after the steps (before saving);
        its value is returned too.

    Returns:
      The k values, or `(values, after(sess))` with `after`.
    """
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as sess:
        if restore:
            saver.restore(sess, restore)
        else:
            sess.run(tf.compat.v1.global_variables_initializer())
        out = [step(sess) for _ in range(k)]
        extra = after(sess) if after is not None else None
        if save:
            saver.save(sess, save)
    return out if after is None else (out, extra)
