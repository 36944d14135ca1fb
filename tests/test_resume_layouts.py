"""A training checkpoint resumes at another layout (issue 23): TP1 -> TP2 (from DP2), TP2 -> TP2xPP2,
TP2 -> PP2xVP2 (DP2), DP2 -> DP1, CP1 (DP2) -> CP2 and CP2 -> CP1 (DP1), and Mixture-of-Experts students EP1 -> EP2 (DP2: each rank then holds half the
experts, issue 35; Qwen3-MoE and GLM-4.7-Flash, issue 52); with Megatron's distributed optimizer (issue 40: its ``fully_reshardable``
state), fp32 and the GPU defaults (bf16 + distributed optimizer), DP2 -> TP2 and DP2 -> DP1 (fp32 also
DP2 -> PP2xVP2); an old ``dp_reshardable`` checkpoint at its own TP/PP (DP2 -> DP1), refused at TP2. The
distributed-optimizer runs also check overlapped communication (issue 40): overlapped steps equal serial ones, and
the parameters read stale after a step until ``Student.finish_param_sync``.

Each resume goes through ``train.resume``: the resumed parameters, fp32 main parameters and Adam moments equal the
saved ones bitwise (gathered to full tensors), the step, LR schedule and data position carry over, the next step's
loss equals the saving layout's next step (bf16: within 1e-3), and the RNG is re-seeded with one warning (restored
exactly at an unchanged layout). A refused resume leaves the run folder's lock as it was. Three launches (world 2,
4, 1), grouped so each layout's checks share one.
"""

from __future__ import annotations

import pytest
import torch

from megatron_opd.testing.multiprocess import run_distributed

SEED, GLOBAL_BATCH = 7, 4
MOE_BUILD = {"moe_token_dispatcher": "alltoall"}  # the ranks' packed micro-batches hold different token counts
DISTRIBUTED = {  # run name -> optim.* of a distributed-optimizer run
    "do_dp2": {"use_distributed_optimizer": True},
    "bf16_dp2": {"use_distributed_optimizer": True, "bf16": True},  # the GPU defaults
}


def _rank_batch(dp_rank: int, dp_size: int):
    """This data-parallel rank's share of a fixed SFT batch of GLOBAL_BATCH sequences of different lengths."""
    from dataclasses import replace

    from megatron_opd.data.batch import pack_sft

    gen = torch.Generator().manual_seed(11)
    lengths = [(4, 7), (2, 10), (6, 3), (3, 8)]
    prompts = [torch.randint(1, 1000, (p,), generator=gen).tolist() for p, _ in lengths]
    responses = [torch.randint(1, 1000, (r,), generator=gen).tolist() for _, r in lengths]
    batch, per_rank = pack_sft(prompts, responses, pad_token_id=0), GLOBAL_BATCH // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return replace(batch, tokens=batch.tokens[rows], loss_mask=batch.loss_mask[rows], seq_weights=torch.ones(0),
                   prompt_lengths=batch.prompt_lengths[rows], lengths=batch.lengths[rows])  # fmt: skip


