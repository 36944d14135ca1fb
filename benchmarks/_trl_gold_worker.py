"""TRL GOLDTrainer side of bench_cross_tokenizer.py: runs in TRL's own venv, never imports megatron_opd.

    python benchmarks/_trl_gold_worker.py SPEC.json RESULT.json              # train with GOLD, evaluate before/after
    python benchmarks/_trl_gold_worker.py --eval-only SPEC.json RESULT.json  # evaluate SPEC's student only

SPEC (written by bench_cross_tokenizer.py): ``student`` and ``teacher`` Hugging Face folders, each with its own
tokenizer; ``train_file`` / ``eval_file`` (jsonl records with ``prompt`` and ``answer``, the prompt text as is, no
chat template); ``prompts_per_step``, ``steps``, ``max_new_tokens``, ``temperature``, ``top_p``; the learning rate
schedule ``lr``, ``min_lr``, ``lr_warmup_steps`` (linear warm-up, cosine to ``min_lr``: HF's
``cosine_with_min_lr``, as our ``lr_decay_style: cosine``); ``seed``, ``threads``, ``hybrid`` (GOLD's
``uld_use_hybrid_loss``), ``save_dir`` (the trained student, optional), ``eval_max_prompts``, and ``gold_config``
(more ``GOLDConfig`` keys, applied last). Only ``student``, ``teacher``, ``eval_file`` and the sampling keys are read
with ``--eval-only``.

GOLD runs fully on-policy (``lmbda=1``) with the ULD loss across tokenizers (``use_uld_loss=True``,
``teacher_tokenizer_name_or_path`` = the teacher's folder) and GOLD's defaults for everything else in the loss
(extended ULD with byte-offset alignment, ``uld_token_merge_strategy="observed"``, ``uld_skip_student_eos`` and
``uld_skip_teacher_eos``, hybrid weights adaptive when ``hybrid``). Sampling follows the SPEC (temperature, top_p)
instead of GOLD's 0.9 / 0.95, so that both trainers sample the same distribution. Off, unlike ``SFTConfig``'s
defaults: gradient checkpointing (our trainer recomputes nothing) and bf16 (fp32 on both sides). One change to
GOLD, without which it fails: its sampler (``model.generate``) is kept off the output rows past the tokenizer's ids
(``generation_config.suppress_tokens``; the task's models pad the vocabulary to a multiple of 16, like Qwen's), as our
sampler is; a sampled padding id has no token string and GOLD's byte offsets raise ``TypeError`` in
``piece_byte_len``. HF's schedule counts steps from 0: GOLD's learning rate is one step behind ours (0 at step 1).

What GOLD's defaults mean here (read from ``trl/experimental/gold/gold_trainer.py``, 1.16.0): ULD compares the
*sorted* probability vectors of the aligned groups (L1), blind to which token holds which probability; the hybrid
loss adds a JSD over the tokens whose strings both vocabularies share (the digits, EOS; weight = their share of the
teacher's rows, 0.92 here). ``observed`` slices the logits at the answer positions, each predicting the *next* token,
so the distribution of the first answer token is never compared, while the one predicting EOS is.

RESULT: per-step wall times (on_step_end to on_step_end, and on_step_begin to on_step_end), per-step generation time
and response tokens, GOLD's loss and learning rate per logged step, this process's peak RSS, the versions, the GOLD
settings used, and ``eval_before`` / ``eval_after`` (``eval`` with ``--eval-only``), each of them:

- ``accuracy``: greedy decoding of the first ``eval_max_prompts`` eval prompts (``max_new_tokens``, stop at EOS),
  the response decoded without special tokens, cut at the first EOS text, stripped and compared with the record's
  ``answer`` (``megatron_opd.tasks.digits.score``);
- ``sequence_log_ratio``: one sample per eval prompt from the student (``temperature``, ``top_p``, seeded), then the
  mean over samples of ``log p_teacher(text) - log q_student(sample)``. ``log q``: the sum of the student's
  log-probabilities (temperature 1) of its response tokens, the EOS included where it stopped. ``log p``: the response
  decoded by the student's tokenizer (special tokens skipped), encoded by the teacher's tokenizer (no special tokens),
  the teacher's EOS appended where the student stopped, scored after the prompt encoded by the teacher's tokenizer;
  the sum of the teacher's log-probabilities of those tokens. That is our trainer's ``cross_tokenizer/
  sequence_log_ratio`` (which also moves part of the last text token's probability to EOS, keeping the sum), on
  held-out prompts instead of the step's training prompts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from _trl_common import cpu_run_args, step_times_callback, vm_hwm_bytes

EOS_TEXT = "<|endoftext|>"
"""The task's EOS, cut at by the scorer (``megatron_opd.tasks.digits.EOS_TOKEN``)."""


def read_records(path: str, limit: int | None = None) -> list[dict]:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records[:limit] if limit is not None else records


def score(response: str, answer) -> float:
    """1.0 iff ``response`` (cut at the first EOS, stripped) is ``answer``: ``megatron_opd.tasks.digits.score``."""
    return 1.0 if response.split(EOS_TEXT, 1)[0].strip() == str(answer).strip() else 0.0


