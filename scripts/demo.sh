#!/usr/bin/env bash
# Install gpuscope into .venv and run the agent on the simulated 4-GPU `demo` node.
# Then open http://localhost:9847/ (metrics at /metrics). Extra arguments go to `gpuscope run`.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check .
exec .venv/bin/gpuscope run --simulate demo "$@"
