"""`tierzero bench`: measure memory, NVMe and CPU Adam speed on this machine."""

from tierzero.engine.bench.command import results_path
from tierzero.engine.bench.measure import QUICK, BenchResult, BenchSizes, run_bench

__all__ = ["QUICK", "BenchResult", "BenchSizes", "results_path", "run_bench"]
