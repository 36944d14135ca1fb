"""The rollout-fidelity monitor: its cost per update, and its values on healthy fp32 runs with each rollout back end.

    python benchmarks/bench_fidelity.py               # ~2 minutes on 2 cores (vLLM rows skip without vllm)
    python benchmarks/bench_fidelity.py --json out.json

Cost: one process (TP=1), a tied Qwen3-shaped student (``--hidden`` 256, 4 layers, ``--vocab`` 32,000) and one
update of ``--samples`` x ``--seq`` tokens on a top-k reverse-KL loss, timed with the sampler's log-probabilities in
the batch (the monitor on) and without (off), the rows interleaved over ``--rounds``; medians. At
``loss.student_temperature`` 1 the monitor reads the loss pass's log-normaliser and gathers one logit per token; at 2
it takes one more logsumexp pass over the shard (the second pair of rows).

Healthy values: a few real steps (sample, update, sync) with the built-in sampler and with a vLLM engine process
(fp32), the monitor's ``rollout/*`` metrics of each step: what the fp32 default of ``rollout.max_logprob_diff`` is
measured against.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _cost_body(model_dir: str, samples: int, seq: int, rounds: int) -> dict:
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.interfaces import TeacherScores
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    accel = initialize_distributed(ParallelConfig())
    arch, chunks = build_and_load(model_dir, ParallelConfig(), trainable=True)
    optim = OptimConfig(lr=1e-6)
    student = Student(chunks, optim, precision_plan(optim, accel), total_steps=1000)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (16,), generator=gen) for _ in range(samples)]
    responses = [torch.randint(0, arch.vocab_size, (seq - 16,), generator=gen) for _ in range(samples)]
    masks = [torch.ones(seq - 16) for _ in range(samples)]
    logprobs = [-torch.rand(seq - 16, generator=gen) * 8 for _ in range(samples)]
    on = pack(prompts, responses, masks, pad_token_id=0, seq_len=seq, logprobs=logprobs)
    off = pack(prompts, responses, masks, pad_token_id=0, seq_len=seq)
    k = 16
    teacher = torch.log_softmax(torch.randn(samples, seq, arch.vocab_size, generator=gen), -1).topk(k, dim=-1)
    scores = TeacherScores(topk_ids=teacher.indices, topk_logprobs=teacher.values)
    times: dict[str, list[float]] = {}
    for _ in range(rounds + 1):  # the first round warms up
        for t_student in (1.0, 2.0):
            cfg = LossConfig(kind="reverse_kl", mode="topk", topk=k, student_temperature=t_student)
            for name, batch in (("off", off), ("on", on)):
                start = time.perf_counter()
                train_step(student, batch, scores, cfg, vocab_size=arch.vocab_size, teacher_temperature=1.0,
                           micro_batch_size=samples)  # fmt: skip
                times.setdefault(f"T={t_student:g} monitor {name}", []).append(time.perf_counter() - start)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def _healthy_body(model_dir: str, steps: int, with_vllm: bool, log_file: str) -> dict:
    from megatron_opd.checkpoint.source import build_and_load
    from megatron_opd.data.batch import pack_rollouts
    from megatron_opd.distributed import ParallelConfig, initialize_distributed
    from megatron_opd.interfaces import SamplingParams
    from megatron_opd.rollout import BuiltinSampler
    from megatron_opd.rollout.fidelity import fidelity_metrics
    from megatron_opd.trainer.config import LossConfig, OptimConfig
    from megatron_opd.trainer.objective import train_step
    from megatron_opd.trainer.student import Student, precision_plan

    accel = initialize_distributed(ParallelConfig())
    out: dict = {}
    backends = ["builtin"] + (["vllm"] if with_vllm else [])
    for backend in backends:
        arch, chunks = build_and_load(model_dir, ParallelConfig(), trainable=True)
        optim = OptimConfig(lr=1e-3)
        student = Student(chunks, optim, precision_plan(optim, accel), total_steps=steps)
        if backend == "builtin":
            rollout = BuiltinSampler(chunks, vocab_size=arch.vocab_size, max_seq_len=96, pad_token_id=0)
        else:
            from megatron_opd.rollout.vllm_backend import VLLMRollout
            from megatron_opd.rollout.vllm_engine import EngineOptions
            from megatron_opd.weight_sync.source import megatron_weight_source

            options = EngineOptions(model=model_dir, max_model_len=96, log_file=log_file)
            rollout = VLLMRollout(megatron_weight_source(chunks, arch), options, dp_rank=0)
        rollout.sync_weights(0)
        rows = []
        for step in range(steps):
            sampling = SamplingParams(max_new_tokens=48, temperature=1.0, seed=step)
            prompts = [[5 + i, 6 + i, 7 + i] for i in range(8)]
            batch = pack_rollouts(rollout.generate(prompts, sampling, 2).result(), pad_token_id=0)
            seen: dict = {}
            train_step(student, batch, None, LossConfig(kind="sft"), vocab_size=arch.vocab_size,
                       teacher_temperature=1.0, micro_batch_size=16,
                       guard=lambda stats, seen=seen: seen.update(fidelity_metrics(stats.as_dict())))  # fmt: skip
            rows.append(seen)
            rollout.sync_weights(step + 1)
        if hasattr(rollout, "close"):
            rollout.close()
        out[backend] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--healthy-steps", type=int, default=4)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    import importlib.util

    from megatron_opd.testing.multiprocess import run_distributed
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        big = make_tiny_hf_model("qwen3", Path(tmp) / "big", seed=0, hidden_size=args.hidden, intermediate_size=
                                 3 * args.hidden, num_attention_heads=args.hidden // 32, num_key_value_heads=2,
                                 vocab_size=args.vocab, tie_word_embeddings=True, max_position_embeddings=1024)  # fmt: skip
        small = make_tiny_hf_model("qwen3", Path(tmp) / "small", seed=1, tie_word_embeddings=True)
        (cost,) = run_distributed(_cost_body, 1, args=(str(big), args.samples, args.seq, args.rounds), timeout=1800)
        with_vllm = importlib.util.find_spec("vllm") is not None
        (healthy,) = run_distributed(
            _healthy_body, 1, args=(str(small), args.healthy_steps, with_vllm, str(Path(tmp) / "vllm.log")),
            timeout=1800,
        )  # fmt: skip
    print(f"update of {args.samples} x {args.seq} tokens, hidden {args.hidden}, vocabulary {args.vocab}, TP=1, fp32")
    print("| student temperature | monitor off (s) | monitor on (s) | on / off |")
    print("| --- | --- | --- | --- |")
    for t in ("1", "2"):
        off, on = cost[f"T={t} monitor off"], cost[f"T={t} monitor on"]
        print(f"| {t} | {off:.3f} | {on:.3f} | {on / off:.3f} |")
    print("\nhealthy fp32 runs, per step (tiny tied qwen3, 16 samples x <= 48 tokens):")
    print("| back end | logprob_diff_mean (max over steps) | logprob_diff_max | kl_k3 | ppl_ratio - 1 |")
    print("| --- | --- | --- | --- | --- |")
    for backend, rows in healthy.items():
        worst = lambda key, rows=rows: max(abs(r[key]) for r in rows)  # noqa: E731
        print(f"| {backend} | {worst('rollout/logprob_diff_mean'):.2e} | {worst('rollout/logprob_diff_max'):.2e} "
              f"| {worst('rollout/kl_k3'):.2e} | {max(abs(r['rollout/ppl_ratio'] - 1) for r in rows):.2e} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": cost, "healthy": healthy}, indent=2))


if __name__ == "__main__":
    main()
