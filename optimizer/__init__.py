"""Policy search for moelight: HRM cost model + an exact LP-per-point search (PuLP/CBC).

Never imports torch; planning runs anywhere in well under a second.
"""

from optimizer.cost_model import ALPHA, PointModel, build_point_model
from optimizer.job import fit_policy, predict_job
from optimizer.policy import InfeasibleError, PlanResult, Policy
from optimizer.search import FAMILIES, evaluate_policy, plan

__all__ = ["ALPHA", "FAMILIES", "InfeasibleError", "PlanResult", "PointModel", "Policy",
           "build_point_model", "evaluate_policy", "fit_policy", "plan", "predict_job"]
