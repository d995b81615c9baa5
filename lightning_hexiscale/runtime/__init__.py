"""Runtime: topology, TP stages, pipeline schedules, asymmetric gradient sync (consumes only a Plan)."""