class _Run:
    """One layout's student, checkpoint folder, prompt stream and step, in a running job."""

    def __init__(
        self,
        layout: dict,
        student_dir: str,
        ckpt_dir: str,
        data_seed: int = SEED,
        build: dict | None = None,
        lora: dict | None = None,
        **precision,
    ) -> None:
        from megatron.core import parallel_state as ps

        from megatron_opd.checkpoint.source import build_and_load
        from megatron_opd.data.stream import PromptStream
        from megatron_opd.distributed import ParallelConfig, initialize_distributed
        from megatron_opd.distributed.device import detect_accelerator
        from megatron_opd.models.builder import ModelBuildConfig
        from megatron_opd.models.lora import LoRAConfig, add_lora
        from megatron_opd.trainer.checkpointing import CheckpointManager
        from megatron_opd.trainer.config import OptimConfig, StudentConfig, TrainConfig
        from megatron_opd.trainer.student import Student, precision_plan

        parallel = ParallelConfig(**layout)
        initialize_distributed(parallel, "cpu", seed=SEED)
        optim = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="linear", clip_grad=0.5, **precision)
        student = StudentConfig(path=student_dir, lora=LoRAConfig(**(lora or {})))
        self.cfg = TrainConfig(student=student, optim=optim, parallel=parallel, seed=SEED)
        plan = precision_plan(optim, detect_accelerator("cpu"))
        build_cfg = ModelBuildConfig(dtype=plan.params_dtype, **(build or {}))
        chunks = build_and_load(student_dir, parallel, build_cfg, trainable=True)[1]
        add_lora(chunks, student.lora, seed=SEED)  # as the trainer's build_student (nothing without lora)
        self.student = Student(chunks, optim, plan, total_steps=10)
        self.ckpt = CheckpointManager(ckpt_dir)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        prompts = [[i + 1, i + 2] for i in range(16)]
        self.data = PromptStream(prompts, [{}] * 16, seed=data_seed, shuffle=True, global_batch=GLOBAL_BATCH,
                                 dp_rank=self.dp_rank, dp_size=self.dp_size)  # fmt: skip
        self.step_count = 0

    def step(self) -> dict:
        """One SFT step on this rank's share of the fixed batch (the stream advances as in the trainer)."""
        from megatron_opd.trainer.config import LossConfig
        from megatron_opd.trainer.objective import train_step

        self.data.next_batch()
        batch = _rank_batch(self.dp_rank, self.dp_size)
        result = train_step(self.student, batch, None, LossConfig(kind="sft"), vocab_size=1000,
                            teacher_temperature=1.0, micro_batch_size=1)  # fmt: skip
        self.step_count += 1
        return {"loss": result.stats.loss, "lr": result.lr, "grad_norm": result.grad_norm}

    def save(self) -> None:
        from megatron_opd.train import training_state

        state = training_state(self.student, self.data.state_dict(), self.step_count, self.cfg, loading=False)
        self.ckpt.save(self.step_count, state, {})

    def resume(self) -> int:
        from megatron_opd.train import resume

        self.step_count = resume(self.ckpt, self.student, self.data, self.cfg)
        return self.step_count

    def full_state(self) -> dict:
        """Parameters, Adam moments and step counts as full tensors (on tensor- and data-parallel rank 0 only),
        the schedule's step and the data position."""
        from megatron.core import parallel_state as ps

        from megatron_opd.models import load_architecture
        from megatron_opd.models.lora import full_adapters
        from megatron_opd.models.reference import full_tensors

        chained = getattr(self.student.optimizer, "chained_optimizers", [self.student.optimizer])
        inner = [o.optimizer for o in chained]
        state = _main_state(chained)
        arch, group = load_architecture(self.cfg.student.path), ps.get_tensor_model_parallel_group()
        full = full_adapters if self.cfg.student.lora.enabled else full_tensors  # a LoRA student: what trains
        out = {"param": full(self.student.chunks, arch, group)}
        for key in ("main_param", "exp_avg", "exp_avg_sq"):
            out[key] = full(self.student.chunks, arch, group, of=lambda p, key=key: state[p][key])
        steps = {float(opt.state[p]["step"]) for opt in inner for p in opt.state}
        # data-parallel replicas are equal; at EP > 1 each data-parallel rank holds its own experts
        keep = ps.get_tensor_model_parallel_rank() == 0 and (
            self.dp_rank == 0 or ps.get_expert_model_parallel_world_size() > 1
        )
        return {
            "tensors": out if keep else {},
            "adam_steps": steps,
            "scheduler_steps": self.student.lr_schedule.num_steps,
            "consumed": self.data.consumed,
        }


def _main_state(optimizers: list) -> dict:
    """Model parameter -> its fp32 main parameter and Adam moments, whole (a collective over data-parallel ranks
    for the distributed optimizer, whose ranks each hold a slice: gathered as its checkpoint saver gathers them)."""
    state = {}
    for opt in optimizers:
        if not hasattr(opt, "get_parameter_state_dp_zero"):  # the plain optimizer: whole main parameters
            pairs = [(p, p) for group in opt.optimizer.param_groups for p in group["params"]]  # fp32
            if hasattr(opt, "float16_groups"):  # bf16: fp32 copies of the bf16 parameters
                pairs = [pair for groups in (zip(opt.float16_groups, opt.fp32_from_float16_groups),
                                             zip(opt.fp32_from_fp32_groups, opt.fp32_from_fp32_groups))
                         for model, main in groups for pair in zip(model, main)]  # fmt: skip
            for p, main in pairs:
                moments = opt.optimizer.state[main]
                state[p] = {"main_param": main, "exp_avg": moments["exp_avg"], "exp_avg_sq": moments["exp_avg_sq"]}
            continue
        world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            (tensors,) = world[index].values()
            for p, (start, end, _) in buffer.param_index_map.items():
                state[p] = {k: tensors[k.removeprefix("main_")][start:end].view(p.shape)
                            for k in ("main_param", "exp_avg", "exp_avg_sq")}  # fmt: skip
    return state


