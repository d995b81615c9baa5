"""The cost model: Appendix B's terms and what the runtime allocates, composed into an estimate of
one training iteration under a Plan (pure functions; no torch.distributed).

- :mod:`.model`          each Appendix B term as a named pure function, formula in its docstring
- :mod:`.estimate`       a plan on a cluster -> :class:`~.estimate.Estimate` (times, memory, throughput)
- :mod:`.compose`        stage terms -> pipeline and iteration time (the one composition estimate and search share)
- :mod:`.workload`       what is trained: the model and its numeric formats
- :mod:`.compute`        compute time per TP group: measured, roofline or FLOPs
- :mod:`.roofline`       the roofline of uncalibrated CUDA compute
- :mod:`.memory`         peak memory of a stage, phase by phase, as the runtime allocates it
- :mod:`.dp_comm`        the data-parallel T_comm of every stage of a plan
- :mod:`.zero_terms`     ZeRO-2 / ZeRO-3 data-parallel time as the runtime runs it
- :mod:`.nic`            shared NICs: concurrent cross-machine transfers divide a NIC's bandwidth
- :mod:`.wire`           bytes on the wire per device and link class (what the runtime sends)
- :mod:`.communicators`  the process groups each rank joins, counted
- :mod:`.cache`          the pricing cache: one :class:`~.cache.PricingCache` of memo tables per cluster

It imports nothing from :mod:`..search` or :mod:`..oracle` (tests/test_layers.py).
"""
