"""The model, data and numpy reference of the optimizer tests
(tests/training/test_optimizers.py: the non-DP wrappers;
tests/privacy/test_wrappers.py: custagg's DP wrappers).

The model is the TF1 MNIST tutorial's softmax regression, small: logits =
x W + b, per-example loss = softmax cross-entropy. Its per-example gradients
have a closed form (dz_i = softmax(z_i) - onehot(y_i); dW_i = x_i dz_i^T;
db_i = dz_i), which is the reference every update is compared with.
"""

import os

import numpy as np
import tensorflow as tf

B, D, K = 6, 4, 3
LR = 0.5
STRATEGY = os.environ.get("CUSTAGG_TEST_STRATEGY", "auto")
CLIP = 1.5


# --------------------------------------------------------------------------
# numpy reference.


def np_per_example(w, b, x, y):
    """Per-example gradients ([B, D, K], [B, K]) and losses [B]."""
    z = x @ w + b
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y])
    dz = p.copy()
    dz[np.arange(len(y)), y] -= 1.0
    return x[:, :, None] * dz[:, None, :], dz, loss


def np_clip_factors(gw, gb, clip):
    """min(1, C/||g_i||), global or per layer ((C_w, C_b))."""
    nw = np.sqrt((gw ** 2).sum(axis=(1, 2)))
    nb = np.sqrt((gb ** 2).sum(axis=1))
    if isinstance(clip, tuple):
        return np.minimum(1, clip[0] / nw), np.minimum(1, clip[1] / nb)
    f = np.minimum(1, clip / np.sqrt(nw ** 2 + nb ** 2))
    return f, f


def batches(num_steps, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(B, D), rng.randint(0, K, B))
            for _ in range(num_steps)]


W0 = np.random.RandomState(42).randn(D, K) * 0.3
B0 = np.array([0.1, -0.2, 0.05])


# --------------------------------------------------------------------------
# The TF model.


class Model(object):

    def __init__(self, use_resource=True, batch=B):
        self.x = tf.compat.v1.placeholder(tf.float64, [batch, D], name="x")
        self.y = tf.compat.v1.placeholder(tf.int64, [batch], name="y")
        self.w = tf.compat.v1.get_variable(
            "w", initializer=tf.constant(W0), use_resource=use_resource)
        self.b = tf.compat.v1.get_variable(
            "b", initializer=tf.constant(B0), use_resource=use_resource)
        logits = tf.matmul(self.x, self.w) + self.b
        self.loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=self.y, logits=logits)
        self.global_step = tf.compat.v1.train.get_or_create_global_step()

    def feed(self, xb, yb):
        return {self.x: xb, self.y: yb}


def run_steps(make_opt, steps, feeds_extra=None, use_resource=True):
    """Builds the model, runs `steps`; returns (w, b, per-step norms, opt)."""
    with tf.Graph().as_default():
        model = Model(use_resource=use_resource)
        opt = make_opt()
        train = opt.minimize(model.loss, global_step=model.global_step)
        norms = opt.per_example_norms
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got_norms = []
            for i, (xb, yb) in enumerate(steps):
                feed = model.feed(xb, yb)
                if feeds_extra:
                    feed.update(feeds_extra(opt, i))
                n, _ = sess.run([norms, train], feed)
                got_norms.append(n)
            w, b, gs = sess.run([model.w, model.b, model.global_step])
    assert gs == len(steps)
    return w, b, got_norms, opt


def np_run(steps, update):
    w, b = W0.copy(), B0.copy()
    norms = []
    for i, (xb, yb) in enumerate(steps):
        gw, gb, _ = np_per_example(w, b, xb, yb)
        norms.append(np.sqrt((gw ** 2).sum(axis=(1, 2)) + (gb ** 2).sum(1)))
        dw, db = update(gw, gb, i)
        w, b = w - LR * dw, b - LR * db
    return w, b, norms


def gd():
    return tf.compat.v1.train.GradientDescentOptimizer(LR)


def clipped_update(clip, microbatches=None):
    def update(gw, gb, i):
        if microbatches:
            k = B // microbatches
            gw = gw.reshape(microbatches, k, D, K).mean(1)
            gb = gb.reshape(microbatches, k, K).mean(1)
        fw, fb = np_clip_factors(gw, gb, clip)
        m = len(gw)
        return (np.einsum("n,ndk->dk", fw, gw) / m, fb @ gb / m)
    return update
