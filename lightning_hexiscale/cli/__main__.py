"""``python -m lightning_hexiscale.cli ...`` (what torchrun launches for `profile`, `calibrate`, `check-estimate`)."""

from lightning_hexiscale.cli.main import console_main

console_main()
