"""The package's import discipline (issue 23): no import circle inside
custagg, no module reading another module's private names, and imports
that go one way through the layers of docs/architecture.md -- at any depth,
so a lazy import inside a function (or a module `__getattr__` re-exporting
another layer's names) cannot hide an upward edge.

Private modules (`rules/_reduce.py`) serve their own package only;
`custagg._tf_compat` (TensorFlow's internals behind one module,
docs/tf-releases.md) and `custagg._version` serve every layer.
The scan reads the source (ast): nothing is imported.
"""

import ast
import collections
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_PRIVATE = {"custagg._tf_compat", "custagg._version"}


def _modules(root=os.path.join(ROOT, "custagg")):
    """{dotted module name: path} for every .py file under `root`."""
    found = {}
    base = os.path.dirname(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                if dotted.endswith(".__init__"):
                    dotted = dotted[:-len(".__init__")]
                found[dotted] = path
    return found


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _package(module, modules):
    """The package a module belongs to (itself, for a package)."""
    is_package = modules[module].endswith("__init__.py")
    return module if is_package else module.rpartition(".")[0]


def scan(modules, every_depth=None):
    """(module-level import edges, findings) over `modules`.

    Findings are strings naming a private name read across modules or a
    private module used outside its package. `every_depth`, a
    defaultdict(set), gets the import edges at every depth (imports inside
    functions included).
    """
    edges = collections.defaultdict(set)
    findings = []
    for module, path in sorted(modules.items()):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        aliases = {}
        top_level = set()
        for node in tree.body:
            for sub in ast.walk(node) if isinstance(
                    node, (ast.If, ast.Try)) else [node]:
                top_level.add(id(sub))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "custagg":
                for a in node.names:
                    full = node.module + "." + a.name
                    if full in modules:
                        targets.append(full)
                        aliases[a.asname or a.name] = full
                    else:
                        targets.append(node.module)
                        if _private(a.name):
                            findings.append("%s imports the private name %s"
                                            % (module, full))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "custagg":
                        targets.append(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
            for target in targets:
                if id(node) in top_level and target != module:
                    edges[module].add(target)
                if every_depth is not None and target != module:
                    every_depth[module].add(target)
                last = target.rpartition(".")[2]
                if (_private(last) and target not in SHARED_PRIVATE and
                        target in modules and
                        _package(module, modules) !=
                        target.rpartition(".")[0]):
                    findings.append("%s uses the private module %s of "
                                    "another package" % (module, target))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and
                    isinstance(node.value, ast.Name) and
                    node.value.id in aliases and _private(node.attr) and
                    aliases[node.value.id] in modules):
                findings.append("%s reads the private name %s.%s" % (
                    module, aliases[node.value.id], node.attr))
    return edges, findings


def cycles(edges, modules):
    """The import circles: strongly connected sets of more than one module
    (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in modules:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return found


# The layers, bottom first (docs/architecture.md). A module may import
# modules of its own layer and of the layers below it, never above. Each
# entry is a module or a package prefix; the longest matching prefix names a
# module's layer. No layer is split: `privacy` (all of DP) sits above
# `training` (the non-DP wrappers it builds on); the public paths
# `custagg.optimizers` and `custagg.distributed` re-export both from above.
LAYERS = [
    ("shared", ["custagg._tf_compat", "custagg._version", "custagg.errors",
                "custagg.sparse", "custagg.op_kinds"]),
    ("graph", ["custagg.graph"]),
    ("traversal", ["custagg.traversal"]),
    ("batch_axis", ["custagg.batch_axis"]),
    ("rules", ["custagg.rules"]),
    ("per_example", ["custagg.per_example"]),
    ("training", ["custagg.training"]),
    ("privacy", ["custagg.privacy"]),
    ("public paths", ["custagg.optimizers", "custagg.distributed"]),
    ("tools", ["custagg.install", "custagg.testing"]),
    ("public API", ["custagg"]),
    ("application", ["custagg.app", "custagg.__main__"]),
]


def layer_of(module):
    """(index in LAYERS, name) of the layer `module` belongs to."""
    best = None
    for index, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "custagg" is the package's own __init__ only: a new
            # top-level module must be placed in a layer here.
            if module == prefix or (prefix != "custagg" and
                                    module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index, name)
    assert best is not None, "%s is in no layer of LAYERS" % module
    return best[1], best[2]


def all_imports(modules):
    """{module: {imported custagg module}} at every depth (function bodies
    included), resolved to modules of `modules`."""
    found = collections.defaultdict(set)
    scan(modules, every_depth=found)
    return found


def upward_imports(modules):
    """Findings: each import of a module in a higher layer, at any depth."""
    findings = []
    for module, targets in sorted(all_imports(modules).items()):
        here, here_name = layer_of(module)
        for target in sorted(targets):
            there, there_name = layer_of(target)
            if there > here:
                findings.append("%s (layer %s) imports %s (layer %s, above)"
                                % (module, here_name, target, there_name))
    return findings


def _imports_inside(fn):
    """Whether the function `fn` (an AST node) imports anything itself."""
    for node in ast.walk(fn):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return True
        name = (node.id if isinstance(node, ast.Name) else
                node.attr if isinstance(node, ast.Attribute) else None)
        if name in ("import_module", "__import__"):
            return True
    return False


def module_getattr_hooks(modules):
    """Modules other than the package's own __init__ defining a module-level
    `__getattr__` that imports: a lazy re-export hides an import edge from
    any scan. (A hook that only returns what its module imported at the top,
    e.g. custagg.optimizers' warning earlier names, hides none.)"""
    found = []
    for module, path in sorted(modules.items()):
        if module == "custagg":
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        if any(isinstance(node, ast.FunctionDef) and
               node.name == "__getattr__" and _imports_inside(node)
               for node in tree.body):
            found.append(module)
    return found


def test_imports_go_one_way_through_the_layers():
    findings = upward_imports(_modules())
    assert not findings, "\n".join(findings)


def test_no_module_getattr_outside_the_package_init():
    assert module_getattr_hooks(_modules()) == []


def test_the_layer_scan_finds_a_lazy_upward_import(tmp_path):
    """A planted low-layer module re-exporting a higher layer's class lazily
    (a module `__getattr__` importing inside its body) is caught twice."""
    pkg = tmp_path / "custagg"
    (pkg / "graph").mkdir(parents=True)
    (pkg / "privacy").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "graph" / "__init__.py").write_text("")
    (pkg / "privacy" / "__init__.py").write_text("")
    (pkg / "privacy" / "dp.py").write_text("class DP:\n    pass\n")
    (pkg / "graph" / "walks.py").write_text(
        "def __getattr__(name):\n"
        "    from custagg.privacy import dp\n"
        "    return getattr(dp, name)\n")
    # A hook returning only what its module imported at the top is no
    # hidden edge (the scan reads that import).
    (pkg / "graph" / "names.py").write_text(
        "from custagg.graph import walks\n"
        "def __getattr__(name):\n"
        "    return getattr(walks, name)\n")
    modules = _modules(str(pkg))
    assert upward_imports(modules) == [
        "custagg.graph.walks (layer graph) imports custagg.privacy.dp "
        "(layer privacy, above)"]
    assert module_getattr_hooks(modules) == ["custagg.graph.walks"]
    edges, _ = scan(modules)
    assert not cycles(edges, modules)  # what the circle check alone misses


# Public paths whose code lives in a layer folder: small modules that only
# re-export (docs/architecture.md, "Public paths"). Such a module is not a
# shim (a leftover where a module used to be): it is where users import
# from, and it defines nothing.
PUBLIC_PATHS = ("optimizers", "distributed")


def _reexports(path):
    """{name: source module} of a module made of imports only (besides its
    docstring and `__all__`); raises AssertionError on anything else."""
    import custagg
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = {}
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(
                node.value, ast.Constant) and isinstance(node.value.value,
                                                         str):
            continue
        if isinstance(node, ast.Assign) and [
                getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            # Earlier names that warn (privacy.wrappers.EARLIER_NAMES); it
            # imports nothing (test_no_module_getattr_outside_the_package_
            # init).
            names.update(dict.fromkeys(custagg._EARLIER,
                                       "custagg.privacy.wrappers"))
            continue
        assert isinstance(node, ast.ImportFrom), (
            "%s line %d: a public-path module only re-exports (from ... "
            "import ...); define things in their layer's module."
            % (path, node.lineno))
        for a in node.names:
            if not (a.asname or a.name).startswith("_"):
                names[a.asname or a.name] = node.module
    return names


@pytest.mark.parametrize("public", PUBLIC_PATHS)
def test_public_module_paths_only_reexport(public):
    """`custagg.optimizers` and `custagg.distributed` are real modules that
    re-export: every public name is the very object of its home module
    (one class per name: `custagg.optimizers.DPOptimizer is
    custagg.privacy.wrappers.DPOptimizer`), and `__all__` lists them."""
    import importlib

    import custagg
    path = os.path.join(ROOT, "custagg", public + ".py")
    names = _reexports(path)
    module = importlib.import_module("custagg." + public)
    assert getattr(custagg, public) is module
    assert sorted(module.__all__) == sorted(names)
    for name, home in names.items():
        if name in custagg._EARLIER:
            continue   # test_earlier_names_warn_and_name_the_wrappers
        assert getattr(module, name) is getattr(
            importlib.import_module(home), name), name


def test_public_names_agree():
    """A name offered at two public places is one object; TF Privacy's
    short names are the query-based classes."""
    import custagg
    from custagg import optimizers
    from custagg.privacy import dp_optimizer
    for name in custagg.__all__:
        if name in custagg._EARLIER:
            continue   # they warn on access: test_earlier_names_warn
        if hasattr(optimizers, name) and name not in custagg._SUBMODULES:
            assert getattr(custagg, name) is getattr(optimizers, name), name
    assert optimizers.DPAdamOptimizer is dp_optimizer.DPAdamOptimizer
    assert optimizers.DPGradientDescentOptimizer is \
        dp_optimizer.DPGradientDescentOptimizer
    # TF Privacy's classes of the wrappers' earlier names are subclasses of
    # the TF1 class.
    assert dp_optimizer.DPAdamGaussianOptimizer.__name__ == \
        "DPAdamGaussianOptimizer"
    assert callable(custagg.gradients)  # the function, not traversal's module


def test_earlier_names_warn_and_name_the_wrappers():
    """custagg's DP wrappers' earlier names (TF Privacy's class names, other
    classes) still give the wrappers, with a FutureWarning naming both."""
    import warnings
    import custagg
    from custagg import optimizers
    from custagg.privacy import wrappers
    assert set(custagg._EARLIER) == set(wrappers.EARLIER_NAMES)
    for module in (custagg, optimizers):
        for old, new in wrappers.EARLIER_NAMES.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = getattr(module, old)
            assert got is getattr(wrappers, new), old
            msgs = [str(w.message) for w in caught
                    if issubclass(w.category, FutureWarning)]
            assert len(msgs) == 1, (old, msgs)
            assert new in msgs[0] and "dp_optimizer." + old in msgs[0], \
                msgs[0]
    with pytest.raises(AttributeError, match="NoSuchOptimizer"):
        optimizers.NoSuchOptimizer  # pylint: disable=pointless-statement


def test_no_private_names_across_modules():
    _, findings = scan(_modules())
    assert not findings, "\n".join(findings)


def test_no_import_circle():
    modules = _modules()
    edges, _ = scan(modules)
    assert not cycles(edges, modules)


def test_the_scan_finds_what_it_forbids(tmp_path):
    """A planted package with each forbidden pattern is caught."""
    pkg = tmp_path / "custagg"
    (pkg / "inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "inner" / "_helpers.py").write_text("def f():\n    pass\n")
    (pkg / "a.py").write_text("from custagg import b\n"
                              "x = b._secret\n")
    (pkg / "b.py").write_text("from custagg import a\n"
                              "from custagg.c import _hidden\n"
                              "from custagg.inner import _helpers\n"
                              "_secret = 1\n")
    (pkg / "c.py").write_text("_hidden = 2\n")
    modules = _modules(str(pkg))
    edges, findings = scan(modules)
    text = "\n".join(findings)
    assert "custagg.a reads the private name custagg.b._secret" in text
    assert "imports the private name custagg.c._hidden" in text
    assert "private module custagg.inner._helpers" in text
    assert cycles(edges, modules) == [["custagg.a", "custagg.b"]]


@pytest.mark.parametrize("old", ["separability", "rowwise", "symbolic_shapes",
                                 "vectorized", "registry", "loop_rules",
                                 "shortcuts", "cli", "datasets", "_walk",
                                 "gradients", "aggregation", "op_gradients",
                                 "slice_recognizer", "recompute",
                                 "training/distributed",
                                 "privacy/_query_fast"])
def test_moved_modules_left_no_shim(old):
    assert not os.path.exists(os.path.join(ROOT, "custagg", old + ".py"))
