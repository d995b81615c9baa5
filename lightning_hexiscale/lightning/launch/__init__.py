"""How the job's processes start, stop and restart, apart from the strategy's step.

- :mod:`.guard`: checks before any process starts, one error from rank 0 reaching the caller
  (:class:`~.guard.LaunchGuard`), agreement on the plan, a rank that dies during start;
- :mod:`.job_watch`: Ctrl-C read by phase in the launching process (a wake-up pipe on its own thread);
- :mod:`.spawn_workers`: spawn/fork workers: started with SIGINT ignored, their phases, stopped;
- :mod:`.interrupt`: Ctrl-C during training: every rank stops at the end of the same step;
- :mod:`.sigterm`: SIGTERM without GracefulInterrupt (a user's script): every rank stops at the same step;
- :mod:`.elastic`: torchrun elastic restarts (machines present, re-plan, resume);
- :mod:`.quiet_worker`: sweep workers started quietly.

Lightning's private launcher classes these rely on stay in :mod:`lightning_hexiscale.lightning.internals`.
"""
