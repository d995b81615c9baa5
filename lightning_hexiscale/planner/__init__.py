"""The planner: plans, the Appendix B cost model, and the two-phase search. No torch.distributed here."""

from lightning_hexiscale.planner.plan import Pipeline, Plan, Stage

__all__ = ["Plan", "Pipeline", "Stage"]