def _rng_snapshot() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), **get_cuda_rng_tracker().get_states()}


class _Warnings:
    """Counts the trainer's re-seeding warnings."""

    def __enter__(self):
        import logging

        self.records, self.logger = [], logging.getLogger("megatron_opd.train")
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)

    @property
    def reseeded(self) -> int:
        return sum("re-seeded" in r.getMessage() for r in self.records)


def _resume_and_continue(run: _Run) -> dict:
    """Resume ``run`` from its folder, record what was restored, take the next step."""
    from megatron_opd.trainer.checkpointing import reseed_rng

    with _Warnings() as caught:
        step = run.resume()
    restored, rng = run.full_state(), _rng_snapshot()
    reseed_rng(SEED, step)
    reseeded = all(torch.equal(rng[k], v) for k, v in _rng_snapshot().items())
    return {"step": step, "restored": restored, "warnings": caught.reseeded, "reseeded": reseeded, "next": run.step()}


def _save_then_step(run: _Run) -> dict:
    """Save ``run`` now, record the saved state, take the next step (the reference for a resumed layout)."""
    run.save()
    saved, rng = run.full_state(), _rng_snapshot()
    return {"saved": saved, "rng": rng, "next": run.step()}


def _stale_and_fresh(run: _Run) -> dict:
    """The full parameters as read right after a step (stale where ``overlap_param_gather`` left the other ranks'
    slices to the next forward pass), then after ``Student.finish_param_sync`` (data-parallel rank 0's)."""
    from megatron.core import parallel_state as ps

    from megatron_opd.models import load_architecture
    from megatron_opd.models.reference import full_tensors

    arch, group = load_architecture(run.cfg.student.path), ps.get_tensor_model_parallel_group()
    stale = {k: v.clone() for k, v in full_tensors(run.student.chunks, arch, group).items()}
    pending = [g.param_gather_dispatched for m in run.student.model for g in m.bucket_groups]
    run.student.finish_param_sync()
    fresh = full_tensors(run.student.chunks, arch, group)
    keep = run.dp_rank == 0
    return {"stale": stale if keep else {}, "fresh": fresh if keep else {}, "dispatched_before": pending}


def _launch_world2(dirs: dict) -> dict:
    """DP2: step 1, save; TP2 resumes it (TP1 -> TP2, DP2 -> DP1), steps 2, saves; TP2 again resumes that exactly."""
    from megatron_opd.trainer.checkpointing import CheckpointManager

    out = {}
    dp2 = _Run({}, dirs["student"], dirs["dp2"])
    dp2.step()
    out["dp2"] = _save_then_step(dp2)
    tp2 = _Run({"tensor_model_parallel_size": 2}, dirs["student"], dirs["dp2"])
    out["dp2_to_tp2"] = _resume_and_continue(tp2)
    tp2.ckpt = CheckpointManager(dirs["tp2"])
    out["tp2"] = _save_then_step(tp2)
    again = _Run({"tensor_model_parallel_size": 2}, dirs["student"], dirs["tp2"])
    with _Warnings() as caught:
        again.resume()
    out["tp2_same_layout"] = {"rng": _rng_snapshot(), "warnings": caught.reseeded}
    out.update(_distributed_optimizer_runs(dirs))
    moe = _Run({}, dirs["moe_student"], dirs["moe_dp2"], build=MOE_BUILD)
    moe.step()
    out["moe_dp2"] = _save_then_step(moe)
    out["moe_dp2_to_ep2"] = _resume_and_continue(
        _Run({"expert_model_parallel_size": 2}, dirs["moe_student"], dirs["moe_dp2"], build=MOE_BUILD)
    )
    # GLM-4.7-Flash (issue 52): multi-latent attention's replicated key/value projection, the expert bias buffer.
    mla = _Run({}, dirs["mla_student"], dirs["mla_dp2"], build=MOE_BUILD)
    mla.step()
    out["mla_dp2"] = _save_then_step(mla)
    out["mla_dp2_to_ep2"] = _resume_and_continue(
        _Run({"expert_model_parallel_size": 2}, dirs["mla_student"], dirs["mla_dp2"], build=MOE_BUILD)
    )
    out.update(_context_parallel_runs(dirs))
    out.update(_lora_runs(dirs))
    return out


