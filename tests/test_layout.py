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
              and node.value.startswith("custagg.app")):
            yield node.value  # importlib.import_module("custagg.app...")


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
