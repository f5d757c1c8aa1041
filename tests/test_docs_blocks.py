"""Every Python code block in README.md and docs/*.md runs as written.

Each block runs alone in a fresh interpreter (its own imports, its own
graph), from an empty directory. A block that is deliberately partial is
preceded by a visible line `*Not run on its own: reason.*` (rendered in
italics, so a reader sees the block is partial) and is only compiled.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "*.md")))
_FENCE = re.compile(r"^```(\w*)[ \t]*$")
_NOT_RUN = re.compile(r"^\*Not run on its own: (.+?)\.?\*\s*$")
# The old marker, an HTML comment, is invisible when rendered.
_HIDDEN_NOT_RUN = re.compile(r"<!--\s*not-run", re.I)


def python_blocks(text):
    """`(first line number, code, not-run reason or None)` per ```python block."""
    blocks, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, start = m.group(1).lower(), i + 1
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang in ("python", "py"):
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = _NOT_RUN.match(lines[k]) if k >= 0 else None
            blocks.append((start + 1, "\n".join(lines[start:j]) + "\n",
                           marker.group(1) if marker else None))
        i = j + 1
    return blocks


def _cases():
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            for line, code, reason in python_blocks(f.read()):
                yield pytest.param(path, line, code, reason,
                                   id="%s:%d" % (os.path.relpath(path, ROOT),
                                                 line))


CASES = list(_cases())


def test_blocks_are_found():
    files = {os.path.basename(c.values[0]) for c in CASES}
    assert "README.md" in files
    assert sum(os.path.basename(c.values[0]) == "README.md"
               for c in CASES) >= 2


def test_block_parser():
    text = ("intro\n```python\nprint(1)\n```\n\n*Not run on its own: needs "
            "data.*\n```python\nload()\n```\n```bash\nls\n```\n```\nplain\n"
            "```\n")
    assert python_blocks(text) == [(3, "print(1)\n", None),
                                   (8, "load()\n", "needs data")]


@pytest.mark.parametrize("path, line, code, reason", CASES)
def test_block_runs(tmp_path, path, line, code, reason):
    where = "%s:%d" % (os.path.relpath(path, ROOT), line)
    compile(code, where, "exec")
    if reason is not None:
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MPLBACKEND="Agg",
               KERAS_HOME=str(tmp_path / "keras"))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, "%s failed:\n%s%s" % (
        where, proc.stdout[-3000:], proc.stderr[-3000:])


_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    with open(path, encoding="utf-8") as f:
        targets = _LINK.findall(f.read())
    missing = [t for t in targets if "://" not in t and not os.path.exists(
        os.path.join(os.path.dirname(path), t))]
    assert not missing, "%s links to missing files: %s" % (path, missing)


