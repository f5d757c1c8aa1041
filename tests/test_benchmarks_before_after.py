"""`python -m benchmarks --before`: two trees' engines in one run,
interleaved (issue 23; issue 34 runs it on a deep conv net, a bi-RNN with
`sequence_length` and a model with dynamic image sizes). What a worker
child runs for each configuration, the cells and table it writes, its
arguments. No timing assertion: both trees are this tree, so their medians
and plans agree."""
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_before_after_cells_from_both_trees(tmp_path):
    # Both trees = this tree, in this process: what each worker child runs
    # (`worker.execute`), then the cells and table from two rounds per
    # tree. The same engine on both sides: equal medians, nothing
    # "changed", the same plans, and the two trees' per-example norms
    # agree. No timing assertion.
    from benchmarks import report, worker
    from benchmarks.systems import tf_systems
    ref = str(tmp_path / "ref.npz")
    tf_systems.run_reference({"model": "mlp", "batch_size": 4, "ref_path": ref})
    cfgs = [dict(model="mlp", task="norms", ref_path=ref),
            dict(model="mnist_softmax", task="norms", builder=True),
            dict(model="mnist_softmax", task="clip", builder=True)]
    records = []
    for cfg in cfgs:
        cfg.update(batch_size=4, system="custagg_auto", framework="tf", repeats=1,
                   budget_s=0.0, threads=1, plan=True, tree="after")
        runs = [dict(cfg, **worker.execute(cfg)) for _ in range(2)]
        for r in runs:
            assert r["status"] == "ok", r
            assert r["custagg_file"].startswith(os.path.join(REPO, "custagg")), r
        for tree, order in (("before", runs), ("after", runs[::-1])):
            records += [dict(r, tree=tree, round=i) for i, r in enumerate(order)]
    cells = report.summarise(records)
    assert [(c["key"], c["measure"]) for c in cells] == [
        ("harness/mlp/B4/norms", "norms"), ("zoo/mnist_softmax/B4/norms", "norms"),
        ("zoo/mnist_softmax/B4/clip", "clip")]
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
    report.write_before_after(str(tmp_path), meta, records)
    assert meta["zoo_norms_rel_err_after_vs_before"]["zoo/mnist_softmax/B4/norms"] < 1e-6
    text = (tmp_path / "before_after.md").read_text()
    assert "| zoo | mnist_softmax | 4 | clip |" in text and "**changed**" not in text
    with open(str(tmp_path / "before_after.json")) as f:
        samples = json.load(f)["samples"]
    assert len(samples) == 12 and not any("plan" in s or "norms" in s for s in samples)
    # --report-only re-renders the page from the written samples (no norms
    # kept): the same table, the norms' comparison as measured.
    from benchmarks import run
    first = text
    assert run.main(["--before", REPO, "--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "before_after.md").read_text() == first
    with open(str(tmp_path / "before_after.json")) as f:
        again = json.load(f)["meta"]["zoo_norms_rel_err_after_vs_before"]
    assert again == meta["zoo_norms_rel_err_after_vs_before"]


def test_before_after_changed_needs_more_than_the_spread():
    from benchmarks import report
    tol = report.TIME_TOLERANCE
    assert report.changed([1.0, 1.1, 1.05], [1.5, 1.6, 1.55], tol) is True
    # Medians 0.1 apart, but one tree's rounds range over 0.3: noise.
    assert report.changed([1.0, 1.3, 1.1], [1.2, 1.2, 1.25], tol) is False
    # Beyond the ranges, but within the relative floor.
    assert report.changed([1.0, 1.0], [1.03, 1.03], tol) is False
    assert report.changed([1.0], [2.0], tol) is None     # one round: no spread


def test_before_after_plan_and_arguments(capsys):
    from benchmarks import models, run, zoo_models
    args = run.parse_args(["--before", REPO])
    assert args.mode == "before" and args.jobs == 1 and args.trees["after"] == REPO
    cfgs = run.plan(args)
    BEFORE = run.BEFORE_BATCHES
    first = [c for c in cfgs if c["round"] == 0]
    # Each configuration once per tree and round, the trees' order swapped
    # in odd rounds.
    assert [c["tree"] for c in first[:2]] == ["before", "after"]
    assert [c["tree"] for c in cfgs if c["round"] == 1][:2] == ["after", "before"]
    assert len(cfgs) == 3 * len(first)
    harness = [c for c in first if c["model"] in BEFORE and c["tree"] == "before"]
    assert len(harness) == 3 * 2 * 3 and {c["system"] for c in harness} == {"custagg_auto"}
    assert sorted({c["batch_size"] for c in harness if c["model"] == "lstm"}) == [32, 64]
    others = [m for m in run.BEFORE_OTHERS if m in models.builders()]
    assert "unet" in others and "official_resnet_cifar" in zoo_models.ZOO
    # The zoo's norms and clipped sums (mnist_deep: its DP step too).
    assert len(first) // 2 - len(harness) == 2 * (2 * (len(zoo_models.ZOO) + len(others)) + 1) \
        - 2 * len(run.BEFORE_SKIP)
    with pytest.raises(SystemExit):
        run.parse_args(["--before", str(REPO) + "/docs"])
    assert "holds no custagg/__init__.py" in capsys.readouterr().err
