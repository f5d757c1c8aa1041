"""The package's shape: the library never imports the application
(`custagg.app`), and importing the application's CLI needs no TensorFlow."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "custagg")
# The entry point `python -m custagg`: it only calls custagg.app.cli.
ALIASES = {"__main__.py"}


def _library_files():
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        rel = os.path.relpath(dirpath, PACKAGE)
        if rel == "app" or rel.startswith("app" + os.sep):
            continue
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py") and not (rel == "." and name in ALIASES):
                yield os.path.join(dirpath, name)


def _imported_modules(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            for alias in node.names:
                yield node.module + "." + alias.name
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith(("custagg.app", "benchmarks."))):
            # importlib.import_module("custagg.app..."), and the benchmark
            # worker's ("benchmarks.systems...").
            yield node.value


def test_library_files_are_found():
    names = {os.path.relpath(p, PACKAGE) for p in _library_files()}
    assert {os.path.join("traversal", "gradients.py"),
            os.path.join("per_example", "api.py"),
            "__init__.py",
            os.path.join("rules", "conv.py")} <= names
    assert not any(n.startswith("app") for n in names)


@pytest.mark.parametrize("path", sorted(_library_files()),
                         ids=lambda p: os.path.relpath(p, PACKAGE))
def test_library_does_not_import_the_app(path):
    bad = [m for m in _imported_modules(path)
           if m == "custagg.app" or m.startswith("custagg.app.")]
    assert not bad, "%s imports the application: %s" % (path, bad)


def test_import_scan_sees_app_imports(tmp_path):
    """The scan above would catch each way of importing the app."""
    path = tmp_path / "m.py"
    path.write_text("import custagg.app.cli\n"
                    "from custagg.app import datasets\n"
                    "from custagg import app\n"
                    "importlib.import_module('custagg.app.train')\n")
    found = list(_imported_modules(str(path)))
    assert {"custagg.app.cli", "custagg.app", "custagg.app.train"} <= set(
        found)


def test_old_application_aliases_are_gone():
    """custagg/cli.py and custagg/datasets.py re-exported custagg.app for
    old callers; none is left (the notebook and benchmarks import
    custagg.app), so the library holds no application names."""
    for name in ("cli.py", "datasets.py"):
        assert not os.path.exists(os.path.join(PACKAGE, name)), name


# Issue 35: DP's modules stay small enough to read; a module that grows past
# this is split by job (docs/architecture.md, "Inside `privacy/`").
MAX_LINES = 700


@pytest.mark.parametrize("folder", ["privacy", "training"])
def test_no_dp_or_training_module_over_max_lines(folder):
    long = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(PACKAGE,
                                                             folder)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    n = sum(1 for _ in f)
                if n > MAX_LINES:
                    long.append("%s: %d lines" % (
                        os.path.relpath(path, PACKAGE), n))
    assert not long, "over %d lines: %s" % (MAX_LINES, ", ".join(long))


def test_every_test_left_to_slow_exists():
    """Each `conftest.LEFT_TO_SLOW` entry names collected tests (an entry
    left behind by a renamed test would silently move nothing)."""
    import re
    import subprocess
    import sys
    import conftest
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", ""],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
    ids = [line for line in out.splitlines() if "::" in line]
    assert len(ids) > 1000, out[-2000:]
    missing = [p for p in conftest.LEFT_TO_SLOW
               if not any(re.fullmatch(re.escape(p).replace(r"\*", ".*"), i)
                          for i in ids)]
    assert not missing, missing


def _benchmark_imports():
    """{benchmarks module: the benchmarks modules it imports, lazily too}."""
    names = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT,
                                                             "benchmarks")):
        dirnames[:] = [d for d in dirnames
                       if d not in ("__pycache__", "results")]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                names[mod.replace(".__init__", "")] = path
    return {mod: {m for m in _imported_modules(path)
                  if m in names and m != mod and not mod.startswith(m + ".")}
            for mod, path in names.items()}


def test_benchmarks_import_no_circle_and_results_hold_no_code():
    """Issue 37: benchmarks/ is one harness whose modules import each other
    without a circle (lazy imports included), and benchmarks/results/ holds
    results, no code."""
    graph = _benchmark_imports()
    assert {"benchmarks.run", "benchmarks.models",
            "benchmarks.systems.tf_systems"} <= set(graph)
    done, path = set(), []

    def visit(mod):
        assert mod not in path, "import circle: %s" % " -> ".join(
            path + [mod])
        if mod not in done:
            path.append(mod)
            for dep in graph[mod]:
                visit(dep)
            path.pop()
            done.add(mod)
    for mod in graph:
        visit(mod)
    results = os.path.join(ROOT, "benchmarks", "results")
    code = [os.path.join(d, f) for d, _, files in os.walk(results)
            for f in files if f.endswith(".py")]
    assert not code, code
