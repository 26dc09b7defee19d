#!/usr/bin/env bash
# ruff and mypy over the whole tree. mypy resolves modules by folder name, so it checks a symlink
# tree in which agent/ is gpuscope/ and exporters/ is gpuscope/exporters/.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
rm -rf .typecheck && mkdir -p .typecheck/gpuscope
for entry in agent/*; do ln -s "../../$entry" ".typecheck/gpuscope/$(basename "$entry")"; done
ln -s ../../exporters .typecheck/gpuscope/exporters
mypy .typecheck/gpuscope
