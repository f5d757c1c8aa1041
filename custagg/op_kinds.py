"""Named kinds of TensorFlow op types: every set of op types custagg reads.

A kind is a frozenset of op type names (`op.type`) that some analysis
treats alike, with what the ops have in common and why the kind exists.
This is the one place such a set is written (`tests/test_op_facts.py`
fails on a set of op types anywhere else in custagg/). What ONE op type
does is not a kind: how it moves the batch axis is its entry in the
batch-axis table (`batch_axis/table.py`), how its per-example gradient
goes is its rule (`rules/`, `register_rule`). docs/architecture.md,
"A set of op types", says which goes where.

Kinds built from other kinds say so (`X = A | B`); `SUBKINDS` lists those
pairs and `OVERLAPS` the other kinds that share ops, with the reason, so a
test can hold every other pair of kinds disjoint.

This module sits with the shared modules at the bottom of the layers
(docs/architecture.md): `_tf_compat`, `graph/` and every layer above read
it. It imports nothing.
"""

# --------------------------------------------------------------------------
# Control flow and functions

# v2 loops: one FuncGraph for the body, one for the condition.
V2_LOOPS = frozenset(["While", "StatelessWhile"])
# v2 conds: FuncGraphs for the branches.
V2_CONDS = frozenset(["If", "StatelessIf", "Case", "StatelessCase"])
# Function calls: one FuncGraph, attr "f" (a `tf.function` call site).
CALLS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
# Ops that run function bodies other than a v2 loop's (conds, calls, the
# gradient of a function): a copy of one would need its own rebuild, which
# the loop rules' one-pass build does not do after a loop.
FUNCTION_OPS = V2_CONDS | CALLS | frozenset(["SymbolicGradient"])

# v1 control flow (Enter/Exit frames, v1 cond): each passes its data
# through unchanged (a Merge picks one input whole, a Switch forwards it to
# one side). The Ref variants are the same ops on reference tensors.
V1_ENTERS = frozenset(["Enter", "RefEnter"])
V1_MERGES = frozenset(["Merge", "RefMerge"])
# Output 1 of a Switch is its "true" side (a v1 loop's body side).
V1_SWITCHES = frozenset(["Switch", "RefSwitch"])
V1_CONTROL_FLOW = V1_ENTERS | V1_MERGES | V1_SWITCHES | frozenset([
    "Exit", "RefExit", "NextIteration", "RefNextIteration"])
# Where a value enters a loop: a v2 While (as an input), a v1 frame's Enter.
LOOP_ENTRIES = V2_LOOPS | V1_ENTERS

# --------------------------------------------------------------------------
# What an op reads and what running it does

# Ops whose outputs depend only on their input's shape (or dtype, or a
# list's length), never on its values: an edge into one carries no
# gradient and no example's data, and every per-example copy gives them
# the same answer. `ZerosLike`/`OnesLike` are what backward passes put on
# outputs that get no gradient; TF 2.12 and 2.15 add a `Shape` in the
# `Reshape` gradient, so counts of consumers that prove something skip
# these (`_tf_compat.value_consumers`).
SHAPE_ONLY = frozenset(["Shape", "ShapeN", "Size", "Rank", "ZerosLike",
                        "OnesLike", "TensorListLength",
                        "TensorListElementShape"])

# Stateful random ops: a copy of one (or a second run) draws new numbers,
# so nothing may copy or rerun them and call it the same forward pass.
# (Stateless random ops, `StatelessRandomUniformV2` ..., draw the same
# numbers from the same seed: they are ordinary ops.)
RANDOM = frozenset([
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "ParameterizedTruncatedNormal",
    "StatefulUniform", "StatefulUniformInt", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulUniformFullInt",
    "StatefulRandomBinomial", "RandomShuffleQueueV2"])

# Candidate samplers (nce_loss, sampled_softmax_loss): output 0 holds one
# block of sampled ids shared by the whole batch, so rows made from it are
# no example's. Random too, but stateful ops of their own family: the
# analyses that must not rerun them refuse them as stateful ops (they are
# not `REPEATABLE_STATEFUL`).
CANDIDATE_SAMPLERS = frozenset([
    "LogUniformCandidateSampler", "UniformCandidateSampler",
    "FixedUnigramCandidateSampler", "ThreadUnsafeUnigramCandidateSampler",
    "LearnedUnigramCandidateSampler", "AllCandidateSampler"])

