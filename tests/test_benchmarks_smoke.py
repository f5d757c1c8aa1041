"""Smoke test of the comparison benchmark (`python -m benchmarks`).

Tiny and fast on purpose: one model, B=8, one repetition, a few TF systems,
no peers. It checks that the harness runs end to end and writes its outputs in
the documented format, and that the systems it ran agree with the reference.
No timing assertions, ever: timings are not what this test is about.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"model", "batch_size", "task", "system", "status", "note", "build_s", "n_ops",
        "first_run_ms", "median_ms", "peak_rss_mb", "floor_ms", "ratio_to_floor",
        "peak_mb", "floor_peak_mb", "peak_ratio", "check"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # custagg is always in the run: a broken import must fail here, not
    # quietly leave it out.
    systems = ["tf_vmap", "tf_grad_ys", "custagg_auto"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    # The repository root first: opacus (an optional peer) installs an
    # unrelated top-level `benchmarks` package into site-packages.
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks", "--models", "mlp", "--batch-sizes", "8",
           "--tasks", "grads,norms,clip,dpsgd,custom", "--systems", ",".join(systems),
           "--repeats", "1", "--budget", "0", "--timeout", "120", "--out", str(out),
           "--no-plot"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(str(out), "results.json")) as f:
        records = json.load(f)
    return out, proc.stdout, records, systems


def test_writes_records_in_the_documented_format(smoke_run):
    out, stdout, records, systems = smoke_run
    assert isinstance(records, list) and records
    for rec in records:
        assert KEYS <= set(rec), sorted(KEYS - set(rec))
        assert rec["status"] in ("ok", "skipped", "failed", "timeout")
    assert {r["system"] for r in records} == set(systems)
    assert os.path.exists(os.path.join(str(out), "results.md"))
    assert os.path.exists(os.path.join(str(out), "machine.json"))
    # One progress line per configuration.
    assert sum(1 for line in stdout.splitlines() if line.startswith("[")) == len(records)


def test_systems_run_and_agree_with_the_reference(smoke_run):
    _, _, records, _ = smoke_run
    for rec in records:
        assert rec["status"] == "ok", rec
        assert rec["check"] == "pass", rec
        assert rec["median_ms"] > 0 and rec["floor_ms"] > 0
        assert rec["ratio_to_floor"] == pytest.approx(rec["median_ms"] / rec["floor_ms"])
        # Peak memory of one traced step of each (benchmarks/memory.py): the
        # floor at least holds its gradients (MLP 784-256-256-10 at B=8:
        # 269,322 float32 parameters).
        assert rec["floor_peak_mb"] >= 269322 * 4 / 1e6, rec
        assert rec["peak_mb"] > 0, rec
        assert rec["peak_ratio"] == pytest.approx(rec["peak_mb"] / rec["floor_peak_mb"], rel=1e-3)
        if rec["task"] == "grads":
            # Materialized per-example gradients: the first layer's
            # [B, 784, 256] floats at least.
            assert rec["peak_mb"] >= 8 * 784 * 256 * 4 / 1e6, rec


def test_report_tables_from_records(tmp_path):
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="mlp", batch_size=8, task="norms", system="tf_vmap", status="ok",
               note="", median_ms=2.0, floor_ms=1.0, ratio_to_floor=2.0, check="pass",
               framework="tf")
    skipped = dict(rec, system="tf_loop", status="skipped", note="skipped (too slow: est 99 s)",
                   median_ms=None, ratio_to_floor=None, check="n/a")
    path = str(tmp_path / "r.md")
    report.write_markdown(path, [rec, skipped], {"cpu": "x", "cores": 2, "tolerance": 1e-3})
    text = open(path).read()
    # The ratio and the two times it is the quotient of, from one record.
    assert "| 2.0x (2 / 1) |" in text and "skipped (too slow" in text
    assert "floor ms |" not in text.split("## All records")[0]


def test_report_memory_tables(tmp_path):
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="mlp", batch_size=8, task="clip", system="custagg_auto", status="ok",
               note="", median_ms=2.0, floor_ms=1.0, ratio_to_floor=2.0, check="pass",
               framework="tf", peak_mb=3.0, floor_peak_mb=2.0, peak_ratio=1.5)
    old = dict(rec, system="tf_vmap", peak_mb=None, floor_peak_mb=None, peak_ratio=None)
    path = str(tmp_path / "r.md")
    report.write_markdown(path, [rec, old], {"cpu": "x", "cores": 2, "tolerance": 1e-3})
    text = open(path).read()
    mem = text.split("## Peak memory, ")[1].split("## Check failures")[0]
    assert "| 1.50x (3 / 2) |" in mem
    assert "tf_vmap" not in mem          # a record without a memory figure: no column
    # Records from before the memory figure: no memory tables at all.
    report.write_markdown(path, [old], {"cpu": "x", "cores": 2, "tolerance": 1e-3})
    assert "Peak memory" not in open(path).read()


def test_readme_tables_are_rewritten_between_the_markers(tmp_path):
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="cnn", batch_size=32, task="clip", system="custagg_rules", status="ok",
               note="", median_ms=3.0, floor_ms=2.0, ratio_to_floor=1.5, check="pass",
               framework="tf")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n%s\nstale table\n%s\noutro\n"
                      % (report.README_START, report.README_END))
    report.update_readme(str(readme), [rec], {"cpu": "x", "cores": 2, "wall_s": 1.0})
    text = readme.read_text()
    assert "stale table" not in text
    assert text.startswith("intro\n") and text.endswith("outro\n")
    assert "| cnn | 32 | 1.5x (3 / 2) |" in text
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="no benchmark block"):
        report.update_readme(str(readme), [rec], {})


def test_each_system_has_one_style_everywhere():
    from benchmarks import report
    from benchmarks.systems import SYSTEMS
    styles = [tuple(sorted(report.system_style(s).items())) for s in SYSTEMS]
    assert len(set(styles)) == len(styles)          # no two systems alike
    colors = [report.system_style(s)["color"] for s in SYSTEMS]
    assert len(set(colors)) == len(colors)
    assert report.system_style("not_a_system") == report.system_style("not_a_system")


def test_plot_draws_measured_systems_only(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="mlp", task="norms", status="ok", note="", check="pass",
               framework="tf", floor_ms=1.0)
    recs = [dict(rec, system=s, batch_size=b, median_ms=r * b, ratio_to_floor=r * b)
            for s, r in (("custagg_rules", 0.1), ("tf_vmap", 1.0)) for b in (8, 32)]
    recs.append(dict(rec, system="tf_loop", batch_size=32, status="skipped",
                     median_ms=None, ratio_to_floor=None))
    import matplotlib.pyplot as plt
    seen = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, *a, **k):
        seen["labels"] = [t.get_text() for t in fig.legends[0].get_texts()]
        seen["colors"] = {l.get_label(): l.get_color()
                          for ax in fig.axes for l in ax.get_lines()}
        return real_savefig(fig, *a, **k)

    plt.Figure.savefig = capture
    try:
        report.write_plot(str(tmp_path / "r.png"), recs)
    finally:
        plt.Figure.savefig = real_savefig
    assert seen["labels"] == ["custagg_rules", "tf_vmap"]
    assert seen["colors"]["tf_vmap"] == report.system_style("tf_vmap")["color"]
    assert (tmp_path / "r.png").stat().st_size > 0


def test_skip_estimate_for_quadratic_systems():
    from benchmarks import run
    args = run.parse_args(["--slow-limit", "30"])
    prev = {"model": "mlp", "batch_size": 128, "task": "grads", "system": "tf_loop",
            "status": "ok", "build_s": 6.0, "first_run_ms": 250.0, "median_ms": 250.0}
    cfg = {"model": "mlp", "batch_size": 512, "task": "grads", "system": "tf_loop"}
    note = run.predict_skip(cfg, [prev], args)
    assert note and note.startswith("skipped (too slow: est")
    # A timeout at a smaller B skips the larger ones, and (for systems that
    # materialize per-example gradients) the other tasks at that B too.
    timed_out = dict(prev, status="timeout", system="tf_vmap")
    cfg2 = dict(cfg, system="tf_vmap", task="norms", batch_size=128)
    assert "timed out" in run.predict_skip(cfg2, [timed_out], args)
    # Linear systems are never skipped by the estimate.
    assert run.predict_skip(dict(cfg, system="tf_vmap"), [dict(prev, system="tf_vmap")], args) is None


def test_skip_estimate_for_linear_systems_does_not_scale_the_build():
    # The while-loop LSTM's rows on a loaded machine: a 34 s build and a 17 s
    # first run at B=32 are one-off costs, so B=512 fits a 600 s timeout.
    from benchmarks import run
    args = run.parse_args(["--timeout", "600"])
    prev = {"model": "lstm", "batch_size": 32, "task": "norms", "system": "custagg_auto",
            "status": "ok", "build_s": 34.0, "first_run_ms": 16800.0, "median_ms": 70.0}
    cfg = {"model": "lstm", "batch_size": 512, "task": "norms", "system": "custagg_auto"}
    assert run.predict_skip(cfg, [prev], args) is None
    # Runs still scale with B: 10 s per run at B=32 is 160 s per run at B=512.
    slow = dict(prev, median_ms=10000.0, first_run_ms=20000.0)
    assert run.predict_skip(cfg, [slow], args).startswith("skipped (too slow: est")


def test_control_flow_preset():
    from benchmarks import run
    args = run.parse_args(["--control-flow", "--batch-sizes", "32"])
    assert args.models == ["lstm", "gru", "keras_lstm", "keras_gru", "norule_rnn"]
    assert args.batch_sizes == [32]
    assert args.tasks == ["norms", "clip", "dpsgd"]
    assert args.systems == ["custagg_auto", "tf_vmap", "jax_vmap", "torch_func"]
    assert args.out.endswith(os.path.join("results", "control_flow"))
    assert run.parse_args(["--control-flow"]).batch_sizes == [32, 128, 512]
    # The default full run keeps its models; the issue-11 ones are the preset's.
    assert "norule_rnn" not in run.parse_args([]).models
    assert {"lstm", "gru", "mlp"} <= set(run.parse_args([]).models)


def test_tf1_models_benchmark_record_and_page(tmp_path):
    # Issue 24's benchmark (--tf1-models: harness configurations of a
    # builder's model), in this process, on the smallest model: a record with
    # both timings, both peaks and the plan's forms, and its page (a failed
    # model listed with its error). No timing assertion.
    from benchmarks import report
    from benchmarks.systems import tf_systems
    rec = tf_systems.run(dict(model="word2vec", batch_size=4, task="clip", system="custagg_auto",
                              repeats=1, budget_s=0.0, threads=1, plan=True, builder=True))
    assert rec["status"] == "ok" and rec["check"] == "n/a", rec
    assert rec["floor_ms"] > 0 and rec["median_ms"] > 0
    assert rec["ratio_to_floor"] == pytest.approx(rec["median_ms"] / rec["floor_ms"])
    assert rec["floor_peak_mb"] is not None and rec["peak_mb"] > 0
    assert rec["forms"] == {"rules": 3}, rec
    rec = dict(rec, model="word2vec", batch_size=4, task="clip", system="custagg_auto")
    failed = dict(rec, model="in_batch_negatives", status="failed",
                  note="InvalidArgumentError: x")
    path = str(tmp_path / "tf1_models.md")
    report.write_markdown(path, [rec, failed], {"cpu": "x", "cores": 2}, "TF1")
    text = open(path).read()
    assert "| word2vec | 4 | ~%.1fx (" % rec["ratio_to_floor"] in text    # ~: 1 repeat
    assert "| in_batch_negatives | 4 | clip | custagg_auto | failed | " \
        "InvalidArgumentError: x |" in text
    assert "| word2vec | rules 3 | - |" in text


def test_tf1_models_run_the_builders_model_under_a_harness_models_name():
    # The TF1 models' transformer (tf.compat.v1.layers, 20 variables, dynamic
    # B and T) shares its name with the harness's transformer block (17
    # parameters): --tf1-models's configurations say they are a builder's,
    # and the worker builds that one.
    from benchmarks import run
    from benchmarks.systems import tf_systems
    configs = run.plan(run.parse_args(["--tf1-models"]))
    assert configs and all(c["builder"] for c in configs)
    cfg = [c for c in configs if c["model"] == "transformer"][0]
    rec = tf_systems.run(dict(cfg, batch_size=2, repeats=1, budget_s=0.0, threads=1))
    assert rec["status"] == "ok", rec
    assert sum(rec["forms"].values()) == 20, rec["forms"]
    assert "transformer/attention/q/kernel" in rec["plan"]


@pytest.mark.parametrize("argv", [
    ["--profile"], ["--peers", "--plans"], ["--zoo", "--plans"], ["--zoo", "--merge"],
    ["--tf1-models", "--merge"], ["--zoo", "--tf1-models"]])
def test_a_flag_outside_its_mode_is_a_usage_error(argv, capsys):
    from benchmarks import run
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_report_only_rewrites_the_modes_own_page(tmp_path):
    # --peers and --zoo: their pages again from their JSON files, the same
    # tables, and no results.md; a zoo.json of the harness before its modes
    # ({"meta", "rows"}): a message.
    import json
    import shutil
    from benchmarks import run
    results = os.path.join(REPO, "benchmarks", "results")
    for name in ("peers.json", "peers_machine.json", "zoo.json"):
        shutil.copy(os.path.join(results, name), str(tmp_path / name))

    def rows(path):
        return [line for line in open(path) if line.startswith("| ")]

    for mode, page in (("--peers", "peers.md"), ("--zoo", "zoo.md")):
        assert run.main([mode, "--report-only", "--out", str(tmp_path)]) == 0
        got = rows(str(tmp_path / page))
        assert got and got == rows(os.path.join(results, page)), page
    assert not os.path.exists(str(tmp_path / "results.md"))
    with open(str(tmp_path / "zoo.json"), "w") as f:
        json.dump({"meta": {}, "rows": []}, f)
    with pytest.raises(SystemExit, match="run the mode again"):
        run.main(["--zoo", "--report-only", "--out", str(tmp_path)])


def test_input_pipelines_benchmark_rows_and_plans():
    # Issue 23's benchmark (`python -m benchmarks.dp_step input_pipelines`)
    # at the tests' size: every source gives a row with both timings and the
    # same plan as the placeholder (all rules on the MLP). No timing assertion.
    from benchmarks import dp_step
    rows = dp_step.input_pipelines(batch=4, repeats=1, models=("mlp",),
                                   log=lambda *a: None)
    assert [r["source"] for r in rows] == list(dp_step.SOURCES)
    for r in rows:
        assert r["plain_s"] > 0 and r["dp_s"] > 0
        assert r["forms"] == {"rules": 6}, r
    text = dp_step.markdown("input_pipelines", rows)
    assert "| mlp | shuffle_batch_queue | 4 |" in text


def test_dp_step_modes_rows():
    # The other modes of benchmarks.dp_step at the tests' size: one row per
    # step, the base step's ratio 1. No timing assertion.
    from benchmarks import dp_step
    quiet = dict(repeats=1, log=lambda *a: None)
    rows = dp_step.microbatches(configs=[("mlp", 8)], **quiet)
    assert [(r["dynamic"], r["microbatches"]) for r in rows] == [
        (False, 8), (False, 2), (False, 1), (True, 8), (True, 2), (True, 1)]
    rows = dp_step.adaptive_clipping(batch=8, models=("mlp",), **quiet)
    assert [r["query"] for r in rows] == list(dp_step.QUERIES)
    assert rows[0]["ratio_to_fixed"] == 1.0
    assert "| mlp | 8 | adaptive |" in dp_step.markdown("adaptive_clipping", rows)


def test_peers_preset():
    from benchmarks import run
    from benchmarks.systems import SYSTEMS
    args = run.parse_args(["--peers"])
    assert args.models == ["mlp", "cnn", "text", "lstm", "gru", "transformer"]
    assert args.batch_sizes == [32, 128, 512] and args.tasks == ["clip", "dpsgd"]
    assert args.stem == "peers" and run.parse_args([]).stem == "results"
    assert {"custagg_auto", "opacus_ghost", "opacus", "jax_privacy", "tfp_fast"} == set(
        args.systems)
    # Each peer runs in its own framework's worker (its own interpreter).
    assert {SYSTEMS[s].framework for s in args.systems} == {"tf", "torch", "jax", "keras"}
    with pytest.raises(SystemExit):
        run.parse_args(["--peers", "--quick"])


def test_peers_run_writes_its_table(tmp_path):
    """`--peers` end to end with custagg alone (the peers' interpreters are
    not in the test environment): peers.json and peers.md, whose cells are
    the time and memory ratios of the records beside them."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--peers", "--models", "mlp", "--batch-sizes",
         "8", "--systems", "custagg_auto", "--repeats", "1", "--budget", "0", "--out",
         str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(str(tmp_path / "peers.json")) as f:
        records = json.load(f)
    assert [(r["task"], r["status"], r["check"]) for r in records] == [
        ("clip", "ok", "pass"), ("dpsgd", "ok", "pass")]
    text = (tmp_path / "peers.md").read_text()
    for r in records:
        assert "| mlp | 8 | %.2fx / %.2fx |" % (r["ratio_to_floor"], r["peak_ratio"]) in text
    assert not (tmp_path / "results.json").exists()


