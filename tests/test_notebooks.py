"""Every notebook in notebooks/ runs top to bottom (small settings), and is
stored without outputs, except those in STORED_EXECUTED (stored executed
with the full settings)."""

import glob
import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
NAMES = [os.path.basename(p) for p in NOTEBOOKS]


def execute(path, timeout=600):
    """Runs the notebook in a fresh kernel; an error in any cell raises."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}
                   ).execute()
    return nb


def text_of(nb):
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", ""))
            data = o.get("data", {})
            out.append(data.get("text/markdown", ""))
            out.append(data.get("text/plain", ""))
    return "\n".join(out)


@pytest.fixture(autouse=True)
def small_env(tmp_path, monkeypatch):
    monkeypatch.setenv("CUSTAGG_NB_SMALL", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    # The same data everywhere: no MNIST from a Keras cache.
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.delenv("CUSTAGG_NB_RUN_QUICK_BENCH", raising=False)


def test_all_notebooks_listed():
    assert NAMES == ["01_per_example_gradients.ipynb", "02_dp_sgd_mnist.ipynb",
                     "03_benchmarks.ipynb"]


# Stored executed (full settings), so readers see the figures without running
# them: notebook 02's accuracy-against-epsilon plot.
STORED_EXECUTED = {"02_dp_sgd_mnist.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    if os.path.basename(path) in STORED_EXECUTED:
        return
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                "%s holds outputs; clear them before committing" % path)


@pytest.mark.parametrize("name", sorted(STORED_EXECUTED))
def test_stored_executed_in_full(name):
    """Every code cell ran, in order, with the full settings (not the
    test's small ones), and none failed."""
    nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(
        range(1, len(code) + 1)), name
    for c in code:
        assert not any(o.get("output_type") == "error" for o in c.outputs)
    text = text_of(nb)
    if name == "02_dp_sgd_mnist.ipynb":
        assert "600 steps of batch 64" in text
        assert "at epsilon" in text
        assert "adaptive clipping: clip 1.000 -> " in text     # and its plot
        assert "Epsilon assuming Poisson sampling" in text
        eps_cell = [c for c in code if "compute_dp_sgd_privacy" in c.source]
        assert eps_cell and any("image/png" in o.get("data", {})
                                for o in eps_cell[0].outputs)


def test_per_example_gradients_notebook():
    nb = execute(NOTEBOOKS[0])
    text = text_of(nb)
    assert "scikit-learn digits" in text
    assert "all three agree" in text
    assert "MatMul" in text


def test_dp_sgd_notebook():
    nb = execute(NOTEBOOKS[1])
    text = text_of(nb)
    assert "DP-SGD" in text and "final test accuracy" in text
    assert "largest norm after clipping" in text
    images = sum("image/png" in o.get("data", {}) for c in nb.cells
                 for o in c.get("outputs", []))
    assert images >= 2


def test_benchmarks_notebook_without_results(tmp_path, monkeypatch):
    monkeypatch.setenv("CUSTAGG_BENCH_RESULTS", str(tmp_path / "none.json"))
    text = text_of(execute(NOTEBOOKS[2]))
    assert "No benchmark results to show" in text
    assert "nothing measured to plot" in text


def test_benchmarks_notebook_with_results(tmp_path, monkeypatch):
    records = []
    for model in ("softmax", "cnn"):
        for bsz in (32, 128):
            for system, ms in (("custagg", 2.0), ("tf_loop", 50.0)):
                records.append(dict(model=model, batch_size=bsz,
                                    task="clipped_sum", system=system,
                                    median_ms=ms * bsz / 32,
                                    ratio_to_floor=ms / 1.5, status="ok",
                                    note="", floor_ms=1.5))
    records.append(dict(model="cnn", batch_size=128, task="norms",
                        system="tf_jacobian", median_ms=None,
                        ratio_to_floor=None, status="timeout",
                        note="killed after the 60 s timeout"))
    records.append({"model": "broken"})
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    monkeypatch.setenv("CUSTAGG_BENCH_RESULTS", str(path))
    nb = execute(NOTEBOOKS[2])
    text = text_of(nb)
    assert "9 records: 8 measured, 1 not measured, 1 malformed" in text
    assert "| custagg | 2 ms (1.3x) | 8 ms (1.3x) |" in text
    assert "timeout" in text
    images = sum("image/png" in o.get("data", {}) for c in nb.cells
                 for o in c.get("outputs", []))
    assert images >= 1
