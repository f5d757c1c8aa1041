"""Where a fact about a set of op types lives (issue 34).

A set of op types ("the v2 loops", "ops that read only a shape", "random
ops") is one named kind of `custagg/op_kinds.py`; what one op type does to
the batch is its entry in the batch-axis table (`batch_axis/table.py`), and
how its per-example gradient goes is its rule (`register_rule("MyOp")`).
The scan below reads custagg/ (ast, nothing imported) and fails on an op
type set written anywhere else:

* a tuple, list or set display (also under `frozenset(...)`, `set(...)`,
  `tuple(...)`, `list(...)`) with two or more string literals that are
  TensorFlow op types, anywhere in a module (module level, a class, a
  function, `op.type in ("AddV2", "Add")` inline);
* a string of two or more op types split into a set (`"Add Sub".split()`).

An op type is a name of `tf.raw_ops` (so data formats such as "NHWC" and
class names in `__all__` are not). Allowed: `op_kinds.py` itself, and in
the table module the sets its entries are built from (`TABLE_PARTS`).
`register_rule("A", "B")` takes arguments, not a set: the registry's own
entries are never flagged.
"""

import ast
import os

import pytest
import tensorflow as tf

from custagg import op_kinds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "custagg")
KINDS_MODULE = os.path.join("custagg", "op_kinds.py")
# The batch-axis table's own op sets: each names the ops of one family of
# entries (`_TABLE[t] = Entry(shape_axes.elementwise)` for each of them).
TABLE_PARTS = {
    os.path.join("custagg", "batch_axis", "table.py"): {
        "_ELEMENTWISE_UNARY", "_ELEMENTWISE_BINARY", "_SPATIAL",
        "_REDUCTIONS"},
}
_COLLECTION_CALLS = ("frozenset", "set", "tuple", "list")


def is_op_type(name):
    return isinstance(name, str) and name[:1].isupper() and \
        hasattr(tf.raw_ops, name)


def _op_literals(node):
    """The op-type literals a node spells as a collection, else []."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in _COLLECTION_CALLS and len(node.args) == 1:
        return _op_literals(node.args[0])
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)
                and is_op_type(e.value)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "split" and \
            isinstance(node.func.value, ast.Constant) and \
            isinstance(node.func.value.value, str):
        return [w for w in node.func.value.value.split() if is_op_type(w)]
    return []


def _allowed_nodes(tree, allowed_names):
    """ids of the nodes under module-level assignments to `allowed_names`."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) in allowed_names
                for t in node.targets):
            found.update(id(sub) for sub in ast.walk(node.value))
    return found


def op_type_sets(source, relpath):
    """[(line, op types)] of the op-type sets `source` writes outside the
    places allowed for them (see the module)."""
    if relpath == KINDS_MODULE:
        return []
    tree = ast.parse(source, relpath)
    allowed = _allowed_nodes(tree, TABLE_PARTS.get(relpath, ()))
    found, inner = [], set()
    for node in ast.walk(tree):
        if id(node) in allowed or id(node) in inner:
            continue
        names = _op_literals(node)
        if len(names) >= 2:
            found.append((node.lineno, sorted(names)))
            inner.update(id(sub) for sub in ast.walk(node))
    return sorted(found)


def _library_files():
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "app")]
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                yield path, os.path.relpath(path, ROOT)


def test_no_op_type_set_outside_op_kinds():
    findings = []
    for path, relpath in _library_files():
        with open(path) as f:
            for line, names in op_type_sets(f.read(), relpath):
                findings.append("%s:%d %s" % (relpath, line, names))
    assert not findings, (
        "op-type sets outside custagg/op_kinds.py (name the kind there, or "
        "make it a table entry or a rule):\n" + "\n".join(findings))