def test_peers_table_lists_each_failure_with_its_error(tmp_path):
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="mlp", batch_size=32, task="clip", system="custagg_auto", status="ok",
               note="", ratio_to_floor=1.2, peak_ratio=0.95, check="pass")
    bad = dict(rec, model="cnn", system="tfp_fast", status="failed", ratio_to_floor=None,
               note="NotImplementedError: Layer Conv2D is not in the registry")
    report.write_peers(str(tmp_path / "p.md"), [rec, dict(bad, task="dpsgd"), bad],
                       {"command": "x", "versions": {"keras": {"tensorflow": "2.15.1"}}})
    text = (tmp_path / "p.md").read_text()
    assert "| mlp | 32 | 1.20x / 0.95x |  |" in text
    assert "| cnn | 32 |  | fails |" in text
    assert ("- `tfp_fast` on cnn B=32 dpsgd, cnn B=32 clip: NotImplementedError: Layer "
            "Conv2D is not in the registry") in text
    assert "keras: tensorflow 2.15.1" in text


def test_run_all_lists_every_benchmark_with_an_existing_entry_point():
    from benchmarks import run_all
    todo = run_all.benchmarks(peers="/p/python", tfp="/t/python")
    names = [t[0] for t in todo]
    assert len(names) == len(set(names))
    assert {"harness", "control_flow", "peers", "zoo", "tf1_models",
            "tf_privacy_compare"} <= set(names)
    for name, argv, alone, outputs in todo:
        if argv[1] == "-m":
            parts = argv[2].split(".")
            path = os.path.join(REPO, *parts)
            assert (os.path.exists(path + ".py")
                    or os.path.exists(os.path.join(path, "__main__.py"))), name
        else:
            assert os.path.exists(os.path.join(REPO, argv[1])), name
        assert outputs, name
    harness = dict((t[0], t) for t in todo)["harness"]
    assert "jax=/p/python-jax/bin/python" in harness[1] and harness[2]
    peers = dict((t[0], t) for t in todo)["peers"]
    assert "--peers" in peers[1] and "keras=/t/python" in peers[1]
    assert "peers" not in [t[0] for t in run_all.benchmarks()]
    # Without a TF 2.15 interpreter TF Privacy's comparison is left out.
    assert "tf_privacy_compare" not in [t[0] for t in run_all.benchmarks()]


