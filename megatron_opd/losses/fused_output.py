"""The output layer fused into the loss: logits formed a chunk of tokens at a time, never all at once.

Today's path multiplies every final hidden state by the output layer's weight shard, keeps the whole
``[tokens, V/TP]`` logit shard, and the vocab-parallel divergence then works on it. Here one autograd function
takes the hidden states ``[T, H]`` (already gathered over sequence parallelism), this rank's weight shard
``[V/TP, H]`` and, per token, the coefficient the reduction gives its loss; per chunk of trained tokens it forms
``logits = h_chunk @ W^T``, runs the per-token divergence on them (any kind, tail, mode or support; its own
vocab-parallel statistics cross ranks, nothing ``[*, V]`` does), and takes the gradient of the chunk's weighted
loss with respect to those logits at once, in the forward pass (as Liger-Kernel's fused linear losses do): the
gradients of ``h`` and ``W`` are then two matmuls, so no chunk is recomputed in backward and at most one
``[chunk, V/TP]`` block is alive. Tokens nothing trains (prompt, padding, tool output) are skipped outright.

The loss is linear in the per-token losses, ``sum_t a_t l_t``, with ``a_t`` read off the reduction itself
(``reduction_coefficients``), so ``token_mean``, ``sequence_mean`` (also over packed segments), ``sum`` and
per-sequence weights need no code of their own here. When the caller knows the gradient backward will bring
(``grad_hint``), the weight gradient goes straight into the weight's gradient buffer; otherwise into an fp32
accumulator that backward scales, like the hidden-state gradient.

Shape legend: ``T`` tokens, ``H`` hidden size, ``V`` this rank's vocabulary columns, ``C`` tokens in a chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_opd.losses.local_ops import select_local_ops
from megatron_opd.losses.reduction import reduce_loss

TokenPass = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``token_pass(logits_CV, index_C)``: the per-token losses ``[C]`` of the trained tokens at flat positions
``index_C`` (differentiable in ``logits_CV``, which it may overwrite: in-place backward)."""

MIN_CHUNK_TOKENS = 256
"""Automatic chunks hold at least this many tokens. Each chunk streams the whole weight shard through three matmuls
(logits, hidden-state gradient, weight gradient), and on a CPU core those run at their full rate only from about 256
tokens: at Qwen's vocabulary over TP=2 the output layer + loss took 1.6-1.8x today's time in 64-token chunks and
0.95-1.06x in 256-token ones (``benchmarks/RESULTS.md``). ``[256, V/TP]`` is 74 MiB there in fp32; a smaller
``loss.chunk_size`` trades time for memory."""

MAX_CHUNK_ELEMENTS = 1 << 28
"""Automatic chunks hold at most this many logits (1 GiB in fp32; about 3,500 tokens at Qwen's vocabulary over
TP=2): the loss's own back end may take every token at once (the Triton kernels keep no temporaries), but here
each chunk's logits and their gradient exist. Smaller chunks cost time on a GPU: each chunk's loss is a few
dozen small launches, and an H100 update is launch-bound (a Qwen3-1.7B update at 4,096 tokens took 154-191 ms
with 2^26-element chunks, 137-145 ms with 2^28, 134 ms in one chunk; ``benchmarks/RESULTS.md``)."""


