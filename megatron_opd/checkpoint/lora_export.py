"""A LoRA student's adapters out of Megatron: merged into their base as a Hugging Face folder, or as a PEFT adapter.

Megatron fuses query/key/value into one ``linear_qkv`` (rows interleaved by key/value group) and gate/up into one
``linear_fc1``; Hugging Face and PEFT keep ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` apart.
The adapter of a fused column-parallel layer, ``W x + s B A x``, has one ``A [r, in]`` and a fused ``B [out, r]``:
the rows of ``s B A`` are the rows of ``B`` times ``A``, so projection ``i``'s adapter is the same ``A`` and
``B``'s rows of ``i``, taken as the weight's rows are (``name_mapping.megatron_to_hf`` applied to ``B``): exact, and
each PEFT adapter keeps rank ``r``. A row-parallel layer (``linear_proj``, ``linear_fc2``) maps one to one.

Legend: r rank, s = alpha / r.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from megatron_opd.checkpoint.atomic import (
    check_destination,
    commit_staging_dir,
    discard_staging_dir,
    make_staging_dir,
)
from megatron_opd.checkpoint.hf_to_mcore import ConversionResult, copy_hf_side_files
from megatron_opd.checkpoint.mcore_io import check_dist_checkpoint, load_dist_checkpoint
from megatron_opd.checkpoint.mcore_to_hf import (
    DEFAULT_MAX_SHARD_BYTES,
    WeightRead,
    convert_mcore_to_hf,
    plan_adapter_reads,
    write_exported_config,
)
from megatron_opd.checkpoint.safetensors_out import plan_shards
from megatron_opd.checkpoint.workers import conversion_workers
from megatron_opd.dtypes import SAFETENSORS_DTYPES, TensorMeta, parse_dtype
from megatron_opd.model_files import HF_CONFIG_DIR, CheckpointError
from megatron_opd.models.architecture import ModelArchitecture
from megatron_opd.models.hf_config import load_architecture
from megatron_opd.models.name_mapping import megatron_to_hf
from megatron_opd.models.weight_rule import Split

logger = logging.getLogger(__name__)

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_COLUMN_LAYERS, _ROW_LAYERS = ("linear_qkv", "linear_fc1"), ("linear_proj", "linear_fc2")


def read_adapters(ckpt: Path, arch: ModelArchitecture) -> list[tuple[WeightRead, torch.Tensor, torch.Tensor, float]]:
    """Every adapter of the checkpoint ``ckpt`` unsharded: ``(weight, A, B, s)`` (a collective under torchrun)."""
    reads = plan_adapter_reads(ckpt, arch)
    request = {f"w{i}.{j}": part.sharded_tensor() for i, read in enumerate(reads) for j, part in enumerate(read.lora)}
    with conversion_workers():
        loaded = load_dist_checkpoint(request, ckpt, validate_access_integrity=False)
    out = []
    for i, read in enumerate(reads):
        A, B, scale = (part.unwrap(loaded[f"w{i}.{j}"]) for j, part in enumerate(read.lora))
        out.append((read, A, B, float(scale)))
    return out


def hf_adapters(
    read: WeightRead, A: torch.Tensor, B: torch.Tensor, arch
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The Hugging Face modules one Megatron adapter becomes: ``(weight name, A_i, B_i)``, one per projection of a
    fused layer (the shared ``A``, ``B``'s rows of that projection)."""
    rule, layer = read.rule, read.layer
    leaf = rule.megatron.split(".")[-2]
    names = rule.hf_names(layer)
    if rule.hf_transposed or leaf not in _COLUMN_LAYERS + _ROW_LAYERS:
        raise CheckpointError(f"{rule.megatron_name(layer)}: an adapter on this layer has no Hugging Face module form")
    if leaf in _ROW_LAYERS:
        if rule.split is not Split.ROW or len(names) != 1:
            raise CheckpointError(f"{rule.megatron_name(layer)}: a row-parallel weight split as {rule.split}")
        return [(names[0], A, B)]
    return [(name, A, b) for name, b in zip(names, megatron_to_hf(rule, B, arch), strict=True)]