LORA = {"rank": 2, "alpha": 4.0}
"""The LoRA student's adapters (rank 2 on hidden size 64: as rank 64 on 2048)."""
LORA_OPTIM = {"use_distributed_optimizer": True}
"""Its optimizer: Megatron's distributed one (the GPU default), its state of the adapters alone."""


def _lora_runs(dirs: dict) -> dict:
    """A LoRA student at DP2: step 1, save (its adapters only), step 2; TP2 resumes it, and DP2 again (every RNG
    state restored, the next step bitwise the saving run's)."""
    run = _Run({}, dirs["student"], dirs["lora_dp2"], lora=LORA, **LORA_OPTIM)
    run.step()
    out = {"lora_dp2": _save_then_step(run)}
    out["lora_dp2_to_tp2"] = _resume_and_continue(
        _Run({"tensor_model_parallel_size": 2}, dirs["student"], dirs["lora_dp2"], lora=LORA, **LORA_OPTIM)
    )
    again = _Run({}, dirs["student"], dirs["lora_dp2"], lora=LORA, **LORA_OPTIM)
    with _Warnings() as caught:
        again.resume()
    out["lora_dp2_same_layout"] = {"rng": _rng_snapshot(), "warnings": caught.reseeded, "next": again.step()}
    return out


def _context_parallel_runs(dirs: dict) -> dict:
    """CP2: step 1, save (each CP rank's RNG state under its own key; the keys once collided and the save failed),
    step 2; CP2 resumes the DP2 run (CP1 -> CP2) and its own checkpoint (every RNG state restored exactly)."""
    cp2 = {"context_parallel_size": 2}
    out = {"dp2_to_cp2": _resume_and_continue(_Run(cp2, dirs["student"], dirs["dp2"]))}
    run = _Run(cp2, dirs["student"], dirs["cp2"])
    run.step()
    out["cp2"] = _save_then_step(run)
    again = _Run(cp2, dirs["student"], dirs["cp2"])
    with _Warnings() as caught:
        again.resume()
    out["cp2_same_layout"] = {"rng": _rng_snapshot(), "warnings": caught.reseeded, "next": again.step()}
    return out


def _save_as_before(run: _Run, ckpt_dir: str) -> None:
    """Save ``run`` into ``ckpt_dir`` as megatron-opd did before fully_reshardable: the distributed optimizer's
    state dp_reshardable, no ``optimizer_format`` in the saved layout."""
    from megatron_opd.trainer import resharding
    from megatron_opd.trainer.checkpointing import CheckpointManager

    ckpt, to_dict, saved_format = run.ckpt, resharding.Layout.to_dict, resharding.SAVED_OPTIMIZER_FORMAT
    run.ckpt, resharding.SAVED_OPTIMIZER_FORMAT = CheckpointManager(ckpt_dir), "dp_reshardable"
    resharding.Layout.to_dict = lambda layout: {k: v for k, v in to_dict(layout).items() if k != "optimizer_format"}
    try:
        run.save()
    finally:
        run.ckpt, resharding.Layout.to_dict, resharding.SAVED_OPTIMIZER_FORMAT = ckpt, to_dict, saved_format


