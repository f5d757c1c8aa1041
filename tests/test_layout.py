"""The package's shape: the library never imports the application
(`custagg.app`), and importing the application's CLI needs no TensorFlow."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "custagg")
# Old import paths of application modules, kept for their callers: each only
# re-exports custagg.app.<name>.
ALIASES = {"cli.py", "datasets.py", "__main__.py"}


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
    assert {"gradients.py", "per_example.py", "__init__.py",
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


@pytest.mark.parametrize("name", sorted(ALIASES - {"__main__.py"}))
def test_aliases_only_re_export(name):
    with open(os.path.join(PACKAGE, name)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        assert node.module.startswith("custagg.app."), node.module
