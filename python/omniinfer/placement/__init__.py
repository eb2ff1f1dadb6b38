"""OmniPlacement: where each MoE expert's copies live, planned statically and kept balanced as
the load drifts. Pure algorithms on numpy; SGLang is needed only for the EPLB comparison."""

from omniinfer.placement.dynamic import PREDICTORS, DynamicConfig, DynamicPlanner
from omniinfer.placement.layout import Placement, PlacementError
from omniinfer.placement.loads import CountsError, load_counts
from omniinfer.placement.migration import MigrationPlan, apply_migration, plan_migration
from omniinfer.placement.static import plan_layerwise, plan_static

__all__ = [
    "PREDICTORS",
    "CountsError",
    "DynamicConfig",
    "DynamicPlanner",
    "MigrationPlan",
    "Placement",
    "PlacementError",
    "apply_migration",
    "load_counts",
    "plan_layerwise",
    "plan_migration",
    "plan_static",
]