def _distributed_optimizer_runs(dirs: dict) -> dict:
    """The distributed optimizer at DP2, fp32 and bf16: step 1, save, step 2; TP2 resumes each. The fp32 run also
    saves step 1 as older megatron-opd did (``dp_reshardable``), which TP2 must refuse."""

    out = {}
    for name, precision in DISTRIBUTED.items():
        run = _Run({}, dirs["student"], dirs[name], **precision)
        first = run.step()
        if name == "do_dp2":
            _save_as_before(run, dirs["legacy_dp2"])
        out[name] = _save_then_step(run)
        if name == "do_dp2":  # overlapped (the default), against the same steps without overlap
            out["overlapped"] = {"losses": [first["loss"], out[name]["next"]["loss"]], **_stale_and_fresh(run)}
            serial = _Run({}, dirs["student"], dirs["serial"], **precision, overlap_grad_reduce=False)
            out["not_overlapped"] = {"losses": [serial.step()["loss"], serial.step()["loss"]],
                                     "fresh": _stale_and_fresh(serial)["stale"]}  # fmt: skip
        out[f"{name}_to_tp2"] = _resume_and_continue(_Run({"tensor_model_parallel_size": 2}, dirs["student"],
                                                          dirs[name], **precision))  # fmt: skip
    refused = _Run({"tensor_model_parallel_size": 2}, dirs["student"], dirs["legacy_dp2"], **DISTRIBUTED["do_dp2"])
    try:
        refused.resume()
        out["legacy_refused_at_tp2"] = ""
    except ValueError as err:
        out["legacy_refused_at_tp2"] = str(err)
    return out


