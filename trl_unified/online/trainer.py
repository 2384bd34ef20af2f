"""The online-RL core that RLOO, GRPO and PPO share, written once: orchestration only.

`OnlineTrainer` owns the generation buffer and the rollout:

    rows → prompts (+ images; environments reset) → completions (`online/completions.py`: generation, rollout_func,
         tool loop) → `RolloutBatch` → old / reference per-token log-probs (only when needed) → rewards (gathered;
         errors name the step, the function and the row) → metrics (`online/metrics.py`) and the completion log →
         advantages (the subclass's `compute_advantages`)

A subclass implements `compute_advantages` and `compute_policy_loss`, and declares what its rollout needs as class
attributes (`old_logps`, `old_logps_from_sampling`, `reshuffle_each_iteration`), resolved once into `self.plan`.
Datasets and samplers: `online/datasets.py`; config: `online/config.py`; a learned critic: `online/critic.py`.
"""

import logging
import os
import time
from typing import Any

import torch
from accelerate.utils import gather, set_seed
from datasets import IterableDataset
from trl import is_conversational, prepare_multimodal_messages

from ..core.logprobs import TokenLogprobs
from ..core.models import cast_lm_head_to_fp32, get_tokenizer
from ..core.reference import prepare_frozen_model
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import get_images
from ..generation import GenerationOutput
from ..generation.vllm_engine import VLLMEngine
from .agents import EMPTY_PROMPT, Environments, check_tool, check_tool_support, prepare_tool_template
from .completion_log import CompletionLog
from .completions import CompletionsMixin, row_value
from .config import OnlineConfig
from .datasets import OnlineDataMixin
from .importance_sampling import corrects_sampling, importance_sampling_ratio, mismatch_metrics
from .metrics import OnlineMetricsMixin
from .rewards import EventLoopThread, RewardFunctions, is_async_callable
from .rollout import RolloutBatch, RolloutPlan


logger = logging.getLogger(__name__)