# ---- evaluation ---------------------------------------------------------------------------------------------------


def generate(model, prompts: list[list[int]], vocab: int, eos_id: int, max_new_tokens: int, temperature: float,
             top_p: float, seed: int) -> list[list[int]]:  # fmt: skip
    """Each prompt's response ids, the EOS kept where it stopped; ``temperature`` 0 is greedy; only ids below
    ``vocab`` (the tokenizer's; the embedding's rows past it are padding) are sampled, as our sampler does.

    Prompts go in batches of one length, so no padding can change what is generated."""
    import torch
    from transformers import GenerationConfig

    sampled = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampled, temperature=temperature if sampled else None,
        top_p=top_p if sampled else None, top_k=0 if sampled else None, eos_token_id=eos_id, pad_token_id=eos_id,
        suppress_tokens=padding_rows(model, vocab),
    )  # fmt: skip
    torch.manual_seed(seed)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    responses: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for length, rows in sorted(by_length.items()):
            ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            for i, row in zip(rows, out[:, length:].tolist()):
                responses[i] = row[: row.index(eos_id) + 1] if eos_id in row else row
    return responses


def padding_rows(model, vocab: int) -> list[int] | None:
    """The output rows past the tokenizer's ``vocab`` ids (never real tokens), or None."""
    rows = int(model.get_output_embeddings().weight.shape[0])
    return list(range(vocab, rows)) or None


def sequence_logprobs(model, prompts: list[list[int]], responses: list[list[int]], vocab: int,
                      batch: int = 64) -> list[float]:  # fmt: skip
    """The sum of each response's token log-probabilities after its prompt (temperature 1, normalised over the
    tokenizer's ``vocab`` ids, as our trainer does)."""
    import torch

    totals: list[float] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            seqs = [p + r for p, r in zip(prompts[start : start + batch], responses[start : start + batch])]
            width = max(len(s) for s in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[..., :vocab].double(), dim=-1)
            for i, (p, r) in enumerate(zip(prompts[start : start + batch], responses[start : start + batch])):
                positions = torch.arange(len(p) - 1, len(p) - 1 + len(r))
                totals.append(float(logp[i, positions, torch.tensor(r, dtype=torch.long)].sum()) if r else 0.0)
    return totals


def evaluate(student, teacher, student_tok, teacher_tok, records: list[dict], spec: dict) -> dict:
    """Held-out greedy accuracy and sequence log-ratio to the teacher (see the module docstring)."""
    student_eos, teacher_eos = int(student_tok.eos_token_id), int(teacher_tok.eos_token_id)
    max_new, seed = int(spec["max_new_tokens"]), int(spec["seed"])
    was_training = student.training
    student.eval()
    teacher.eval()
    t0 = time.perf_counter()
    prompts = [student_tok(r["prompt"], add_special_tokens=True)["input_ids"] for r in records]
    s_vocab, t_vocab = len(student_tok), len(teacher_tok)
    greedy = generate(student, prompts, s_vocab, student_eos, max_new, 0.0, 1.0, seed)
    texts = [student_tok.decode(r, skip_special_tokens=True) for r in greedy]
    accuracy = sum(score(t, r["answer"]) for t, r in zip(texts, records)) / len(records)

    samples = generate(student, prompts, s_vocab, student_eos, max_new, float(spec["temperature"]),
                       float(spec.get("top_p", 1.0)), seed + 1)  # fmt: skip
    logq = sequence_logprobs(student, prompts, samples, s_vocab)
    teacher_prompts = [teacher_tok(r["prompt"], add_special_tokens=True)["input_ids"] for r in records]
    teacher_responses = []
    for sample in samples:
        text = student_tok.decode(sample, skip_special_tokens=True)
        ids = list(teacher_tok(text, add_special_tokens=False)["input_ids"])
        teacher_responses.append(ids + [teacher_eos] if sample and sample[-1] == student_eos else ids)
    logp = sequence_logprobs(teacher, teacher_prompts, teacher_responses, t_vocab)
    ratios = [p - q for p, q in zip(logp, logq)]
    student.train(was_training)
    return {
        "accuracy": accuracy,
        "greedy_response_length": sum(len(r) for r in greedy) / len(greedy),
        "sequence_log_ratio": sum(ratios) / len(ratios),
        "sample_response_length": sum(len(r) for r in samples) / len(samples),
        "stopped_share": sum(1 for s in samples if s and s[-1] == student_eos) / len(samples),
        "prompts": len(records),
        "seconds": time.perf_counter() - t0,
        "greedy_examples": [{"prompt": r["prompt"], "response": t} for r, t in zip(records[:4], texts[:4])],
    }


