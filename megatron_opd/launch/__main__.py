import sys

from megatron_opd.launch.cli import main

sys.exit(main())
