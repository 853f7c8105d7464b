#!/usr/bin/env bash
# Download, here, the wheels `rooflm serve` and `rooflm bench serve --plot` need on the GPU machine,
# which has torch, numpy and transformers but no server stack and no network. They land in .whl/
# (git-ignored through .git/info/exclude); carry it to the device call, where benchmarks/serving.sh
# installs them into /tmp/site. Usage: bash benchmarks/fetch_serving_wheels.sh [PYTHON_VERSION]
#
# Versions are those of this checkout's .venv (`.venv/bin/pip show NAME`), so the GPU runs the code
# the CPU tests ran. No dependency resolution (--no-deps): the list below is the closure of what
# the API process imports (checked with `python -X importtime`), minus what the GPU machine has
# (torch, numpy). rich/pygments are left out: httpx imports them only for its own CLI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${1:-3.12}

SERVER=(  # rooflm serve: HTTP, validation, engine-core socket and its encoding, /metrics
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 sniffio==1.3.1
  idna==3.20 pyzmq==27.3.0 msgspec==0.22.0 prometheus-client==0.26.0 tqdm==4.70.1
)
CLIENT=(  # rooflm bench serve: the streaming HTTP client (aiohttp), and httpx for curl-like probes
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.18
)
STRUCTURED=(  # structured outputs (rooflm/structured/, benchmarks/structured_overhead.py):
  # xgrammar needs torch, triton, transformers and numpy (on the GPU machine), pydantic (above)
  # and apache-tvm-ffi, whose one dependency is typing-extensions (above)
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
)
GGUF=(  # the GGUF GPU tests (tests/kernels/test_gguf_on_cuda_kernels.py, tests/unit/test_gguf_formats.py)
  # import gguf-py as their reference and skip without it; its numpy is on the GPU machine
  gguf==0.19.0 pyyaml==6.0.4
)
PLOT=(  # rooflm bench serve --plot (headless Agg)
  matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1
  pillow==13.0.0 pyparsing==3.3.3 python-dateutil==4.0.0 tzdata==2026.6 packaging==26.3
)

mkdir -p .whl
EXCLUDE=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${SERVER[@]}" "${CLIENT[@]}" "${STRUCTURED[@]}" "${GGUF[@]}" "${PLOT[@]}"
ls -1 .whl
du -ch .whl/*.whl | tail -1
