#!/usr/bin/env bash
# The one command a machine with a CUDA GPU runs to check the GPU path, offline, unattended, in at most 8 minutes:
#   1. triforce plan --hardware this-gpu: the card measured (bandwidth, bfloat16 matmul rate, pinned uploads);
#   2. scripts/gpu_check.py profile: profiler tables of an eager and a default-mode decode step, the host
#      synchronisations torch reports, and each tier's step cost by token count beside its floors;
#   3. scripts/gpu_check.py runs: a random-weight Llama-3.1-8B-shaped target (config built in code) at 32K tokens
#      (autoregressive, --offload kv, triforce) and at 128K with --offload kv (autoregressive, triforce), the card
#      held to 24 GiB as on an RTX 4090: ms/token beside `triforce plan --hardware this-gpu`'s prediction, prefill
#      beside its FLOP floor, peak memory beside the plan's. Random weights give real costs, not acceptance;
#   4. scripts/gpu_check.py embedded: `triforce generate` of the embedded model's shape in a cold process, eager
#      and in the default step mode: time to the first token;
#   5. the tests marked cuda (pytest -m cuda), in the time left.
# Each step runs in its own process under a timeout cut to what is left of the 8 minutes; each figure is appended
# to OUT/*.jsonl and OUT/summary.txt as it is measured, so a timeout leaves what finished. Caches (compiled
# kernels, converted models, the random checkpoints) are shared by the steps, outside OUT. Nothing is downloaded.
# Usage: scripts/gpu-check.sh [OUT]   (default gpu-check/). The exit status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
failed=0
deadline=$((SECONDS + 480))
STEPS=""  # a --steps value (eager, graphs, compiled) for the default-mode runs; empty: the CLI's default

cache="${TMPDIR:-/tmp}/triforce-gpu-check-cache"
mkdir -p "$cache"
export TRIFORCE_CACHE="$cache/triforce" TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
steps_flag=()
[ -n "$STEPS" ] && steps_flag=(--steps "$STEPS")

# step NAME SECONDS COMMAND...: run COMMAND under a timeout of SECONDS or what is left, whichever is less, its
# output in OUT/NAME.log; skipped when under 20 s are left
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s left" | tee -a "$out/summary.txt"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "== $name (at most ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local status="${PIPESTATUS[0]}"
    if [ "$status" -ne 0 ]; then
        echo "== $name: exit status $status$([ "$status" -eq 124 ] && echo ' (timed out)')" | tee -a "$out/summary.txt"
        failed=1
    fi
}

python3 - <<'EOF' | tee "$out/device.txt"
import importlib.util, torch
assert torch.cuda.is_available(), "no CUDA device: this script checks the GPU path"
props = torch.cuda.get_device_properties(0)
flash = importlib.util.find_spec("flash_attn") is not None
print(f"{props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"flash-attn {'installed' if flash else 'not installed'}")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

check=(python3 scripts/gpu_check.py)
step plan 40 python3 -m triforce_cli plan --model Llama-3.1-8B --hardware this-gpu --context 32k --memory-gb 24
step profile 100 "${check[@]}" profile --out "$out" --run-timeout 60 "${steps_flag[@]}"
step runs-32k 130 "${check[@]}" runs --out "$out" --run-timeout 60 --memory-limit-gib 24 "${steps_flag[@]}" \
    --runs 32768:none:autoregressive,32768:kv:autoregressive,32768:none:triforce
step runs-128k 150 "${check[@]}" runs --out "$out" --run-timeout 75 --memory-limit-gib 24 "${steps_flag[@]}" \
    --runs 131072:kv:autoregressive,131072:kv:triforce
step embedded 90 "${check[@]}" embedded --out "$out" --run-timeout 40 --checkpoints "$cache/models" "${steps_flag[@]}"
step pytest-cuda 150 python3 -m pytest -q -m cuda tests

echo "== summary ($out/summary.txt)"
cat "$out/summary.txt"
exit "$failed"
