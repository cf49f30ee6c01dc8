"""Ahead-of-time planning: compile the engine for a TPU or GPU target that is not there."""

from jaxpage.planning.planner import plan
from jaxpage.planning.report import PlanReport

__all__ = ["plan", "PlanReport"]
