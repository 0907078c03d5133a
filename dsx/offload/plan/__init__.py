"""The per-layer activation plan: keep, offload to host, offload to SSD, or recompute.

:func:`make_plan` picks an action per layer from the profiling step's :class:`LayerProfile` s and the tiers'
measured :class:`TierBandwidth` s: the least predicted step time under ``memory_budget_gb``, or, without a
budget, the most memory saved at no predicted cost. The modules: :mod:`~dsx.offload.plan.types` (the
vocabulary), :mod:`~dsx.offload.plan.cost` (the cost model), :mod:`~dsx.offload.plan.barrier` (where the
runtime waits for writes), :mod:`~dsx.offload.plan.search` (the search) and :mod:`~dsx.offload.plan.bound`
(a lower bound no plan beats, from measurements).
"""

from dsx.offload.plan.barrier import write_barrier, write_barrier_fixed
from dsx.offload.plan.bound import bound_step_s, lower_bound
from dsx.offload.plan.cost import movable, simulate, tier_capacity, tier_usage
from dsx.offload.plan.search import MAX_DEPTH, floor_bytes, make_plan, planned_bandwidths
from dsx.offload.plan.types import Action, LayerProfile, MoveCap, Plan, PlanError
from dsx.runtime.bandwidth import TierBandwidth

__all__ = [
    "MAX_DEPTH",
    "Action",
    "LayerProfile",
    "MoveCap",
    "Plan",
    "PlanError",
    "TierBandwidth",
    "bound_step_s",
    "floor_bytes",
    "lower_bound",
    "make_plan",
    "movable",
    "planned_bandwidths",
    "simulate",
    "tier_capacity",
    "tier_usage",
    "write_barrier",
    "write_barrier_fixed",
]
