#!/usr/bin/env bash
# The one command a machine with a CUDA GPU runs to check the GPU path, offline, in under 10 minutes on one GPU:
#   1. the tests marked cuda (pytest -m cuda): exactness and the compiled steps on the GPU;
#   2. triforce bench --device cuda with the embedded model: every mode against autoregressive, 4K tokens;
#   3. scripts/gpu_check.py: a random-weight Llama-3.1-8B-shaped target at 32K and 128K tokens, on the device and
#      with --offload kv, the card held to 24 GiB as on an RTX 4090, printing ms/token, peak memory and what
#      `triforce plan` predicts for the 4090 side by side. Random weights give real step costs and memory, not
#      acceptance: their speculative figures are a cost floor, not a speed-up.
# It uses the machine's own torch (and flash-attn where installed) and downloads nothing. Results go to the folder
# given as the first argument (default gpu-check/): pytest's log, the bench JSON and the random-weight runs' JSON.
# The exit status is non-zero if any step failed or any run ran out of memory.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
failed=0

python3 - <<'EOF' | tee "$out/device.txt"
import importlib.util, torch
assert torch.cuda.is_available(), "no CUDA device: this script checks the GPU path"
props = torch.cuda.get_device_properties(0)
flash = importlib.util.find_spec("flash_attn") is not None
print(f"{props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"flash-attn {'installed' if flash else 'not installed'}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

echo "== 1/3 pytest -m cuda"
timeout 240 python3 -m pytest -q -m cuda tests 2>&1 | tee "$out/pytest-cuda.txt" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

echo "== 2/3 triforce bench --device cuda (embedded model, 4K tokens)"
timeout 150 triforce bench --device cuda --context 4k --max-new-tokens 64 --repeats 3 --warmup 1 \
    --out "$out/bench-embedded.json" || failed=1

echo "== 3/3 random-weight Llama-3.1-8B shape at 32K and 128K, the card held to 24 GiB"
timeout 300 python3 scripts/gpu_check.py --memory-limit-gib 24 --out "$out/random-llama-3.1-8b.json" || failed=1

exit "$failed"
