"""Fixtures shared by custagg's tests.

custagg builds graphs, so this file turns eager execution off for the whole
test process when it is imported (pytest imports it before any test module).
Every test then runs inside its own fresh `tf.Graph` (the autouse `graph`
fixture), so names, seeds and leftover ops never leak from one test into the
next. Tests that need eager mode, or the global switches of
`tf.compat.v1.disable_v2_behavior()`, run Python in a subprocess
(`run_python`): eager cannot be turned back on once a graph-mode test ran.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

# Before TensorFlow is imported: quiet C++ logs, and let graph-mode code use
# tf.compat.v1.layers / legacy Keras where the tf-keras package is installed
# (needed on TF 2.16-2.21, whose tf.keras is Keras 3). Without tf-keras the
# switch is left unset: TF 2.12-2.15's tf.keras is Keras 2 already, and on
# 2.15 the switch would make tf.keras look for tf-keras and fail; tests that
# need Keras 2 layers on 2.16+ skip and say so.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.ops import control_flow_util  # noqa: E402

tf.compat.v1.disable_eager_execution()

# Grappler, TF's graph optimizer, rewrites each graph at its first
# `Session.run`, keeping every value; on the large per-example graphs it was
# a third of the default run (the zoo, the rules and the bi-LSTM CRF tests:
# 176 s with it, 119 s without, 2 cores). The default run checks the graphs
# custagg builds as built; with CUSTAGG_TEST_GRAPPLER=1 every session keeps
# TF's default, as CI's slow set and its older releases run, so a rewrite
# that changed a value still fails CI. Subprocesses (notebooks, the CLI,
# the docs' examples) always run as users do.
if os.environ.get("CUSTAGG_TEST_GRAPPLER", "0") != "1":
    _session_init = tf.compat.v1.Session.__init__

    def _without_grappler(self, target="", graph=None, config=None):
        c = tf.compat.v1.ConfigProto()
        if config is not None:
            c.CopyFrom(config)
        c.graph_options.rewrite_options.disable_meta_optimizer = True
        _session_init(self, target, graph, c)

    tf.compat.v1.Session.__init__ = _without_grappler

SEED = 1234
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests import `benchmarks.zoo_models` (the model zoo) from the checkout.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(autouse=True)
def graph():
    """A fresh default `tf.Graph` for each test, with a fixed graph seed."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(SEED)
        yield g


@pytest.fixture
def sess(graph):
    """A `tf.compat.v1.Session` on the test's graph (closed afterwards)."""
    with tf.compat.v1.Session(graph=graph) as s:
        yield s


@pytest.fixture
def rng():
    """A seeded numpy Generator, the same stream in every test."""
    return np.random.default_rng(SEED)


@pytest.fixture
def control_flow_v1():
    """Builds v1 control flow (Switch/Merge/Enter/Exit) during the test.

    `tf.compat.v1.disable_v2_behavior()` does this too but also turns other
    process-wide switches; this fixture flips only the control-flow one and
    restores it afterwards.
    """
    was_v2 = control_flow_util.ENABLE_CONTROL_FLOW_V2
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            tf.compat.v1.enable_control_flow_v2()