def test_readme_is_short_and_its_commands_are_the_ci_ones():
    readme = os.path.join(ROOT, "README.md")
    assert os.path.getsize(readme) <= 10 * 1024
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    first = text[text.index("```bash\n") + 8:]
    commands = [l.split("#")[0].strip() for l in
                first[:first.index("```")].strip().split("\n")]
    assert len(commands) == 2 and "python -m custagg" in commands[0]
    # .ci/run runs the same line, just after the comment that says so.
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().split("\n")
    marker = [i for i, l in enumerate(ci) if "keep the two identical" in l]
    assert marker, ".ci/run no longer marks the README's test command"
    assert commands[1] == ci[marker[0] + 1].strip()


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_partial_blocks_say_so_visibly(path):
    """An HTML comment is invisible when rendered: a partial block must be
    marked by the visible `*Not run on its own: ...*` line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert not _HIDDEN_NOT_RUN.search(text), (
        "%s marks a partial block with an HTML comment; write the visible "
        "line `*Not run on its own: reason.*` instead" % path)


_RATIO_ROW = re.compile(r"^\|.*\|\s*[^|]*\b\d+(?:\.\d+)?x\b")
_RESULTS_LINK = re.compile(r"\]\(((?:\.\./)?benchmarks/results/[^)]+)\)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_pages_with_measured_tables_cite_a_results_file(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not any(_RATIO_ROW.match(l) for l in text.split("\n")):
        return
    cited = [t for t in _RESULTS_LINK.findall(text) if os.path.exists(
        os.path.normpath(os.path.join(os.path.dirname(path), t)))]
    assert cited, ("%s has a table of measured ratios but links no "
                   "benchmarks/results/ file" % path)


def _step_table(text):
    """{(model, B, M): (tfp s, custagg s, ratio)} of a seconds-per-step table."""
    rows = {}
    for line in text.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not (cells[1].isdigit() and cells[2].isdigit()):
            continue
        try:
            values = (float(cells[3]), float(cells[4]),
                      float(cells[5].rstrip("x")))
        except ValueError:  # "-": TF Privacy was not run there
            continue
        model = "mlp" if cells[0].lower().startswith("mlp") else "cnn"
        rows[(model, int(cells[1]), int(cells[2]))] = values
    return rows


def test_tf_privacy_timings_agree_with_their_results_file():
    """docs/optimizers.md and docs/privacy.md quote the seconds per step of
    benchmarks/results/tf_privacy_compare.md (rounded, never other runs)."""
    results = _read("benchmarks/results/tf_privacy_compare.md")
    source = _step_table(results[results.index("## Seconds per DP-SGD"):])
    assert len(source) >= 8
    for page in ("docs/optimizers.md", "docs/privacy.md"):
        quoted = _step_table(_read(page))
        assert quoted, page
        for key, (tfp, ours, ratio) in quoted.items():
            want = source[key]
            assert abs(tfp - want[0]) <= 0.01 * want[0] + 1e-4, (page, key)
            assert abs(ours - want[1]) <= 0.01 * want[1] + 1e-4, (page, key)
            assert abs(ratio - want[0] / want[1]) <= 0.1 * ratio, (page, key)


def test_install_page_says_which_notebooks_are_stored_executed():
    import json
    executed = set()
    for nb in glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")):
        with open(nb, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        if any(c.get("outputs") for c in cells if c["cell_type"] == "code"):
            executed.add(os.path.basename(nb)[:2])
    text = " ".join(_read("docs/install.md").split())
    said = re.search(r"((?:\d\d(?:, | and )?)+) (?:is|are) stored executed",
                     text)
    assert said, "docs/install.md does not say which notebooks carry outputs"
    assert set(re.findall(r"\d\d", said.group(1))) == executed


def test_main_job_sample_shows_the_total_the_cli_prints():
    sample = _read("docs/main-job.md")
    assert re.search(r"^total [\d.]+ s \(TensorFlow import and data [\d.]+ s; "
                     r"graph, training and check [\d.]+ s\)$", sample, re.M)


def test_readme_first_screen_says_what_custagg_does():
    """The README's first screen says what custagg does and shows the two
    commands; how long they take and how Keras 2 layers work on TF >= 2.16
    are on docs/install.md, which the first screen links."""
    readme = _read("README.md")
    first = readme[:readme.index("## Why")]
    assert len(first.split("\n")) <= 45
    flat = " ".join(first.split())
    for said in ("per-example gradients", "clipped sums", "DP-SGD",
                 "custagg.gradients", "custagg.privacy",
                 "python -m custagg", "python -m pytest -q -n 2",
                 "docs/install.md"):
        assert said in flat, said
    assert not re.search(r"\d+ min\b", flat)   # times are on docs/install.md
    install = " ".join(_read("docs/install.md").split())
    assert "TF_USE_LEGACY_KERAS=1" in install and "tf-keras" in install
    assert "tf.compat.v1.layers" in install
    assert re.search(r"default suite.*?: about \d+ min", install)
    assert "-m slow" in install
    # The slow set is run by CI right after the README's command.
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert re.search(r"^(\w+=\S+ )*python -m pytest -q -n 2 -m slow$", ci,
                     re.M)


@pytest.mark.parametrize("page, least", [("docs/benchmarks.md", 36), ("README.md", 6)])
def test_peer_tables_are_the_results_files_rows(page, least):
    """The tables of custagg beside the DP peers (between a page's `peers`
    markers) are benchmarks/results/peers.md's rows, verbatim."""
    text = _read(page)
    block = text[text.index("<!-- peers:start -->"):text.index("<!-- peers:end -->")]
    rows = [l for l in block.split("\n") if l.startswith("| ") and "x / " in l]
    assert len(rows) >= least, "%s: the peers table lost its rows" % page
    results = _read("benchmarks/results/peers.md").split("\n")
    for row in rows:
        assert row in results, "%s: not in benchmarks/results/peers.md: %s" % (page, row)
