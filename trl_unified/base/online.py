"""The online-RL core that RLOO and GRPO share, written once.

`OnlineConfig` holds every field `trl.RLOOConfig` and `trl.GRPOConfig` 1.16 have in common (each trainer's config sets
its own defaults where TRL's differ: `num_generations`, `beta`). `OnlineTrainer` owns the repeat sampler, the
generation buffer, `_prepare_inputs`, the checkpointed buffer state and the rollout:

    rows → prompts (+ images) → generate_batched → masks → old / reference per-token log-probs (only when needed)
         → rewards (gathered; errors name the step, the function and the row) → metrics and completions log
         → advantages (the subclass's `compute_advantages`) → a `RolloutBatch`

A subclass implements `compute_advantages` and `compute_policy_loss`, nothing else.
"""

import dataclasses
import logging
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather, gather_object, set_seed
from datasets import Dataset, IterableDataset
from trl import is_conversational, prepare_multimodal_messages

from .config import PolicyConfig
from .data import RepeatSampler, get_images, require_columns
from .generation import max_positions, prompt_lengths
from .prefix import report_fallback, unsupported_reason
from .reference import prepare_frozen_model
from .rewards import RewardFunctions
from .trainer import PolicyTrainerBase


logger = logging.getLogger(__name__)

_VLLM = "vLLM generation is not implemented yet; trl_unified generates with transformers' generate."
_VLLM_FIELDS = (
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
)  # fmt: skip
_CB = "Continuous batching is not implemented; generation uses batched generate()."


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs, over `dim` (all entries if None); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim)
    variance = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()


