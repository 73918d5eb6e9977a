#!/usr/bin/env bash
# Fetch, on a machine with network, the Python wheels an offline GPU machine may lack for the HTTP
# server (fastapi, starlette, pydantic, uvicorn, prometheus_client and their small dependencies) and
# for constrained decoding (xgrammar and its apache-tvm-ffi; xgrammar's other requirements, torch,
# transformers, triton, numpy, pydantic, are there or among these), for CPython 3.12 on x86-64
# Linux. They land in ./.whl (ignored by git); scripts/gpu_suite.sh installs them into ./.site when
# it finds them. Usage, from the project root:
#   bash scripts/fetch_gpu_wheels.sh [extra pip requirement ...]
# PYTHON_VERSION=3.11 (say) fetches for another Python.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  uvicorn==0.54.0 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 prometheus-client==0.26.0 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 "$@"
ls .whl
