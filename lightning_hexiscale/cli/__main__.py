"""``python -m lightning_hexiscale.cli ...`` (what torchrun launches for `profile`, `calibrate`, `check-estimate`)."""

import sys

from lightning_hexiscale.cli.main import main

sys.exit(main())
