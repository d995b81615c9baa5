"""Measuring a cluster and holding the cost model against measured training steps.

- :mod:`.fit`        pure: alpha-beta least squares, round-robin pair schedule
- :mod:`.measure`    collective: matmul FLOP/s, memory, ping-pong of every pair -> ProfileResult
- :mod:`.writer`     ProfileResult -> cluster YAML + matrix file that ``Cluster.load`` reads
- :mod:`.discover`   collective: the cheap, cached profile (per machine pair and device type) behind
  ``cluster="auto"`` and ``hexiscale discover``; :mod:`.discovery_plan` decides what it measures (pure)
- :mod:`.launch`     forked local CPU ranks, or torchrun / SLURM / Lightning environments
- :mod:`.calibrate`  efficiency per device type and theta_ddp from measured steps
- :mod:`.check`      run a plan for a few steps; measured vs estimated time and memory

The commands (``hexiscale profile | discover | calibrate | check-estimate``) live in
:mod:`lightning_hexiscale.cli.profile`, :mod:`lightning_hexiscale.cli.discover` and :mod:`lightning_hexiscale.cli.calibrate`.
"""