def chunk_tokens(chunk_size: int | None, vocab_columns: int, device: torch.device) -> int:
    """Tokens per chunk: ``chunk_size`` if given, else about the loss back end's elements per chunk on ``device``
    (at most ``MAX_CHUNK_ELEMENTS``) over ``V``, but at least ``MIN_CHUNK_TOKENS``."""
    if chunk_size is not None:
        return chunk_size
    chunk_elements = min(select_local_ops("auto", device).chunk_elements(device), MAX_CHUNK_ELEMENTS)
    return max(MIN_CHUNK_TOKENS, chunk_elements // max(vocab_columns, 1))


def reduction_coefficients(
    mask_BS: torch.Tensor,
    weights_BS: torch.Tensor,
    mode: str,
    *,
    normalizer: float | None = None,
    segment_ids: torch.Tensor | None = None,
    sequence_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a`` with ``reduce_loss(l * weights, mask, mode, ...) == sum(a * l)`` for every ``l`` (float64): the
    reduction is linear in the per-token losses, so its gradient is the coefficient of each."""
    x_BS = torch.zeros(mask_BS.shape, dtype=torch.float64, device=mask_BS.device, requires_grad=True)
    with torch.enable_grad():
        kwargs = {} if mode == "sum" else {"normalizer": normalizer, "segment_ids": segment_ids,
                                           "sequence_weights": sequence_weights}  # fmt: skip
        total = reduce_loss(x_BS * weights_BS.to(torch.float64), mask_BS, mode, **kwargs)
        (coefficients,) = torch.autograd.grad(total, x_BS, allow_unused=True)
    return torch.zeros_like(x_BS) if coefficients is None else coefficients.detach()


class _AsModelOutput(torch.autograd.Function):
    """The chunk's logits as a model output would be: a non-leaf sharing the block's storage, so the divergence may
    overwrite them with their gradient (``inplace_backward``). Its backward never runs: only the gradient *with
    respect to* these logits is asked for."""

    @staticmethod
    def forward(ctx, logits_CV: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return logits_CV.detach()

    @staticmethod
    def backward(ctx, grad_CV: torch.Tensor):
        raise RuntimeError("the fused output loss's logits are not differentiated through")


class _FusedOutputLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, coeff_T, index_N, token_pass, rows, grad_into, grad_hint):
        weight = weight_VH  # the parameter itself (weight_VH is detached below): backward may set its .grad
        grad_h_TH = torch.zeros_like(hidden_TH)
        if not weight_VH.requires_grad:  # a frozen output layer (a LoRA student's): no weight gradient at all
            grad_w_VH, alpha = None, 1.0
        elif grad_into is None:  # an accumulator of our own, scaled in backward
            grad_w_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
            grad_w_VH = grad_w_VH if weight_VH.dtype != torch.float64 else grad_w_VH.double()
            alpha = 1.0
        else:  # straight into the weight's gradient buffer, scaled now by the gradient backward will bring
            grad_w_VH, alpha = grad_into, grad_hint
        per_token_N = torch.zeros(index_N.numel(), dtype=torch.float32, device=hidden_TH.device)
        weight_VH = weight_VH.detach()
        # One logit block and one hidden-gradient block, refilled by every chunk: a fresh [C, V] block per chunk
        # cost a page fault per 4 KiB on CPU (~10% of a chunk's time at 256 tokens) and allocator churn on a GPU.
        logits_buf_CV = weight_VH.new_empty(min(rows, index_N.numel()), weight_VH.shape[0])
        grad_h_buf_CH = weight_VH.new_empty(logits_buf_CV.shape[0], weight_VH.shape[1])
        anchor = torch.zeros((), dtype=weight_VH.dtype, device=weight_VH.device, requires_grad=True)
        for lo in range(0, index_N.numel(), rows):
            index_C = index_N[lo : lo + rows]
            h_CH = hidden_TH.index_select(0, index_C)
            n = index_C.numel()
            torch.mm(h_CH, weight_VH.t(), out=logits_buf_CV[:n])
            with torch.enable_grad():
                # Non-leaf logits (the divergence may turn them into their own gradient); the two gradients below
                # are written by hand.
                logits_CV = _AsModelOutput.apply(logits_buf_CV[:n], anchor)
                loss_C = token_pass(logits_CV, index_C)
                coeff_C = coeff_T.index_select(0, index_C).to(loss_C.dtype)
                (grad_CV,) = torch.autograd.grad(loss_C, logits_CV, grad_outputs=coeff_C)
            grad_CV = grad_CV.to(weight_VH.dtype)
            grad_h_TH.index_copy_(0, index_C, torch.mm(grad_CV, weight_VH, out=grad_h_buf_CH[:n]))
            if grad_w_VH is None:
                pass
            elif grad_w_VH.dtype == weight_VH.dtype:
                grad_w_VH.addmm_(grad_CV.t(), h_CH, alpha=alpha)
            else:  # low precision: the chunks' products accumulate in fp32
                grad_w_VH.add_(grad_CV.t() @ h_CH, alpha=alpha)
            per_token_N[lo : lo + rows] = loss_C.detach().float()
            del logits_CV, grad_CV, loss_C
        coeff_N = coeff_T.index_select(0, index_N)
        loss = torch.where(coeff_N != 0, per_token_N.double() * coeff_N, 0.0).sum().to(torch.float32)
        # Not saved tensors: backward scales them in place, with no second copy while autograd accumulates them.
        ctx.grads = (grad_h_TH, None if grad_into is not None or grad_w_VH is None else grad_w_VH.to(weight_VH.dtype))
        ctx.grad_hint = grad_hint if grad_into is not None else None
        ctx.weight = weight if grad_into is not None and grad_into is not weight.grad else None  # main_grad written
        ctx.mark_non_differentiable(per_token_N)
        return loss, per_token_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_per_token):
        grad_h_TH, grad_w_VH = ctx.grads
        del ctx.grads
        if ctx.grad_hint is not None:
            _check_grad_hint(grad_loss, ctx.grad_hint)
        grad_w = None if grad_w_VH is None else grad_w_VH.mul_(grad_loss)
        weight, ctx.weight = ctx.weight, None
        if weight is not None and not getattr(weight, "zero_out_wgrad", False):
            # The gradient is in Megatron's main_grad already; DDP's hook (run once the weight's gradient is
            # complete) asserts a .grad under optim.overlap_grad_reduce. Megatron's fused-accumulation protocol: a
            # placeholder (here without storage) that the hook skips (grad_added_to_main_grad). A weight tied to the
            # embedding on this stage (zero_out_wgrad) needs none: the embedding's gradient arrives through autograd.
            weight.grad = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
            weight.grad_added_to_main_grad = True
        return grad_h_TH.mul_(grad_loss), grad_w, None, None, None, None, None, None


def _check_grad_hint(grad_loss: torch.Tensor, grad_hint: float) -> None:
    """Refuse an incoming gradient other than the one the weight gradient was written for. Checked on the device
    (no host read per micro-batch): on CPU it raises here, on a GPU it is a device-side assertion (fatal)."""
    message = (
        f"the fused output loss wrote its weight gradient for an incoming gradient of {grad_hint:g} but got "
        "{got} (has the pipeline schedule's loss scaling changed?); set loss.fused_output=off and report this"
    )
    try:
        torch._assert_async((grad_loss - grad_hint).abs() <= 1e-6 * abs(grad_hint), message.format(got="another"))
    except RuntimeError:  # raised at once where the tensor is on the host: the value costs no sync there
        raise RuntimeError(message.format(got=f"{float(grad_loss):g}")) from None


def fused_output_loss(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    coeff_T: torch.Tensor,
    trained_T: torch.Tensor,
    token_pass: TokenPass,
    *,
    rows: int,
    grad_hint: float | None = None,
    index_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, per_token_N, index_N)``: ``sum_t coeff_t * l_t`` over the tokens where ``trained_T`` (the same on
    every TP rank), differentiable in ``hidden_TH`` and ``weight_VH``; the per-token losses at flat positions
    ``index_N`` (detached, for statistics). ``rows`` tokens per chunk.

    ``grad_hint``: the gradient backward will bring to the loss, when the caller knows it (Megatron's schedule:
    the loss function's scale x CP size / micro-batches). The weight's gradient then goes straight into its
    gradient buffer (``main_grad`` under Megatron's DDP, else ``.grad``, created if missing) during the forward,
    with no ``[V/TP, H]`` accumulator; backward checks the hint and refuses a different gradient. A frozen weight
    (``requires_grad=False``: a LoRA student's output layer) gets no gradient at all.

    ``index_N``: the flat positions where ``trained_T`` is true, when the caller has them without a device sync (the
    trainer: computed on the host before the schedule); else found here (``nonzero``: on a GPU, a sync)."""
    if index_N is None:
        index_N = trained_T.reshape(-1).nonzero().reshape(-1)
    hidden_TH = hidden_TH.to(weight_VH.dtype)  # Megatron's Float16Module hands the last stage's output over in fp32
    grad_into = None
    if grad_hint is not None and weight_VH.requires_grad:
        grad_into = getattr(weight_VH, "main_grad", None)
        if grad_into is None:
            if weight_VH.grad is None:
                weight_VH.grad = torch.zeros_like(weight_VH)
            grad_into = weight_VH.grad
    loss, per_token_N = _FusedOutputLoss.apply(
        hidden_TH, weight_VH, coeff_T.reshape(-1), index_N, token_pass, max(1, int(rows)), grad_into, grad_hint
    )
    return loss, per_token_N, index_N
