#!/usr/bin/env bash
# The whole test suite from a fresh machine: installs what the tests need, then lint + pytest.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

# Real Prometheus (and Alertmanager) for the end-to-end tests, from Debian's packages.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null \
   || ! command -v prometheus-alertmanager >/dev/null; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    prometheus prometheus-alertmanager >/dev/null
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
export PATH="$PWD/.venv/bin:$PATH"

scripts/lint.sh
python -m pytest "$@"
