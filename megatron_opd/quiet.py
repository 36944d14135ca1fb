"""The one place that silences library output we have checked is harmless, so a run shows our output.

Checked on CPU with megatron-core 0.16 and torch 2.13 (each line below was seen on every rank of the old quick
start): apex / TransformerEngine missing (we use the local spec on purpose; the trainer logs which library runs
each part instead, see megatron_opd.fused_libraries), CUDA-only hints and deprecations that megatron-core prints
on import, and torch.distributed's notes about gloo. Only rank 0 logs at INFO; other
ranks log warnings and errors. Anything not listed here still reaches the console.
"""

from __future__ import annotations

import logging
import os
import warnings

# (category, message regex) pairs: each checked harmless for megatron-opd's code paths.
_HARMLESS_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (UserWarning, r".*[Aa]pex.*"),
    (UserWarning, r".*[Tt]ransformer[ _-]?[Ee]ngine.*"),
    (UserWarning, r".*CUDA.*not available.*"),
    (UserWarning, r".*torch\.cuda.*"),
    (UserWarning, r".*pin_memory.*no accelerator.*"),
    (UserWarning, r".*Megatron-Core.*(experimental|deprecated).*"),
    (UserWarning, r".*To copy construct from a tensor.*"),
    (UserWarning, r".*TypedStorage is deprecated.*"),
    (UserWarning, r".*barrier\(\).*device_id.*"),
    (UserWarning, r".*No device id is provided.*"),
    (UserWarning, r".*nvidia-modelopt.*"),
    (UserWarning, r".*Unsupported.*[Ff]used.*"),
    (UserWarning, r".*`torch_dist` and `zarr`.*"),
    (UserWarning, r".*full scope is deprecated.*"),
    (UserWarning, r".*CUDA_DEVICE_MAX_CONNECTIONS.*"),
    # megatron-core 0.19: an import-time notice, and torch's notes when every rank reads the common state alone.
    (UserWarning, r".*MimoModelConfig is experimental.*"),
    (UserWarning, r".*assuming the intent is to load in a single process.*"),
    (UserWarning, r".*argument order of load has been changed.*"),
    (FutureWarning, r".*"),
    (DeprecationWarning, r".*"),
)

# Loggers that announce optional fused kernels or version notes at INFO/WARNING on every rank.
_NOISY_LOGGERS = (
    "megatron",
    "megatron.core",
    "torch.distributed",
    "torch.distributed.elastic",
    "transformers",
    "urllib3",
    "filelock",
    "vllm",  # trainer ranks import only vLLM's weight-transfer classes; the engine logs to its own file
)


def silence_harmless_warnings() -> None:
    """Ignore the library warnings listed above (and only those) in this process."""
    for category, message in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def install(rank: int | None = None, level: int = logging.INFO) -> None:
    """Set up logging for this process: our INFO on rank 0, warnings elsewhere, known-harmless noise filtered."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    silence_harmless_warnings()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s" if rank == 0 else f"[rank {rank}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
