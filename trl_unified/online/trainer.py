"""The online-RL core that RLOO, GRPO and PPO share, written once.

`OnlineTrainer` owns the repeat sampler, the generation buffer, `_prepare_inputs`, the checkpointed buffer state and
the rollout:

    rows → prompts (+ images) → completions (`generate_batched`) → masks → old / reference per-token log-probs
         (only when needed) → rewards (gathered; errors name the step, the function and the row) → metrics and the
         completion log → advantages (the subclass's `compute_advantages`) → a `RolloutBatch`

A subclass implements `compute_advantages` and `compute_policy_loss`, nothing else. The config is
`base/online_config.py`, the batch `base/rollout.py`, the completion samples `base/completion_log.py`.
"""

import copy
import logging
import os
import time
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather, gather_object, set_seed
from datasets import Dataset, IterableDataset
from trl import is_conversational, prepare_multimodal_messages

from ..core.models import cast_lm_head_to_fp32, get_tokenizer, load_model_plain
from ..core.reference import prepare_frozen_model
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import RepeatedIterable, RepeatSampler, dataset_columns, get_images, require_columns
from ..generation.batched import GenerationOutput, max_positions, prompt_lengths
from .agents import (
    EMPTY_PROMPT,
    Environments,
    ToolLoop,
    check_tool,
    check_tool_support,
    parse_turn,
    prepare_tool_template,
)
from .completion_log import CompletionLog
from .config import OnlineConfig
from .critic import (
    attach_value_model,
    check_value_vocabulary,
    load_value_model,
    position_ids_from_mask,
    save_value_model,
    without_value_model,
)
from .rewards import EventLoopThread, RewardFunctions, is_async_callable, nanstd
from .rollout import RolloutBatch
from .schedules import EveryNStepsScheduler


logger = logging.getLogger(__name__)

_LOGPROB_OPTIONS = {"compute_entropy", "entropy_requires_grad", "batch_size", "output_router_logits"}