@pytest.mark.parametrize("source, expected", [
    ('X = frozenset(["Identity", "Snapshot"])\n', [(1, ["Identity",
                                                       "Snapshot"])]),
    ('X = ("AddV2", "Add")\n', [(1, ["Add", "AddV2"])]),
    ('X = {"Shape", "Size"}\n', [(1, ["Shape", "Size"])]),
    ('X = frozenset("Sum Mean".split())\n', [(1, ["Mean", "Sum"])]),
    ('def f(op):\n    return op.type in ("Mul", "RealDiv")\n',
     [(2, ["Mul", "RealDiv"])]),
    ('def f(kind):\n    return kind not in ["Gather", "GatherV2"]\n',
     [(2, ["Gather", "GatherV2"])]),
    ('class C:\n    S = set(["While", "If"])\n', [(2, ["If", "While"])]),
    # Not op-type sets: one op type, data formats, names of classes, the
    # registry's arguments, a table keyed by (op type, index).
    ('X = frozenset(["Assert"])\n', []),
    ('ok = fmt in ("NHWC", "NCHW")\n', []),
    ('__all__ = ["Folded", "ListOf", "RANDOM"]\n', []),
    ('@register_rule("AddV2", "Add")\nclass R:\n    pass\n', []),
    ('T = {("Split", 0), ("SplitV", 1)}\n', []),
    ('X = op.type == "Identity"\n', []),
])
def test_the_scan_finds_what_it_forbids(source, expected):
    assert op_type_sets(source, os.path.join("custagg", "m.py")) == expected


def test_the_table_may_list_its_own_families():
    table = os.path.join("custagg", "batch_axis", "table.py")
    source = ('_SPATIAL = frozenset("Conv2D MaxPool".split())\n'
              'RANDOM = frozenset(["RandomUniform", "Multinomial"])\n')
    assert op_type_sets(source, table) == [(2, ["Multinomial",
                                                "RandomUniform"])]
    assert op_type_sets(source, KINDS_MODULE) == []


def _kinds():
    return {name: value for name, value in vars(op_kinds).items()
            if name.isupper() and isinstance(value, frozenset)}


def test_every_kind_names_tensorflow_ops():
    """A misspelt op type would silently never match."""
    kinds = _kinds()
    assert len(kinds) >= 20
    for name, kind in sorted(kinds.items()):
        assert kind, name
        unknown = sorted(t for t in kind if not is_op_type(t))
        assert not unknown, "%s: %s are not TensorFlow ops" % (name, unknown)


def _built_from(kinds):
    """{(small, large)}: `op_kinds.SUBKINDS` closed under chains."""
    pairs = set(op_kinds.SUBKINDS)
    for small, large in pairs:
        assert small in kinds and large in kinds, (small, large)
        assert kinds[small] < kinds[large], (small, large)
    while True:
        more = {(a, d) for a, b in pairs for c, d in pairs if b == c}
        if more <= pairs:
            return pairs
        pairs |= more


def test_kinds_overlap_only_where_documented():
    """Two kinds share ops only when one is built from the other (a pair of
    `op_kinds.SUBKINDS`, or a chain of them), or both from a third that
    holds the shared ops, or the shared ops are listed
    in `op_kinds.IN_SEVERAL_KINDS` with why the op is two things at once."""
    kinds = _kinds()
    related = _built_from(kinds)
    shared = set()
    undocumented = []
    names = sorted(kinds)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if (a, b) in related or (b, a) in related:
                continue
            both = kinds[a] & kinds[b]
            for c in kinds:     # a kind both are built from
                if (c, a) in related and (c, b) in related:
                    both = both - kinds[c]
            shared |= both
            if not both <= set(op_kinds.IN_SEVERAL_KINDS):
                undocumented.append("%s & %s = %s" % (
                    a, b, sorted(both - set(op_kinds.IN_SEVERAL_KINDS))))
    assert not undocumented, "\n".join(undocumented)
    # No stale entry: each listed op is in two unrelated kinds.
    assert sorted(set(op_kinds.IN_SEVERAL_KINDS) - shared) == []


def test_the_table_and_the_registry_name_tensorflow_ops():
    """The table's entries and the default registry's rules are keyed by op
    types that exist (a misspelt key is an entry nothing reads: the table
    had one for `Gelu`, which TensorFlow does not have)."""
    import custagg
    from custagg.batch_axis import table
    for what, types in (("table", table._TABLE),
                        ("registry", custagg.default_registry().op_types())):
        unknown = sorted(t for t in types if not is_op_type(t))
        assert not unknown, "%s: %s are not TensorFlow ops" % (what, unknown)
