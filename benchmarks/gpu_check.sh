#!/usr/bin/env bash
# The GPU session, prepared as one command: its parts' limits add up to 580 s, inside one
# device call (600 s). On an H200: the tests 47 s, default_run_bench about 70 s, step_bench's
# mlp model 190 s (its rows print when its rounds end, before the hf model's start):
#   1. every CUDA test (pytest -m cuda: streams, events, pinned pool, device tiers, the
#      deferred clipped step, 2-byte gradients, bf16 master, layer-major);
#   2. default_run_bench on the GPU: `tierzero train`'s default config, the update in step()
#      against the update deferred into the next forward (issue 30's step() share);
#   3. step_bench on the GPU: plain PyTorch and tierzero none / cpu / opt_nvme / all_nvme on
#      both models, medians of 2 interleaved rounds, peak RSS and peak GPU memory (24 child
#      processes of 9-19 s each and a disk measurement before each NVMe one; each child's
#      time prints as it ends).
# Issue 30's 2.07B rows have their own command for the same session, once this passed:
# benchmarks/gpu_scale_check.sh (3-4 minutes; see its header).
# Run from the repository root on a machine with a CUDA build of torch:
#     bash benchmarks/gpu_check.sh [OUTDIR]        (SWAP=/nvme/dir for the NVMe rows)
# Nothing is installed or downloaded: the machine's own torch, transformers, psutil, ... are
# used, and the checkout is imported through PYTHONPATH. Logs and JSON go to OUTDIR
# (default bench_out/gpu). Exit status 1 if either part failed or ran out of its time.
set -uo pipefail
out=${1:-bench_out/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY' 2>&1 | tee "$out/machine.txt"
import os, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
      "cpus", os.cpu_count())
PY
status=0
timeout 150 "$py" -m pytest -v -rs --durations=8 -m cuda tests -p no:cacheprovider 2>&1 \
    | tee "$out/cuda_tests.log" || status=1
timeout 90 "$py" benchmarks/default_run_bench.py --blocks 4 --block 3 --swap "${SWAP:-/tmp}" \
    --out "$out/default_run_gpu.json" 2>&1 | tee "$out/default_run_gpu.log" || status=1
timeout 340 "$py" benchmarks/step_bench.py --device cuda --models mlp,hf --repeats 2 --steps 3 \
    --warmup 2 --threads 8 --swap "${SWAP:-/tmp}" --out "$out/step_bench_gpu.json" 2>&1 \
    | tee "$out/step_bench_gpu.log" || status=1
echo "gpu_check: exit $status (logs in $out)"
exit $status