def test_run_all_records_each_run_and_fails_when_one_fails(tmp_path, monkeypatch):
    from benchmarks import run_all
    monkeypatch.setattr(run_all, "RESULTS", str(tmp_path))
    write = "open(%r, 'w').write('x')" % str(tmp_path / "a.md")

    def fake(peers=None, tfp=None):
        return [("writes", [sys.executable, "-c", write], True, ["a.md"]),
                ("fails", [sys.executable, "-c", "raise SystemExit(3)"],
                 False, ["b.md"]),
                ("passes", [sys.executable, "-c", "pass"], False, ["c.md"])]
    monkeypatch.setattr(run_all, "benchmarks", fake)
    assert run_all.main(["--jobs", "2"]) == 1
    with open(str(tmp_path / "run_all.json")) as f:
        runs = {r["name"]: r for r in json.load(f)["runs"]}
    assert runs["writes"]["exit"] == 0 and runs["writes"]["outputs"] == ["a.md"]
    assert runs["fails"]["exit"] == 3 and runs["fails"]["outputs"] == []
    md = (tmp_path / "run_all.md").read_text()
    assert "| writes |" in md and "| fails |" in md and "a.md" in md
    assert run_all.main(["--only", "passes"]) == 0
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nope"])


def test_memory_plot_draws_peak_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import report
    rec = {k: None for k in KEYS}
    rec.update(model="mlp", task="clip", status="ok", note="", check="pass",
               framework="tf", floor_ms=1.0, median_ms=1.0, ratio_to_floor=1.0)
    # custagg's peak ratio stays flat, tf_vmap's grows with B; tf_loop has
    # a time but no peak and must not be drawn.
    recs = [dict(rec, system=s, batch_size=b, peak_ratio=p(b))
            for s, p in (("custagg_auto", lambda b: 0.9),
                         ("tf_vmap", lambda b: 4.0 * b)) for b in (8, 32)]
    recs.append(dict(rec, system="tf_loop", batch_size=8, peak_ratio=None))
    import matplotlib.pyplot as plt
    seen = {}
    real_savefig = plt.Figure.savefig

    def capture(fig, *a, **k):
        seen["title"] = fig._suptitle.get_text()
        seen["lines"] = {l.get_label(): list(l.get_ydata())
                         for ax in fig.axes for l in ax.get_lines()
                         if not l.get_label().startswith("_")}
        seen["ylabel"] = fig.axes[0].get_ylabel()
        return real_savefig(fig, *a, **k)

    plt.Figure.savefig = capture
    try:
        report.write_plot(str(tmp_path / "m.png"), recs, metric="memory")
    finally:
        plt.Figure.savefig = real_savefig
    assert seen["title"].startswith("Peak memory")
    assert "peak memory" in seen["ylabel"]
    assert seen["lines"]["custagg_auto"] == [0.9, 0.9]
    assert seen["lines"]["tf_vmap"] == [32.0, 128.0]
    assert "tf_loop" not in seen["lines"]


def test_run_all_merge_replaces_only_the_rerun(tmp_path, monkeypatch):
    from benchmarks import run_all
    monkeypatch.setattr(run_all, "RESULTS", str(tmp_path))

    def fake(peers=None, tfp=None):
        return [("a", [sys.executable, "-c", "pass"], False, []),
                ("b", [sys.executable, "-c", "raise SystemExit(2)"], False,
                 [])]
    monkeypatch.setattr(run_all, "benchmarks", fake)
    assert run_all.main([]) == 1
    monkeypatch.setattr(run_all, "benchmarks", lambda peers=None, tfp=None: [
        ("b", [sys.executable, "-c", "pass"], False, [])])
    assert run_all.main(["--only", "b", "--merge"]) == 0
    with open(str(tmp_path / "run_all.json")) as f:
        data = json.load(f)
    runs = {r["name"]: r for r in data["runs"]}
    assert runs["a"]["exit"] == 0 and "rerun" not in runs["a"]
    assert runs["b"]["exit"] == 0 and runs["b"]["rerun"]
    assert len(data["meta"]["reruns"]) == 1
    assert "Re-run:" in (tmp_path / "run_all.md").read_text()

