#!/usr/bin/env bash
# System packages the tests need (Debian): redis-server for shared rate limits, chromium +
# chromium-driver for the locust web-UI test (Playwright's own browser download fails here), and
# prometheus (with promtool) for the observability tests and the alert-rule unit tests.
# Idempotent; needs root (CI runs as root). Services are started by the tests, on loopback only.
set -euo pipefail
missing=()
if command -v redis-server >/dev/null 2>&1; then
  echo "[system-deps] redis-server present: $(redis-server --version | cut -d' ' -f3)"
else
  missing+=(redis-server)
fi
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "[system-deps] chromium present: $(chromium --version 2>/dev/null | cut -d' ' -f2)"
else
  missing+=(chromium chromium-driver)
fi
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  echo "[system-deps] prometheus present: $(prometheus --version 2>&1 | head -1 | cut -d' ' -f3)"
else
  missing+=(prometheus)
fi
if [ "${#missing[@]}" = "0" ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "[system-deps] missing: ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "[system-deps] installing ${missing[*]} ..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
if [[ " ${missing[*]} " == *" redis-server "* ]]; then
  # The package starts a system service on 6379; the tests run their own servers, so stop it.
  (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
  echo "[system-deps] redis-server $(redis-server --version | cut -d' ' -f3) installed"
fi
if [[ " ${missing[*]} " == *" prometheus "* ]]; then
  # The package starts a system service on :9090 (and its node exporter); the tests start their
  # own Prometheus on loopback, so stop them.
  for svc in prometheus prometheus-node-exporter; do
    (service "$svc" stop || systemctl stop "$svc" || true) >/dev/null 2>&1
  done
  echo "[system-deps] prometheus $(prometheus --version 2>&1 | head -1 | cut -d' ' -f3) installed"
fi
if [[ " ${missing[*]} " == *" chromium "* ]]; then
  echo "[system-deps] chromium $(chromium --version 2>/dev/null | cut -d' ' -f2) installed"
fi
