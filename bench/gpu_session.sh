#!/usr/bin/env bash
# Every GPU figure this project asks for, in one go, from the project's checkout on a fresh GPU machine: the machine
# and library versions, benchmark 6 (train step: tokens/s, MFU), benchmark 5 (sampling: HF vs vLLM) and two
# iterations in bfloat16 of the shipped Qwen3-4B attack and defense configs, random weights, with the in-process
# sampler and with vLLM (bench/real_size.py). Each step runs under a time limit (STEP_SECONDS, 590), writes its log
# and figures into OUT, and a failing step does not stop the next: OUT/summary.txt lists each step's exit status
# and seconds.
#
#   bash bench/gpu_session.sh OUT                  # a GPU: Qwen3-4B shapes
#   bash bench/gpu_session.sh OUT --device cpu     # every step on a CPU with small shapes: try it here first
#
# PYTHON (default: .venv/bin/python where it exists, else python3) must import the project; where it does not,
# `pip install -e .` installs it; on a machine without network, from WHEELS where that folder exists (the wheels of
# the dependencies the machine lacks, downloaded elsewhere for its Python and platform by `python
# bench/offline_wheels.py .whl --present LIST --leave-out duckdb`, LIST the machine's `pip list --format=freeze`; building
# the models also needs XDG_CACHE_HOME pointing at a copy of the real tokenizers' cache, tests/real_tokenizers.py).
# The vLLM steps use the engine environment ENGINE (default .vllm, made by `redteam-grpo install-sampler`); where it
# is missing they are skipped, and the summary says so.
set -uo pipefail

OUT=${1:?usage: bash bench/gpu_session.sh OUT [--device cpu]}
DEVICE=cuda
if [[ "${2:-}" == "--device" ]]; then DEVICE=${3:?--device needs a value}; fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEP_SECONDS=${STEP_SECONDS:-590}
MODELS=${MODELS:-${TMPDIR:-/tmp}/redteam-grpo-models}  # outside OUT: 8 GB that need not come back
ENGINE=${ENGINE:-$ROOT/.vllm}
WHEELS=${WHEELS:-$ROOT/.whl}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [[ "$DEVICE" == "cpu" ]]; then
    SHAPE=small  # hidden 512 x 8 layers, Qwen3's vocabulary
    TRAIN_ARGS=(--tiny --device cpu --batch 4 --prompt-tokens 16 --completion-tokens 16 --steps 1 --iterations 2)
    SAMPLE_ARGS=(--shape small --device cpu --prompts 2 --group 2 --tokens 16)
else
    SHAPE=4b
    TRAIN_ARGS=(--model-dir "$MODELS/qwen3-4b-random")
    SAMPLE_ARGS=(--model-dir "$MODELS/qwen3-4b-random")
fi
: >"$OUT/summary.txt"

# step NAME COMMAND...: run it under the time limit into OUT/NAME.log; its status and seconds go to the summary
step() {
    local name=$1
    shift
    local started=$SECONDS
    echo "== $name: $*"
    timeout --signal=TERM --kill-after=20 "$STEP_SECONDS" "$@" >"$OUT/$name.log" 2>&1
    local status=$?
    local verdict="exit $status"
    [[ $status == 124 || $status == 137 ]] && verdict="timed out after $STEP_SECONDS s"
    printf '%-16s %-28s %5d s\n' "$name" "$verdict" $((SECONDS - started)) | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.log"
    return "$status"
}

skipped() {
    printf '%-16s skipped: %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"
}

if ! "$PYTHON" -c "import redteam_grpo" 2>/dev/null; then
    if [[ -d "$WHEELS" ]]; then
        # no index: the wheels as they are, then the project over the machine's own torch, whatever its version
        step install bash -c "'$PYTHON' -m pip install --no-index --no-deps '$WHEELS'/*.whl &&
            '$PYTHON' -m pip install --no-index --no-deps --no-build-isolation -e ." || exit 1
    else
        step install "$PYTHON" -m pip install -e . || exit 1
    fi
fi

step environment "$PYTHON" - "$OUT/environment.json" <<'EOF'
import json, platform, subprocess, sys
from importlib.metadata import PackageNotFoundError, version

import torch

facts = {"python": platform.python_version(), "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
for name in ("torch", "transformers", "peft", "prefect", "pyarrow", "redteam-grpo"):
    try:
        facts[name] = version(name)
    except PackageNotFoundError:
        facts[name] = None
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    facts["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
print(json.dumps({k: v for k, v in facts.items() if k != "nvidia_smi"}, indent=2))
json.dump(facts, open(sys.argv[1], "w"), indent=2)
EOF

step build-model "$PYTHON" -c "
import sys; sys.path.insert(0, 'bench')
from pathlib import Path
import real_size
folder = real_size.build_policy(Path('$MODELS') / 'qwen3-$SHAPE-random', '$SHAPE')
print(folder, real_size.weight_bytes(folder) / 1e9, 'GB')
"

step train-step "$PYTHON" bench/gpu_train_step.py "${TRAIN_ARGS[@]}"

if [[ -x "$ENGINE/bin/python" ]]; then
    step sampling "$PYTHON" bench/gpu_sampling.py "${SAMPLE_ARGS[@]}" --engine "$ENGINE"
else
    step sampling "$PYTHON" bench/gpu_sampling.py "${SAMPLE_ARGS[@]}"
    skipped sampling-vllm "no engine environment at $ENGINE (redteam-grpo install-sampler makes one)"
fi

# Two iterations: one, then one more by --resume. Attack and defense each in their own step (10 minutes each).
for mode in attack defense; do
    step "run-hf-$mode" "$PYTHON" bench/real_size.py --mode "$mode" --shape "$SHAPE" --device "$DEVICE" \
        --iterations 1 --cache "$MODELS" --out "$OUT/run-hf"
    cp "$OUT/run-hf/real_size.json" "$OUT/run-hf-$mode.json" 2>/dev/null
    if [[ -x "$ENGINE/bin/python" ]]; then
        step "run-vllm-$mode" "$PYTHON" bench/real_size.py --mode "$mode" --shape "$SHAPE" --device "$DEVICE" \
            --iterations 1 --cache "$MODELS" --out "$OUT/run-vllm" --engine "$ENGINE"
        cp "$OUT/run-vllm/real_size.json" "$OUT/run-vllm-$mode.json" 2>/dev/null
    else
        skipped "run-vllm-$mode" "no engine environment at $ENGINE"
    fi
done

# every log and figure in one archive, the runs' own logs included (a run cut off by the time limit leaves its
# progress there only), without the runs' folders (checkpoints: gigabytes)
tar -czf "$OUT/figures.tgz" -C "$OUT" --exclude='./figures.tgz' --exclude='*/runs' .
echo
echo "every figure is in $OUT (summary.txt, *.json, *.log; all of them in figures.tgz):"
cat "$OUT/summary.txt"
