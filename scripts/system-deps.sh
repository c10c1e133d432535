#!/usr/bin/env bash
# System services the tests need (Debian packages): redis-server for shared rate limits.
# Idempotent; needs root (CI runs as root). Services are started by the tests, on loopback only.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  echo "[system-deps] redis-server present: $(redis-server --version | cut -d' ' -f3)"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "[system-deps] redis-server is missing; install it with: sudo apt-get install -y redis-server" >&2
  exit 1
fi
echo "[system-deps] installing redis-server ..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
# The package starts a system service on 6379; the tests run their own servers, so stop it.
(service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
echo "[system-deps] redis-server $(redis-server --version | cut -d' ' -f3) installed"
