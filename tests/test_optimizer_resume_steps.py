"""Resuming Megatron's distributed optimizer with torch's Adam (GPU without apex/TE): Megatron 0.16 restores Adam's
step count from the parameter group as one tensor shared by every parameter, which torch's Adam then advances once
per parameter. ``Student.load_optimizer_state`` gives each parameter its own count; checked here against an
uninterrupted torch Adam (the whole path ran on an H100: ``benchmarks/RESULTS.md``, "Trainer on GPU")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_opd.trainer.student import Student


class DistributedOptimizerLike:
    """What Megatron 0.16's DistributedOptimizer.load_state_dict leaves behind without apex/TE."""

    def __init__(self, inner: torch.optim.Adam) -> None:
        self.optimizer = inner

    def load_state_dict(self, state_dict: dict) -> None:
        shared = torch.tensor(float(state_dict["step"]))
        for group in self.optimizer.param_groups:
            group["step"] = state_dict["step"]
            for p in group["params"]:
                self.optimizer.state[p] = {**state_dict["state"][id_of(self.optimizer, p)], "step": shared}


def id_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    return next(i for i, q in enumerate(p for g in optimizer.param_groups for p in g["params"]) if q is param)


def test_resumed_adam_matches_the_uninterrupted_one():
    torch.manual_seed(0)
    start = [torch.randn(5), torch.randn(3)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]

    def run(params, optimizer, steps):
        for g in steps:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            optimizer.step()

    straight = [p.clone().requires_grad_() for p in start]
    adam = torch.optim.Adam(straight, lr=0.1)
    run(straight, adam, grads)

    first = [p.clone().requires_grad_() for p in start]
    adam1 = torch.optim.Adam(first, lr=0.1)
    run(first, adam1, grads[:4])
    saved = {"step": 4, "state": {i: {k: v.clone() for k, v in adam1.state[p].items() if k != "step"}
                                  for i, p in enumerate(first)}}  # fmt: skip
    resumed = [p.detach().clone().requires_grad_() for p in first]
    adam2 = torch.optim.Adam(resumed, lr=0.1)
    student = SimpleNamespace(optimizer=DistributedOptimizerLike(adam2))
    Student.load_optimizer_state(student, saved)
    steps = [adam2.state[p]["step"] for p in resumed]
    assert steps[0] is not steps[1] and all(float(s) == 4 for s in steps)
    run(resumed, adam2, grads[4:])
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # Without the fix the shared count runs ahead and the parameters drift from the uninterrupted run.
    broken = [p.detach().clone().requires_grad_() for p in first]
    adam3 = torch.optim.Adam(broken, lr=0.1)
    DistributedOptimizerLike(adam3).load_state_dict(saved)
    run(broken, adam3, grads[4:])
    assert float(adam3.state[broken[0]]["step"]) == 8
    assert not all(torch.equal(a, b) for a, b in zip(straight, broken))
