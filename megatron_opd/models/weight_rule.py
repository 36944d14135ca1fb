"""What a family declares about each weight: the Megatron parameter, the Hugging Face tensors it is made of, and how
it is split over tensor- and expert-parallel ranks (applied by :mod:`megatron_opd.models.name_mapping`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Split(str, Enum):
    """How a full Megatron tensor is split across tensor-parallel ranks."""

    REPLICATED = "replicated"  # every rank holds all of it (norms)
    COLUMN = "column"  # dim 0 (ColumnParallelLinear output features)
    ROW = "row"  # dim 1 (RowParallelLinear input features)
    VOCAB = "vocab"  # dim 0 of a vocabulary-padded embedding / output layer
    QKV = "qkv"  # dim 0, whole key/value groups per rank
    GATE_UP = "gate_up"  # gate and up each split on dim 0, then stacked per rank
    GROUPED = "grouped"  # dim 0 in whole groups (``WeightRule.group_rows``), each rank an equal run of groups
    GATE_UP_INTERLEAVED = "gate_up_interleaved"  # as GATE_UP; one HF tensor whose rows alternate gate, up (gpt-oss)


class ExpertSplit(str, Enum):
    """How a Mixture-of-Experts tensor is split across expert-parallel ranks (declared for MoE families)."""

    NONE = "none"  # not an expert tensor: every expert-parallel rank holds it (dense layers, router, norms)
    PER_EXPERT = "per_expert"  # one tensor per expert ({expert} in the names); each EP rank holds E/EP experts
    # expand_rules() yields one rule per expert with {expert} filled by the GLOBAL expert index (as {layer} is the
    # global layer); Megatron numbers a rank's experts locally (local_experts.0..E/EP-1): see global_expert_names().


@dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter and the Hugging Face tensors it is built from."""

    megatron: str
    """Local-spec Megatron name, ``{layer}`` for the global layer index."""
    hf: tuple[str, ...]
    """Hugging Face names, in fusion order (q, k, v / gate, up), or one name where the checkpoint fuses them
    (Phi-3's ``qkv_proj``: all q rows, then k, then v; ``gate_up_proj``: gate, then up)."""
    split: Split
    te_megatron: str | None = None
    """Name under the TransformerEngine spec, where it differs (norms fused into linears)."""
    experts: ExpertSplit = ExpertSplit.NONE
    """The split across expert-parallel ranks, on top of ``split`` (tensor parallelism within an expert)."""
    layers: tuple[int, ...] | None = None
    """The global layers that hold this per-layer tensor (None: every layer); MoE and dense layers differ."""
    buffer: bool = False
    """The Megatron tensor is a registered buffer, not a parameter (e.g. DeepSeek-V3's expert bias): it is
    loaded, converted and synced like a parameter but never trained."""
    hf_transposed: bool = False
    """The Hugging Face matrices are stored ``[in, out]``, the transpose of Megatron's (gpt-oss's stacked experts)."""
    hf_shape: tuple[tuple[int, ...], ...] | None = None
    """Each Hugging Face tensor's shape, where :func:`hf_shapes` cannot tell it from the name (multi-latent
    attention's projections)."""

    group_rows: tuple[tuple[int, ...], ...] | None = None
    """``Split.GROUPED`` only: for each Hugging Face tensor, the rows one group takes in each of its parts (a part
    holds every group's rows, group after group; Gated DeltaNet's ``[q; k; v]`` projection has three parts of
    ``key_head_dim``, ``key_head_dim`` and ``value_head_dim x`` values per key head). The Megatron tensor holds
    each group's rows of every part together, so that a tensor-parallel rank's slice is a run of whole groups."""

    def megatron_name(self, layer: int | None = None, te: bool = False) -> str:
        name = self.te_megatron if (te and self.te_megatron) else self.megatron
        return name.format(layer=layer) if layer is not None else name

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        return tuple(n.format(layer=layer) for n in self.hf) if layer is not None else self.hf

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron


def stacked_name(base: str, index: int | str) -> str:
    """The name of row ``index`` of a Hugging Face tensor stacked over experts (gpt-oss's ``mlp.experts.gate_up_proj``
    ``[experts, ...]``): a rule names one expert's row as ``base[index]`` (``index`` may be ``"{expert}"``); the
    checkpoint reader reads that row alone."""
    return f"{base}[{index}]"


def stacked_base(name: str) -> tuple[str, int | None]:
    """``(base, index)`` of a :func:`stacked_name`, ``(name, None)`` for a whole tensor."""
    if name.endswith("]") and "[" in name:
        base, _, index = name[:-1].rpartition("[")
        if index.isdigit():
            return base, int(index)
    return name, None