class OnlineTrainer(CompletionsMixin, OnlineDataMixin, OnlineMetricsMixin, PolicyTrainerBase):
    """Base of the online trainers (RLOO, GRPO, PPO): TRL's constructor and usage surface, the rollout and its buffer.

    A subclass implements:
    - `compute_advantages(rewards, rewards_per_func, batch, mode)`: `(N_global,)` advantages from the gathered
      rewards (groups of G contiguous; NaN = unscorable) and this process's `RolloutBatch` (old/reference log-probs);
      or, for per-token local advantages (PPO's GAE), `assign_advantages`.
    - `compute_policy_loss(model, inputs, num_items_in_batch)`: the loss of one `RolloutBatch` micro-batch.

    and may declare (class attributes, resolved once in `setup()` into `self.plan`, see `RolloutPlan`):
    - `old_logps`: when the rollout computes the old per-token log-probs π_old: `"trl"` (TRL's rule: when an
      optimiser step falls inside one generation round), `"always"` (PPO), or `"unless_unchanged"` (RLOO: skipped
      when the policy cannot change between generation and use; a KL-shaped reward then waits for the loss forward);
    - `old_logps_from_sampling`: read π_old from the logits the lean decode loop computed while sampling instead of
      a no-grad forward of the policy (PPO, as TRL's PPO reads `generate`'s scores);
    - `reshuffle_each_iteration`: each of the `num_iterations` passes over a rollout draws a new order of
      micro-batches (PPO's epochs over shuffled mini-batches) rather than reusing the first pass's;
    - `scores_rewards = False`: no reward functions and no advantages (distillation), `batch_class`: the
      `RolloutBatch` subclass a rollout builds.
    """

    config_class = OnlineConfig
    repeats_prompts = True  # groups of G completions: log-prob forwards encode each prompt once where allowed
    old_logps = "trl"
    old_logps_from_sampling = False
    reshuffle_each_iteration = False
    scores_rewards = True  # False: no reward functions, no advantages (distillation)
    batch_class = RolloutBatch  # what a rollout returns (a subclass may add views of it)
    _entropy_bonus_enabled = False  # TRL's attribute: entropies keep their gradient when an entropy bonus is on

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
            if self.reference_model.kind == "copy":
                cast_lm_head_to_fp32(self.accelerator.unwrap_model(self.reference_model.model))
        self._setup_agents()
        reward_funcs, reward_processing_classes = self._reward_sources
        self.rewards = None
        if self.scores_rewards:
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
        # vLLM (use_vllm=True): one generation engine for training, evaluation and the tool loop (docs/vllm.md)
        self.vllm_engine = (
            VLLMEngine.from_args(self.args, self.model, self.accelerator) if self.args.use_vllm else None
        )
        self.plan = RolloutPlan.resolve(self.old_logps, self.args, self.reference_model.available)
        self._step, self._buffer, self._rollout, self._step_time = 0, None, None, 0.0
        self.completion_log = CompletionLog(self.args.generation_batch_size)
        # Each process samples different completions, reproducibly (the samplers have their own seeded generator).
        set_seed(self.args.seed, device_specific=True)

    def _setup_agents(self) -> None:
        """Tools, environments and their checks (see `online/agents.py`), once, before the reward functions."""
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
            shared = self.uses_shared_prefix(
                self.model,
                "generation",
                generation_config=self.generation_config(),
                continuous_batching=self.args.use_transformers_continuous_batching,
            )
        return {
            "shared_prefix": shared,
            "gather_deepspeed3_params": self.args.ds3_gather_for_generation,
            "pad_to_multiple_of": self.args.pad_to_multiple_of,
            "continuous_batching": self._continuous_batching_config(),
            "vllm": self._synced_vllm_engine(),
        }

    def _synced_vllm_engine(self) -> VLLMEngine | None:
        """The vLLM engine holding this trainer's current weights: synced once per optimiser step (a generation
        round, its evaluation and its tool-loop turns share one sync), on every process at once."""
        if self.vllm_engine is None:
            return None
        self.vllm_engine.ensure_synced(
            self.model_wrapped or self.model, self.accelerator, self, self.state.global_step
        )
        return self.vllm_engine

    def _continuous_batching_config(self):
        if not self.args.use_transformers_continuous_batching:
            return None
        from transformers.generation import ContinuousBatchingConfig

        kwargs = dict(self.args.transformers_continuous_batching_config or {})
        kwargs.setdefault("max_memory_percent", 0.5)  # TRL's training-aware default
        return ContinuousBatchingConfig(**kwargs)

    def policy_logprobs(self, model, inputs: RolloutBatch) -> TokenLogprobs:
        """The loss forward of a policy-gradient trainer: per-token log-probs (with grad) and entropies of the
        completions of `inputs`, and the MoE load-balancing loss when it is enabled."""
        input_ids, attention_mask, extra = inputs.model_inputs()
        return self.token_logprobs(
            model,
            input_ids,
            attention_mask,
            inputs.loss_mask.size(1),
            compute_entropy=True,
            entropy_requires_grad=self._entropy_bonus_enabled,
            output_router_logits=self.aux_loss_enabled,
            **extra,
        )

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
        elif self._step % steps == 0 and self.reshuffle_each_iteration:
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
        from_policy = self.vllm_engine is None  # the lean loop's sampling log-probs are the policy's own: π_old
        batch = self.batch_class.from_generation(out, self.args.mask_truncated_completions, from_policy)
        batch.num_loss_tokens = self.accelerator.gather(batch.loss_mask.sum()).sum().item()
        self._log_generation_metrics(mode, out, sampled)
        self._rollout_logps(batch, mode)
        rows = [{**row, **{k: row_value(v, i) for k, v in sampled.extra_fields.items()}} for i, row in enumerate(rows)]
        n, rank = len(rows), self.accelerator.process_index
        advantages, names = None, []
        if self.rewards is not None:
            rewards_per_func = self._score(rows, prompts, sampled.completions, out)
            rewards, names = self.rewards.combine(rewards_per_func), self.rewards.names  # (N_global,)
            self._log_reward_metrics(rewards_per_func, rewards)
        else:  # a trainer without rewards (distillation: the teacher's distributions are the signal)
            rewards_per_func = torch.zeros(n * self.accelerator.num_processes, 0, device=batch.prompt_ids.device)
            rewards = rewards_per_func.sum(1)
        batch.rewards = rewards[rank * n : (rank + 1) * n]
        batch.row_index = torch.arange(rank * n, (rank + 1) * n, device=rewards.device)
        if self.rewards is not None and not self.plan.defers_advantages(mode):
            advantages = self.assign_advantages(rewards, rewards_per_func, batch, mode)
        self.completion_log.add_round(
            prompts, sampled.completions, images, rewards_per_func, names, advantages, self.args.log_multimodal
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
            if self.plan.needs_old_logps(mode) and batch.old_logps is None:  # not read from sampling logits
                batch.old_logps = self.token_logprobs(
                    self.model, input_ids, attention_mask, width, batch_size=chunk, **extra
                ).logps
            if self.reference_model.available:
                batch.ref_logps = self.reference_logprobs(input_ids, attention_mask, width, batch_size=chunk, **extra)
        if self.vllm_engine is not None and corrects_sampling(self.args):
            self._importance_sampling(batch)

    def _importance_sampling(self, batch: RolloutBatch) -> None:
        """vLLM's correction (`online/importance_sampling.py`) into `batch.importance_sampling_ratio`, and TRL's
        `sampling/*` metrics over every process."""
        a, mask = self.args, batch.loss_mask
        if batch.sampling_logps is None:  # a tool loop or rollout_func: no engine log-probs, w = 1 (TRL's NaN rule)
            batch.sampling_logps = torch.full_like(batch.old_logps, float("nan"))
        mode = a.vllm_importance_sampling_mode
        batch.importance_sampling_ratio = importance_sampling_ratio(
            batch.old_logps, batch.sampling_logps, mask, mode, a.vllm_importance_sampling_clip_min,
            a.vllm_importance_sampling_clip_max,
        )  # fmt: skip
        stats = mismatch_metrics(batch.old_logps, batch.sampling_logps, mask, batch.importance_sampling_ratio, mode)
        for name, value in stats.items():
            values = gather(value.reshape(1))
            reduce = torch.max if name.endswith("max") else torch.min if name.endswith("min") else torch.mean
            self.log_metric(name, reduce(values[~torch.isnan(values)]).item() if values.numel() else 0.0)

    def _score(self, rows, prompts, completions, out: GenerationOutput) -> torch.Tensor:
        """`(N_global, num_funcs)` rewards gathered from every process; failures name the step and the batch.
        Reward functions get TRL's arguments, plus `prompt_ids` (the prompt tokens of each row) unless the dataset
        has a `prompt_ids` column of its own (see `RewardFunctions`); prompts given as token ids reach them decoded."""
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
                prompt_token_ids=prompt_ids,
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

    def log(self, logs, start_time=None):
        if self.args.log_completions and self.accelerator.is_main_process:
            combine = self.rewards.combine if self.rewards is not None else (lambda r: r.sum(1))
            self.completion_log.report(self.state.global_step, combine, self.args)
        super().log(logs, start_time)


def _identity(rows):
    return rows
