"""Run by ``tests/test_distributed.py`` under torchrun and as a ``RankJob``: writes the launch variables a rank sees
to ``$PROBE_DIR/rank<RANK>.json`` (a file, whatever a launcher does with the ranks' output), and fails or hangs on
request."""

import json
import os
import sys
import time

LAUNCH_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
)  # fmt: skip

if __name__ == "__main__":
    seen = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in LAUNCH_VARIABLES}}
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
    if sys.argv[1:] == ["rank1_fails"] and os.environ["RANK"] == "1":
        sys.exit(3)
    if sys.argv[1:] in (["rank1_fails"], ["hang"]):
        time.sleep(600)  # until the job stops this rank