def _run_python(code, timeout=180):
    """Runs `code` in a fresh Python (this interpreter), repo on sys.path.

    Returns the `subprocess.CompletedProcess` (text stdout/stderr). Each call
    pays TensorFlow's import (several seconds): put many checks in one call.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO_ROOT)


@pytest.fixture
def run_python():
    """`run_python(code) -> CompletedProcess`: Python code in a subprocess."""
    return _run_python


# The default run's time budget (README: about 6 min on 2 cores): these
# cases cost the most and each has a cheaper sibling in the default run (in
# brackets); `-m slow` runs them. Test ids, `*` matching any text.
LEFT_TO_SLOW = (
    # [float32 transformer; every other zoo model in float64]
    "tests/test_zoo.py::test_zoo_matches_loop[keras_transformer-float64]",
    "tests/privacy/test_microbatches.py::test_zoo_microbatches_match_per_microbatch_"
    "gradients[keras_transformer]",
    # [the same row-wise proof in float64]
    "tests/test_rowwise.py::test_proved_copies_in_float32_match_the_loop",
    # [tests/batch_axis/test_sources.py's constants source]
    "tests/test_rowwise.py::test_a_constant_holding_a_batch_is_a_source",
    # [the other three privacy parameter sets]
    "tests/privacy/test_privacy.py::test_pld_is_tighter_than_rdp[args3]",
    # [auto in the same function; rules and pfor inside the fallbacks]
    "tests/test_in_tf_function.py::test_per_example_api_matches_the_loop_in_"
    "the_same_function[loop]",
    "tests/test_in_tf_function.py::test_per_example_api_matches_the_loop_in_"
    "the_same_function[rules]",
    "tests/test_in_tf_function.py::test_per_example_api_matches_the_loop_in_"
    "the_same_function[pfor]",
    # [the other hidden-coupling cases]
    "tests/test_rowwise.py::test_hidden_couplings_are_not_proved_and_take_"
    "the_exact_form[batch size as a number]",
    # [test_hand_written_loop_is_proved; the hidden-coupling cases' values]
    "tests/test_rowwise.py::test_model_without_rules_is_proved_and_matches_"
    "the_loop",
    # [the readout head's rules in every loop-rules model]
    "tests/per_example/test_loop_rules.py::test_layer_before_a_loop_keeps_"
    "its_rules",
    # [wide & deep, word2vec and the in-batch negatives]
    "tests/per_example/test_tf1_models.py::test_tf1_model_matches_loop["
    "transformer-B1,7]",
    # [a run-time message; the hidden-coupling cases keep the run-time
    # checks]
    "tests/test_rowwise.py::test_inputs_of_other_lengths_fail_with_the_"
    "inputs_named",
    # [while_rnn_add_bias]
    "tests/rules/test_rules.py::test_matches_loop[while_rnn_bias_add_"
    "unstacked-float64]",
    # [test_certified.py's loop rules certified after the loop, rolled:
    # the same coupling after a loop, its check failing]
    "tests/per_example/test_loop_rules.py::test_coupling_after_the_loop_is_"
    "certified_and_exact",
    # [test_certified_rows.py's plan-time refusal; the unit test of
    # forms/rows.py's non_example_rows]
    "tests/per_example/test_certified.py::test_fixed_block_rows_are_refused_"
    "at_plan_time*",
    # [float64 at both (B, chunk) pairs; float32 with B=5 in chunks of 2]
    "tests/rules/test_conv_chunks.py::test_chunked_norms_and_clipped_sums_"
    "match_loop[*-float32-1-tensor]",
    # [test_loop_rules.py's values for weight_inside_and_outside; the
    # one-pass structure pinned for every model by test_clipped_sums_run_
    # one_forward_and_one_backward_loop and test_the_executed_step_runs_no_
    # original_loop; dynamic_rnn_lstm_seqlen's values under v1 control flow
    # in test_v1_control_flow_loops_take_loop_rules; hand_while_rnn here]
    "tests/per_example/test_loop_rules_one_pass.py::test_one_pass_matches_"
    "the_loop[stacked_lstm-small]",
    "tests/per_example/test_loop_rules_one_pass.py::test_one_pass_matches_"
    "the_loop[keras_lstm_sequence-small]",
    "tests/per_example/test_loop_rules_one_pass.py::test_one_pass_matches_"
    "the_loop[dynamic_rnn_lstm_seqlen-small]",
    "tests/per_example/test_loop_rules_one_pass.py::test_one_pass_matches_"
    "the_loop[weight_inside_and_outside-small]",
    # [test_bilstm_crf.py's tagger at B 1,7: an embedding below two LSTM
    # loops, certified rows after them, one pass]
    "tests/per_example/test_loop_rules_one_pass.py::test_certified_xs_next_"
    "to_the_loop_rules_take_one_pass",
    "tests/per_example/test_loop_rules_one_pass.py::test_rules_below_the_"
    "loop_take_the_rebuilt_loops_gradient[batches0]",
    # [the float64 hand-written LSTMs and RNNs]
    "tests/per_example/test_loop_rules.py::test_float32_hand_lstm[batches0]",
    # [hand_while_rnn's values with a gradient taken first; the eps lists
    # pinned for every model with a gradient taken first]
    "tests/per_example/test_loop_rules_steps.py::test_values_with_a_"
    "gradient_taken_first[keras_gru_sequence-B1,7]",
    "tests/per_example/test_loop_rules_steps.py::test_values_with_a_"
    "gradient_taken_first[keras_lstm_last-B1,7]",
    # [one true label per example, both losses; test_several_true_labels_
    # are_exact for num_true > 1]
    "tests/per_example/test_nce.py::test_colliding_ids_group_norms_are_"
    "exact[*-2]",
    "tests/per_example/test_nce.py::test_colliding_ids_are_exact[*-2-*]",
    # [test_certified_behind_a_loop_is_exact[rolled]: failing checks take
    # the exact form, values; the bilstm_tagger case of one forward of
    # each loop]
    "tests/per_example/test_certified_one_pass.py::test_failing_checks_on_"
    "tf1_models_are_exact[*-batches0]",
    "tests/per_example/test_certified_one_pass.py::test_tf1_models_"
    "certified_step_runs_one_forward_of_each_loop[ptb_lm]",
    # [the apart case: one forward of the loop in a certified step]
    "tests/per_example/test_certified_one_pass.py::test_a_certified_step_"
    "runs_one_forward_of_the_loop[rolled]",
    # [the LSTMCell classifier: a bi-RNN with sequence_length, dynamic T]
    "tests/per_example/test_bilstm_crf.py::test_a_birnn_classifier_with_"
    "dynamic_steps_matches_the_loop[GRUCell]",
    # [while_rnn_add_bias in float64]
    "tests/rules/test_rules.py::test_matches_loop[while_rnn_add_bias-"
    "float32]",
    # [test_zoo's keras_batch_norm_training; the other zoo models'
    # microbatches]
    "tests/privacy/test_microbatches.py::test_zoo_microbatches_match_per_"
    "microbatch_gradients[keras_batch_norm_training]",
    # [a one-pixel explicit padding]
    "tests/test_edge_cases.py::test_chain_through_conv2d_with_explicit_"
    "padding[3]",
    # [test_certified_one_pass.py's rolled loop, its checks failing; test_
    # coupled_embedding_is_exact_either_way]
    "tests/per_example/test_certified.py::test_rolled_embedding_behind_a_"
    "loop_is_caught[B1,7]",
    # [the dense layer on a placeholder x with a dynamic batch]
    "tests/test_edge_cases.py::test_placeholder_as_x_with_a_dynamic_batch["
    "relu]",
    # [test_loop_rules.py's hand_while_rnn values; the one pass pinned for
    # it by test_clipped_sums_run_one_forward_and_one_backward_loop]
    "tests/per_example/test_loop_rules_one_pass.py::test_one_pass_matches_"
    "the_loop[hand_while_rnn-small]",
    # [test_run_time_shapes.py's squeeze to unknown rank; the other
    # dynamic models here]
    "tests/per_example/test_tf1_dynamic_models.py::test_dynamic_model_"
    "matches_loop[neurobind-float64-B1,7]",
    # [test_embedding_behind_a_loop_is_certified_and_the_rules_run: an
    # embedding certified behind a loop, small]
    "tests/per_example/test_certified.py::test_ptb_embedding_is_certified_"
    "and_the_rules_run[B1,7]",
    # [the other hidden couplings in a loop body]
    "tests/test_rowwise.py::test_hidden_couplings_are_not_proved_and_take_"
    "the_exact_form[batch mean under an integer path in the body]",
    # [sum pooling at every shape; mean and none at the first two]
) + tuple("tests/test_gather_norms.py::test_norms_match_loop[dtype%d-*-%s]"
          % (shape, pooling) for shape in range(2, 8)
          for pooling in ("mean", "none"))


# A time budget for a run (`CUSTAGG_TEST_BUDGET_S`, seconds; unset: none).
# CI runs the slow set with one so that the whole of CI fits its 30 minutes
# on 2 cores: the tests are then taken round-robin across files (each file's
# first tests first, so every file is reached early), and once the budget is
# spent each worker skips the tests it has not started, saying so in the
# summary (-rs). Failures still fail the run. Without the variable every
# selected test runs, in file order.
_BUDGET_S = float(os.environ.get("CUSTAGG_TEST_BUDGET_S") or 0)
_STARTED = time.monotonic()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: the slow marks must be on before `-m` deselects.
    import re
    left = re.compile("|".join(re.escape(p).replace(r"\*", ".*")
                               for p in LEFT_TO_SLOW))
    for item in items:
        if left.fullmatch(item.nodeid):
            item.add_marker(pytest.mark.slow)


class _RoundRobin(object):
    """Under a budget, the selected tests round-robin across files (after
    `-m` has deselected: trylast)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        by_file = {}
        for item in items:
            by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
        queues = list(by_file.values())
        items[:] = [q[i] for i in range(max(map(len, queues), default=0))
                    for q in queues if i < len(q)]


def pytest_configure(config):
    if _BUDGET_S:
        config.pluginmanager.register(_RoundRobin(), "custagg-round-robin")


def pytest_runtest_setup(item):
    if _BUDGET_S and time.monotonic() - _STARTED > _BUDGET_S:
        pytest.skip("CUSTAGG_TEST_BUDGET_S=%d s spent: not started (run "
                    "without the variable to run it)" % _BUDGET_S)
