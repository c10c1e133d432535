#!/usr/bin/env bash
# The agent CLIs that the real-client tests drive (tests/integration/test_agents_real.py), pinned
# with their whole dependency tree by scripts/clients/package-lock.json (the registry gains new
# releases of their dependencies whose files it does not serve yet: an unpinned install of cline
# once asked for @ai-sdk/provider@4.0.39 and failed), installed into .clients/ (gitignored), with
# .clients/bin/{codex,claude,cline} linking to what runs.
# Idempotent: nothing is fetched when the locked tree is already there. --ignore-scripts: the
# native binaries come as npm optional dependencies. Claude Code's postinstall would only copy its
# native binary over a placeholder stub, so bin/claude links to the native binary itself.
# Without npm this prints a warning and exits 0; the real-client tests then skip.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${CLIENTS_DIR:-$ROOT/.clients}"
LOCK="$ROOT/scripts/clients"
STAMP="$DEST/.installed"
WANT="$(cat "$LOCK/package.json" "$LOCK/package-lock.json" | sha256sum | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
   && [ -x "$DEST/bin/codex" ] && [ -x "$DEST/bin/claude" ] && [ -x "$DEST/bin/cline" ]; then
  echo "[clients] present (lock $WANT)"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "[clients] npm not found: the real-client tests (Codex, Claude Code, Cline) will not run" >&2
  exit 0
fi
mkdir -p "$DEST"
cp "$LOCK/package.json" "$LOCK/package-lock.json" "$DEST/"
echo "[clients] installing the locked tree of $LOCK/package.json into $DEST ..."
# npm install (not npm ci): the lock leaves out the other platforms' optional native packages,
# which npm ci would demand; with the lock present npm install takes every locked version as is.
(cd "$DEST" && npm install --ignore-scripts --no-audit --no-fund --loglevel=error)
mkdir -p "$DEST/bin"
ln -sfn ../node_modules/.bin/codex "$DEST/bin/codex"
ln -sfn ../node_modules/.bin/cline "$DEST/bin/cline"
case "$(uname -m)" in
  x86_64) native=claude-code-linux-x64 ;;
  aarch64) native=claude-code-linux-arm64 ;;
  *) native=unsupported ;;
esac
ln -sfn "../node_modules/@anthropic-ai/$native/claude" "$DEST/bin/claude"
for bin in codex claude cline; do
  "$DEST/bin/$bin" --version >/dev/null 2>&1 \
    || { echo "[clients] $bin does not start after install" >&2; exit 1; }
done
echo "$WANT" > "$STAMP"
echo "[clients] ok: $(cd "$DEST" && node -e 'const d=require("./package.json").dependencies; console.log(Object.entries(d).map(([k,v])=>k+"@"+v).join(" "))')"
