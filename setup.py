"""custagg: per-example gradients and custom gradient aggregation for TF graph mode."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    ns = {}
    with open(os.path.join(HERE, "custagg", "_version.py")) as f:
        exec(f.read(), ns)
    return ns["__version__"]


# The `tensorflow` distribution (not `tensorflow-cpu`) is required: on Linux
# it runs on the CPU unless the `and-cuda` extra is asked for, and `tf-keras`
# depends on `tensorflow` by name, so requiring `tensorflow-cpu` would install
# two copies over each other. Releases 2.12-2.21 are tested (.ci/run runs the
# suite on 2.21, 2.15 and 2.12; docs/tf-releases.md); an installed one in
# the range is kept.
INSTALL_REQUIRES = [
    "tensorflow>=2.12,<2.22",
    # Each TensorFlow release pins its own range (2.12: 1.22-1.24.3, 2.15:
    # 1.23.5-1.x, 2.18: 1.26-2.0, 2.21: >=1.26); custagg needs no more.
    "numpy>=1.22",
    "six>=1.12",
    # Carries the 1,797 UCI handwritten digits, the main job's offline data.
    "scikit-learn>=1.3",
    # Google's privacy accountant (RDP, PLD): custagg.privacy's epsilon.
    # 0.4.3 is TF Privacy 0.9.0's pin; newer ones install on TF 2.12-2.21 too.
    "dp-accounting>=0.4.3",
    # The main job's progress bar inside each epoch (off when not a TTY).
    "tqdm>=4.60",
]

# Test dependencies that install next to any supported TensorFlow.
TEST_BASE = [
    "pytest>=7",
    # Executes notebooks/ in the test suite.
    "nbclient>=0.10",
    "nbformat>=5.9",
    "ipykernel>=6.29",
    # The notebooks plot.
    "matplotlib>=3.8",
]

LONG_DESCRIPTION = """\
Per-example gradients and custom gradient aggregation for TensorFlow graph
mode (`tf.compat.v1`): `custagg.gradients` is a drop-in for
`tf.compat.v1.gradients` with an added `AggregationMethod.CUSTOM` (a sum
weighted by factors fed at run time); `custagg.per_example_gradients`,
`per_example_norms` and `clipped_gradients` give what happens before TF's
sum over the batch, mostly in one backward pass; TF1 optimizer wrappers do
weighted, clipped and DP-SGD training. `python -m custagg` trains the TF1
MNIST tutorial model with per-example gradients. See the README and docs/
in the source repository.
"""

# tf.compat.v1.layers / Keras 2 layers in graph mode: TF 2.16-2.21's tf.keras
# is Keras 3, so the tests use the tf-keras package there (conftest sets
# TF_USE_LEGACY_KERAS=1 when it is installed). Each tf-keras release
# requires its own TensorFlow minor (tf-keras 2.15.1: TF 2.15; 2.21.0: TF
# 2.21), and none exists before 2.14: with an older TensorFlow installed,
# install the matching tf-keras first (`pip install "tf-keras==2.15.1"` for
# TF 2.15; the installed one is kept), or on TF 2.12-2.13, whose tf.keras is
# Keras 2, use the `test-base` extra. Unpinned, a fresh install takes the
# newest of both.
TEST_REQUIRES = TEST_BASE + ["tf-keras>=2.14.1,<2.22"]

setup(
    name="custagg",
    version=_version(),
    description=("Per-example gradients and custom gradient aggregation for "
                 "TensorFlow graph mode (tf.compat.v1)."),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["custagg", "custagg.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "test-base": TEST_BASE,
                    # Open and run notebooks/ by hand (jupyter brings nbconvert).
                    "notebooks": TEST_BASE[1:] + ["jupyter"]},
    entry_points={"console_scripts": ["custagg=custagg.__main__:main"]},
    license="Apache-2.0",
)
