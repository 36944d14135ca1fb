"""The converter's command line (``opd-convert``): Hugging Face safetensors <-> Megatron-Core dist_ckpt (torch_dist).

    opd-convert hf-to-mcore --hf-dir Qwen3-8B --out ckpt/qwen3-8b --tp 2 --pp 2
    opd-convert mcore-to-hf --ckpt ckpt/qwen3-8b --out export/qwen3-8b
    opd-convert mcore-to-hf --ckpt runs/lora/checkpoints/step_00000100 --out export/merged  # adapters + their base
    opd-convert lora-to-peft --ckpt runs/lora/checkpoints/step_00000100 --out export/adapter  # a PEFT adapter folder
    torchrun --nproc-per-node 8 -m megatron_opd.checkpoint.convert hf-to-mcore ...   # 8 processes share the work

(``python tools/checkpoint/convert.py`` in a checkout is the same command.) Both directions stream tensor by tensor
(see docs/checkpoint.md): peak memory is a few tensors, not the model. The logic lives in the rest of
``megatron_opd.checkpoint``; this module only parses arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import sys
import warnings

EXIT_USAGE, EXIT_VERIFY = 2, 1
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9 bytes, ``512MiB`` -> 512 * 2**20 (transformers' ``max_shard_size`` spelling)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def positive_int(text: str) -> int:
    """A count or multiple that must be at least 1 (0 would divide by zero)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert between Hugging Face safetensors and Megatron-Core dist_ckpt, streaming tensor by tensor.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    to_mcore = sub.add_parser("hf-to-mcore", help="Hugging Face folder -> Megatron-Core dist_ckpt (torch_dist)")
    to_mcore.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="dist_ckpt folder to create")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size the checkpoint is laid out for")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_mcore.add_argument(
        "--first-stage-layers", type=int, help="layers of the first pipeline stage (uneven split, e.g. 61 layers)"
    )
    to_mcore.add_argument("--last-stage-layers", type=int, help="layers of the last pipeline stage (uneven split)")
    to_mcore.add_argument("--vp", type=int, default=1, help="virtual pipeline stages per pipeline rank (1: none)")
    to_mcore.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (Mixture-of-Experts models: experts split over EP ranks)",
    )
    to_mcore.add_argument("--etp", type=int, help="expert tensor-parallel size (MoE models; default: --tp)")
    to_mcore.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), help="parameter dtype (default: config.json torch_dtype)"
    )
    to_mcore.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="vocabulary padding multiple per tensor-parallel rank (Megatron's option of the same name)",
    )

    to_hf = sub.add_parser("mcore-to-hf", help="Megatron-Core dist_ckpt -> Hugging Face folder (safetensors)")
    to_hf.add_argument("--ckpt", required=True, help="dist_ckpt folder (any TP/PP/VP it was saved with)")
    to_hf.add_argument("--out", required=True, help="Hugging Face folder to create")
    to_hf.add_argument(
        "--hf-config-dir",
        help="folder with config.json and tokenizer files (default: the checkpoint's hf_config/ from hf-to-mcore)",
    )
    to_hf.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="exported dtype (default: the checkpoint's)")
    to_hf.add_argument(
        "--base",
        help="a LoRA student's adapter-only checkpoint: the base model it is merged into, a Hugging Face or dist_ckpt "
        "folder (default: the student.path it records)",
    )
    to_hf.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="largest safetensors file, e.g. 5GB or 2GiB"
    )

    to_peft = sub.add_parser("lora-to-peft", help="a LoRA student's adapters -> PEFT adapter folder (for `peft`)")
    to_peft.add_argument("--ckpt", required=True, help="dist_ckpt folder holding the adapters (any TP/PP)")
    to_peft.add_argument(
        "--out", required=True, help="folder to create: adapter_config.json, adapter_model.safetensors"
    )
    to_peft.add_argument(
        "--base", help="the base model folder (its config.json; default: the student.path the checkpoint records)"
    )
    to_peft.add_argument("--hf-config-dir", help="folder with the base's config.json (default: --base's)")
    to_peft.add_argument("--force", action="store_true", help="replace --out if it exists")

    for p in (to_mcore, to_hf):
        p.add_argument(
            "--force", action="store_true", help="replace --out if it exists (only once conversion succeeds)"
        )
        p.add_argument(
            "--verify",
            action="store_true",
            help="afterwards, compare transformers' and Megatron's logits on random sequences (loads both models)",
        )
        p.add_argument("--verify-sequences", type=int, default=4, help="random sequences for --verify")
        p.add_argument("--verify-seq-len", type=int, default=32, help="tokens per --verify sequence")
        p.add_argument(
            "--verify-tolerance",
            type=float,
            help="largest accepted max relative error (default: 1e-4, or 5e-2 when the dtype changed)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def peak_rss_bytes() -> int:
    """This process's peak resident set size as the kernel counts it (``VmHWM``; getrusage elsewhere).

    ``getrusage`` would also count the memory of the parent that forked us before ``exec``.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _verify(args: argparse.Namespace, hf_dir: str, ckpt_dir: str, lossless: bool) -> bool:
    from megatron_opd.checkpoint.verify import verify_conversion

    result = verify_conversion(hf_dir, ckpt_dir, num_sequences=args.verify_sequences, seq_len=args.verify_seq_len)
    tolerance = args.verify_tolerance if args.verify_tolerance is not None else (1e-4 if lossless else 5e-2)
    verdict = "OK" if result.max_rel_error <= tolerance else "FAILED"
    print(
        f"verify: max relative error of logits {result.max_rel_error:.3e} (max abs {result.max_abs_error:.3e}) "
        f"on {result.num_sequences} random sequences of {result.seq_len} tokens; tolerance {tolerance:.0e}: {verdict}"
    )
    return verdict == "OK"


def _source_dtype(config_dir: str) -> str:
    from megatron_opd.dtypes import parse_dtype
    from megatron_opd.models.hf_config import load_architecture

    return str(parse_dtype(load_architecture(config_dir).torch_dtype))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Megatron and DCP warn at import and on every save/load about optional back ends and deprecations.
    for module in (r"megatron\..*", r"torch\.distributed\.checkpoint\..*"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron_opd.checkpoint").setLevel(logging.INFO)
    logging.getLogger("megatron_opd.checkpoint.verify").setLevel(logging.WARNING)  # the CLI prints the verdict

    from megatron_opd.checkpoint import OutputExistsError, convert_hf_to_mcore
    from megatron_opd.checkpoint.lora_export import to_hugging_face  # an adapter-only checkpoint: merged
    from megatron_opd.checkpoint.progress import TqdmProgress
    from megatron_opd.distributed.parallel import ParallelConfig
    from megatron_opd.dtypes import parse_dtype
    from megatron_opd.models import CheckpointError, UnsupportedArchitectureError

    if args.command == "lora-to-peft":
        return _lora_to_peft(args)
    if args.command == "mcore-to-hf" and args.verify:
        from megatron_opd.checkpoint.adapters import is_adapter_checkpoint

        if is_adapter_checkpoint(args.ckpt):
            print(
                f"error: --verify compares the export with the checkpoint's own weights; {args.ckpt} holds a LoRA "
                "student's adapters only: drop --verify (the merge is tested against transformers and peft)",
                file=sys.stderr,
            )
            return EXIT_USAGE
    progress = TqdmProgress(args.command, enabled=_rank() == 0 and not args.no_progress)
    try:
        if args.command == "hf-to-mcore":
            parallel = ParallelConfig(
                tensor_model_parallel_size=args.tp,
                pipeline_model_parallel_size=args.pp,
                virtual_pipeline_model_parallel_size=args.vp if args.vp > 1 else None,
                expert_model_parallel_size=args.ep,
                expert_tensor_parallel_size=args.etp,
                num_layers_in_first_pipeline_stage=args.first_stage_layers,
                num_layers_in_last_pipeline_stage=args.last_stage_layers,
            )
            result = convert_hf_to_mcore(
                args.hf_dir,
                args.out,
                parallel,
                dtype=args.dtype,
                force=args.force,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                progress=progress,
            )
            hf_dir, ckpt_dir = args.hf_dir, args.out
        else:
            result = to_hugging_face(
                args.ckpt,
                args.out,
                hf_config_dir=args.hf_config_dir,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_size,
                force=args.force,
                progress=progress,
                base=args.base,
            )
            hf_dir, ckpt_dir = args.out, args.ckpt
    except (CheckpointError, UnsupportedArchitectureError, OutputExistsError, FileNotFoundError, ValueError) as err:
        progress.close()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    progress.close()
    rate = result.bytes / 1e6 / max(result.seconds, 1e-9)
    print(
        f"rank {_rank()}: wrote {result.tensors} tensors, {result.bytes / 1e9:.3f} GB in {result.seconds:.1f} s "
        f"({rate:.0f} MB/s), peak RSS {peak_rss_bytes() / 2**30:.2f} GiB -> {result.out_dir}"
    )
    if args.verify and _rank() == 0:
        # A dtype change makes the comparison lossy; mcore-to-hf --dtype is counted as one.
        lossless = args.dtype is None or (
            args.command == "hf-to-mcore" and str(parse_dtype(args.dtype)) == _source_dtype(args.hf_dir)
        )
        if not _verify(args, hf_dir, ckpt_dir, lossless):
            return EXIT_VERIFY
    return 0


def _lora_to_peft(args: argparse.Namespace) -> int:
    from megatron_opd.checkpoint import OutputExistsError
    from megatron_opd.checkpoint.lora_export import export_peft_adapter
    from megatron_opd.models import CheckpointError

    try:
        out = export_peft_adapter(args.ckpt, args.out, hf_config_dir=args.hf_config_dir, base=args.base,
                                  force=args.force)  # fmt: skip
    except (CheckpointError, OutputExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"rank {_rank()}: wrote a PEFT adapter folder -> {out}")
    return 0


if __name__ == "__main__":
    from megatron_opd.process_exit import exit_now

    exit_now(main())