@dataclass
class OnlineConfig(PolicyConfig):
    """Fields shared by `trl.RLOOConfig` and `trl.GRPOConfig` 1.16, same names and defaults, validated once."""

    _unimplemented_fields = {
        **dict.fromkeys(_VLLM_FIELDS, _VLLM),
        **dict.fromkeys(
            (
                "use_transformers_continuous_batching",
                "transformers_continuous_batching_config",
                "use_transformers_paged",
            ),
            _CB,
        ),
    }

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep every dataset column: extra columns reach the reward functions."}
    )
    max_completion_length: int | None = field(
        default=512, metadata={"help": "Maximum length of the generated completion."}
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE load-balancing loss; None uses the model config's value, 0.0 disables it."
        },
    )
    num_generations: int | None = field(default=8, metadata={"help": "Completions sampled per prompt (G >= 2)."})
    num_generations_eval: int | None = field(
        default=None, metadata={"help": "Completions per prompt during evaluation. None uses num_generations."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "Under ZeRO-3, gather the policy weights once per generation call (fast, needs memory)."},
    )
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training prompts."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={"help": "Pad prompt and completion ids to a multiple of this. 'auto' pads to 128 on Neuron only."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generation round, all processes. None: per_device_train_batch_size * "
            "num_processes * steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={"help": "Micro-steps served by one generation round. None uses gradient_accumulation_steps."},
    )
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (not implemented: must stay False)."})
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM mode (not implemented)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation (not implemented)."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode (not implemented)."})
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "vLLM structured outputs (not implemented)."}
    )
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (not implemented)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host (not implemented)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (not implemented)."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vLLM server timeout (not implemented)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM weight-update port (not implemented)."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM memory share (not implemented)."})
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "vLLM context window (not implemented)."}
    )
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism (not implemented)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient β. If 0.0, no reference model is loaded."})
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes over each generation batch (μ)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the probability ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping range. None uses epsilon (DAPO recommends 0.28)."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function. None weighs them all 1.0."}
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude completions that hit max_completion_length without EOS from the loss."},
    )
    sync_ref_model: bool = field(
        default=False, metadata={"help": "Every ref_model_sync_steps, set π_ref = α π_θ + (1 - α) π_ref (TR-DPO)."}
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "α of the reference-model sync (TR-DPO)."})
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "τ, steps between reference-model syncs (TR-DPO)."}
    )
    log_completions: bool = field(
        default=False,
        metadata={"help": "Print (and send to W&B) a sample of completions at every logging step."},
    )
    log_multimodal: bool = field(default=True, metadata={"help": "Include images in the logged completion samples."})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions printed when log_completions is on. None prints all."}
    )
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each prompt once in completion samples."})
    use_transformers_continuous_batching: bool = field(
        default=False, metadata={"help": "transformers continuous batching (not implemented: must stay False)."}
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "ContinuousBatchingConfig kwargs (not implemented)."}
    )
    use_transformers_paged: bool = field(default=False, metadata={"help": "Deprecated alias of continuous batching."})
    shared_prefix: str = field(  # 'auto', or True/False (also 'true'/'false' from the command line)
        default="auto",
        metadata={
            "help": "trl_unified only. Encode each prompt once per group of completions (Prefix Grouper, "
            "arXiv:2506.05433) in generation, the reference / old-log-prob forwards and the policy forward with grad: "
            "the same numbers with less compute. 'auto': wherever the model and inputs allow it (decoder-only, no "
            "image inputs, no gradient checkpointing in the grad pass; an info log line names any fallback); True: "
            "the same, but an unsupported model raises at construction; False: off."
        },
    )
    strict_rewards: bool = field(
        default=False,
        metadata={
            "help": "trl_unified only. Raise when every reward function returns None for a whole generation batch "
            "(TRL's behaviour, the default here too, is to warn and train on zero advantages)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):
            value = self.pad_to_multiple_of.lower()
            if value == "auto":
                self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
            else:
                self.pad_to_multiple_of = None if value in ("none", "null") else int(value)
        if isinstance(self.shared_prefix, str) and self.shared_prefix.lower() in ("true", "false"):
            self.shared_prefix = self.shared_prefix.lower() == "true"  # from the command line
        if self.shared_prefix not in ("auto", True, False):
            raise ValueError(f"shared_prefix={self.shared_prefix!r} must be 'auto', True or False.")
        self._check_batch_layout()
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0 (0 disables the KL penalty and the reference model).")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError(
                "You passed `sync_ref_model=True` while `beta=0.0`: there is no reference model to sync. "
                "Set beta > 0 or sync_ref_model=False."
            )

    def _check_batch_layout(self):
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True would break prompt groups of num_generations. Set it to False."
            )
        world, per_device = self.world_size, self.per_device_train_batch_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("Set generation_batch_size or steps_per_generation, not both.")
        if self.generation_batch_size is None:
            self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
            self.generation_batch_size = per_device * world * self.steps_per_generation
        elif self.generation_batch_size % (per_device * world):
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} must be divisible by the global batch size "
                f"per_device_train_batch_size * num_processes = {per_device * world}."
            )
        else:
            self.steps_per_generation = self.generation_batch_size // (per_device * world)
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}, but a group baseline needs at least 2 completions per "
                "prompt. Set num_generations >= 2."
            )
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} (per_device_train_batch_size * num_processes * "
                f"steps_per_generation) must be divisible by num_generations={self.num_generations}."
            )
        if self.do_eval and self.eval_strategy != "no":
            self.check_eval_batch_size()

    def check_eval_batch_size(self):
        """Every eval batch must hold whole groups of `num_generations_eval` completions (checked again by
        `evaluate()`, which can run with no eval strategy set)."""
        g_eval = self.num_generations_eval or self.num_generations
        if (self.per_device_eval_batch_size * self.world_size) % g_eval:
            raise ValueError(
                f"per_device_eval_batch_size * num_processes = {self.per_device_eval_batch_size * self.world_size} "
                f"must be divisible by the eval num_generations ({g_eval}). Set per_device_eval_batch_size to a "
                f"multiple of {g_eval} (or num_generations_eval to a divisor of it)."
            )


