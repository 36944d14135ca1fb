"""TRL GKDTrainer side of bench_train.py: runs in TRL's own venv, never imports megatron_opd.

    python benchmarks/_trl_gkd_worker.py SPEC.json RESULT.json

SPEC (written by bench_train.py): student/teacher Hugging Face folders, the prompts already tokenized by
megatron_opd's PromptEncoder (so both trainers sample from identical prompt ids), batch, response length,
beta, temperature, learning rate, steps, threads, seed. RESULT: per-step wall times (on_step_end to on_step_end,
and on_step_begin to on_step_end), per-step generation time and generated response tokens, the loss, this
process's peak RSS (VmHWM) and the library versions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from _trl_common import cpu_run_args, step_times_callback, vm_hwm_bytes


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    pad_id = int(spec["pad_token_id"])
    generation: list[dict[str, float]] = []

    class TimedGKDTrainer(GKDTrainer):
        """GKDTrainer with its on-policy generation timed and its response tokens counted (nothing else changed)."""

        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):
            t0 = time.perf_counter()
            ids, attention_mask, labels = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            prompt_len = inputs["prompts"].shape[1]
            generation.append(
                {
                    "seconds": time.perf_counter() - t0,
                    "response_tokens": int(attention_mask[:, prompt_len:].sum()),
                    "sequences": int(ids.shape[0]),
                }
            )
            return ids, attention_mask, labels

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        # Left-padded prompts for generate(); no "labels" key, so the Trainer passes no num_items_in_batch and
        # GKD's loss is the mean over the sampled response tokens (as our token_mean).
        width = max(len(r["prompt_ids"]) for r in rows)
        prompts = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["prompt_ids"])
            prompts[i, width - n :] = torch.tensor(r["prompt_ids"])
            mask[i, width - n :] = 1
        return {"prompts": prompts, "prompt_attention_mask": mask, "input_ids": prompts, "attention_mask": mask}

    tokenizer = AutoTokenizer.from_pretrained(spec["student"])
    tokenizer.pad_token_id = pad_id
    student = AutoModelForCausalLM.from_pretrained(spec["student"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher"], dtype=torch.float32)
    # Stop on the same ids as our sampler (the tokenizer's EOS; the fixture's generation_config.json has none).
    student.generation_config.eos_token_id = list(spec["stop_token_ids"])
    dataset = Dataset.from_list([{"prompt_ids": ids} for ids in spec["prompt_ids"]])

    out_dir = tempfile.mkdtemp(prefix="trl_gkd_")
    args = GKDConfig(
        output_dir=out_dir,
        per_device_train_batch_size=int(spec["prompts_per_step"]),
        gradient_accumulation_steps=1,
        max_steps=int(spec["steps"]),
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        lmbda=1.0,
        beta=float(spec["beta"]),
        temperature=float(spec["temperature"]),
        max_new_tokens=int(spec["max_new_tokens"]),
        max_length=int(spec["max_seq_len"]),
        disable_dropout=True,
        **cpu_run_args(int(spec["seed"])),
        remove_unused_columns=False,
    )
    timer = step_times_callback()
    trainer = TimedGKDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        data_collator=collate,
        callbacks=[timer],
    )
    trainer.train()

    steps = len(timer.end)
    starts = [timer.train_begin] + timer.end[:-1]
    result = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "threads": torch.get_num_threads(),
        "step_seconds": [e - s for s, e in zip(starts, timer.end)],
        "step_seconds_inner": [e - b for b, e in zip(timer.begin, timer.end)],
        "generation_seconds": [g["seconds"] for g in generation[:steps]],
        "response_tokens": [g["response_tokens"] for g in generation[:steps]],
        "sequences": [g["sequences"] for g in generation[:steps]],
        "loss": timer.losses,
        "peak_rss_bytes": vm_hwm_bytes(),
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {os.path.basename(sys.argv[0])} SPEC.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
