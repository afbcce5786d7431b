#!/usr/bin/env bash
# pdserve's GPU check, run from the repository root on a machine with a CUDA GPU (the device machine), in about
# 2-3 minutes, each step bounded by `timeout`, all of them together by GPU_CHECK_BUDGET (330 s).
#
# What it needs beside the repository: python3 with CUDA torch, transformers, safetensors, tokenizers, numpy,
# pytest (+ pytest-timeout), which the device image has, and pdserve's engine-level imports that it lacks, carried
# as wheels in .whl/ (`*.whl` is git-ignored, so the folder travels only when named in `carry`). Recreate them from
# the repository root of the checkout that is sent (wheels for CPython 3.12, manylinux x86-64, no dependencies: they
# have none the device lacks):
#
#   mkdir -p .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl msgspec==0.22.0 pyzmq==27.3.0
#
# The device tool's call:  command: `bash scripts/gpu_check.sh`   carry: [".whl"]   timeout_s: 420
#
# It prints `PASS <step>` or `FAIL <step> (...)` per step, pytest's own PASSED/FAILED/SKIPPED line per test, and a
# summary; everything goes to $OUT/gpu_check.log, the timings to $OUT/gpu_bench.json, pytest's report to
# $OUT/gpu_pytest.xml. Off the device (a dry run): PYTHON=... GPU_CHECK_DEVICE=cpu BENCH_PRESET=tiny.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRESET=${BENCH_PRESET:-llama120m}
WORK=$(mktemp -d /tmp/pdserve-gpu.XXXXXX)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=()
START=$SECONDS

BUDGET=${GPU_CHECK_BUDGET:-330}  # seconds for all steps together: a step gets at most what is left of it

step() {  # step NAME SECONDS COMMAND...: runs it under a deadline, says PASS or FAIL
    local name=$1 limit=$2 left=$((BUDGET - (SECONDS - START)))
    shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then RESULTS+=("FAIL $name (not run: the ${BUDGET}s budget is spent)"); return 1; fi
    echo "=== $name (limit ${limit}s, at $((SECONDS - START))s)"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then RESULTS+=("PASS $name"); echo "PASS $name"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then RESULTS+=("FAIL $name (timed out after ${limit}s)"); echo "FAIL $name (timed out)"
    else RESULTS+=("FAIL $name (exit $rc)"); echo "FAIL $name (exit $rc)"
    fi
    return $rc
}

main() {
if ls .whl/*.whl >/dev/null 2>&1 && [ -z "${SKIP_WHEELS:-}" ]; then
    step wheels 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
else
    echo "=== wheels: none carried (.whl/*.whl)"
fi

echo "=== machine"
timeout 20 nvidia-smi || echo "(no nvidia-smi)"
step imports 60 "$PY" - "$DEVICE" <<'EOF'
import sys, platform, torch, transformers
device = sys.argv[1]
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
    x = torch.ones(1024, 1024, device=device)
    assert (x @ x)[0, 0].item() == 1024
import msgspec, zmq  # the engine's imports that the device image lacks (carried wheels)
import pdserve.llm, pdserve.modelgen.cli  # noqa: F401
print("pdserve engine imports: ok")
EOF

# The generator's standalone entry point: `python -m pdserve make-model` builds every subcommand's parser and so
# imports the server stack (uvicorn, httptools, fastapi), which the device lacks; the generator itself needs none.
step make-model 60 "$PY" -m pdserve.modelgen.cli make-model --arch llama --preset "$PRESET" "$WORK/$PRESET"

# The 120M model just made is the one the test would make again; a tiny preset (dry runs) leaves the test its own.
LLAMA120M=$([ "$PRESET" = llama120m ] && [ -d "$WORK/$PRESET" ] && echo "$WORK/$PRESET")
step pytest-cuda 150 env PDSERVE_TEST_DEVICE="$DEVICE" PDSERVE_LLAMA120M="$LLAMA120M" \
    "$PY" -m pytest -q -rA tests/test_cuda.py --no-fork-server -p no:cacheprovider --timeout 120 \
    --junitxml "$OUT/gpu_pytest.xml"

if [ -d "$WORK/$PRESET" ]; then
    step bench 110 "$PY" scripts/gpu_bench.py --model "$WORK/$PRESET" --device "$DEVICE" --out "$OUT/gpu_bench.json" \
        ${BENCH_ARGS:-}
fi

rm -rf "$WORK"
echo "=== summary ($((SECONDS - START))s)"
printf '%s\n' "${RESULTS[@]}"
for r in "${RESULTS[@]}"; do [[ $r == FAIL* ]] && return 1; done
return 0
}

# Through a pipe rather than `exec > >(tee ...)`: the log is complete when the script returns.
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
