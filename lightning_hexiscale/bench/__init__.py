"""Library code of the benchmarks (``benchmarks/``) and of the GPU check recipes (``recipes/``).

Each benchmark is one script that imports only this package; what two of them share lives here:
the CPU memory measurement (:mod:`.resident_memory`), the heterogeneous bench's plan sets, rules
and launcher (:mod:`.hetero_plans`, :mod:`.hetero_rules`, :mod:`.hetero_run`) and the single-GPU
checks (:mod:`.gpu_checks`). A layer above the Lightning layer (it may use all of the package) and
below the CLI.
"""
