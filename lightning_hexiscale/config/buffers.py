"""Sizes the runtime allocates by and the planner prices by, in one place both may import.

The planner (``planner/cost/memory.py``) must price the buckets the runtime packs
(``runtime/grad_sync.py``, ``runtime/zero_layout.py``); a constant written twice drifts, so both
read it from here (``config/`` is below both layers, ``tests/test_layers.py``).
"""

from __future__ import annotations

BUCKET_CAP_BYTES = 4 * 2**20
"""4 MiB: the gradient-sync and ZeRO bucket cap (bytes of one flat bucket). A bucket holds at least
one whole parameter segment, so a segment larger than the cap makes a bucket of its own size
(``planner.cost.memory.bucket_elements``). Smaller than DDP's 25 MiB so that several buckets overlap
with the last backward even for small stages; a gloo all-reduce costs ~0.14 ms of latency against
~18 ms per 4 MB on 8 ranks, so the extra collectives cost little."""
