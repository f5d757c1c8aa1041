"""Which forms other people's TF1 models (`benchmarks/zoo_models.py`) get
from the static proof (issue 24): the plan alone, no run (the values are
tests/per_example/test_tf1_models.py's). A variable listed here must be on
the form given; a regression that sends it back to the certificate or an
O(B^2) form shows here first.

The tagger's and the language model's projections (`tf.reshape(h, [-1,
H])`, then a MatMul and a bias on the `[B*T]` rows before the reshape
back: the static proof stops at the reshape back) are certified at run
time on the rows of the fold, whose example-major order is proved
(`forms/rows.py`: `fold_of`).

word2vec's NCE weights and biases are on rules: their gather at
`concat([labels, sampled])` is split into the examples' label rows and the
shared sampled rows, each example's gradient on those its own row of the
sampled logits' gradient (`rules/gather.py`: `NceSplit`).

The language model's embedding is certified too: its logits are reshaped
to `[tf.shape(input_data)[0], -1, V]` (the input's B is another symbol
than the RNN output's, and no run-time check equates them), so the walk
back from the loss stops there and the embedding's gather of the fed ids
lies outside the batch region. It reads fed data all the same
(`batch_axis.data_region`), so it is no batch-free chain: a rule consumer
whose rows (`[B, T, H]`, row b of example b) the certificate checks.

Still off the static proof, and why (so not listed): the language
model's recurrent layers (certified, in their loop, for the same reshape),
and the in-batch negatives' document tower (truly coupled).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg

from benchmarks import zoo_models as tf1_models

ALL = "*"
EXPECTED = {
    "transformer": {ALL: "rules"},
    "wide_deep": {ALL: "rules"},
    "word2vec": {ALL: "rules"},
    "bilstm_tagger": {
        "words/_word_embeddings:0": "rules",
        "bi-lstm/bidirectional_rnn/fw/lstm_cell/kernel:0": "loop-rules",
        "bi-lstm/bidirectional_rnn/fw/lstm_cell/bias:0": "loop-rules",
        "bi-lstm/bidirectional_rnn/bw/lstm_cell/kernel:0": "loop-rules",
        "bi-lstm/bidirectional_rnn/bw/lstm_cell/bias:0": "loop-rules",
        "proj/W:0": "certified",
        "proj/b:0": "certified"},
    "ptb_lm": {"Model/embedding:0": "certified",
               "Model/softmax_w:0": "certified",
               "Model/softmax_b:0": "certified"},
    "in_batch_negatives": {"query_tower/h/kernel:0": "rules",
                           "query_tower/out/kernel:0": "rules"},
}


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="tf.compat.v1.layers and the v1 RNN cells need "
                           "the tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_static_proof_takes_the_model(name, graph):
    dtype = tf.float32 if name in tf1_models.FLOAT32_ONLY else tf.float64
    model = tf1_models.MODELS[name](dtype, np.random.default_rng(0))
    plan = custagg.plan_per_example(model.loss, model.xs)
    want = EXPECTED[name]
    for x, form in zip(model.xs, plan.forms()):
        expected = want.get(ALL, want.get(x.name))
        if x.name in model.coupled:
            assert form != "rules", str(plan)
        elif expected is not None:
            assert form == expected, "%s: %s\n%s" % (x.name, form, plan)
