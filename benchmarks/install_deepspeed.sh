#!/usr/bin/env bash
# Builds a virtualenv with DeepSpeed for step_bench's ds_* rows (benchmarks/ds_runner.py),
# apart from the project's .venv so DeepSpeed's pins never touch it.
#
#   benchmarks/install_deepspeed.sh /work/ds-venv [deepspeed version]
#   python benchmarks/step_bench.py --deepspeed-python /work/ds-venv/bin/python
#
# CPU only: torch is pinned to 2.13.0 (the CPU wheel; an unpinned torch pulls a multi-GB
# CUDA build). DeepSpeed is an sdist that imports torch while it builds, hence
# --no-build-isolation against the torch installed first; its ops (cpu_adam, fused_adam,
# async_io) are JIT-built at first use with ninja and the system C++ compiler. NVMe offload
# needs libaio's headers (Debian: libaio-dev). ds_runner imports step_bench (and so
# tierzero's engine, and transformers for the "hf" model) from the checkout, so their
# runtime dependencies are installed too.
set -euo pipefail

venv=${1:?usage: $0 VENV_DIR [DEEPSPEED_VERSION]}
ds_version=${2:-0.19.8}
python=${PYTHON:-python3.11}

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
    echo "libaio-dev is missing: DeepSpeed's async_io op (NVMe offload) will not build." >&2
    echo "Install it (apt-get install libaio-dev, as root) and rerun." >&2
    exit 1
fi
if ! command -v c++ >/dev/null; then
    echo "no C++ compiler (c++) on PATH: DeepSpeed JIT-builds its CPU ops with one." >&2
    exit 1
fi

"$python" -m venv "$venv"
pip=("$venv/bin/pip" install --quiet)
"${pip[@]}" torch==2.13.0
"${pip[@]}" numpy psutil py-cpuinfo ninja packaging
DS_ACCELERATOR=cpu DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "deepspeed==$ds_version"
# what step_bench.py imports (ds_runner reuses its model builders): tierzero's runtime deps
"${pip[@]}" PyYAML safetensors aiofiles "transformers==5.23.0"

"$venv/bin/python" - <<'PY'
import torch
if torch.__version__ != "2.13.0+cpu":
    raise SystemExit(f"torch is {torch.__version__}, expected 2.13.0+cpu: a package replaced it")
PY
DS_ACCELERATOR=cpu "$venv/bin/python" -c \
    "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)"
echo "ok: rerun step_bench with --deepspeed-python $venv/bin/python"
