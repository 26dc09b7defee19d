#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs what the tests need, then lint + pytest.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# From Debian's packages, each only where its command is missing: real Prometheus (and Alertmanager)
# for the end-to-end tests; systemd-analyze and kubectl (kustomize) for tests/test_deploy.py.
# Debian's kubernetes-client is kubectl 1.20, enough for deploy/kubernetes (kept to kustomize 2's
# fields); a newer kubectl already on the machine is used as it is.
packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || packages+=(prometheus)
command -v prometheus-alertmanager >/dev/null || packages+=(prometheus-alertmanager)
command -v systemd-analyze >/dev/null || packages+=(systemd)
command -v kubectl >/dev/null || packages+=(kubernetes-client)
command -v curl >/dev/null || packages+=(curl)  # tests/test_web_security.py: a client certificate
if [ ${#packages[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${packages[@]}" >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"

scripts/lint.sh
python -m pytest "$@"
