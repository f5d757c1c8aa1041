#!/usr/bin/env bash
# The DP peers' interpreters for `python -m benchmarks --peers`, each in a
# venv of its own (nothing here touches the project's environment; .ci/run
# does not need it):
#   PREFIX-torch  torch 2.13.0 (the local CPU wheel, by path) + opacus 1.6.0
#   PREFIX-jax    jax/jaxlib 0.10.2 + jax-privacy 2.0.0
#   PREFIX-tf215  tensorflow 2.15.1 + tf-keras 2.15.1 + tensorflow-privacy 0.9.0
#                 (its other dependencies pinned as it needs them)
# Usage: bash benchmarks/peers_env.sh [PREFIX]   (default /work/venv-peers)
# then the command it prints at the end.
set -euo pipefail
PREFIX=${1:-/work/venv-peers}
PY=${PYTHON:-python3.11}
TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}

if [ ! -x "$PREFIX-torch/bin/python" ]; then
  "$PY" -m venv "$PREFIX-torch"
  # By path: any other torch spec resolves to a multi-GB CUDA build.
  "$PREFIX-torch/bin/pip" install -q "$TORCH_WHEEL"
  "$PREFIX-torch/bin/pip" install -q opacus==1.6.0 numpy
fi
if [ ! -x "$PREFIX-jax/bin/python" ]; then
  "$PY" -m venv "$PREFIX-jax"
  "$PREFIX-jax/bin/pip" install -q jax==0.10.2 jaxlib==0.10.2 jax-privacy==2.0.0
fi
if [ ! -x "$PREFIX-tf215/bin/python" ]; then
  "$PY" -m venv "$PREFIX-tf215"
  P="$PREFIX-tf215/bin/pip"
  "$P" install -q tensorflow==2.15.1 tf-keras==2.15.1 "numpy<2"
  # TF Privacy 0.9.0 asks for `tensorflow~=2.4` and tf-models-official's
  # world; without --no-deps pip would move TF. Its imports need these:
  "$P" install -q --no-deps tensorflow-privacy==0.9.0
  "$P" install -q absl-py dm-tree==0.1.8 dp-accounting==0.4.3 "packaging~=22.0" \
      "scikit-learn==1.*" "scipy~=1.9" "tensorflow-estimator==2.15.*" \
      "tensorflow-probability~=0.22.0"
fi
echo "python -m benchmarks --peers --python torch=$PREFIX-torch/bin/python" \
     "--python jax=$PREFIX-jax/bin/python --python keras=$PREFIX-tf215/bin/python"