class OnlineTrainer(PolicyTrainerBase):
    """Base of the online trainers (RLOO, GRPO, PPO): TRL's constructor and usage surface, the rollout and its buffer.

    A subclass implements:
    - `compute_advantages(rewards, rewards_per_func, batch, mode)`: `(N_global,)` advantages from the gathered
      rewards (groups of G contiguous; NaN = unscorable) and this process's `RolloutBatch` (old/reference log-probs).
    - `compute_policy_loss(model, inputs, num_items_in_batch)`: the loss of one `RolloutBatch` micro-batch.
    Optionally `needs_old_logps(mode)` and `defers_advantages()` (see their docstrings).
    """

    config_class = OnlineConfig
    # Read the old log-probs (when `needs_old_logps`) from the logits the lean decode loop computed while sampling,
    # instead of a no-grad forward of the policy over the rollout (PPO, as TRL's PPO reads `generate`'s scores; RLOO
    # and GRPO keep TRL's forward). The forward still runs where the loop could not decode.
    old_logps_from_sampling = False

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: OnlineConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        ref_model=None,
    ):
        self._reward_sources = (reward_funcs, reward_processing_classes)  # read by setup()
        self._standalone_tools = list(tools or [])
        self.rollout_func = rollout_func
        self._environment_factory = environment_factory  # read by prepare_dataset() and setup()
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

    def setup(self) -> None:
        if isinstance(self.train_dataset, IterableDataset) and self.args.dataloader_num_workers != 0:
            logger.warning(
                "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
                f"provided value ({self.args.dataloader_num_workers})."
            )
            self.args.dataloader_num_workers = 0
        if self.args.cast_lm_head_to_fp32:
            cast_lm_head_to_fp32(self.model)
            if self.reference.kind == "copy":
                cast_lm_head_to_fp32(self.accelerator.unwrap_model(self.reference.model))
        self._setup_agents()
        reward_funcs, reward_processing_classes = self._reward_sources
        self.rewards = RewardFunctions(
            reward_funcs,
            reward_processing_classes,
            self.args.reward_weights,
            self.args,
            extra_funcs=self._env.reward_funcs if self._env is not None else (),
        )
        for i, reward_model in self.rewards.models():
            self.rewards.funcs[i] = prepare_frozen_model(reward_model.requires_grad_(False), self.accelerator)
        self._check_prompt_lengths()
        self._step, self._buffer, self._rollout, self._step_time = 0, None, None, 0.0
        self.completion_log = CompletionLog(self.args.generation_batch_size)
        # Each process samples different completions, reproducibly (the samplers have their own seeded generator).
        set_seed(self.args.seed, device_specific=True)

    def _setup_agents(self) -> None:
        """Tools, environments and their checks (see `base/agents.py`), once, before the reward functions."""
        for tool in self._standalone_tools:
            check_tool(tool)
        factory = self._environment_factory
        self._env = Environments(factory, self._standalone_tools) if factory is not None else None
        self.tools = list(self._standalone_tools)
        if self._env is not None:
            self.tools += [m for m in self._env.all_methods() if m not in self.tools]
        if self.tools or factory:
            check_tool_support(self.processing_class)
        self.chat_template = prepare_tool_template(self.processing_class) if self.tools else None
        self.max_tool_calling_iterations = self.args.max_tool_calling_iterations
        self._event_loop = EventLoopThread() if any(is_async_callable(t) for t in self.tools) else None

    # ------------------------------------------------------------------ a learned critic (PPO), see base/critic.py
    value_head = None  # the attached value model, when the algorithm learns one
    _entropy_bonus_enabled = False  # TRL's attribute: entropies keep their gradient when an entropy bonus is on

    def attach_critic(self, value_model) -> None:
        """Attach a value model (a sequence classifier on the policy's vocabulary) as a trained submodule of the
        policy; saving keeps it out of the published policy and checkpoints keep it for an exact resume."""
        if isinstance(value_model, str):
            value_model = load_model_plain(value_model, what="value model", num_labels=1)
        check_value_vocabulary(self.model, value_model)
        self.value_model = value_model.to(self.args.device)
        self.value_head = attach_value_model(self.model, self.value_model)
        # DDP's search for unused parameters (the Trainer's default without gradient checkpointing) starts from the
        # forward's outputs, which do not contain the values: it would mark the critic unused, and again ready when
        # its gradient arrives. Every trainable parameter gets a gradient at every step, so no search is needed.
        if self.args.ddp_find_unused_parameters:
            raise ValueError(
                "ddp_find_unused_parameters=True is not supported with a value model (every parameter gets a "
                "gradient at every step, and the search would mark the critic unused). Leave it None or False."
            )
        self.args.ddp_find_unused_parameters = False
        if getattr(self.accelerator, "ddp_handler", None) is not None:  # built by Trainer.__init__ from the args
            self.accelerator.ddp_handler.find_unused_parameters = False

    @torch.no_grad()
    def token_values(self, batch: RolloutBatch, chunk: int | None = None) -> torch.Tensor:
        """The critic's values `(B, C)` of the states before each completion token (`chunk` rows per forward),
        without grad, for the rollout; with grad, the loss requests them from the policy's own forward
        (`value_head.request_values`), so that DDP sees the critic inside the wrapper's forward."""
        input_ids, attention_mask, _ = batch.model_inputs()
        positions = position_ids_from_mask(attention_mask)
        width, chunk = batch.completion_ids.size(1), chunk or input_ids.size(0)
        parts = []
        with self.accelerator.autocast():
            for i in range(0, input_ids.size(0), chunk):
                rows = slice(i, i + chunk)
                parts.append(self.value_head(input_ids[rows], attention_mask[rows], positions[rows], width))
        return torch.cat(parts)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The policy (a critic is not part of the published model; with `args.save_value_model` it is saved too, in
        `<output_dir>/value_model`)."""
        with without_value_model(self.accelerator.unwrap_model(self.model)):
            super().save_model(output_dir, _internal_call)
        if getattr(self.args, "save_value_model", False) and not _internal_call and self.is_world_process_zero():
            self.value_model.save_pretrained(os.path.join(output_dir or self.args.output_dir, "value_model"))

    def optimizer_steps_per_rollout(self) -> int:
        """How many optimiser steps share one learning rate: 1 (the Trainer's schedule); PPO: one rollout's steps."""
        return 1

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        every = self.optimizer_steps_per_rollout()
        if every == 1 or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        super().create_scheduler(max(1, num_training_steps // every), optimizer)
        self.lr_scheduler = EveryNStepsScheduler(self.lr_scheduler, every)
        return self.lr_scheduler

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with without_value_model(self.accelerator.unwrap_model(self.model)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.value_head is not None:
            load_value_model(self.value_head, resume_from_checkpoint)

    # ------------------------------------------------------------------ TRL's attributes
    @property
    def reward_weights(self) -> torch.Tensor:
        return self.rewards.weights

    @property
    def environment_factories(self) -> dict | None:
        return self._env.factories if self._env is not None else None

    @property
    def environments(self) -> list | None:
        """The environment instances of the last generation batch, one per row (None without environments)."""
        return self._env.instances if self._env is not None else None

    @property
    def _env_tools(self) -> dict:
        return self._env.tools if self._env is not None else {}

    @property
    def _environment_pool(self) -> dict:
        return self._env.pool if self._env is not None else {}

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

    @property
    def _logs(self) -> dict:
        """TRL's completion samples (`CompletionLog.columns`), read by callbacks written against TRL."""
        return self.completion_log.columns

    # ------------------------------------------------------------------ hooks
    def needs_old_logps(self, mode: str) -> bool:
        """Whether the rollout computes per-token log-probs at sampling time (TRL's rule: only when the policy can
        change between generation and a use of the batch, i.e. when an optimiser step falls inside one generation
        round: `gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0`)."""
        args = self.args
        return (
            mode == "train"
            and args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0
        )

    def defers_advantages(self) -> bool:
        """True when advantages need the loss forward's log-probs (the rollout then leaves them None)."""
        return False

    def reshuffles_each_iteration(self) -> bool:
        """Whether each of the `num_iterations` passes over a rollout draws a new order of micro-batches (PPO's
        epochs over shuffled mini-batches) rather than reusing the first pass's."""
        return False

    def assign_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor | None:
        """Set `batch.advantages` (this process's rows). By default from `compute_advantages` over the global
        generation batch; returns the global advantages for the completion log (None if there is no such row view).
        A trainer whose advantages are per token and local (PPO's GAE) overrides this."""
        advantages = self.compute_advantages(rewards, rewards_per_func, batch, mode)
        n, rank = len(batch), self.accelerator.process_index
        batch.advantages = advantages[rank * n : (rank + 1) * n]
        return advantages

    def compute_advantages(
        self, rewards: torch.Tensor, rewards_per_func: torch.Tensor, batch: RolloutBatch, mode: str
    ) -> torch.Tensor:
        """`(N_global,)` advantages. `rewards`: the weighted sum over functions `(N_global,)`, NaN where no function
        scored the row; `rewards_per_func`: `(N_global, num_funcs)`; groups of G rows contiguous."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_advantages.")

    def generation_options(self) -> dict[str, Any]:
        with torch.no_grad():  # generation runs without grad (and with checkpointing off)
            shared = self.uses_shared_prefix(self.model, "generation", obstacle=self._generation_sharing_obstacle())
        return {
            "shared_prefix": shared,
            "gather_deepspeed3_params": self.args.ds3_gather_for_generation,
            "pad_to_multiple_of": self.args.pad_to_multiple_of,
            "continuous_batching": self._continuous_batching_config(),
        }

    def _continuous_batching_config(self):
        if not self.args.use_transformers_continuous_batching:
            return None
        from transformers.generation import ContinuousBatchingConfig

        kwargs = dict(self.args.transformers_continuous_batching_config or {})
        kwargs.setdefault("max_memory_percent", 0.5)  # TRL's training-aware default
        return ContinuousBatchingConfig(**kwargs)

    def token_logprobs(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """The base's log-probs, encoding each repeated prompt once where `shared_prefix` allows it."""
        extra = {k: v for k, v in kwargs.items() if k not in _LOGPROB_OPTIONS}
        shared = self.uses_shared_prefix(
            model, "log-prob forward", extra, router_logits=kwargs.get("output_router_logits", False)
        )
        return super().token_logprobs(model, input_ids, attention_mask, logits_to_keep, shared_prefix=shared, **kwargs)

    def _generation_sharing_obstacle(self) -> str | None:
        config = self.generation_config()
        if (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1:
            return "beam search / num_return_sequences expand the rows inside generate"
        if self.args.use_transformers_continuous_batching:
            return "continuous batching manages its own paged cache"
        return None

    # ------------------------------------------------------------------ TRL's loss helpers (public on its trainers)
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's helper: tokens whose entropy is at least the `threshold` quantile (`1 - top_entropy_quantile`) of all
        processes' unmasked token entropies (Beyond the 80/20 Rule, arXiv:2506.01939). `(B, C)` bool."""
        local = entropies[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9)  # entropies are >= 0
        values = self.accelerator.gather(padded)
        values = values[values != -1e9]
        if values.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return ((entropies * mask.float()) >= torch.quantile(values, threshold)) & mask.bool()

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's helper, DeepSeek-V3.2's off-policy sequence mask `(B, 1)`: drop (0) a sequence with A < 0 whose mean
        KL(π_old ‖ π_θ) = mean_t (log π_old - log π_θ) over its tokens exceeds the threshold; keep (1) the rest."""
        kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
        mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        return ((advantages >= 0) | (mean_kl <= off_policy_threshold)).to(mask.dtype)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """TRL's extension point for subclasses: `(per-token log-probs, entropies or None, MoE aux loss or None)` of
        the last `logits_to_keep` tokens (entropies keep their gradient when the entropy bonus is on)."""
        aux = kwargs.pop("compute_aux_loss", False)
        out = self.token_logprobs(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=batch_size,
            compute_entropy=compute_entropy,
            entropy_requires_grad=self._entropy_bonus_enabled,
            output_router_logits=aux,
            **{k: v for k, v in kwargs.items() if v is not None},
        )
        return out.logps, out.entropy, out.aux_loss

    def masked_global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Mean over all processes: token-weighted under `mask` for `(B, C)`, per sequence for `(B, 1)`."""
        if x.size(1) == 1:
            total, count = x.sum(), x.new_tensor(float(x.size(0)))
        else:
            total, count = (x * mask).sum(), mask.sum().float()
        stats = self.accelerator.reduce(torch.stack([total, count]), reduction="sum")
        return (stats[0] / stats[1].clamp(min=1.0)).item()

    def log_clip_ratios(self, ratio, advantages, mask, low: float, high: float) -> None:
        """TRL's `clip_ratio/*`: how often the ratio (per token `(B, C)`, or per sequence `(B, 1)`) was clipped
        below (ratio < low with A < 0) and above (ratio > high with A > 0), as global means, and the extreme
        per-sequence fractions over all processes."""
        advantages = advantages.view(ratio.size(0), -1)
        low_clip = ((ratio < low) & (advantages < 0)).float()
        high_clip = ((ratio > high) & (advantages > 0)).float()
        per_sequence = (
            (lambda x: x.squeeze(1)) if ratio.size(1) == 1 else (lambda x: (x * mask).sum(-1) / mask.sum(-1))
        )
        self.log_metric("clip_ratio/low_mean", self.masked_global_mean(low_clip, mask))
        self.log_metric("clip_ratio/high_mean", self.masked_global_mean(high_clip, mask))
        self.log_metric("clip_ratio/region_mean", self.masked_global_mean(((low_clip + high_clip) > 0).float(), mask))
        for name, values, reduce in (("low_min", low_clip, torch.min), ("high_max", high_clip, torch.max)):
            gathered = gather(per_sequence(values))
            gathered = gathered[~torch.isnan(gathered)]
            self.log_metric(f"clip_ratio/{name}", reduce(gathered).item() if gathered.numel() else float("nan"))

    # ------------------------------------------------------------------ datasets
    def prepare_dataset(self, dataset, name):
        dataset = super().prepare_dataset(dataset, name)
        if dataset is None:
            return self._environment_owned_dataset() if name == "train" else None
        if self._environment_factory is None or "prompt" in dataset_columns(dataset):
            require_columns(dataset, [["prompt"]], f"{name} dataset", type(self).__name__)
        if isinstance(dataset, Dataset) and "prompt" in dataset.column_names:
            _check_prompts(dataset, name)
            need = self.args.generation_batch_size // self.args.num_generations
            if name == "train" and len(dataset) < need:
                raise ValueError(
                    f"train_dataset has {len(dataset)} prompts, but one generation batch needs {need} distinct "
                    f"prompts (generation_batch_size={self.args.generation_batch_size} / "
                    f"num_generations={self.args.num_generations}); training would run 0 steps. Add prompts, or "
                    "lower per_device_train_batch_size / steps_per_generation."
                )
        return dataset

    def train(self, *args, **kwargs):
        self._check_environment_column(self.train_dataset, "train")  # before the first rollout (TRL: in it)
        return super().train(*args, **kwargs)

    def _check_environment_column(self, dataset, name: str) -> None:
        """With a dict of environment factories, every row's `environment` must name one of them."""
        factories = self._environment_factory
        if not isinstance(factories, dict) or not isinstance(dataset, Dataset):
            return
        if "environment" not in dataset.column_names:
            raise ValueError(
                f"environment_factory is a dict ({list(factories)}), so each row of the {name} dataset must name its "
                "environment in an `environment` column; the dataset has none."
            )
        unknown = sorted({str(v) for v in dataset.unique("environment")} - {str(k) for k in factories})
        if unknown:
            raise ValueError(
                f"The {name} dataset has `environment={unknown[0]!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(factories)}. Fix the column or add the factory."
            )

    def _environment_owned_dataset(self) -> Dataset:
        """Without a train_dataset, the environment owns the data: `reset()` supplies each prompt (TRL's rule)."""
        factory = self._environment_factory
        if factory is None:
            raise ValueError(
                f"`train_dataset` is required unless an `environment_factory` is provided: {type(self).__name__} "
                "needs prompts to generate from."
            )
        if isinstance(factory, dict):
            raise ValueError(
                "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                "`environment` column to route each example to its environment. Provide a dataset, or pass a single "
                "environment factory."
            )
        if self.args.max_steps <= 0:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and returns the prompt from "
                "`reset()`), `max_steps` must be set to a positive value to define the training length. Set it via "
                f"`{type(self.args).__name__}(max_steps=...)`."
            )
        rows = self.args.generation_batch_size // self.args.num_generations
        return Dataset.from_dict({"prompt": [EMPTY_PROMPT] * rows})

    def _check_prompt_lengths(self) -> None:
        """The longest prompt plus `max_completion_length` must fit the model's positions (`max_position_embeddings`),
        checked on the tokenised prompts of map-style datasets before training; `generate_batched` checks the rest."""
        limit = max_positions(self.accelerator.unwrap_model(self.model))
        if limit is None:
            return
        new_tokens = self.args.max_completion_length or 0  # None: generate's own default length
        datasets = {"train": self.train_dataset}
        datasets.update(self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset})
        for name, dataset in datasets.items():
            names = dataset.column_names if isinstance(dataset, Dataset) else []
            if "prompt" not in names or any(c in names for c in ("image", "images")):
                continue
            lengths = prompt_lengths(self.processing_class, dataset["prompt"], self.args.chat_template_kwargs)
            row = max(range(len(lengths)), key=lengths.__getitem__)
            if lengths[row] + new_tokens > limit:
                raise ValueError(
                    f"{name} dataset row {row} has a prompt of {lengths[row]} tokens; with max_completion_length="
                    f"{new_tokens} that is {lengths[row] + new_tokens} positions, beyond the model's maximum of "
                    f"{limit} (config.max_position_embeddings). Shorten or filter long prompts, or lower "
                    "max_completion_length."
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
            dataset = RepeatedIterable(
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
        repeated = RepeatedIterable(dataset.shuffle(seed=self.args.seed), self.num_generations_eval, 1, 1)
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
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare_eval_datasets(eval_dataset)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ the generation buffer
    def _prepare_inputs(self, inputs):
        if not self.model.training:
            return self.rollout(inputs)
        steps = self.args.steps_per_generation
        if self._step % (steps * self.args.num_iterations) == 0 or self._buffer is None:
            self._rollout = self.rollout(inputs)
            self._buffer = self._rollout.shuffled().split(steps)
        elif self._step % steps == 0 and self.reshuffles_each_iteration():
            self._buffer = self._rollout.shuffled().split(steps)  # a new order of micro-batches for this pass
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
        state = {"step": self._step, "buffer": self._buffer, "rollout": self._rollout}
        torch.save(state, os.path.join(folder, f"trl_unified_state_{self.accelerator.process_index}.pt"))
        if self.value_head is not None and self.is_world_process_zero():
            save_value_model(self.value_head, folder)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = (
            os.path.join(checkpoint, f"trl_unified_state_{self.accelerator.process_index}.pt") if checkpoint else None
        )
        if path and os.path.exists(path):
            state = torch.load(path, weights_only=False)
            self._step, self._buffer, self._rollout = state["step"], state["buffer"], state.get("rollout")

    # ------------------------------------------------------------------ the rollout
    def rollout(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        """Generate for this process's rows, score them, and return the typed batch (see the module docstring)."""
        mode = "train" if self.model.training else "eval"
        prompts, images = self._rollout_prompts(rows)
        sampled = self._generate(prompts, images)
        out = sampled.generation
        batch = RolloutBatch.from_generation(out, self.args.mask_truncated_completions)
        batch.num_loss_tokens = self.accelerator.gather(batch.loss_mask.sum()).sum().item()
        self._log_generation_metrics(mode, out, sampled)
        self._rollout_logps(batch, mode)
        rows = [
            {**row, **{k: _row_value(v, i) for k, v in sampled.extra_fields.items()}} for i, row in enumerate(rows)
        ]
        rewards_per_func = self._score(rows, prompts, sampled.completions, out)
        rewards = self.rewards.combine(rewards_per_func)  # (N_global,)
        n, rank = len(rows), self.accelerator.process_index
        local = slice(rank * n, (rank + 1) * n)
        batch.rewards, batch.row_index = rewards[local], torch.arange(rank * n, (rank + 1) * n, device=rewards.device)
        self._log_reward_metrics(rewards_per_func, rewards)
        advantages = (
            None if self.defers_advantages() else self.assign_advantages(rewards, rewards_per_func, batch, mode)
        )
        self.completion_log.add_round(
            prompts,
            sampled.completions,
            images,
            rewards_per_func,
            self.rewards.names,
            advantages,
            self.args.log_multimodal,
        )
        return batch

    def _rollout_prompts(self, rows):
        """This process's prompts (after each environment's `reset` observation) and images."""
        if self._env is not None:
            self._env.assign(rows)
            prompts = self._env.reset(rows, [row.get("prompt", EMPTY_PROMPT) for row in rows])
        else:
            prompts = [row["prompt"] for row in rows]
        images = [get_images(row) for row in rows]
        if all(i is None for i in images):
            return prompts, None
        if not is_conversational(rows[0]):
            raise ValueError("Rows with images need conversational prompts (lists of messages), not plain strings.")
        return [prepare_multimodal_messages(p, images=i or []) for p, i in zip(prompts, images, strict=True)], images

    # ------------------------------------------------------------------ sampling: generate, rollout_func, tool loop
    def generate_eval_texts(self, rows, prompts):
        """With tools or environments, generative evaluation runs the agent: the tool loop, greedy unless
        `eval_do_sample`, the answer read from the last assistant turn."""
        if not rows or not (self.tools or self._env is not None):
            return super().generate_eval_texts(rows, prompts)
        prompts, _ = self._rollout_prompts(rows)
        sampled = self._generate(
            prompts, do_sample=self.args.eval_do_sample, max_new_tokens=self.args.eval_max_new_tokens
        )
        return [c[-1].get("content", "") if isinstance(c, list) else c for c in sampled.completions]

    def _generate(self, prompts: list, images=None, do_sample=True, max_new_tokens=None) -> "SampledCompletions":
        """The completions of `prompts` (one per prompt; the sampler already repeats each num_generations times):
        from `rollout_func` when given, else the policy's generation; then, with tools, the multi-turn tool loop."""
        prompts = copy.deepcopy(prompts)
        sampling = dict(do_sample=do_sample, max_new_tokens=max_new_tokens)
        extra_fields: dict[str, Any] = {}
        if self.rollout_func is not None:
            prompt_ids, completion_ids, extra_fields = self._call_rollout_func(prompts)
        elif self.tools:
            if images is not None:
                raise NotImplementedError("Tools with image rows are not implemented; drop the images or the tools.")
            prompt_ids = self._tokenize_with_tools(prompts)
            completion_ids = self.generate(prompt_ids, **sampling).completion_ids_list
        else:
            out = self.generate(prompts, images=images, return_logprobs=self.old_logps_from_sampling, **sampling)
            conversational = is_conversational({"prompt": prompts[0]})
            completions = [[{"role": "assistant", "content": t}] for t in out.texts] if conversational else out.texts
            return SampledCompletions(out, completions, {})
        completions = self._parse_completions(prompts, prompt_ids, completion_ids)
        tool_mask, calls, failures = extra_fields.pop("env_mask", None) if not self.tools else None, 0, 0
        if self.tools:
            loop = ToolLoop(
                self.processing_class,
                lambda contexts, new_tokens: (
                    self.generate(contexts, do_sample=do_sample, max_new_tokens=new_tokens).completion_ids_list
                ),
                max_new_tokens or self.args.max_completion_length,
                max_positions(self.accelerator.unwrap_model(self.model)),
                self.max_tool_calling_iterations,
                self.chat_template,
                self.args.chat_template_kwargs,
                self._event_loop,
            )
            completion_ids, tool_mask, completions, calls, failures = loop.run(
                prompt_ids, completion_ids, completions, self._row_tools(len(prompts))
            )
        out = GenerationOutput.from_token_lists(
            prompt_ids,
            completion_ids,
            self.processing_class,
            self.eos_token_ids,
            tool_mask,
            self.args.pad_to_multiple_of,
            self.accelerator.device,
        )
        return SampledCompletions(out, completions, extra_fields, calls, failures)

    def _call_rollout_func(self, prompts):
        """TRL's contract: `rollout_func(prompts, trainer)` returns `prompt_ids`, `completion_ids` and `logprobs`
        (one list per prompt); any other key (e.g. `env_mask`, `logprob_token_ids`) is forwarded to the reward
        functions as a column."""
        output = self.rollout_func(prompts, self)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        for key in ("prompt_ids", "completion_ids"):
            if len(output[key]) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(output[key])} {key} for {len(prompts)} prompts; it must return one "
                    "per prompt (each prompt already appears num_generations times)."
                )
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        return [list(p) for p in output["prompt_ids"]], [list(c) for c in output["completion_ids"]], extra

    def _row_tools(self, n: int) -> list[list]:
        return self._env.row_tools() if self._env is not None else [self.tools] * n

    def _tokenize_with_tools(self, prompts) -> list[list[int]]:
        """Each prompt rendered with its row's tools (and the training chat template, when one is needed)."""
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError(
                "Tools need conversational prompts (lists of messages): the chat template renders the tools. Turn "
                "plain prompts into [{'role': 'user', 'content': prompt}]."
            )
        template_kwargs = dict(self.args.chat_template_kwargs or {})
        return [
            list(
                self.processing_class.apply_chat_template(
                    [prompt],
                    tools=tools or None,
                    chat_template=self.chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **template_kwargs,
                )["input_ids"][0]
            )
            for prompt, tools in zip(prompts, self._row_tools(len(prompts)), strict=True)
        ]

    def _parse_completions(self, prompts, prompt_ids, completion_ids) -> list:
        """Conversational rows: a list of messages per row (tool calls parsed when the tokenizer has a response
        parser); plain rows: the decoded text."""
        tokenizer = get_tokenizer(self.processing_class)
        if not is_conversational({"prompt": prompts[0]}):
            return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            return [[{"role": "assistant", "content": text}] for text in texts]
        tools = self._row_tools(len(prompts))
        return [
            [parse_turn(self.processing_class, ids, prefix, row_tools)]
            for ids, prefix, row_tools in zip(completion_ids, prompt_ids, tools, strict=True)
        ]

    def _rollout_logps(self, batch: RolloutBatch, mode: str) -> None:
        """Old (when `needs_old_logps`) and reference per-token log-probs, no grad, in micro-batches."""
        input_ids, attention_mask, extra = batch.model_inputs()
        width = batch.completion_ids.size(1)
        # Image inputs are per row: one forward over the batch keeps rows and images aligned.
        train = mode == "train"
        chunk = (
            None if extra else self.args.per_device_train_batch_size if train else self.args.per_device_eval_batch_size
        )
        with torch.no_grad():
            if self.needs_old_logps(mode) and batch.old_logps is None:  # not already read from the sampling logits
                batch.old_logps = self.token_logprobs(
                    self.model, input_ids, attention_mask, width, batch_size=chunk, **extra
                ).logps
            if self.reference.available:
                batch.ref_logps = self.reference_logprobs(input_ids, attention_mask, width, batch_size=chunk, **extra)

    def _score(self, rows, prompts, completions, out: GenerationOutput) -> torch.Tensor:
        """`(N_global, num_funcs)` rewards gathered from every process; failures name the step and the batch.
        Reward functions get TRL's arguments, plus `prompt_ids` (the prompt tokens of each row, for scorers that
        read token ids); prompts given as token ids reach them decoded."""
        extra = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(out.prompt_ids, out.prompt_mask, strict=True)]
        if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], int):
            prompts = get_tokenizer(self.processing_class).batch_decode(prompts, skip_special_tokens=True)
        try:
            local = self.rewards(
                prompts,
                completions,
                out.completion_ids_list,
                extra,
                self.accelerator.device,
                self.args.chat_template_kwargs,
                trainer_state=self.state,
                log_metric=self.log_metric,
                log_extra=self.completion_log.log_extra,
                prompt_ids=prompt_ids,
                **({"environments": self._env.instances} if self._env is not None else {}),
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

    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """TRL's sample generations: near-greedy completions (temperature 0.01) for the eval prompts (only the first
        `per_device_eval_batch_size` rows when `sampling`) with their combined reward; the first rows are printed on
        the main process; every row is returned as `{"query", "model response", "score"}`."""
        if self.eval_dataset is None or isinstance(self.eval_dataset, dict):
            return []
        rows = list(self.eval_dataset)
        rows = rows[: self.args.per_device_eval_batch_size] if sampling else rows
        rows = rows[self.accelerator.process_index :: self.accelerator.num_processes]
        prompts, _ = self._rollout_prompts(rows)
        temperature, self.args.temperature = self.args.temperature, 0.01
        try:
            out = self.generate(prompts)
        finally:
            self.args.temperature = temperature
        scores = self.rewards.combine(self._score(rows, prompts, out.texts, out)).tolist()
        pairs = zip(gather_object(prompts), gather_object(out.texts), scores, strict=True)
        table = [{"query": query, "model response": text, "score": score} for query, text, score in pairs]
        if self.accelerator.is_main_process:
            for row in table[:5]:
                print(row)
        return table

    # ------------------------------------------------------------------ metrics
    def _log_generation_metrics(self, mode, out, sampled):
        """TRL's completion metrics, over the tokens the model sampled (tool-result tokens do not count), and the
        tool metrics when there are tools: calls per rollout and failures per call, over all processes."""
        lengths = gather(out.model_token_mask.sum(1).float())
        truncated = gather(out.is_truncated.float())
        if mode == "train":
            tokens = gather(out.prompt_mask.sum() + out.model_token_mask.sum()).sum().item()
            self.state.num_input_tokens_seen += tokens
        if self.tools:
            device = lengths.device
            calls = gather(torch.tensor([float(sampled.tool_calls)], device=device)).sum()
            failures = gather(torch.tensor([float(sampled.tool_failures)], device=device)).sum()
            self.log_metric("tools/call_frequency", (calls / lengths.numel()).item())
            self.log_metric("tools/failure_frequency", (failures / calls).item() if calls > 0 else 0.0)
            # trl_unified's addition (TRL 1.16 logs no turn count): model turns per completion
            turns = [
                sum(m.get("role") == "assistant" for m in c) if isinstance(c, list) else 1 for c in sampled.completions
            ]
            self.log_metric(
                "tools/turns_per_completion", gather(torch.tensor(turns, device=device).float()).mean().item()
            )
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

    def log(self, logs, start_time=None):
        if self.args.log_completions and self.accelerator.is_main_process:
            self.completion_log.report(self.state.global_step, self.rewards.combine, self.args)
        super().log(logs, start_time)


class SampledCompletions(NamedTuple):
    """What `_generate` returns: the completions as a `GenerationOutput` (with the tool mask of multi-turn rows), as
    the reward functions see them (texts, or lists of messages), the extra per-row fields of a `rollout_func`, and
    the tool calls / failures of this process."""

    generation: GenerationOutput
    completions: list
    extra_fields: dict[str, Any]
    tool_calls: int = 0
    tool_failures: int = 0


def _row_value(values, i):
    """A rollout_func extra field for row i: lists are per row, anything else is shared by every row (TRL's rule)."""
    return values[i] if isinstance(values, list) and i < len(values) else values


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
