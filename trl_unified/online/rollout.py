"""The two stages of an online rollout and their typed hand-offs: `Samples` (what sampling produced, before anything is
scored), `RolloutBatch` (what the loss of every online trainer reads), and `RolloutPlan` (what a trainer's rollout
computes)."""

from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather

from ..data.batch import TensorBatch, scalar_field
from ..generation.output import GenerationOutput, sampled_token_mask


@dataclass
class Samples:
    """Stage one's output for one process's rows of a generation round (`OnlineTrainer.sample`), the input of stage
    two (`OnlineTrainer.finish`); it may be sampled ahead of training, so nothing here depends on the trained weights
    except `policy_version` (the optimiser step of the weights that sampled). `rows` carry a `rollout_func`'s extra
    fields; `prompts` (after an environment's `reset`) and `completions` are as the reward functions see them;
    `logprobs_are_policy`: `generation.logprobs` are the trained policy's own (π_old, the lean decode loop's logits),
    not another engine's (vLLM's, which the importance-sampling correction compares with π_old)."""

    rows: list[dict[str, Any]]
    prompts: list
    images: list | None
    generation: GenerationOutput
    completions: list
    policy_version: int
    logprobs_are_policy: bool
    tool_calls: int = 0
    tool_failures: int = 0
    environments: list | None = None


@dataclass
class RolloutBatch(TensorBatch):
    """One process's rows of a generation batch: B completions, P prompt and C completion positions.

    Rows of one prompt are contiguous until the buffer shuffles them; `row_index` keeps each row's place in the
    global (all processes) generation batch.

    Fields:
        prompt_ids, prompt_mask (`(B, P)`): left-padded prompt tokens and their attention mask.
        completion_ids (`(B, C)`): right-padded completions, cut after the first EOS (kept).
        completion_mask (`(B, C)`): 1 on completion tokens up to the EOS; 0 on padding, and on every token of a
            truncated completion when `mask_truncated_completions` is set.
        rewards (`(B,)`): the weighted reward of each completion; NaN where no function scored it.
        row_index (`(B,)`): position of each row in the global generation batch.
        advantages (`(B,)`, `(B, C)` per token, or None): None only when the trainer computes them in the loss
            (`defers_advantages`).
        old_logps (`(B, C)` or None): per-token log-probs at sampling time; None when the policy is unchanged between
            generation and every use of the batch (then they equal the loss forward's, detached).
        ref_logps (`(B, C)` or None): per-token reference log-probs; None without a reference model.
        is_truncated (`(B,)` bool): the completion hit `max_completion_length` without an EOS.
        num_loss_tokens (`float`): tokens under `completion_mask` in the whole generation batch, all processes
            (the normaliser of token-sum losses such as DAPO's).
        visual_inputs (list of B dicts, or None): per-row image / video tensors (pixel_values, image_grid_thw, ...).
        prompt_token_inputs (dict of `(B, P)`): per-token prompt inputs besides the ids (e.g. mm_token_type_ids).
        tool_mask (`(B, C)` or None): 1 on tokens the model sampled, 0 on tool-result tokens of a multi-turn
            (agent) completion; None when every completion token is the model's.
        values, returns (`(B, C)` or None): a critic's per-token values at sampling time and the return targets
            (PPO); None for critic-free algorithms.
        sampling_logps (`(B, C)` or None): the generation engine's log-probs of the sampled tokens (vLLM), when
            they are not the trainer's own π_old.
        importance_sampling_ratio (`(B, 1)`, `(B, C)` or None): the vLLM correction of the loss
            (`online/importance_sampling.py`); None without it.
        staleness (`int`): optimiser steps between the weights that sampled the batch and those it is finished
            under (0 unless rollouts are asynchronous).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    row_index: torch.Tensor
    is_truncated: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_loss_tokens: float = scalar_field(0.0)
    visual_inputs: list[dict[str, torch.Tensor]] | None = None
    prompt_token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    tool_mask: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    importance_sampling_ratio: torch.Tensor | None = None
    staleness: int = scalar_field(0)

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    @classmethod
    def from_samples(cls, samples: Samples, mask_truncated_completions: bool = False) -> "RolloutBatch":
        """The batch of `samples`, before scoring (`rewards` / `row_index` are filled in by `finish`). With
        `mask_truncated_completions`, a completion that hit the length limit without EOS is masked out whole."""
        out, policy = samples.generation, samples.logprobs_are_policy
        completion_mask = out.completion_mask
        if mask_truncated_completions:
            completion_mask = completion_mask * (~out.is_truncated).unsqueeze(1).long()
        return cls(
            prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=completion_mask,
            rewards=torch.empty(0),
            row_index=torch.empty(0),
            is_truncated=out.is_truncated,
            visual_inputs=out.visual_inputs,
            prompt_token_inputs=dict(out.prompt_token_inputs or {}),
            tool_mask=out.tool_mask,
            old_logps=out.logprobs if policy else None,
            sampling_logps=None if policy else out.logprobs,
        )

    @property
    def loss_mask(self) -> torch.Tensor:
        """`(B, C)`: the tokens the loss, the KL and the entropy are taken over: the model's own completion tokens
        (`completion_mask * tool_mask`); the forward still attends to tool-result tokens (`completion_mask`)."""
        return sampled_token_mask(self.completion_mask, self.tool_mask)

    def shuffled(self, group_size: int = 1) -> "RolloutBatch":
        """The rows in a random order; with `group_size` > 1, whole groups of that many contiguous rows are
        shuffled, each group's rows kept together and in order (online DPO's pairs)."""
        order = torch.randperm(len(self) // group_size)
        return self.select((order[:, None] * group_size + torch.arange(group_size)).flatten())

    def split(self, num_chunks: int) -> list["RolloutBatch"]:
        """`num_chunks` equal, contiguous micro-batches."""
        if len(self) % num_chunks:
            raise ValueError(f"Cannot split a batch of {len(self)} rows into {num_chunks} equal micro-batches.")
        step = len(self) // num_chunks
        return [self.select(torch.arange(i * step, (i + 1) * step)) for i in range(num_chunks)]

    def gather_global(self, values: torch.Tensor) -> torch.Tensor:
        """`(N_global, ...)`: per-row `values` `(B, ...)` of every process's rows, in generation order (`row_index`
        undoes the buffer's shuffling)."""
        order = gather(self.row_index)
        out = values.new_empty((order.numel(), *values.shape[1:]))
        out[order] = gather(values)
        return out

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`(input_ids (B, P+C), attention_mask (B, P+C), extra model inputs)` for a forward over prompt +
        completion; the extra inputs carry the rows' images, with per-token prompt inputs zero-extended."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1)
        extra = {}
        if self.visual_inputs:
            device = input_ids.device
            extra = {k: torch.cat([row[k] for row in self.visual_inputs]).to(device) for k in self.visual_inputs[0]}
        for key, value in self.prompt_token_inputs.items():
            extra[key] = torch.cat([value, value.new_zeros(value.size(0), self.completion_ids.size(1))], dim=1)
        return input_ids, attention_mask, extra


