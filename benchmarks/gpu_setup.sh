#!/usr/bin/env bash
# The Python packages sparse_lm needs on an NVIDIA GPU machine whose image already has
# jax[cuda] >= 0.11 (and torch, flax, optax, orbax, pytest) but no internet.
#
#   On a machine with internet, Python 3.12 wheels for x86-64 Linux into DIR:
#     bash benchmarks/gpu_setup.sh download DIR
#   Carry DIR to the GPU machine, then there:
#     bash benchmarks/gpu_setup.sh install DIR
#
# Why not `pip install -r requirements.txt`: it pins jax 0.10.2 (CI's CPU version) and
# tokamax 0.0.12, whose GPU kernels call `pl.dot`, removed from Pallas in jax 0.11. On jax
# >= 0.11.1 tokamax 0.0.17 is the version that works; it imports xprof (>= 2.23) at import
# time. Used for the suite on one H200 in docs/benchmarks.md ("The suite on one H200").
set -euo pipefail

# Packages the image lacks: the data pipeline, logging, tokamax 0.0.17 and its needs, xprof and
# what it imports, and the notebook runner (tests/test_notebook.py and the two other notebooks;
# ipykernel runs without its optional debugger, debugpy, left out to keep the carry small).
PKGS=(
  grain==0.2.18 array-record==0.8.6 dm-tree==0.1.10 tensorboardX==2.6.5 portpicker==1.6.0
  tokamax==0.0.17 einshape==1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 qwix==0.1.8 typeguard==2.13.3 immutabledict==4.3.1
  xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 gviz-api==1.10.0 cheroot==11.1.2
  more-itertools jaraco.functools
  nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 jupyter-client==8.10.0
  jupyter-core==5.9.1 traitlets==5.16.1 pyzmq==27.3.0 tornado==6.6.1 comm==0.2.3
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7
  matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 pexpect==4.9.0 ptyprocess==0.7.0
  prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2
  pure-eval==0.2.4 fastjsonschema==2.22.3 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  platformdirs==4.14.9
)

case "${1:-}" in
  download)
    dir=${2:?usage: gpu_setup.sh download DIR}
    mkdir -p "$dir"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_12_x86_64 --platform manylinux1_x86_64 -d "$dir" "${PKGS[@]}"
    ;;
  install)
    dir=${2:?usage: gpu_setup.sh install DIR}
    # --no-deps: the image's jax, numpy, protobuf, ... stay as they are.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$dir"/*.whl
    python3 -c "import grain, tokamax, nbclient, jax; print('gpu_setup: ok, jax', jax.__version__, \
      jax.devices())"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_setup.sh download DIR | install DIR" >&2
    exit 2
    ;;
esac
