"""The GPU-only parts of ``rollout.backend=vllm`` that CPU can still check: the trainer-driven sleep cycle (which
call reaches the engine when), the choice of weight-transfer back end and its refusals, vLLM's NCCL trainer init
info as we build it, and the version the control plane commits. The transfers themselves need CUDA (NCCL) and a
GPU build of vLLM."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_opd.rollout.sleep import SleepCycle
from megatron_opd.trainer.config import RolloutConfig, TrainConfig

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_sleep_cycle_wakes_weights_before_a_sync_and_the_kv_cache_only_before_a_rollout():
    calls = []
    cycle = SleepCycle(lambda method, **kw: calls.append((method, kw)), enabled=True)
    # zero_step_off: rollout, collect (nothing else outstanding), update, sync, next rollout.
    cycle.before_rollout()
    cycle.rollouts_collected(outstanding=0)
    cycle.before_sync()
    cycle.before_rollout()
    cycle.rollouts_collected(outstanding=0)
    cycle.before_rollout()  # e.g. the evaluation's rollout without a sync in between
    assert calls == [
        ("sleep", {"level": 1}),
        ("wake_up", {"tags": ["weights"]}),
        ("wake_up", {"tags": ["kv_cache"]}),
        ("sleep", {"level": 1}),
        ("wake_up", {"tags": ["weights"]}),
        ("wake_up", {"tags": ["kv_cache"]}),
    ]
    # Another rollout outstanding: the engine keeps working.
    calls.clear()
    cycle.rollouts_collected(outstanding=1)
    assert calls == []
    # Disabled (the default): never a call.
    off = SleepCycle(lambda *a, **k: pytest.fail("an engine call without rollout.vllm_sleep"), enabled=False)
    off.rollouts_collected(0), off.before_sync(), off.before_rollout()


@needs_vllm
def test_transfer_back_end_choice_and_refusals():
    from megatron_opd.rollout.vllm_setup import resolve_transfer_backend
    from megatron_opd.weight_sync.gloo_engine import BACKEND

    assert resolve_transfer_backend(RolloutConfig(), on_cuda=True) == "nccl"
    assert resolve_transfer_backend(RolloutConfig(), on_cuda=False) == BACKEND
    assert resolve_transfer_backend(RolloutConfig(weight_transfer_backend="gloo"), on_cuda=True) == BACKEND
    with pytest.raises(ValueError, match="rollout.weight_transfer_backend=nccl needs the student on CUDA"):
        resolve_transfer_backend(RolloutConfig(weight_transfer_backend="nccl"), on_cuda=False)
    with pytest.raises(ValueError, match="set rollout.vllm_sleep=false"):
        resolve_transfer_backend(RolloutConfig(vllm_sleep=True), on_cuda=False)
    assert resolve_transfer_backend(RolloutConfig(vllm_sleep=True), on_cuda=True) == "nccl"


def test_sleep_is_refused_with_an_asynchronous_scheduler(tmp_path):
    cfg = TrainConfig()
    cfg.student.path = cfg.teacher.path = str(tmp_path)
    cfg.data.train_files = [str(tmp_path / "train.jsonl")]
    cfg.rollout.backend, cfg.scheduler.mode, cfg.rollout.vllm_sleep = "vllm", "one_step_off", True
    with pytest.raises(ValueError, match="use scheduler.mode=zero_step_off or rollout.vllm_sleep=false"):
        cfg.validate()
    cfg.scheduler.mode = "zero_step_off"
    cfg.validate()


@needs_vllm
def test_nccl_init_info_and_versioned_control_plane():
    from megatron_opd.rollout.vllm_backend import VersionedClient, transfer_init_info
    from megatron_opd.weight_sync.gloo_engine import BACKEND, GlooTrainerInitInfo

    common = dict(master_address="10.0.0.1", master_port=29600, world_size=5, rank=0)
    info = transfer_init_info("nccl", bucket_bytes=1 << 28, timeout_s=60, **common)
    assert type(info).__name__ == "NCCLTrainerInitInfo" and info.backend == "nccl"
    assert (info.world_size, info.packed, info.packed_buffer_size_bytes, info.is_sender) == (5, True, 1 << 28, True)
    gloo = transfer_init_info(BACKEND, bucket_bytes=1 << 20, timeout_s=60, **dict(common, rank=1))
    assert isinstance(gloo, GlooTrainerInitInfo) and not gloo.is_sender and gloo.bucket_bytes == 1 << 20
    with pytest.raises(ValueError, match="unknown weight-transfer back end"):
        transfer_init_info("ipc", bucket_bytes=1, timeout_s=1, **common)

    class Engine:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a: self.calls.append((name, *a))

    engine = Engine()
    client = VersionedClient(engine)
    client.version = "7"
    client.init_weight_transfer_engine({"x": 1})
    client.start_weight_update()
    client.update_weights({"names": []})
    client.finish_weight_update()  # vLLM's NCCL engine finishes without a version: ours is committed
    client.finish_weight_update("8")
    assert engine.calls == [("init_weight_transfer_engine", {"x": 1}), ("start_weight_update",),
                            ("update_weights", {"names": []}), ("finish_weight_update", "7"),
                            ("finish_weight_update", "8")]  # fmt: skip