@dataclass
class RolloutBatch:
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
        advantages (`(B,)` or None): None only when the trainer computes them in the loss (`defers_advantages`).
        old_logps (`(B, C)` or None): per-token log-probs at sampling time; None when the policy is unchanged between
            generation and every use of the batch (then they equal the loss forward's, detached).
        ref_logps (`(B, C)` or None): per-token reference log-probs; None without a reference model.
        is_truncated (`(B,)` bool): the completion hit `max_completion_length` without an EOS.
        num_loss_tokens (`float`): tokens under `completion_mask` in the whole generation batch, all processes
            (the normaliser of token-sum losses such as DAPO's).
        image_inputs (list of B dicts, or None): per-row image tensors (pixel_values, image_grid_thw, ...).
        prompt_token_inputs (dict of `(B, P)`): per-token prompt inputs besides the ids (e.g. mm_token_type_ids).
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
    num_loss_tokens: float = 0.0
    image_inputs: list[dict[str, torch.Tensor]] | None = None
    prompt_token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows `index` (a 1-D long tensor) of every per-row field, in that order."""

        def take(value):
            if isinstance(value, torch.Tensor):
                return value[index.to(value.device)]
            if isinstance(value, list):
                return [value[i] for i in index.tolist()]
            if isinstance(value, dict):
                return {k: take(v) for k, v in value.items()}
            return value

        return RolloutBatch(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})

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
        if self.image_inputs:
            device = input_ids.device
            extra = {k: torch.cat([row[k] for row in self.image_inputs]).to(device) for k in self.image_inputs[0]}
        width = self.completion_ids.size(1)
        for key, value in self.prompt_token_inputs.items():
            extra[key] = torch.cat([value, value.new_zeros(value.size(0), width)], dim=1)
        return input_ids, attention_mask, extra


class OnlineTrainer(PolicyTrainerBase):
    """Base of the online trainers (RLOO, GRPO): TRL's constructor and usage surface, the rollout and its buffer.

    A subclass implements:
    - `compute_advantages(rewards, rewards_per_func, batch, mode)`: `(N_global,)` advantages from the gathered
      rewards (groups of G contiguous; NaN = unscorable) and this process's `RolloutBatch` (old/reference log-probs).
    - `compute_policy_loss(model, inputs, num_items_in_batch)`: the loss of one `RolloutBatch` micro-batch.
    Optionally `needs_old_logps(mode)` and `defers_advantages` (see their docstrings).
    """

    config_class = OnlineConfig

    def __init__(
        self,
        model,
        reward_funcs,
        args: OnlineConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        ref_model=None,
    ):
        args = args or self.config_class(output_dir=f"{str(model).split('/')[-1]}-{self._name}")
        _configure_iterable_loading(args, train_dataset, eval_dataset)
        super().__init__(
            model,
            args,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            ref_model=ref_model,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.rewards = RewardFunctions(reward_funcs, reward_processing_classes, self.args.reward_weights, self.args)
        for i, reward_model in self.rewards.models():
            self.rewards.funcs[i] = prepare_frozen_model(reward_model.requires_grad_(False), self.accelerator)
        self._setup_aux_loss()
        self._check_prompt_lengths()
        self._check_shared_prefix_support()
        self._step, self._buffer, self._step_time = 0, None, 0.0
        size = self.args.generation_batch_size
        self._logs = {
            "images": deque(maxlen=size),
            "prompt": deque(maxlen=size),
            "completion": deque(maxlen=size),
            "rewards": defaultdict(lambda: deque(maxlen=size)),
            "advantages": deque(maxlen=size),
            "extra": defaultdict(lambda: deque(maxlen=size)),
        }
        self._pending_extra: dict[str, list] = defaultdict(list)
        self._logs_round = self._logs_printed = 0
        self.sync_reference_every_steps()
        # Each process samples different completions, reproducibly (the samplers have their own seeded generator).
        set_seed(self.args.seed, device_specific=True)

    # ------------------------------------------------------------------ TRL's attributes
    @property
    def reward_funcs(self) -> list:
        return self.rewards.funcs

    @property
    def reward_func_names(self) -> list[str]:
        return self.rewards.names

    @property
    def reward_processing_classes(self) -> list:
        return self.rewards.processing_classes

    @property
    def num_generations(self) -> int:
        return self.args.num_generations

    @property
    def num_generations_eval(self) -> int:
        return self.args.num_generations_eval or self.args.num_generations

    @property
    def beta(self) -> float:
        return self.args.beta

    @property
    def num_iterations(self) -> int:
        return self.args.num_iterations

    # ------------------------------------------------------------------ hooks
    def needs_reference(self, args) -> bool:
        return args.beta != 0.0

    def needs_old_logps(self, mode: str) -> bool:
        """Whether the rollout computes per-token log-probs at sampling time (TRL's rule: only when the policy can
        change between generation and a use of the batch, i.e. when an optimiser step falls inside one generation
        round: `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`)."""
        args = self.args
        return (
            mode == "train"
            and args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0
        )

    @property
    def defers_advantages(self) -> bool:
        """True when advantages need the loss forward's log-probs (the rollout then leaves them None)."""
        return False

    def compute_advantages(
        self, rewards: torch.Tensor, rewards_per_func: torch.Tensor, batch: RolloutBatch, mode: str
    ) -> torch.Tensor:
        """`(N_global,)` advantages. `rewards`: the weighted sum over functions `(N_global,)`, NaN where no function
        scored the row; `rewards_per_func`: `(N_global, num_funcs)`; groups of G rows contiguous."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_advantages.")

    def generation_options(self) -> dict[str, Any]:
        with torch.no_grad():  # generation runs without grad (and with checkpointing off)
            share = self._shares_prompts(self.model, "generation")
        return {
            "share_prefix": share,
            "gather_deepspeed3_params": self.args.ds3_gather_for_generation,
            "pad_to_multiple_of": self.args.pad_to_multiple_of,
        }

    def token_logprobs(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """The base's log-probs, encoding each repeated prompt once where `shared_prefix` allows it."""
        extra = {k: v for k, v in kwargs.items() if k not in _LOGPROB_OPTIONS}
        share = self._shares_prompts(model, "log-prob forward", extra, kwargs.get("output_router_logits", False))
        return super().token_logprobs(model, input_ids, attention_mask, logits_to_keep, share_prompt=share, **kwargs)

    def _shares_prompts(self, model, where: str, extra=None, router_logits: bool = False) -> bool:
        if self.args.shared_prefix is False:
            return False
        reason = unsupported_reason(model, extra)
        if reason is None and router_logits:
            reason = "the MoE load-balancing loss is computed over every row's tokens"
        if reason is not None:
            report_fallback(where, reason)
        return reason is None

    def _check_shared_prefix_support(self) -> None:
        if self.args.shared_prefix is True:
            with torch.no_grad():
                reason = unsupported_reason(self.model)
            if reason is None and self.args.gradient_checkpointing:
                reason = "gradient checkpointing drops the KV cache in a forward with grad"
            if reason is not None:
                raise ValueError(f"shared_prefix=True, but {reason}. Use shared_prefix='auto' (falls back) or False.")

    # ------------------------------------------------------------------ datasets
    def prepare_dataset(self, dataset, processing_class, args, name):
        if dataset is None:
            if name == "train":
                raise ValueError(f"`train_dataset` is required: {type(self).__name__} needs prompts to generate from.")
            return None
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise TypeError(
                f"`{name}_dataset` must be a `Dataset` or `IterableDataset`, got `{type(dataset).__name__}`."
            )
        require_columns(dataset, [["prompt"]], f"{name} dataset", type(self).__name__)
        if isinstance(dataset, Dataset):
            _check_prompts(dataset, name)
            if name == "train" and len(dataset) < args.generation_batch_size // args.num_generations:
                need = args.generation_batch_size // args.num_generations
                raise ValueError(
                    f"train_dataset has {len(dataset)} prompts, but one generation batch needs {need} distinct "
                    f"prompts (generation_batch_size={args.generation_batch_size} / "
                    f"num_generations={args.num_generations}); "
                    "training would run 0 steps. Add prompts, or lower per_device_train_batch_size / "
                    "steps_per_generation."
                )
        return dataset

    def _check_prompt_lengths(self) -> None:
        """The longest prompt plus `max_completion_length` must fit the model's positions (`max_position_embeddings`),
        checked on the tokenised prompts of map-style datasets before training; `generate_batched` checks the rest."""
        limit = max_positions(self.accelerator.unwrap_model(self.model))
        if limit is None:
            return
        datasets = {"train": self.train_dataset}
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        datasets.update(evals)
        for name, dataset in datasets.items():
            if not isinstance(dataset, Dataset) or any(c in dataset.column_names for c in ("image", "images")):
                continue
            lengths = prompt_lengths(self.processing_class, dataset["prompt"], self.args.chat_template_kwargs)
            row = max(range(len(lengths)), key=lengths.__getitem__)
            if lengths[row] + self.args.max_completion_length > limit:
                raise ValueError(
                    f"{name} dataset row {row} has a prompt of {lengths[row]} tokens; with max_completion_length="
                    f"{self.args.max_completion_length} that is {lengths[row] + self.args.max_completion_length} "
                    f"positions, beyond the model's maximum of {limit} (config.max_position_embeddings). Shorten or "
                    "filter long prompts, or lower max_completion_length."
                )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt", "image", "images"]

    def _get_train_sampler(self, train_dataset=None):
        args = self.args
        return RepeatSampler(
            train_dataset if train_dataset is not None else self.train_dataset,
            mini_repeat_count=args.num_generations,
            batch_size=args.generation_batch_size // args.num_generations,
            repeat_count=args.num_iterations * args.steps_per_generation,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )

    def _get_eval_sampler(self, eval_dataset):
        return RepeatSampler(eval_dataset, mini_repeat_count=self.num_generations_eval, seed=self.args.seed)

    def get_train_dataloader(self):
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            args = self.args
            dataset = _RepeatedIterable(
                dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset,
                args.num_generations,
                args.generation_batch_size // args.num_generations,
                args.num_iterations * args.steps_per_generation,
            )
        return self._get_dataloader(
            dataset=dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,  # one whole generation batch
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = dataset if dataset is not None else self.eval_dataset
        if not isinstance(dataset, IterableDataset):
            return super().get_eval_dataloader(eval_dataset)
        # Each eval prompt repeated num_generations_eval times, as the map-style RepeatSampler does; one worker only
        # for this loader, so the stream is not interleaved (the train loader keeps its own setting).
        repeated = _RepeatedIterable(dataset.shuffle(seed=self.args.seed), self.num_generations_eval, 1, 1)
        workers, self.args.dataloader_num_workers = self.args.dataloader_num_workers, 0
        try:
            return self._get_dataloader(
                dataset=repeated,
                description="Evaluation",
                batch_size=self.args.eval_batch_size,
                sampler_fn=self._get_eval_sampler,
                dataloader_key=eval_dataset if isinstance(eval_dataset, str) else None,
            )
        finally:
            self.args.dataloader_num_workers = workers

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        self.args.check_eval_batch_size()
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ the generation buffer
    def _prepare_inputs(self, inputs):
        if not self.model.training:
            return self.rollout(inputs)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.args.num_iterations) == 0 or self._buffer is None:
            self._buffer = self.rollout(inputs).shuffled().split(steps)
        micro_batch = self._buffer[self._step % steps]
        self._step += 1
        return micro_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        self._step_time += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:  # `step_time`: seconds per optimiser step
            self.log_metric("step_time", self._step_time)
            self._step_time = 0.0
        return output

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        # The generation buffer and micro-step counter, so a resume continues mid-round exactly.
        folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
        state = {"step": self._step, "buffer": self._buffer}
        torch.save(state, os.path.join(folder, f"trl_unified_state_{self.accelerator.process_index}.pt"))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = (
            os.path.join(checkpoint, f"trl_unified_state_{self.accelerator.process_index}.pt") if checkpoint else None
        )
        if path and os.path.exists(path):
            state = torch.load(path, weights_only=False)
            self._step, self._buffer = state["step"], state["buffer"]

    # ------------------------------------------------------------------ the rollout
    def rollout(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        """Generate for this process's rows, score them, and return the typed batch (see the module docstring)."""
        mode = "train" if self.model.training else "eval"
        prompts, images = self._rollout_prompts(rows)
        out = self.generate(prompts, images=images)
        completion_mask = out.completion_mask
        if self.args.mask_truncated_completions:
            completion_mask = completion_mask * (~out.is_truncated).unsqueeze(1).long()
        batch = RolloutBatch(
            prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=completion_mask,
            rewards=torch.empty(0),
            row_index=torch.empty(0),
            is_truncated=out.is_truncated,
            num_loss_tokens=self.accelerator.gather(completion_mask.sum()).sum().item(),
            image_inputs=out.image_inputs,
            prompt_token_inputs=dict(out.prompt_token_inputs or {}),
        )
        self._log_generation_metrics(mode, out)
        self._rollout_logps(batch, mode)
        conversational = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": t}] for t in out.texts] if conversational else out.texts
        rewards_per_func = self._score(rows, prompts, completions, out.completion_ids_list)
        rewards = self.rewards.combine(rewards_per_func)  # (N_global,)
        n, rank = len(rows), self.accelerator.process_index
        local = slice(rank * n, (rank + 1) * n)
        batch.rewards, batch.row_index = rewards[local], torch.arange(rank * n, (rank + 1) * n, device=rewards.device)
        self._log_reward_metrics(rewards_per_func, rewards)
        advantages = (
            None if self.defers_advantages else self.compute_advantages(rewards, rewards_per_func, batch, mode)
        )
        if advantages is not None:
            batch.advantages = advantages[local]
        self._log_samples(prompts, completions, images, rewards_per_func, advantages)
        return batch

    def _rollout_prompts(self, rows):
        prompts = [row["prompt"] for row in rows]
        images = [get_images(row) for row in rows]
        if all(i is None for i in images):
            return prompts, None
        if not is_conversational(rows[0]):
            raise ValueError("Rows with images need conversational prompts (lists of messages), not plain strings.")
        return [prepare_multimodal_messages(p, images=i or []) for p, i in zip(prompts, images, strict=True)], images

    def _rollout_logps(self, batch: RolloutBatch, mode: str) -> None:
        """Old (when `needs_old_logps`) and reference per-token log-probs, no grad, in micro-batches."""
        input_ids, attention_mask, extra = batch.model_inputs()
        width = batch.completion_ids.size(1)
        # Image inputs are per row: one forward over the batch keeps rows and images aligned.
        chunk = (
            None
            if extra
            else self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size
        )
        with torch.no_grad():
            if self.needs_old_logps(mode):
                batch.old_logps = self.token_logprobs(
                    self.model, input_ids, attention_mask, width, batch_size=chunk, **extra
                ).logps
            if self.reference.available:
                batch.ref_logps = self.reference_logprobs(input_ids, attention_mask, width, batch_size=chunk, **extra)

    def _score(self, rows, prompts, completions, completion_ids) -> torch.Tensor:
        """`(N_global, num_funcs)` rewards gathered from every process; failures name the step and the batch."""
        extra = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        try:
            local = self.rewards(
                prompts,
                completions,
                completion_ids,
                extra,
                self.accelerator.device,
                self.args.chat_template_kwargs,
                trainer_state=self.state,
                log_metric=self.log_metric,
                log_extra=self._log_extra,
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise type(e)(
                f"{e} [at global step {self.state.global_step}, on the batch whose first prompt is {prompts[0]!r}; "
                "the last saved checkpoint is untouched]"
            ) from e
        unscorable = torch.isnan(local).all(dim=1)
        if unscorable.any():
            row = int(unscorable.nonzero()[0, 0])
            logger.warning(
                f"All reward functions returned None for the following kwargs:\n"
                f"{{'prompt': {prompts[row]!r}, 'completion': {completions[row]!r}}}\n"
                "Please ensure that at least one reward function returns a valid reward."
            )
        rewards_per_func = gather(local)
        if self.args.strict_rewards and torch.isnan(rewards_per_func).all():
            raise ValueError(
                f"Every reward function returned None/NaN for all {rewards_per_func.size(0)} completions at global "
                f"step {self.state.global_step} (functions: {self.rewards.names}; first row: prompt {prompts[0]!r}, "
                f"completion {completions[0]!r}). strict_rewards=True requires at least one score per batch."
            )
        return rewards_per_func

    def _setup_aux_loss(self):
        text_config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        coef = self.args.router_aux_loss_coef
        if coef and not hasattr(text_config, "output_router_logits"):
            raise ValueError(f"router_aux_loss_coef={coef} but the policy is not a Mixture-of-Experts model.")
        self.aux_coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.aux_loss_enabled = hasattr(text_config, "output_router_logits") and bool(self.aux_coef)

    # ------------------------------------------------------------------ metrics and completion logs
    def _log_generation_metrics(self, mode, out):
        lengths = gather(out.completion_mask.sum(1).float())
        truncated = gather(out.is_truncated.float())
        if mode == "train":
            tokens = gather(out.prompt_mask.sum() + out.completion_mask.sum()).sum().item()
            self.state.num_input_tokens_seen += tokens
        self.log_metric("num_tokens", self.state.num_input_tokens_seen)
        terminated = lengths[truncated == 0] if (truncated == 0).any() else torch.zeros(1, device=lengths.device)
        for name, values in (("", lengths), ("terminated_", terminated)):
            self.log_metric(f"completions/mean_{name}length", values.mean().item())
            self.log_metric(f"completions/min_{name}length", values.min().item())
            self.log_metric(f"completions/max_{name}length", values.max().item())
        self.log_metric("completions/clipped_ratio", truncated.mean().item())

    def _log_reward_metrics(self, rewards_per_func, rewards):
        for i, name in enumerate(self.rewards.names):
            self.log_metric(f"rewards/{name}/mean", torch.nanmean(rewards_per_func[:, i]).item())
            self.log_metric(f"rewards/{name}/std", nanstd(rewards_per_func[:, i]).item())
        self.log_metric("reward", torch.nanmean(rewards).item())
        self.log_metric("reward_std", nanstd(rewards).item())

    def _log_extra(self, column: str, values: list) -> None:
        """`log_extra` for reward functions: a column (one value per completion) for the completions log."""
        self._pending_extra[column].extend(values)

    def _log_samples(self, prompts, completions, images, rewards_per_func, advantages) -> None:
        """Extend TRL's `_logs` (prompt, completion, rewards per function, advantages, extra columns, images)."""
        self._logs["prompt"].extend(gather_object(prompts))
        self._logs["completion"].extend(gather_object(completions))
        for i, name in enumerate(self.rewards.names):
            self._logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        if advantages is not None:
            self._logs["advantages"].extend(advantages.tolist())
        # Every process must join each gather: agree on the column names first (a column may be logged on one rank).
        names = sorted(set(gather_object(list(self._pending_extra))))
        for name in names:
            self._logs["extra"][name].extend(gather_object(self._pending_extra.get(name, [None] * len(prompts))))
        self._pending_extra.clear()
        if images is not None and self.args.log_multimodal:
            self._logs["images"].extend(gather_object(images))
        self._logs_round += 1

    def log(self, logs, start_time=None):
        if self.args.log_completions and self.accelerator.is_main_process and self._logs_printed < self._logs_round:
            self._print_completions()
            self._logs_printed = self._logs_round  # each generation round is shown once
        super().log(logs, start_time)

    def _print_completions(self):
        logs = self._logs
        per_func = torch.tensor(list(zip(*logs["rewards"].values())), dtype=torch.float32)  # (N, num_funcs)
        rewards = self.rewards.combine(per_func).tolist()
        columns = dict(logs["extra"])
        if logs["advantages"]:
            columns["advantage"] = logs["advantages"]
        rows = [(p, c, r, {k: v[i] for k, v in columns.items() if i < len(v)})
                for i, (p, c, r) in enumerate(zip(logs["prompt"], logs["completion"], rewards))]  # fmt: skip
        if self.args.log_unique_prompts:
            rows = list({str(row[0]): row for row in rows}.values())
        rows = rows[: self.args.num_completions_to_print or len(rows)]
        for prompt, completion, reward, extra in rows:
            values = "".join(f"\n  {k}: {v}" for k, v in extra.items())
            step = self.state.global_step
            print(f"[step {step}] reward={reward:.3f}\n  prompt: {prompt}\n  completion: {completion}{values}")
        if "wandb" in (self.args.report_to or []):
            import wandb

            if wandb.run is not None:
                names = ["step", "prompt", "completion", "reward", *columns]
                data = [
                    [self.state.global_step, str(p), str(c), r, *[e.get(k) for k in columns]] for p, c, r, e in rows
                ]
                wandb.log({"completions": wandb.Table(columns=names, data=data)})


_LOGPROB_OPTIONS = {"compute_entropy", "entropy_requires_grad", "batch_size", "output_router_logits"}


def _identity(rows):
    return rows


def _check_prompts(dataset: Dataset, name: str) -> None:
    """Empty or missing prompts cannot be generated from: name the first such row."""
    for i, prompt in enumerate(dataset["prompt"]):
        if (
            prompt is None
            or (isinstance(prompt, str) and not prompt.strip())
            or (isinstance(prompt, list) and not prompt)
        ):
            raise ValueError(
                f"{name} dataset row {i} has prompt {prompt!r}: every row needs a non-empty prompt (a string or a "
                "list of messages). Filter such rows out, e.g. dataset.filter(lambda row: row['prompt'])."
            )


def _configure_iterable_loading(args, train_dataset, eval_dataset) -> None:
    """Iterable datasets carry the prompt repeats in the stream: each process reads its own shard (no dispatch) and
    the train stream is read by one worker, so no group of num_generations is split (as TRL does)."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if not any(isinstance(d, IterableDataset) for d in (train_dataset, *evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in `accelerator_config`. "
            "Please set it to `False`: rows are python dicts and each process reads its own shard."
        )
    args.accelerator_config.dispatch_batches = False
    if isinstance(train_dataset, IterableDataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
            f"provided value ({args.dataloader_num_workers})."
        )
        args.dataloader_num_workers = 0


class _RepeatedIterable(torch.utils.data.IterableDataset):
    """Streaming counterpart of `RepeatSampler`: chunks of `prompts_per_batch` rows, each row repeated
    `mini_repeat_count` times in a row, each chunk repeated `repeat_count` times."""

    def __init__(self, dataset: IterableDataset, mini_repeat_count: int, prompts_per_batch: int, repeat_count: int):
        self.dataset, self.mini_repeat_count = dataset, mini_repeat_count
        self.prompts_per_batch, self.repeat_count = prompts_per_batch, repeat_count

    def __iter__(self):
        chunk = []
        for row in self.dataset:
            chunk.append(row)
            if len(chunk) == self.prompts_per_batch:
                for _ in range(self.repeat_count):
                    for item in chunk:
                        yield from [item] * self.mini_repeat_count
                chunk = []
