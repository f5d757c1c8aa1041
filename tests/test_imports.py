"""The package's import discipline (issue 23): no import circle inside
custagg, and no module reading another module's private names.

Private modules (`rules/_reduce.py`, `privacy/_query_fast.py`) serve their
own package only; `custagg._tf_compat` (TensorFlow's internals behind one
module, docs/tf-releases.md) and `custagg._version` serve every layer.
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


def scan(modules):
    """(module-level import edges, findings) over `modules`.

    Findings are strings naming a private name read across modules or a
    private module used outside its package.
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
                                 "shortcuts", "cli", "datasets", "_walk"])
def test_moved_modules_left_no_shim(old):
    assert not os.path.exists(os.path.join(ROOT, "custagg", old + ".py"))
