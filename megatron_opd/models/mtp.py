"""Multi-token-prediction (MTP) layers of DeepSeek-V3 checkpoints: present in the files, absent from the model.

DeepSeek-V3/R1 publish ``num_nextn_predict_layers`` extra layers after the ``num_hidden_layers`` decoder layers
(``model.layers.61.*`` of the 61-layer V3: its own attention, experts, ``eh_proj``, norms, embedding and head),
used in pre-training and for speculative decoding. Megatron-opd scores and trains next-token prediction only, so
the loader and the converter skip them, and say so once, rather than silently. Any other tensor no weight rule
names is left unread as before. An exported folder has none, so its ``config.json`` declares none either
(:func:`without_mtp`): a loader that reads the count (vLLM's speculative decoding) would look for missing tensors.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_opd.models.hf_io import HFCheckpointReader

MTP_LAYERS_KEY = "num_nextn_predict_layers"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layer_tensors(reader: HFCheckpointReader, num_layers: int) -> dict[int, list[str]]:
    """Layer index -> checkpoint tensors of each MTP layer ``config.json``'s ``num_nextn_predict_layers`` declares
    (the layers right after ``num_layers``), for those present in the checkpoint."""
    try:
        count = int(reader.config.get("num_nextn_predict_layers") or 0)
    except (TypeError, ValueError):
        count = 0
    layers = range(num_layers, num_layers + count)
    found: dict[int, list[str]] = {}
    for name in reader.names():
        match = _LAYER.match(name)
        if match and int(match.group(1)) in layers:
            found.setdefault(int(match.group(1)), []).append(name)
    return dict(sorted(found.items()))


def skipped_mtp_message(reader: HFCheckpointReader, num_layers: int) -> str | None:
    """The one log line saying which MTP layers of the checkpoint are skipped and why; None when it has none."""
    found = mtp_layer_tensors(reader, num_layers)
    if not found:
        return None
    tensors = sum(len(names) for names in found.values())
    return (
        f"skipping {tensors} tensors of multi-token-prediction layer(s) {list(found)} in {reader.dir} "
        f"(config.json num_nextn_predict_layers={reader.config.get('num_nextn_predict_layers')}): megatron-opd "
        "scores and trains next-token prediction only, so they are neither loaded nor exported"
    )


def without_mtp(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` dict) declaring no MTP layer: ``num_nextn_predict_layers`` 0 where it was set,
    for a folder megatron-opd writes (its weights never include them)."""
    return {**config, MTP_LAYERS_KEY: 0} if config.get(MTP_LAYERS_KEY) else config
