"""benchmarks.before_after: two trees' engines in one run, interleaved
(issue 23; issue 34 runs it on a deep conv net, a bi-RNN with
`sequence_length` and a model with dynamic image sizes). What a worker child
runs (`execute`), the cells and table it writes, its arguments. No timing
assertion: both trees are this tree, so their medians and plans agree."""
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_before_after_cells_from_both_trees(tmp_path):
    # Issue 23's before/after benchmark (benchmarks/before_after.py) with
    # both trees = this tree, in this process: what each worker child runs
    # (`execute`), then the cells and table from two rounds per tree. The
    # same engine on both sides: equal medians, nothing "changed", the same
    # plans, and the two trees' per-example norms agree. No timing assertion.
    from benchmarks import before_after
    from benchmarks.systems import tf_systems
    ref = str(tmp_path / "ref.npz")
    tf_systems.run_reference({"model": "mlp", "batch_size": 4, "ref_path": ref})
    cfgs = [dict(suite="harness", model="mlp", batch_size=4, task="norms",
                 system="custagg_auto", framework="tf", ref_path=ref),
            dict(suite="zoo", model="mnist_softmax", batch_size=4, framework="tf")]
    samples = []
    for cfg in cfgs:
        cfg.update(repeats=1, budget_s=0.0, threads=1)
        runs = [before_after.execute(cfg) for _ in range(2)]
        for r in runs:
            assert r["status"] == "ok", r
            assert r["custagg_file"].startswith(os.path.join(REPO, "custagg")), r
        for tree, order in (("before", runs), ("after", runs[::-1])):
            samples += [{"key": before_after.cfg_key(cfg), "tree": tree, "round": i,
                         "result": r} for i, r in enumerate(order)]
    cells = before_after.summarise(samples)
    assert [(c["key"], c["measure"]) for c in cells] == [
        ("harness/mlp/B4/norms", "norms"), ("zoo/mnist_softmax/B4", "norms"),
        ("zoo/mnist_softmax/B4", "clip")]
    for c in cells:
        assert c["after_over_before"] == pytest.approx(1.0), c
        assert c["changed"] is False and c["peak_changed"] is False, c
        assert c["before"]["ratios"] and min(c["before"]["ratios"]) > 0
        assert c["before"]["peak_ratio"] > 0
        assert c["forms"]["before"] == c["forms"]["after"], c
        assert set(c["forms"]["after"]) == {"rules"}, c
    assert cells[0]["checks"] == {"before": ["pass"], "after": ["pass"]}
    assert cells[0]["forms"]["after"] == {"rules": 6}        # MLP 784-256-256-10
    meta = {"rounds": 2, "before": {"dir": REPO, "commit": "x"},
            "after": {"dir": REPO, "commit": "x"}, "command": "cmd", "cpu": "cpu",
            "cores": 2, "loadavg_start": (1.0, 1.0, 1.0)}
    before_after.write(str(tmp_path), meta, samples)
    assert meta["zoo_norms_rel_err_after_vs_before"]["zoo/mnist_softmax/B4"] < 1e-6
    text = (tmp_path / "before_after.md").read_text()
    assert "| zoo | mnist_softmax | 4 | clip |" in text and "**changed**" not in text
    with open(str(tmp_path / "before_after.json")) as f:
        assert len(json.load(f)["samples"]) == 8


def test_before_after_changed_needs_more_than_the_spread():
    from benchmarks import before_after
    tol = before_after.TIME_TOLERANCE
    assert before_after._changed([1.0, 1.1, 1.05], [1.5, 1.6, 1.55], tol) is True
    # Medians 0.1 apart, but one tree's rounds range over 0.3: noise.
    assert before_after._changed([1.0, 1.3, 1.1], [1.2, 1.2, 1.25], tol) is False
    # Beyond the ranges, but within the relative floor.
    assert before_after._changed([1.0, 1.0], [1.03, 1.03], tol) is False
    assert before_after._changed([1.0], [2.0], tol) is None     # one round: no spread


def test_before_after_plan_and_arguments(capsys):
    from benchmarks import before_after, zoo, zoo_models
    args = before_after.parse_args([REPO])
    cfgs = before_after.plan(args)
    harness = [c for c in cfgs if c["suite"] == "harness"]
    assert len(harness) == 3 * 2 * 3 and {c["system"] for c in harness} == {"custagg_auto"}
    assert sorted({c["batch_size"] for c in harness if c["model"] == "lstm"}) == [32, 64]
    others = [m for m in before_after.OTHERS_DEFAULT if m in zoo.builders()]
    assert "unet" in others and "official_resnet_cifar" in zoo_models.ZOO
    assert len(cfgs) - len(harness) == 2 * (len(zoo_models.ZOO) + len(others)) - len(
        before_after.ZOO_SKIP)
    with pytest.raises(SystemExit):
        before_after.parse_args([str(REPO) + "/docs"])
    assert "holds no custagg/__init__.py" in capsys.readouterr().err
