"""`tierzero plan`: per-tier bytes, fit and predicted step time for each offload choice."""

from tierzero.engine.plan.dry_comm import DryComm
from tierzero.engine.plan.dry_run import PHASES, DryRun, Traffic, dry_run
from tierzero.engine.plan.planner import (
    CHOICES,
    ChoicePlan,
    Machine,
    engine_config,
    plan_all,
    recommend,
    step_time,
)
from tierzero.engine.plan.shapes import CountModel, ModelShape, model_shape

__all__ = ["CHOICES", "PHASES", "ChoicePlan", "CountModel", "DryComm", "DryRun", "Machine",
           "ModelShape", "Traffic", "dry_run", "engine_config", "model_shape", "plan_all",
           "recommend", "step_time"]