def load(spec: dict):
    """Student and teacher (fp32, eval mode) with their own tokenizers; the student stops on its EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student_tok = AutoTokenizer.from_pretrained(spec["student"])
    teacher_tok = AutoTokenizer.from_pretrained(spec["teacher"])
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
    student.generation_config.eos_token_id = student_tok.eos_token_id
    student.generation_config.pad_token_id = student_tok.pad_token_id
    return student.eval(), teacher.eval(), student_tok, teacher_tok


# ---- training -----------------------------------------------------------------------------------------------------


def gold_config(spec: dict, out_dir: str):
    """GOLD's configuration: on-policy ULD across tokenizers, the SPEC's batch, sampling and schedule."""
    from trl.experimental.gold import GOLDConfig

    kwargs = dict(
        output_dir=out_dir,
        per_device_train_batch_size=int(spec["prompts_per_step"]),
        gradient_accumulation_steps=1,
        max_steps=int(spec["steps"]),
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": float(spec["min_lr"])},
        warmup_steps=int(spec["lr_warmup_steps"]),
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        lmbda=1.0,  # every batch sampled by the student
        temperature=float(spec["temperature"]),
        top_p=float(spec.get("top_p", 1.0)),
        max_completion_length=int(spec["max_new_tokens"]),
        max_length=int(spec.get("max_length", 64)),
        use_uld_loss=True,
        teacher_tokenizer_name_or_path=spec["teacher"],
        uld_use_hybrid_loss=bool(spec["hybrid"]),
        gradient_checkpointing=False,
        **cpu_run_args(int(spec["seed"])),
    )
    kwargs.update(spec.get("gold_config", {}))
    return GOLDConfig(**kwargs)


def train(spec: dict, student, teacher, student_tok, result: dict) -> None:
    """GOLD's training run, timed per step; fills ``result`` and saves the student to ``spec["save_dir"]``."""
    from datasets import Dataset
    from trl.experimental.gold import GOLDTrainer

    generation: list[dict[str, float]] = []

    class TimedGOLDTrainer(GOLDTrainer):
        """GOLDTrainer with its on-policy generation timed and its response tokens counted (nothing else changed)."""

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            t0 = time.perf_counter()
            out = super().generate_on_policy_outputs(model, inputs, generation_config)
            prompt_len = inputs["prompts"].shape[1]
            generation.append(
                {"seconds": time.perf_counter() - t0, "response_tokens": int(out[1][:, prompt_len:].sum())}
            )
            return out

    # GOLD's prompt-completion text format; with lmbda=1 the completion is never trained on (GOLD needs one to
    # build its dataset: the record's answer).
    rows = [{"prompt": r["prompt"], "completion": str(r["answer"])} for r in read_records(spec["train_file"])]
    out_dir = tempfile.mkdtemp(prefix="trl_gold_")
    args = gold_config(spec, out_dir)
    timer = step_times_callback()
    trainer = TimedGOLDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=student_tok,
        callbacks=[timer],
    )
    # Needed to run at all: HF's generate samples every output row, and a padding row's id (past the tokenizer's,
    # which our sampler never samples) makes GOLD's byte offsets fail (piece_byte_len(None): TypeError).
    trainer.generation_config.suppress_tokens = padding_rows(student, len(student_tok))
    trainer.train()
    steps = len(timer.end)
    starts = [timer.train_begin] + timer.end[:-1]
    keys = ("lmbda", "beta", "temperature", "top_p", "top_k", "use_uld_loss", "use_extended_uld",
            "uld_token_merge_strategy", "uld_use_hybrid_loss", "uld_hybrid_matched_weight",
            "uld_hybrid_unmatched_weight", "uld_crossentropy_weight", "uld_distillation_weight",
            "uld_student_temperature", "uld_teacher_temperature", "uld_skip_student_eos", "uld_skip_teacher_eos",
            "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "max_grad_norm",
            "weight_decay", "optim", "gradient_checkpointing", "max_length", "max_completion_length")  # fmt: skip
    result.update(
        gold_settings={k: getattr(args, k) for k in keys},
        step_seconds=[e - s for s, e in zip(starts, timer.end)],
        step_seconds_inner=[e - b for b, e in zip(timer.begin, timer.end)],
        generation_seconds=[g["seconds"] for g in generation[:steps]],
        response_tokens=[g["response_tokens"] for g in generation[:steps]],
        loss=[log["loss"] for log in timer.logs],
        lr=[log.get("learning_rate") for log in timer.logs],
        logs=timer.logs,
    )
    if spec.get("save_dir"):
        trainer.save_model(spec["save_dir"])


def main(argv: list[str]) -> None:
    eval_only = "--eval-only" in argv
    paths = [a for a in argv if a != "--eval-only"]
    if len(paths) != 2:
        raise SystemExit(f"usage: {os.path.basename(sys.argv[0])} [--eval-only] SPEC.json RESULT.json")
    with open(paths[0]) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import transformers
    import trl

    student, teacher, student_tok, teacher_tok = load(spec)
    eval_records = read_records(spec["eval_file"], int(spec.get("eval_max_prompts", 256)))
    result: dict = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
    }
    if eval_only:
        result["eval"] = evaluate(student, teacher, student_tok, teacher_tok, eval_records, spec)
    else:
        result["eval_before"] = evaluate(student, teacher, student_tok, teacher_tok, eval_records, spec)
        train(spec, student, teacher, student_tok, result)
        result["eval_after"] = evaluate(student, teacher, student_tok, teacher_tok, eval_records, spec)
    result["peak_rss_bytes"] = vm_hwm_bytes()
    with open(paths[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
