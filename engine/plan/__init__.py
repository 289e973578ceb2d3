"""`tierzero plan`: per-tier bytes, fit and predicted step time for each offload choice."""

from engine.plan.planner import CHOICES, ChoicePlan, Machine, plan_all, recommend, shard_specs
from engine.plan.shapes import ModelShape, model_shape

__all__ = ["CHOICES", "ChoicePlan", "Machine", "ModelShape", "model_shape", "plan_all",
           "recommend", "shard_specs"]
