"""Start a scale-out recipe: ``python examples/scale/launch.py RECIPE.launch.yaml [--dry-run | --memory]``.

A thin entry to :mod:`megatron_opd.launch` (``python -m megatron_opd.launch`` is the same); see docs/scaling.md.
"""

import sys

from megatron_opd.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
