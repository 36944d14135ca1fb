"""``opd-launch RECIPE.launch.yaml [--dry-run | --memory] [--nodes a,b,c] [--node-rank N]``.

Plans a recipe's jobs (trainer, teacher servers, vLLM servers) over the nodes and starts this node's share;
``python -m megatron_opd.launch`` is the same command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megatron_opd.launch.layout import load_recipe
from megatron_opd.launch.nodes import job_hosts
from megatron_opd.launch.plan import build_plan, describe, nodes_needed, token_file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="opd-launch", description=__doc__.split("\n\n")[1])
    p.add_argument("recipe", help="layout file, e.g. examples/scale/qwen3-32b_to_qwen3-1.7b.launch.yaml")
    p.add_argument("--nodes", help="host names (Slurm host-list syntax allowed); default: SLURM_JOB_NODELIST")
    p.add_argument("--node-rank", type=int, help="this node's index in the list; default: SLURM_NODEID, else hostname")
    p.add_argument("--dry-run", action="store_true", help="print every node's commands and exit")
    p.add_argument("--memory", action="store_true", help="print the memory per device of each job and exit")
    p.add_argument("--wait-timeout-s", type=float, default=3600.0, help="how long the trainer waits for the servers")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe)
    if args.memory:
        from megatron_opd.launch.recipe_memory import recipe_memory
        from megatron_opd.trainer.memory import format_table

        print(format_table(recipe_memory(recipe), recipe.launch.gpu_memory_gib))
        return 0
    hosts = job_hosts(args.nodes)
    if hosts is None and args.dry_run:  # no cluster at hand: show the layout on placeholder names
        hosts = [f"node{i}" for i in range(nodes_needed(recipe))]
    if hosts is None:
        raise SystemExit("no nodes: pass --nodes host1,host2,... or run inside a Slurm allocation")
    plan = build_plan(recipe, hosts)
    if args.dry_run:
        print(describe(plan))
        return 0
    from megatron_opd.launch.run import run_node, this_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node = this_node(hosts, args.node_rank)
    token = Path(token_file(recipe))
    if not token.is_file():
        raise SystemExit(f"{token} is missing: write a secret there first (slurm.sbatch does), readable on every node")
    return run_node(plan, node, Path(recipe.launch.run_dir), args.wait_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
