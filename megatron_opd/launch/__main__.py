"""``python -m megatron_opd.launch RECIPE [--dry-run | --memory]``."""

import sys

from megatron_opd.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
