"""The built-in rollout back end: batched sampling on the student's own tensor-parallel ``GPTModel``.

The sampler shares the trainer's model chunk, so weight sync is free: it only records the policy version. Every rank
of the tensor-parallel group runs :meth:`BuiltinSampler.generate` with the same inputs and gets the same rollouts.

Generation is static batching with Megatron-Core's KV cache (``StaticInferenceContext``). Prompts of different
lengths are right-padded; the batch is prefilled up to the shortest prompt and then advances one position at a time
for every row, feeding a row its own prompt token while its prompt lasts (Megatron-LM's legacy generation loop). All
rows then share positions, so no attention mask is needed and the result is exact. Where MoE layers exchange
tokens across data-parallel ranks (expert parallelism), those ranks decode step for step: a rank whose rows have
all finished runs dummy forwards until every rank's have (``distributed.lockstep``). Logits stay vocab-sharded:
sampling uses :mod:`megatron_opd.rollout.sampling`, which never gathers the vocabulary. Asked for
(``SamplingParams.return_topk = k``), each generated position also records the global top-k ids of the raw logits
(a merge of k candidates per rank, no gather): the student's half of the union loss support, at no extra forward.
With ``SamplingParams.return_routes`` (``rollout.routing_replay``) every forward also records the experts each
MoE router chose for each row's token (``models.route_replay``), which the trainer then replays.

Shape legend: ``N`` rows (prompts x n), ``L`` positions (prompt + response), ``V`` this rank's vocabulary shard.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future

import torch
import torch.distributed as dist

from megatron_opd.distributed.lockstep import agree_count, lockstep_group
from megatron_opd.interfaces import Rollouts, SamplingParams, completed
from megatron_opd.losses.shard_ops import global_topk
from megatron_opd.losses.vocab_parallel import make_vocab_shard
from megatron_opd.models import route_replay
from megatron_opd.models.context_parallel import whole_sequences
from megatron_opd.rollout.sampling import sample_next, token_logprobs

logger = logging.getLogger(__name__)

# Module attributes that switch sequence parallelism on (Megatron-Core's ``set_model_to_sequence_parallel`` list).
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


def _keep_logits_sharded(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # GPTModel asserts that inference gathers the tensor-parallel logits; the sampler works on the shards.
    return args, {**kwargs, "runtime_gather_output": False}


@contextlib.contextmanager
def _generation_mode(chunk: torch.nn.Module) -> Iterator[None]:
    """Eval mode, no autograd, sharded logits, no sequence and no context parallelism, all restored afterwards.

    Neither can split a one-token decode step, so sequence parallelism is switched off as Megatron-Core's own
    inference does, and each context-parallel rank decodes whole sequences itself
    (``models.context_parallel.whole_sequences``); the weights are the same either way.
    """
    modes = [(m, m.training) for m in chunk.modules()]
    switched = [
        (m, attr)
        for m in chunk.modules()
        for attr in _SEQUENCE_PARALLEL_ATTRS
        if isinstance(getattr(m, attr, None), bool) and getattr(m, attr)
    ]
    config = chunk.config
    config_sp = config.sequence_parallel
    hook = chunk.output_layer.register_forward_pre_hook(_keep_logits_sharded, with_kwargs=True)
    try:
        chunk.eval()
        for m, attr in switched:
            setattr(m, attr, False)
        config.sequence_parallel = False
        with torch.no_grad(), whole_sequences(chunk):
            yield
    finally:
        hook.remove()
        config.sequence_parallel = config_sp
        for m, attr in switched:
            setattr(m, attr, True)
        for m, training in modes:
            m.training = training


class BuiltinSampler:
    """:class:`~megatron_opd.interfaces.RolloutBackend` on the student's ``GPTModel`` (tensor parallel, no PP)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        *,
        vocab_size: int,
        max_seq_len: int,
        pad_token_id: int,
        tp_group: dist.ProcessGroup | None = None,
        policy_version: int = 0,
    ) -> None:
        """``vocab_size``: the tokenizer's; ids at or above it are never sampled. ``max_seq_len``: prompt + response
        limit. ``tp_group``: the vocabulary's group (default: Megatron-Core's tensor-parallel group)."""
        from megatron.core import parallel_state

        pp_size = (
            parallel_state.get_pipeline_model_parallel_world_size()
            if parallel_state.model_parallel_is_initialized()
            else 1
        )
        if len(chunks) != 1 or pp_size > 1:
            raise ValueError(
                f"the built-in sampler needs pipeline_model_parallel_size=1 (got {pp_size}, {len(chunks)} model "
                "chunks on this rank); use rollout.backend=vllm to sample from a pipeline-parallel student"
            )
        chunk = chunks[0]
        if not (chunk.pre_process and chunk.post_process):
            raise ValueError("the built-in sampler needs a chunk holding the whole model (pre- and post-process)")
        if max_seq_len < 2:
            raise ValueError(
                f"rollout max_seq_len must be >= 2 (a prompt token and a response token), got {max_seq_len}"
            )
        padded_vocab = int(chunk.vocab_size)
        if not 0 <= pad_token_id < padded_vocab:
            raise ValueError(f"pad_token_id={pad_token_id} is outside the model's vocabulary [0, {padded_vocab})")
        self.model = chunk
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id
        self.policy_version = policy_version
        tp_size = (
            dist.get_world_size(tp_group)
            if tp_group is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        if padded_vocab % tp_size:
            raise ValueError(
                f"the model's vocabulary {padded_vocab} does not split over {tp_size} tensor-parallel ranks"
            )
        self.lockstep = lockstep_group(chunks)
        """The ranks whose decode loops run step for step (MoE layers that exchange tokens across data-parallel
        ranks; None otherwise): each decode step, one all-reduce decides whether any of them still decodes."""
        self.shard = make_vocab_shard(padded_vocab // tp_size, tp_group, vocab_size)
        if self.shard.world_size != tp_size:
            raise ValueError(f"tp_group has {self.shard.world_size} ranks, the model is split over {tp_size}")

    asynchronous = False
    """It samples on the trainer's ranks, between updates."""

    def sync_weights(self, policy_version: int) -> None:
        """The sampler shares the trainer's weights: only the version changes."""
        self.policy_version = policy_version

    def close(self) -> None:
        """Nothing to release: the sampler is the trainer's own model."""

    def _check_inputs(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> None:
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if not prompt_token_ids:
            raise ValueError("generate needs at least one prompt")
        vocab = self.shard.vocab_size
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) >= self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens, which leaves no room for a response under "
                    f"max_seq_len={self.max_seq_len}"
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")
        bad = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab}) and could never be sampled")
        if sampling.return_topk > vocab:
            raise ValueError(f"return_topk={sampling.return_topk} asks for more ids than the vocabulary's {vocab}")

    def _forward(self, tokens_NL: torch.Tensor, start: int, context, routes_NLMk=None) -> torch.Tensor:
        """Logits ``[N, V]`` of the last of positions ``[start, start + L)``, whose keys/values join the cache; with
        ``routes_NLMk``, the routers' choices of those positions are written there."""
        positions_NL = torch.arange(start, start + tokens_NL.shape[1], device=tokens_NL.device).expand_as(tokens_NL)
        logits_N1V = self.model(
            tokens_NL, positions_NL, None, inference_context=context, runtime_gather_output=True
        )  # runtime_gather_output only satisfies GPTModel's assert; _keep_logits_sharded overrides it
        context.sequence_len_offset += tokens_NL.shape[1]
        if routes_NLMk is not None:
            n, length = tokens_NL.shape
            for hook in self._route_hooks:  # Megatron routes tokens in [L, N] order
                chosen_NLk = hook.recorded.view(length, n, -1).transpose(0, 1)
                routes_NLMk[:, start : start + length, hook.moe_index] = chosen_NLk.to(routes_NLMk.dtype)
        return logits_N1V[:, -1]

    def _idle(self) -> None:
        """Dummy one-token forwards (no cache, output discarded) for as long as another rank of the lockstep group
        still decodes: its MoE layers exchange tokens with this rank at every step."""
        tokens_11 = torch.full(
            (1, 1), self.pad_token_id, dtype=torch.int64, device=next(self.model.parameters()).device
        )
        while True:
            self.model(tokens_11, torch.zeros_like(tokens_11), None, runtime_gather_output=True)
            if not agree_count(0, self.lockstep):
                return

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int) -> Future[Rollouts]:
        """Sample ``n`` responses per prompt (adjacent), on every rank of the tensor-parallel group at once."""
        from megatron.core.inference.contexts import StaticInferenceContext

        self._check_inputs(prompt_token_ids, sampling, n)
        started = time.perf_counter()
        device = next(self.model.parameters()).device
        prompts = [list(p) for p in prompt_token_ids for _ in range(n)]
        rows = len(prompts)
        lengths_N = torch.tensor([len(p) for p in prompts], device=device)
        shortest, longest = min(len(p) for p in prompts), max(len(p) for p in prompts)
        total = min(self.max_seq_len, longest + sampling.max_new_tokens)
        # Row i may grow to this many tokens (exclusive end of its response).
        limit_N = torch.clamp(lengths_N + sampling.max_new_tokens, max=self.max_seq_len)

        tokens_NL = torch.full((rows, total), self.pad_token_id, dtype=torch.int64, device=device)
        for i, prompt in enumerate(prompts):
            tokens_NL[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
        logprobs_NL = torch.zeros(rows, total, dtype=torch.float32, device=device)
        drawn = sampling.truncates  # then also each token's log-probability under the truncated distribution
        drawn_NL = torch.zeros(rows, total if drawn else 0, dtype=torch.float32, device=device)
        k = sampling.return_topk
        topk_NLK = torch.full((rows, total if k else 0, k), -1, dtype=torch.int64, device=device)
        end_N = limit_N.clone()
        done_N = torch.zeros(rows, dtype=torch.bool, device=device)
        stopped_N = torch.zeros(rows, dtype=torch.bool, device=device)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.int64, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed)
        routes_NLMk = None
        if sampling.return_routes:
            self._route_hooks = route_replay.recording([self.model], True)
            if not self._route_hooks:
                raise ValueError("rollout.routing_replay needs a Mixture-of-Experts student (this one has no router)")
            top_k = self.model.config.moe_router_topk
            routes_NLMk = torch.full((rows, total, len(self._route_hooks), top_k), -1, dtype=torch.int16, device=device)

        context = StaticInferenceContext(rows, total)
        steps = 0
        with _generation_mode(self.model), self._recording(routes_NLMk is not None):
            logits_NV = self._forward(tokens_NL[:, :shortest], 0, context, routes_NLMk)
            for pos in range(shortest, total):
                # The noise is drawn for every row at every step, so the stream does not depend on the layout.
                sampled_N = sample_next(logits_NV, self.shard, sampling, generator, drawn=drawn)
                if drawn:
                    sampled_N, drawn_N = sampled_N
                in_prompt_N = pos < lengths_N
                new_N = ~in_prompt_N & ~done_N
                token_N = torch.where(in_prompt_N, tokens_NL[:, pos], sampled_N)
                token_N = torch.where(done_N, torch.full_like(token_N, self.pad_token_id), token_N)
                tokens_NL[:, pos] = token_N
                logprobs_NL[:, pos] = torch.where(new_N, token_logprobs(logits_NV, token_N, self.shard), 0.0)
                if drawn:
                    drawn_NL[:, pos] = torch.where(new_N, drawn_N.float(), 0.0)
                if k:  # an all-gather of k candidates per rank; the noise stream is untouched
                    topk_NLK[:, pos] = torch.where(new_N[:, None], global_topk(logits_NV, k, self.shard)[1], -1)
                stop_N = new_N & torch.isin(token_N, stop_ids)
                finish_N = new_N & (stop_N | (pos + 1 >= limit_N))
                stopped_N |= stop_N
                end_N = torch.where(finish_N, pos + 1, end_N)
                done_N |= finish_N
                steps += 1
                running = not bool(done_N.all())  # a sync point, once per step
                if self.lockstep is not None and agree_count(int(running), self.lockstep):
                    if not running:  # others still decode: join their steps with dummy forwards
                        self._idle()
                        break
                elif not running:
                    break
                logits_NV = self._forward(tokens_NL[:, pos : pos + 1], pos, context, routes_NLMk)

        tokens_NL, logprobs_NL, topk_NLK, drawn_NL = tokens_NL.cpu(), logprobs_NL.cpu(), topk_NLK.cpu(), drawn_NL.cpu()
        starts, ends, stopped = lengths_N.tolist(), end_N.tolist(), stopped_N.tolist()
        response_ids = [tokens_NL[i, starts[i] : ends[i]].clone() for i in range(rows)]
        elapsed = time.perf_counter() - started
        logger.debug(
            "sampled %d rows x %d steps (%d tokens) in %.2f s",
            rows,
            steps,
            sum(r.numel() for r in response_ids),
            elapsed,
        )
        return completed(
            Rollouts(
                prompt_ids=[tokens_NL[i, : starts[i]].clone() for i in range(rows)],
                response_ids=response_ids,
                response_mask=[torch.ones_like(r) for r in response_ids],
                logprobs=[logprobs_NL[i, starts[i] : ends[i]].clone() for i in range(rows)],
                finish_reasons=["stop" if s else "length" for s in stopped],
                prompt_index=[i // n for i in range(rows)],
                policy_version=self.policy_version,
                topk_ids=[topk_NLK[i, starts[i] : ends[i]].clone() for i in range(rows)] if k else None,
                routes=None if routes_NLMk is None else [self._routes_of(routes_NLMk, i, ends[i]) for i in range(rows)],
                drawn_logprobs=[drawn_NL[i, starts[i] : ends[i]].clone() for i in range(rows)] if drawn else None,
            )
        )

    @contextlib.contextmanager
    def _recording(self, on: bool) -> Iterator[None]:
        try:
            yield
        finally:
            if on:
                route_replay.recording([self.model], False)

    @staticmethod
    def _routes_of(routes_NLMk: torch.Tensor, row: int, end: int) -> torch.Tensor:
        """Row ``row``'s routes up to its end; the last token's are left out (-1), as no prediction reads them and
        only rows still decoding route it."""
        routes = routes_NLMk[row, :end].cpu().clone()
        routes[end - 1] = -1
        return routes
