"""What the TRL workers of the benchmarks share (``_trl_gkd_worker.py``, ``_trl_gold_worker.py``): they run in TRL's
own venv and never import megatron_opd."""

from __future__ import annotations

import time


def vm_hwm_bytes() -> int:
    """This process's peak resident memory (the kernel's ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def step_times_callback():
    """A ``TrainerCallback`` recording each step's begin and end (``perf_counter``) and every logged row with a
    loss (``logs``; ``losses`` its losses)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.train_begin = 0.0
            self.begin: list[float] = []
            self.end: list[float] = []
            self.logs: list[dict] = []

        @property
        def losses(self) -> list[float]:
            return [log["loss"] for log in self.logs]

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()}})

    return StepTimes()


def cpu_run_args(seed: int) -> dict:
    """The TRL config arguments of a timed fp32 CPU run: no mixed precision, no checkpoints, no reporting, a log
    row per step."""
    return dict(use_cpu=True, bf16=False, fp16=False, seed=seed, logging_steps=1, report_to="none",
                save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