# Stateful ops whose second run repeats the first (reads, and the v1
# TensorArrays a rebuilt loop makes anew): a loop run once more may hold
# them.
REPEATABLE_STATEFUL = frozenset([
    "ReadVariableOp", "VarHandleOp", "ResourceGather", "Placeholder",
    "TensorArrayReadV3", "TensorArrayWriteV3", "TensorArrayGatherV3",
    "TensorArrayScatterV3", "TensorArraySizeV3", "TensorArrayV3"])

# Checks: stateful ops that act only by failing (a shape assertion of a
# loss); a copy may run one again, as the original would.
CHECKS = frozenset(["Assert"])
# Ops the loss may wait for through control edges that change no value:
# they fail or print (dynamic_rnn asserts its sequence lengths' shape).
HARMLESS_EFFECTS = CHECKS | frozenset(["PrintV2"])

# Stateful ops that only read a variable through its handle: whatever
# makes the handle, the value read is a variable's (their other inputs, a
# gather's ids, carry their data as usual).
VARIABLE_READS = frozenset(["ReadVariableOp", "ResourceGather",
                            "ResourceGatherNd"])

# Leaves whose value no feed or input pipeline changes: constants,
# variables (a parameter, the same whichever examples are fed) and the
# lookup tables an initializer fills.
SHARED_LEAVES = frozenset([
    "Const", "VarHandleOp", "VariableV2", "Variable", "HashTableV2",
    "HashTable", "MutableHashTableV2", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTableV2"])

# Where a feed replaces a default value: the rows are taken there, not
# from the default (a pipeline wrapped in placeholder_with_default).
FEED_POINTS = frozenset(["PlaceholderWithDefault"])

# Ops that make a value from a shape and a fill value (zeros for an RNN's
# first state, an empty list to fill): their rows are all equal and made,
# not read.
MAKERS = frozenset(["Fill", "TensorListReserve", "EmptyTensorList",
                    "TensorArrayV3"])

# The reads of a v1 TensorArray after its loop (where the loop rules put
# the seeds of its values' gradients).
V1_TENSOR_ARRAY_READS = frozenset(["TensorArrayGatherV3", "TensorArrayReadV3",
                                   "TensorArrayConcatV3"])

# --------------------------------------------------------------------------
# Ops that pass a value, its rows or its gradient on

# Identities: the output is the input, value and shape.
IDENTITIES = frozenset(["Identity", "Snapshot"])

# Between a loop's input (a variable's handle, or a value) and the value a
# loop-rule tap reads: the variable's read and identities of it. (x itself,
# in x's shape: unlike `KEEPS_VALUES`, no cast or reshape.)
LOOP_VALUE_READS = frozenset(["ReadVariableOp", "Identity"])

# Ops between a parameter and the op that uses it that the rules see
# through (`rules.shortcuts`): they change neither values nor (up to a
# reshape) layout, and their gradient is the incoming one cast or reshaped
# back. A forward fact about values, unlike `SAME_GRADIENT`.
KEEPS_VALUES = frozenset(["ReadVariableOp", "Identity", "Snapshot", "Cast",
                          "ExpandDims", "Reshape", "Squeeze"])

# Binary adds (`AddN` takes a list).
ADDS = frozenset(["AddV2", "Add"])

# Ops whose gradient at an input of the output's shape is the output's
# gradient unchanged: a backward fact (the loop rules share one dz along
# them), unlike `KEEPS_VALUES`: a Cast or a Reshape would change dz's dtype
# or shape, and a sum is no value of its addends.
SAME_GRADIENT = ADDS | frozenset(["Identity", "AddN"])

# Multiplications and divisions (by a scalar, where the reader checks it):
# TF's Mean gradient divides, a loss scale multiplies.
SCALINGS = frozenset(["Mul", "RealDiv"])

# Broadcasting binary ops: the output's rows are the rows of its input of
# the output's rank (a bias or a scale has none).
BROADCASTING = ADDS | SCALINGS | frozenset(["Sub"])

# Ops whose output rows are their input 0's rows, one to one (a unary op
# applied elementwise, or an identity). The certificate's walk back along
# a rule's rows follows these (`forms/rows.py`).
SAME_ROWS = frozenset([
    "Identity", "Cast", "StopGradient", "Snapshot", "PreventGradient",
    "CheckNumerics", "EnsureShape", "Neg", "Abs", "Floor", "Ceil", "Round",
    "Sign", "Relu", "Tanh", "Sigmoid", "Exp", "Square"])

# Ops whose output 0 has the shape of input 0 (symbolic shapes read it
# through them): the unary elementwise ops, and shape-keeping ops that
# mix along an axis (softmax, batch normalization, a bias). (No `Gelu`:
# TF has no such op, `tf.nn.gelu` is made of `Erf`, `Mul` ...)
SAME_SHAPE = SAME_ROWS | frozenset([
    "Acos", "Asin", "Atan", "Cos", "Cosh", "Elu", "Erf", "Expm1", "Log",
    "Log1p", "LeakyRelu", "Reciprocal", "Relu6", "Rsqrt", "Selu", "Sin",
    "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Softmax",
    "LogSoftmax", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "BiasAdd"])

# conv1d's views of a space-to-batch convolution's output before its
# `BatchToSpaceND`: the Squeeze of its unit axis, identities. They keep
# the rows (`rules/conv_views.py` reads the block through them).
CONV_ROW_VIEWS = frozenset(["Squeeze", "Identity"])

# Broadcasts of a tensor to a larger shape (TF's Sum and Mean gradients
# spread `dy` so).
SPREADS = frozenset(["BroadcastTo", "Tile"])

# --------------------------------------------------------------------------
# Op families

# Every gather of rows by ids (`Gather` is the v1 op: no axis input, no
# `batch_dims`).
GATHERS = frozenset(["ResourceGather", "GatherV2", "Gather"])
# The gathers with an axis input or a table handle and a `batch_dims`
# attr: the ops of the gather rule (`rules/gather.py`).
RULE_GATHERS = frozenset(["ResourceGather", "GatherV2"])
# The gathers of a value tensor (not a resource), which a slice of the
# traversal's CUSTOM list form may be (`traversal/slice_recognizer.py`).
VALUE_GATHERS = frozenset(["GatherV2", "Gather"])

# Batched matrix products (`tf.matmul` of rank > 2): the leading axes are
# batch axes of the product.
BATCH_MATMULS = frozenset(["BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"])

# Sparse segment reductions (feature columns' `embedding_lookup_sparse`);
# the `...WithNumSegments` variants would take the same rule, left out
# until a model needs them.
SPARSE_SEGMENT_REDUCTIONS = frozenset([
    "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN"])

# The reductions that form batch statistics (a mean, a sum over the batch
# axis): the planner's hint names them as the usual reason examples mix.
SUM_REDUCTIONS = frozenset(["Sum", "Mean"])

# Convolutions whose EXPLICIT padding a copy makes a `tf.pad` (`copy_op`).
EXPLICIT_PADDING_CONVS = frozenset(["Conv2D", "DepthwiseConv2dNative"])


# --------------------------------------------------------------------------
# How the kinds relate (tests/test_op_facts.py holds every other pair of
# kinds disjoint).

# (smaller, larger): a kind built from another one (`larger = smaller | ...`)
# or a narrower kind of the same ops.
SUBKINDS = (
    ("V2_CONDS", "FUNCTION_OPS"), ("CALLS", "FUNCTION_OPS"),
    ("V1_ENTERS", "V1_CONTROL_FLOW"), ("V1_MERGES", "V1_CONTROL_FLOW"),
    ("V1_SWITCHES", "V1_CONTROL_FLOW"),
    ("V2_LOOPS", "LOOP_ENTRIES"), ("V1_ENTERS", "LOOP_ENTRIES"),
    ("CHECKS", "HARMLESS_EFFECTS"),
    ("ADDS", "SAME_GRADIENT"), ("ADDS", "BROADCASTING"),
    ("SCALINGS", "BROADCASTING"),
    ("SAME_ROWS", "SAME_SHAPE"),
    ("IDENTITIES", "SAME_ROWS"), ("IDENTITIES", "KEEPS_VALUES"),
    ("LOOP_VALUE_READS", "KEEPS_VALUES"),
    ("RULE_GATHERS", "GATHERS"), ("VALUE_GATHERS", "GATHERS"),
)

# Op types in two kinds neither of which is built from the other (nor both
# from a third holding the op), and why the op is two things at once. Any
# other two kinds share no op.
IN_SEVERAL_KINDS = {
    "Identity": "an identity keeps values, rows, shape and the gradient",
    "Cast": "keeps values (up to dtype) and rows",
    "Squeeze": "keeps values (up to layout) and, of a unit axis, the rows",
    "ReadVariableOp": "reads a variable (again on a rerun), keeps its value",
    "ResourceGather": "a gather that reads a variable (again on a rerun)",
    "GatherV2": "gathers a value tensor, with an axis and batch_dims",
    "VarHandleOp": "a variable's handle: a shared leaf, the same each run",
    "TensorArrayV3": "makes an empty array, anew and the same each run",
    "TensorArrayReadV3": "reads a v1 TensorArray, again on a rerun",
    "TensorArrayGatherV3": "reads a v1 TensorArray, again on a rerun",
}
