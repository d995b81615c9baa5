"""`make demo`: the most complete real job the project can run on a CPU machine.

Estimates every plan shipped under conf/plans/ on its cluster with the Appendix B cost model and
prints the plan tables and estimates. (Training on emulated CPU devices replaces this once the
Lightning strategy and `recipes/train.py` land.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_hexiscale.cli import main as hexiscale

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", nargs="*", default=None, help="plan files (default: conf/plans/*.yaml)")
    args = parser.parse_args(argv)
    plans = args.plans or sorted(str(p) for p in (ROOT / "conf" / "plans").glob("*.yaml"))
    status = 0
    for plan in plans:
        print("=" * 100)
        print(f"hexiscale estimate --plan {Path(plan).relative_to(ROOT) if Path(plan).is_absolute() else plan}")
        print("=" * 100)
        status |= hexiscale(["estimate", "--plan", plan])
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