def _launch_world4(dirs: dict) -> dict:
    """TP2 -> TP2xPP2, and TP2 -> PP2xVP2 at DP2 (two model chunks a rank)."""
    run = _Run({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, dirs["student"], dirs["tp2"])
    out = {"tp2_to_tp2pp2": _resume_and_continue(run)}
    vp = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    out["tp2_to_pp2vp2"] = _resume_and_continue(_Run(vp, dirs["student"], dirs["tp2"]))
    # the distributed optimizer's state resharded to an interleaved pipeline, whose schedule starts each chunk's
    # overlapped gradient reduction and parameter all-gather (grad_sync_func / param_sync_func)
    out["do_dp2_to_pp2vp2"] = _resume_and_continue(_Run(vp, dirs["student"], dirs["do_dp2"], **DISTRIBUTED["do_dp2"]))
    tp2pp2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    out["lora_dp2_to_tp2pp2"] = _resume_and_continue(
        _Run(tp2pp2, dirs["student"], dirs["lora_dp2"], lora=LORA, **LORA_OPTIM)
    )
    return out


def _launch_world1(dirs: dict) -> dict:
    """DP2 -> DP1; the legacy layout reader agrees with the saved layout; a refused resume keeps the lock."""
    import fcntl
    from pathlib import Path

    from megatron.core import dist_checkpointing

    from megatron_opd.data.records import DataError
    from megatron_opd.trainer.resharding import layout_from_metadata, saved_layout

    out = {"dp2_to_dp1": _resume_and_continue(_Run({}, dirs["student"], dirs["dp2"]))}
    for name, precision in DISTRIBUTED.items():
        out[f"{name}_to_dp1"] = _resume_and_continue(_Run({}, dirs["student"], dirs[name], **precision))
    out["legacy_dp2_to_dp1"] = _resume_and_continue(_Run({}, dirs["student"], dirs["legacy_dp2"],
                                                         **DISTRIBUTED["do_dp2"]))  # fmt: skip
    out["cp2_to_dp1"] = _resume_and_continue(_Run({}, dirs["student"], dirs["cp2"]))
    out["lora_dp2_to_dp1"] = _resume_and_continue(_Run({}, dirs["student"], dirs["lora_dp2"], lora=LORA, **LORA_OPTIM))
    out["lora_refusals"] = _lora_refusals(dirs)
    cp2 = Path(dirs["cp2"]) / "step_00000001"
    out["cp2_layout"] = layout_from_metadata(cp2, {}, dist_checkpointing.load_common_state_dict(str(cp2)))
    path = Path(dirs["dp2"]) / "step_00000001"
    common = dist_checkpointing.load_common_state_dict(str(path))
    legacy = layout_from_metadata(path, common["trainer"]["config"]["parallel"], common)  # read as for old folders
    out["legacy_layout_matches"] = legacy == saved_layout(path)

    lock_path = Path(dirs["dp2"]) / ".lock"
    before = "pid 4242 on the-last-host\n"  # the line the run that wrote the checkpoints left
    lock_path.write_text(before)
    run = _Run({}, dirs["student"], dirs["dp2"], data_seed=SEED + 1)  # other data order: the resume is refused
    run.ckpt.acquire_lock()
    try:
        run.resume()
        out["refused"] = False
    except DataError:
        out["refused"] = True
    out["lock_kept"] = lock_path.read_text() == before
    with open(lock_path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out["lock_released"] = True
        except OSError:
            out["lock_released"] = False
    return out


def _lora_refusals(dirs: dict) -> dict:
    """The messages of resumes that do not fit: a LoRA student from a full checkpoint, a full student from adapters,
    adapters of another rank."""
    from pathlib import Path

    out = {}
    for name, ckpt, lora in (("full_student", "dp2", LORA), ("lora_into_full", "lora_dp2", None),
                             ("other_rank", "lora_dp2", {**LORA, "rank": 4})):  # fmt: skip
        run = _Run({}, dirs["student"], str(Path(dirs[ckpt])), lora=lora)
        try:
            run.resume()
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    return out


def _merged_tensors(per_rank: list[dict], key: str) -> dict:
    merged = {}
    for rank in per_rank:
        for kind, tensors in rank[key]["tensors"].items():
            merged.setdefault(kind, {}).update(tensors)
    return merged


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from megatron_opd.testing.tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("resume_layouts")
    mla = make_tiny_hf_model("glm4_moe_lite", root / "mla_student", seed=1, num_hidden_layers=2,
                             mlp_layer_types=["dense", "sparse"])  # fmt: skip
    dirs = {
        "student": str(make_tiny_hf_model("qwen3", root / "student", seed=1, num_hidden_layers=4)),
        "moe_student": str(make_tiny_hf_model("qwen3_moe", root / "moe_student", seed=1, num_hidden_layers=2)),
        "mla_student": str(mla),
    }
    names = ("dp2", "tp2", "legacy_dp2", "serial", "moe_dp2", "mla_dp2", "cp2", "lora_dp2", *DISTRIBUTED)
    dirs.update({name: str(root / name) for name in names})
    world2 = run_distributed(_launch_world2, 2, args=(dirs,), timeout=300)
    world4 = run_distributed(_launch_world4, 4, args=(dirs,), timeout=300)
    world1 = run_distributed(_launch_world1, 1, args=(dirs,), timeout=300)
    return {"world2": world2, "world4": world4, "world1": world1, "dirs": dirs}


CASES = {  # resumed case -> (its launch, the saving layout's entry in the world-2 launch)
    "dp2_to_tp2": ("world2", "dp2"),
    "tp2_to_tp2pp2": ("world4", "tp2"),
    "tp2_to_pp2vp2": ("world4", "tp2"),
    "dp2_to_dp1": ("world1", "dp2"),
    "do_dp2_to_tp2": ("world2", "do_dp2"),
    "do_dp2_to_dp1": ("world1", "do_dp2"),
    "do_dp2_to_pp2vp2": ("world4", "do_dp2"),
    "bf16_dp2_to_tp2": ("world2", "bf16_dp2"),
    "bf16_dp2_to_dp1": ("world1", "bf16_dp2"),
    "legacy_dp2_to_dp1": ("world1", "do_dp2"),  # saved at the same step as do_dp2
    "moe_dp2_to_ep2": ("world2", "moe_dp2"),
    "mla_dp2_to_ep2": ("world2", "mla_dp2"),
    "dp2_to_cp2": ("world2", "dp2"),
    "cp2_to_dp1": ("world1", "cp2"),
    "lora_dp2_to_tp2": ("world2", "lora_dp2"),
    "lora_dp2_to_tp2pp2": ("world4", "lora_dp2"),
    "lora_dp2_to_dp1": ("world1", "lora_dp2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_at_another_layout(case, launches):
    launch, source = CASES[case]
    saved_ranks, resumed_ranks = launches["world2"], launches[launch]
    saved = _merged_tensors([r[source] for r in saved_ranks], "saved")
    resumed = _merged_tensors([r[case] for r in resumed_ranks], "restored")
    assert set(resumed) == {"param", "main_param", "exp_avg", "exp_avg_sq"}
    assert set(resumed["param"]) == set(saved["param"])
    for kind in resumed:
        for name, ref in saved[kind].items():
            assert torch.equal(resumed[kind][name], ref), f"{case}: {kind} of {name} differs from the saved one"

    reference = saved_ranks[0][source]
    first = resumed_ranks[0][case]
    for rank in resumed_ranks:
        r = rank[case]["restored"]
        assert r["adam_steps"] == reference["saved"]["adam_steps"], f"{case}: Adam step counts {r['adam_steps']}"
        assert r["scheduler_steps"] == reference["saved"]["scheduler_steps"], f"{case}: LR schedule not resumed"
        assert r["consumed"] == reference["saved"]["consumed"], f"{case}: data position not resumed"
        assert rank[case]["reseeded"], f"{case}: the RNG was not re-seeded from seed and step"
    assert first["step"] == saved_ranks[0][source]["saved"]["scheduler_steps"]
    assert sum(rank[case]["warnings"] for rank in resumed_ranks) == 1, "one re-seeding warning per resume"
    ours, ref = first["next"], reference["next"]
    loss_tol, norm_tol = (1e-3, 1e-2) if case.startswith("bf16") else (1e-5, 1e-4)  # bf16: its rounding at TP2
    assert abs(ours["loss"] - ref["loss"]) <= loss_tol * abs(ref["loss"]), f"{case}: next loss {ours} vs {ref}"
    assert ours["lr"] == ref["lr"], f"{case}: next LR {ours['lr']} vs {ref['lr']}"
    assert abs(ours["grad_norm"] - ref["grad_norm"]) <= norm_tol * ref["grad_norm"], f"{case}: {ours} vs {ref}"


def test_distributed_optimizer_and_bf16_train_as_the_plain_fp32_optimizer(launches):
    """DP2: the distributed optimizer's state and losses equal the plain optimizer's (fp32), and the GPU defaults'
    (bf16 + distributed optimizer) losses are within bf16's rounding of them."""
    rank0 = launches["world2"][0]
    plain = [rank0["dp2"]["saved"]["tensors"], rank0["dp2"]["next"]["loss"]]
    for name, tol in (("do_dp2", 1e-6), ("bf16_dp2", 1e-3)):
        assert rank0[name]["saved"]["scheduler_steps"] == rank0["dp2"]["saved"]["scheduler_steps"]
        ours = rank0[name]["next"]["loss"]
        assert abs(ours - plain[1]) <= tol * abs(plain[1]), f"{name}: second loss {ours} vs plain fp32 {plain[1]}"
    ours = rank0["do_dp2"]["saved"]["tensors"]
    for kind in ("param", "exp_avg", "exp_avg_sq"):  # after step 1 (moments from the gradients reduced over DP2)
        for key, ref in plain[0][kind].items():
            torch.testing.assert_close(ours[kind][key], ref, rtol=1e-5, atol=1e-9, msg=f"{kind} of {key}")


def test_overlapped_steps_equal_serial_ones_and_readers_finish_the_gather(launches):
    """DP2, distributed optimizer: two steps with overlapped gradient reduction and parameter gathering (the
    defaults) equal them without overlap bitwise; right after the step the parameters read stale (the other rank's
    slices wait for the next forward pass) until ``Student.finish_param_sync``."""
    rank0 = launches["world2"][0]
    overlapped, serial = rank0["overlapped"], rank0["not_overlapped"]
    assert overlapped["losses"] == serial["losses"], (overlapped["losses"], serial["losses"])
    assert not any(overlapped["dispatched_before"]), "the step already gathered the parameters: nothing overlapped"
    stale = [k for k, v in overlapped["stale"].items() if not torch.equal(v, serial["fresh"][k])]
    assert stale, "no parameter read stale after an overlapped step: the test cannot see a missing finish"
    for name, ref in serial["fresh"].items():
        assert torch.equal(overlapped["fresh"][name], ref), f"{name} differs from the step without overlap"


def test_dp_reshardable_checkpoints_load_at_their_own_model_parallel_layout_only(launches):
    message = launches["world2"][0]["legacy_refused_at_tp2"]
    assert "dp_reshardable" in message and "checkpoint.load_optimizer=false" in message, message


@pytest.mark.parametrize("layout", ["tp2", "cp2", "lora_dp2"])
def test_unchanged_layout_restores_every_rng_state(layout, launches):
    for rank in launches["world2"]:
        saved, restored = rank[layout]["rng"], rank[f"{layout}_same_layout"]["rng"]
        assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
        assert rank[f"{layout}_same_layout"]["warnings"] == 0
    if layout != "tp2":  # and the next step is the saving run's, bitwise
        rank0 = launches["world2"][0]
        assert rank0[f"{layout}_same_layout"]["next"] == rank0[layout]["next"]


def test_lora_checkpoints_hold_the_adapters_only(launches):
    """A LoRA student's checkpoint holds its adapters and their optimizer state, not the frozen base: its tensors
    under 5% of the full student's checkpoint's at the same step and optimizer (``do_dp2``; 2.5%), with its base
    recorded. Its files are 9% of the full ones here: on this shape DCP's ~1.5 kB per stored item (one zip per layer
    slice: ~170 items) and the RNG states outweigh the adapters; at real sizes the tensors are all."""
    from pathlib import Path

    from megatron_opd.checkpoint.mcore_to_hf import stored_tensors

    dirs = {name: Path(path) for name, path in launches["dirs"].items()}
    lora, full = dirs["lora_dp2"] / "step_00000001", dirs["do_dp2"] / "step_00000001"

    def files(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    def tensors(path):
        return sum(md.size.numel() * md.properties.dtype.itemsize for md in stored_tensors(path).values())

    ratio = tensors(lora) / tensors(full)
    assert ratio < 0.05, f"the adapter-only checkpoint's tensors are {ratio:.1%} of the full student's"
    assert files(lora) < 0.1 * files(full), (files(lora), files(full))
    weights = {key for key in stored_tensors(lora) if not key.startswith(("optimizer", "rng_state"))}
    assert weights and all(".lora." in key for key in weights), sorted(weights)[:8]

    def record(path):  # checkpoint.adapters.saved_adapter_record; Megatron (~5 s to import) only for 0.17+'s layout
        if (path / "common.pt").is_file():
            return torch.load(path / "common.pt", weights_only=False)["trainer"].get("adapters")
        from megatron_opd.checkpoint.adapters import saved_adapter_record

        return saved_adapter_record(path)

    assert record(lora)["base"] == str(dirs["student"].resolve()) and record(lora)["rank"] == LORA["rank"]
    assert record(full) is None


def test_a_lora_resume_that_does_not_fit_is_refused_by_name(launches):
    refusals = launches["world1"][0]["lora_refusals"]
    assert "student.lora.rank=2" in refusals["full_student"], refusals
    assert "student.lora.rank=0" in refusals["lora_into_full"], refusals
    assert "student.lora.rank=2" in refusals["other_rank"], refusals


def test_cp2_checkpoint_layout_reads_from_its_rng_keys(launches):
    """A CP2 checkpoint's ``rng_state`` keys carry the CP axis; the metadata reader (for checkpoints without a saved
    layout) reads it back."""
    layout = launches["world1"][0]["cp2_layout"]
    assert (layout.context_parallel_size, layout.data_parallel_size) == (2, 1), layout


def test_refused_resume_keeps_the_lock_and_legacy_layouts_read(launches):
    result = launches["world1"][0]
    assert result["refused"], "a resume on another data order must be refused"
    assert result["lock_kept"], "a refused resume rewrote the previous run's line in .lock"
    assert result["lock_released"], "a refused resume left checkpoint.dir locked"
    assert result["legacy_layout_matches"], "the layout read from a checkpoint's metadata differs from the saved one"


def test_optimizer_state_refusals():
    from megatron_opd.trainer.resharding import Layout, check_optimizer_state

    def layout(tp=1, pp=1, dp=1, distributed=True, fmt="fully_reshardable"):
        return Layout(tp, pp, 1, 1, dp, distributed, fmt if distributed else "")

    check_optimizer_state(layout(tp=2), layout(pp=2, dp=4), "ckpt")  # fully_reshardable: any layout
    check_optimizer_state(layout(dp=8, fmt="dp_reshardable"), layout(dp=4), "ckpt")  # any data-parallel size
    with pytest.raises(ValueError, match="dp_reshardable.*checkpoint.load_optimizer=false"):
        check_optimizer_state(layout(tp=2, fmt="dp_reshardable"), layout(tp=4), "ckpt")
    with pytest.raises(ValueError, match="optim.use_distributed_optimizer=true"):
        check_optimizer_state(layout(), layout(distributed=False), "ckpt")
    with pytest.raises(ValueError, match="optim.use_distributed_optimizer=false"):
        check_optimizer_state(layout(distributed=False), layout(), "ckpt")
    check_optimizer_state(layout(tp=2, distributed=False), layout(pp=2, distributed=False), "ckpt")
