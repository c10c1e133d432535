#!/usr/bin/env bash
# The agent CLIs that the real-client tests drive (tests/integration/test_agents_real.py), pinned,
# installed into .clients/ (gitignored), with .clients/bin/{codex,claude,cline} linking to what runs.
# Idempotent: nothing is fetched when the pinned versions are already there. --ignore-scripts: the
# native binaries come as npm optional dependencies. Claude Code's postinstall would only copy its
# native binary over a placeholder stub, so bin/claude links to the native binary itself.
# Without npm this prints a warning and exits 0; the real-client tests then skip.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${CLIENTS_DIR:-$ROOT/.clients}"
PKGS=(@openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.328 cline@3.0.65)
STAMP="$DEST/.installed"
WANT="${PKGS[*]}"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
   && [ -x "$DEST/bin/codex" ] && [ -x "$DEST/bin/claude" ] && [ -x "$DEST/bin/cline" ]; then
  echo "[clients] present: $WANT"
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "[clients] npm not found: the real-client tests (Codex, Claude Code, Cline) will not run" >&2
  exit 0
fi
mkdir -p "$DEST"
[ -f "$DEST/package.json" ] || echo '{"name": "serve-app-clients", "private": true}' > "$DEST/package.json"
echo "[clients] installing $WANT into $DEST ..."
(cd "$DEST" && npm install --no-save --ignore-scripts --no-audit --no-fund --loglevel=error "${PKGS[@]}")
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
echo "[clients] ok: $WANT"
