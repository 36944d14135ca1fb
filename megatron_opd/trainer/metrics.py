"""Per-step metrics to the console (under a tqdm bar), ``output_dir/metrics.jsonl``, TensorBoard and, optionally,
W&B. Rank 0 only."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_opd.trainer.config import LoggingConfig

logger = logging.getLogger("megatron_opd.train")

# Console columns, in order: (metric key, label, format).
_CONSOLE = (
    ("loss", "loss", "{:.4f}"),
    ("divergence", "div/tok", "{:.4f}"),
    ("top1_agreement", "top1", "{:.2f}"),
    ("response_length", "resp", "{:.1f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("time/rollout", "rollout", "{:.2f}s"),
    ("time/teacher", "teacher", "{:.2f}s"),
    ("time/update", "update", "{:.2f}s"),
    ("lr", "lr", "{:.2e}"),
    ("moe/load_balancing_loss", "aux", "{:.3f}"),  # Mixture-of-Experts students only
    ("moe/expert_load_max", "load", "{:.2f}"),
    ("staleness/policy_lag", "lag", "{:.3f}"),  # stale batches only
    ("staleness/is_weight_std", "IS sd", "{:.2f}"),
    ("staleness/lr_scale", "lr x", "{:.2f}"),  # optim.lag_lr_target
)


class MetricsLogger:
    """Writes metrics on rank 0; a no-op elsewhere."""

    def __init__(
        self,
        cfg: LoggingConfig,
        output_dir: str,
        *,
        rank: int,
        total_steps: int,
        start_step: int,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.enabled = rank == 0
        self.bar = None
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.jsonl = Path(output_dir) / "metrics.jsonl"
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, disable=None
            )
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("logging.wandb_project is set but wandb is not installed: pip install wandb") from err
            self.wandb = wandb.init(project=cfg.wandb_project, config=run_config, dir=output_dir)

    def write(self, message: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            logger.info(message)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        if not self.enabled:
            return
        if self.bar is not None and advance:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}", refresh=False)
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if advance and step % self.cfg.log_every == 0:
            cols = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in _CONSOLE if key in metrics]
            cols += [  # several teachers (teachers.*): each one's per-token divergence
                f"{key.split('/')[1]} div {value:.4f}"
                for key, value in metrics.items()
                if key.startswith("teacher/") and key.endswith("/divergence")
            ]
            self.write(f"step {step:>5} | " + " | ".join(cols))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
