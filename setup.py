"""custagg: per-example gradients and custom gradient aggregation for TF graph mode."""
import os
import subprocess
import sys

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
    # The README's test command runs the suite on 2 worker processes (-n 2).
    "pytest-xdist>=3.5",
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

# Keras 2 for TF1 code. Most TF1 programs build their layers with
# tf.compat.v1.layers or Keras 2; from TensorFlow 2.16 on tf.keras is Keras 3,
# which has neither, and Keras 2 is the separate tf-keras package (with
# TF_USE_LEGACY_KERAS=1, which `import custagg` sets when tf-keras is
# installed). Each tf-keras release requires its own TensorFlow minor
# (tf-keras 2.15.1: TF 2.15; 2.21.0: TF 2.21) and none exists before 2.14,
# so which tf-keras fits depends on the TensorFlow being used, and a
# requirement marker cannot say that. setup.py therefore asks the Python
# that pip installs into which TensorFlow it has:
#   none (a fresh environment), or one outside custagg's range that pip will
#     replace: tf-keras unpinned; pip takes the newest TF and tf-keras pair;
#   2.16-2.21: the tf-keras of the same minor (needed; pip keeps TF);
#   2.14-2.15: tf.keras is Keras 2: no tf-keras; the test extra adds the
#     same-minor tf-keras (the tests run on it there too, as .ci/run does);
#   2.12-2.13: no tf-keras exists, none is needed.
# A wheel built elsewhere (`python -m build`, in its own environment) sees no
# TensorFlow and carries the unpinned requirement.
TF_RANGE = ((2, 12), (2, 21))


def _installed_tensorflow():
    """`(major, minor)` of the TensorFlow in the target environment, or None.

    pip runs this file in an isolated build environment that hides the
    target's site-packages, but with the target's interpreter: `-I` starts
    it without pip's overrides (PYTHONPATH, sitecustomize), so it sees the
    packages pip installs next to.
    """
    probe = ("import importlib.metadata as m\n"
             "for d in ('tensorflow', 'tensorflow-cpu', 'tensorflow-intel', "
             "'tensorflow-macos', 'tf-nightly'):\n"
             "    try:\n"
             "        print(m.version(d)); break\n"
             "    except m.PackageNotFoundError:\n"
             "        pass\n")
    try:
        out = subprocess.run([sys.executable, "-I", "-c", probe],
                             capture_output=True, text=True, timeout=60,
                             check=False).stdout.split()
        major, minor = out[0].split(".")[:2]
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def tf_keras_requirements(tf_version, for_tests):
    """The tf-keras requirement (a list of 0 or 1) for `tf_version`."""
    if tf_version is None or not TF_RANGE[0] <= tf_version <= TF_RANGE[1]:
        return ["tf-keras>=2.14.1,<2.22"]
    major, minor = tf_version
    same_minor = "tf-keras>=%d.%d,<%d.%d" % (major, minor, major, minor + 1)
    if tf_version >= (2, 16) or (for_tests and tf_version >= (2, 14)):
        return [same_minor]
    return []


_TF = _installed_tensorflow()
INSTALL_REQUIRES += tf_keras_requirements(_TF, for_tests=False)
TEST_REQUIRES = TEST_BASE + [
    r for r in tf_keras_requirements(_TF, for_tests=True)
    if r not in INSTALL_REQUIRES]

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
