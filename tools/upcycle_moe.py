"""Upcycle a dense checkpoint into a Mixture-of-Experts one (``megatron_opd.models.upcycle``): every expert a copy
of the layer's MLP, a random router; the new model computes the dense one's logits.

    python tools/upcycle_moe.py DENSE_DIR OUT_DIR [--experts 4] [--top-k 2]

Reads the dense model types a Mixture-of-Experts family declares (``upcycles_from``: Qwen3 -> Qwen3-MoE). The quick
start's ``--moe`` starts its MoE student so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_opd.models.upcycle import upcycle_to_moe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dense_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = upcycle_to_moe(args.dense_dir, args.out_dir, args.experts, args.top_k, args.router_std, args.seed)
    print(f"wrote {out}: {args.experts} experts (top-{args.top_k}) per layer upcycled from {args.dense_dir}")


if __name__ == "__main__":
    main()