@dataclass(frozen=True)
class RolloutPlan:
    """What a rollout computes, per mode: a trainer's answer to `OnlineTrainer.rollout_plan()`, asked once in
    `setup()`. Each trainer states its own rule beside its loss (RLOO, PPO, distillation, GRPO's importance-sampling
    correction); the online core only reads the answer.

    old_logps_train, old_logps_eval: whether the rollout computes π_old (the per-token log-probs at sampling time,
        read by the ratio of the loss) with a no-grad forward, where sampling did not already return them.
    defer_advantages: training advantages wait for the loss forward (RLOO: a reward KL-shaped with π_old, when π_old
        is that forward's log-probs).
    """

    old_logps_train: bool
    old_logps_eval: bool
    defer_advantages: bool = False

    @classmethod
    def trl(cls, args) -> "RolloutPlan":
        """TRL's rule: π_old only when the policy can change between generation and a use of the batch, i.e. when an
        optimiser step falls inside one generation round (`gradient_accumulation_steps % (steps_per_generation *
        num_iterations) != 0`); in training only."""
        return cls(args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0, False)

    def needs_old_logps(self, mode: str) -> bool:
        return self.old_logps_train if mode == "train" else self.old_logps_eval

    def defers_advantages(self, mode: str) -> bool:
        return self.defer_advantages and mode == "train"