def hf_deltas(adapters, arch) -> dict[str, tuple]:
    """Hugging Face weight name -> what its merged delta ``s B_i A_i`` is computed from (computed when written)."""
    out = {}
    for read, A, B, scale in adapters:
        for name, a, b in hf_adapters(read, A, B, arch):
            out[name] = (a, b, scale)
    return out


def _adapter_base(ckpt: Path, base: str | os.PathLike | None) -> Path:
    from megatron_opd.checkpoint.adapters import saved_adapter_record

    if base is not None:
        return Path(base)
    record = saved_adapter_record(ckpt)
    if record is None:
        raise CheckpointError(f"{ckpt} is not an adapter-only checkpoint: give its base with --base")
    return Path(record["base"])


def to_hugging_face(
    ckpt: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    hf_config_dir: str | os.PathLike | None = None,
    **kwargs,
) -> ConversionResult:
    """A ``dist_ckpt`` as a Hugging Face folder (``opd-convert mcore-to-hf``, the trainer's export): a LoRA student's
    adapter-only checkpoint merged into its base (:func:`merge_adapter_checkpoint`), any other converted as it is
    (``convert_mcore_to_hf``; ``kwargs``: dtype, max_shard_bytes, force, progress)."""
    from megatron_opd.checkpoint.adapters import is_adapter_checkpoint

    if is_adapter_checkpoint(check_dist_checkpoint(ckpt)):
        return merge_adapter_checkpoint(ckpt, out_dir, base=base, hf_config_dir=hf_config_dir, **kwargs)
    if base is not None:
        raise ValueError(f"--base is for a LoRA student's adapter-only checkpoint; {ckpt} holds its own weights")
    return convert_mcore_to_hf(ckpt, out_dir, hf_config_dir=hf_config_dir, **kwargs)


def merge_adapter_checkpoint(
    ckpt: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    hf_config_dir: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    progress=None,
) -> ConversionResult:
    """A LoRA student's adapter-only checkpoint merged into its frozen base (``W + s B A``) as a Hugging Face folder.

    ``base`` (default: the one the checkpoint records): a ``dist_ckpt`` base is exported by the converter with the
    adapters merged; a Hugging Face base is copied tensor by tensor, each adapted weight with its delta added in
    float64 (as the converter adds it), in the base's dtype or ``dtype``."""
    from megatron_opd.checkpoint.source import config_dir, model_format

    ckpt = check_dist_checkpoint(ckpt)
    base = _adapter_base(ckpt, base)
    if not base.exists():
        raise CheckpointError(
            f"the base {base} of the adapters in {ckpt} is not there: pass the folder of the model they were trained "
            "on with --base (the student.path of their run)"
        )
    if model_format(base, "--base") == "dist_ckpt":
        return convert_mcore_to_hf(base, out_dir, hf_config_dir=hf_config_dir or config_dir(base), dtype=dtype,
                                   max_shard_bytes=max_shard_bytes, force=force, progress=progress,
                                   adapters=ckpt)  # fmt: skip
    return _merge_into_hf(ckpt, base, out_dir, dtype, max_shard_bytes, force)


