"""`RolloutBatch`: the typed output of an online rollout, what the loss of every online trainer reads."""

from dataclasses import dataclass, field

import torch

from ..core.batch import TensorBatch, scalar_field
from ..generation.output import sampled_token_mask
from .importance_sampling import corrects_sampling


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

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    @classmethod
    def from_generation(
        cls, out, mask_truncated_completions: bool = False, logprobs_are_old: bool = True
    ) -> "RolloutBatch":
        """The batch of a `GenerationOutput`, before scoring (`rewards` / `row_index` are filled in by the rollout).
        With `mask_truncated_completions`, a completion that hit the length limit without EOS is masked out whole.
        The output's sampling log-probs are π_old when `logprobs_are_old` (the policy's own decoding logits), else
        `sampling_logps` (another engine's, e.g. vLLM's)."""
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
            old_logps=out.logprobs if logprobs_are_old else None,
            sampling_logps=None if logprobs_are_old else out.logprobs,
        )

    @property
    def loss_mask(self) -> torch.Tensor:
        """`(B, C)`: the tokens the loss, the KL and the entropy are taken over: the model's own completion tokens
        (`completion_mask * tool_mask`); the forward still attends to tool-result tokens (`completion_mask`)."""
        return sampled_token_mask(self.completion_mask, self.tool_mask)

    def shuffled(self) -> "RolloutBatch":
        return self.select(torch.randperm(len(self)))

    def split(self, num_chunks: int) -> list["RolloutBatch"]:
        """`num_chunks` equal, contiguous micro-batches."""
        if len(self) % num_chunks:
            raise ValueError(f"Cannot split a batch of {len(self)} rows into {num_chunks} equal micro-batches.")
        step = len(self) // num_chunks
        return [self.select(torch.arange(i * step, (i + 1) * step)) for i in range(num_chunks)]

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`(input_ids (B, P+C), attention_mask (B, P+C), extra model inputs)` for a forward over prompt +
        completion; the extra inputs carry the rows' images, with per-token prompt inputs zero-extended."""
        input_ids = torch.cat([self.prompt_ids, self.completion_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1)
        extra = {}
        if self.visual_inputs:
            device = input_ids.device
            extra = {k: torch.cat([row[k] for row in self.visual_inputs]).to(device) for k in self.visual_inputs[0]}
        width = self.completion_ids.size(1)
        for key, value in self.prompt_token_inputs.items():
            extra[key] = torch.cat([value, value.new_zeros(value.size(0), width)], dim=1)
        return input_ids, attention_mask, extra


@dataclass(frozen=True)
class RolloutPlan:
    """What a rollout computes, per mode, resolved once from an online trainer's `old_logps` rule and its config.

    `old_logps` rules (π_old: the per-token log-probs at sampling time, read by the ratio of the loss):
    - `"trl"`: TRL's rule, only when the policy can change between generation and a use of the batch, i.e. when an
      optimiser step falls inside one generation round: `gradient_accumulation_steps % (steps_per_generation *
      num_iterations) != 0`; in training only.
    - `"always"`: in training and evaluation (PPO: π_old anchors the ratio and the KL penalty).
    - `"unless_unchanged"`: always, except in training when the policy is unchanged between generation and every
      use of the batch (one pass, one optimiser step per generation round, and with a reference, the whole
      generation batch in one micro-batch): then π_old equals the loss forward's log-probs, detached, and the
      advantages, whose reward is KL-shaped with π_old (RLOO), are computed in the loss (`defers_advantages`).
    """

    old_logps_train: bool
    old_logps_eval: bool
    defer_advantages: bool = False

    @classmethod
    def resolve(cls, rule: str, args, reference_available: bool) -> "RolloutPlan":
        if corrects_sampling(args):
            return cls(True, True)  # TRL: the correction compares π_old with vLLM's log-probs, in both modes
        if rule == "always":
            return cls(True, True)
        if rule == "never":  # no ratio in the loss (distillation)
            return cls(False, False)
        if rule == "trl":
            window = args.steps_per_generation * args.num_iterations
            return cls(args.gradient_accumulation_steps % window != 0, False)
        if rule == "unless_unchanged":
            aligned = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
            unchanged = aligned and (args.beta == 0.0 or args.steps_per_generation == 1)
            return cls(not unchanged, True, defer_advantages=unchanged and reference_available)
        raise ValueError(f"Unknown old_logps rule {rule!r}: expected 'trl', 'always', 'unless_unchanged' or 'never'.")

    def needs_old_logps(self, mode: str) -> bool:
        return self.old_logps_train if mode == "train" else self.old_logps_eval

    def defers_advantages(self, mode: str) -> bool:
        return self.defer_advantages and mode == "train"
