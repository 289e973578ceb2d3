#!/usr/bin/env bash
# Issue 30's 2.07B rows on a GPU machine, prepared as one command for a device session
# after benchmarks/gpu_check.sh has passed there. On a CPU-only VM the 2.07B step is bound
# by the CPU that runs forward and backward (benchmarks/RESULTS.md, "The issue's rows on a
# VM with a fast drive"); with the compute on a GPU the CPU runs only the Adam update, so
# this is where "each row's step within 1.15x the drive's time for its bytes" is decided.
#
# Rows (scale_bench.py, one tierzero child each, the drive measured before and after each):
#   1. int8 moments + bf16 master, clipping 1.0: fires on every step of the bench's
#      random-init model, so steps 2-4 are the deferred step;
#   2. the same with clipping at 1000: steps 3-5 are the speculated step, committed;
#   3. (ROWS=all) fp32, the default precision, clipping 1.0.
# Each row's JSON, log and traced last step go to OUTDIR. Rows 1-2 took 3 min 14 s in all on
# the 2-core CPU VM with a 4-9 GB/s drive; on a drive of ~2 GB/s expect about 2 minutes
# each (27.5 and 23.5 GB a step) and about 4 for row 3 (64.8 GB). Each row's child is
# stopped 60 s before the row's limit (scale_bench --child-timeout; the drive is measured
# before and after it inside the limit), keeping the steps it finished. Free space in SWAP:
# rows 1-2 used up to 21 GB (measured on the CPU VM: state,
# gradients, the regions a speculated step keeps, bandwidth files); row 3's state alone is
# 33 GB (not measured).
#     SWAP=/nvme/dir bash benchmarks/gpu_scale_check.sh [OUTDIR]      (ROWS=all for row 3)
# Nothing is installed or downloaded: the machine's own torch and transformers are used,
# and the checkout is imported through PYTHONPATH. Exit status 1 if a row failed or ran
# out of its time.
set -uo pipefail
out=${1:-bench_out/gpu_scale}
swap=${SWAP:-/tmp}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import platform, torch; print('python', platform.python_version(), 'torch',
torch.__version__, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)" \
    2>&1 | tee "$out/machine.txt"
status=0
row() {  # name, timeout (s), scale_bench arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$py" benchmarks/scale_bench.py --swap "$swap" --engines tierzero \
        --child-timeout $((limit - 60)) --trace "$out/trace_$name" --out "$out/$name.json" \
        "$@" 2>&1 | tee "$out/$name.log" || status=1
}
row deferred 200 --state-precisions int8+bf16master --steps 4 --clip 1.0
row speculated 220 --state-precisions int8+bf16master --steps 5 --clip 1000
if [ "${ROWS:-}" = all ]; then
    row fp32 330 --state-precisions fp32 --steps 4 --clip 1.0
fi
echo "gpu_scale_check: exit $status (logs in $out)"
exit $status