def _merge_into_hf(ckpt: Path, base: Path, out_dir, dtype, max_shard_bytes: int, force: bool) -> ConversionResult:
    from megatron_opd.models.hf_io import HFCheckpointReader

    start = time.perf_counter()
    check_destination(out_dir, force, sources=(ckpt, base))
    reader = HFCheckpointReader(base)
    if reader.quantization is not None:
        raise CheckpointError(
            f"the base {base} is quantised: merge into a dequantised copy (opd-convert hf-to-mcore --hf-dir {base} "
            "--out BASE_MCORE, then --base BASE_MCORE)"
        )
    arch = load_architecture(base)
    deltas = hf_deltas(read_adapters(ckpt, arch), arch)
    unknown = sorted(set(deltas) - set(reader.names()))
    if unknown:
        raise CheckpointError(
            f"the base {base} has no tensor {unknown[0]} for the adapters of {ckpt}: is it their base?"
        )
    out_dtype = parse_dtype(dtype) if dtype is not None else None
    entries = {name: reader.entry(name) for name in reader.names()}
    planned = [TensorMeta(name, out_dtype or SAFETENSORS_DTYPES[e.dtype], e.shape) for name, e in entries.items()]

    def write(staging: Path) -> int:
        plan = plan_shards(planned, max_shard_bytes)
        plan.create_files(staging)
        written = 0
        for meta in planned:
            tensor = reader.get(meta.name)
            if meta.name in deltas:  # W + s B A in float64, as the converter merges
                A, B, scale = deltas[meta.name]
                tensor = (tensor.double() + scale * (B.double() @ A.double())).to(tensor.dtype)
            written += plan.write(staging, meta.name, tensor.to(meta.dtype))
        plan.write_index(staging)
        copy_hf_side_files(base, staging)
        write_exported_config(base, staging, out_dtype or planned[0].dtype)
        return written

    written = _write_on_first_rank(out_dir, force, write)
    return ConversionResult(Path(out_dir).resolve(), len(planned), written, time.perf_counter() - start)


def _write_on_first_rank(out_dir, force: bool, write) -> int:
    """``write(staging)`` on the first conversion rank, then the staging folder committed as ``out_dir`` (the
    others wait; every rank raises if it failed)."""
    with conversion_workers() as workers:
        error, result = None, 0
        if workers.is_first:
            staging = make_staging_dir(out_dir)
            try:
                result = write(staging)
                commit_staging_dir(staging, out_dir, force)
            except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
                discard_staging_dir(staging)
                error = err
        if not workers.all_ok(error is None):
            raise error or CheckpointError(f"writing {out_dir} failed on the first rank")
        return result


def export_peft_adapter(
    ckpt: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_config_dir: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Write the adapters of ``ckpt`` (adapter-only, or a checkpoint holding them beside their weights) as a PEFT
    folder: ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's names
    (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``), one adapter per Hugging Face projection.
    ``peft.PeftModel.from_pretrained(model, out_dir)`` on the base (or its export) then computes the adapter forward.
    The config comes from ``hf_config_dir``, else the base's (``base``, default the recorded one), else the
    checkpoint's ``hf_config/``."""
    from safetensors.torch import save_file

    from megatron_opd.checkpoint.adapters import is_adapter_checkpoint, saved_adapter_record
    from megatron_opd.checkpoint.source import config_dir

    ckpt = check_dist_checkpoint(ckpt)
    record = saved_adapter_record(ckpt) if is_adapter_checkpoint(ckpt) else None
    if hf_config_dir is None:
        base = base or (record or {}).get("base")
        hf_config_dir = config_dir(base, "--base") if base else ckpt / HF_CONFIG_DIR
    check_destination(out_dir, force, sources=(ckpt,))
    arch = load_architecture(hf_config_dir)
    tensors, modules, scales, ranks = {}, [], set(), set()
    for read, A, B, scale in read_adapters(ckpt, arch):
        for name, a, b in hf_adapters(read, A, B, arch):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()  # q, k, v share A: one copy each
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
            modules.append(module)
        scales.add(scale)
        ranks.add(A.shape[0])
    if len(scales) != 1 or len(ranks) != 1:
        raise CheckpointError(f"{ckpt}: adapters of several ranks {sorted(ranks)} or scales {sorted(scales)}")
    (rank,), (scale,) = ranks, scales
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base) if base else None,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        # full module names: a leaf name (gate_proj) would also match the routed experts, which have no adapters
        "target_modules": sorted(modules),
        "modules_to_save": None,
    }

    def write(staging: Path) -> None:
        save_file(tensors, str(staging / PEFT_WEIGHTS), metadata={"format": "pt"})
        (staging / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    _write_on_first_rank(out_dir, force, write)
    logger.info("wrote %d PEFT adapters (rank %d, alpha %g) to %s", len(modules), rank, scale * rank, out_dir)
    return Path(out_dir).resolve()
