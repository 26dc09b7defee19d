#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs what the tests need, then lint + pytest.
# Usage: scripts/test.sh [pytest args...]
#
# System commands come from Debian's packages, each only where the command is missing: a real
# Prometheus (with promtool) and Alertmanager for the end-to-end tests, systemd-analyze and kubectl
# (kustomize) for tests/test_deploy.py, curl for a client-certificate request, Chromium for the status
# page in a real browser. Each is found under Debian's or upstream's name (Alertmanager's binary is
# `prometheus-alertmanager` in Debian, `alertmanager` upstream; Chromium's is `chromium` or
# `chromium-browser`), so binaries installed from the projects' own releases are used as they are.
# Debian's kubernetes-client is kubectl 1.20, enough for deploy/kubernetes (kept to kustomize 2's
# fields); a newer kubectl already on the machine is used as it is.
#
# Installing packages needs root. As another user it uses `sudo -n` (never a password prompt); where
# that is not allowed it prints the exact command to run as root and stops.
set -euo pipefail
cd "$(dirname "$0")/.."

have() {
  local name
  for name in "$@"; do command -v "$name" >/dev/null && return 0; done
  return 1
}

packages=()
have prometheus && have promtool || packages+=(prometheus)
have prometheus-alertmanager alertmanager || packages+=(prometheus-alertmanager)
have systemd-analyze || packages+=(systemd)
have kubectl || packages+=(kubernetes-client)
have curl || packages+=(curl)
have chromium chromium-browser || packages+=(chromium)
if [ ${#packages[@]} -gt 0 ]; then
  install=(apt-get install -y -qq --no-install-recommends "${packages[@]}")
  if ! command -v apt-get >/dev/null; then
    echo "scripts/test.sh: missing commands from these Debian packages: ${packages[*]}" >&2
    echo "Install their equivalents with this system's package manager, then run it again." >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "scripts/test.sh: the tests need packages that only root can install: ${packages[*]}" >&2
    echo "Run this once as root, then run scripts/test.sh again:" >&2
    echo "  apt-get update && DEBIAN_FRONTEND=noninteractive ${install[*]}" >&2
    exit 1
  fi
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive "${install[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"

# The OTLP tests push to a real OpenTelemetry Collector, built from its Go modules with Go from PyPI
# (kept in .cache, so this is quick once built). A build that fails says why; the tests that need it
# then skip with that reason. On CI a failed build stops here, unless its cause is the machine's
# network (the Go module proxy out of reach: exit status 3).
otelcol_started=$(date +%s)
otelcol_status=0
scripts/build-otelcol || otelcol_status=$?
echo "scripts/test.sh: scripts/build-otelcol took $(( $(date +%s) - otelcol_started ))s (exit status $otelcol_status)"
if [ "$otelcol_status" -ne 0 ] && [ "$otelcol_status" -ne 3 ] && [ -n "${CI:-}" ]; then
  exit "$otelcol_status"
fi

scripts/lint.sh
python -m pytest "$@"
