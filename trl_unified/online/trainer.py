"""The online-RL core that RLOO, GRPO, PPO and distillation share (orchestration only): the generation buffer and the
rollout's two stages, `sample(rows) -> Samples` (prompts -> completions) and `finish(samples) -> RolloutBatch`
(log-probs, rewards, metrics, advantages); every trainer-specific decision is a hook (docs/architecture.md).
"""

import logging
import os
import time
from operator import attrgetter
from typing import Any

import torch
from accelerate.utils import gather, set_seed
from datasets import IterableDataset
from transformers.trainer_utils import get_last_checkpoint
from trl import is_conversational, prepare_multimodal_messages

from ..core.logprobs import TokenLogprobs
from ..core.reference import prepare_frozen_model
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import get_images
from ..generation import GenerationOutput
from ..generation.vllm_engine import VLLMEngine
from ..models.loading import cast_lm_head_to_fp32, get_tokenizer
from .agents import EMPTY_PROMPT, Environments, check_tool, check_tool_support, prepare_tool_template
from .async_rollouts import AsyncRollouts, EpochStart, ProducerLimits, RoundSchedule, ScheduledRows
from .completion_log import CompletionLog
from .completions import CompletionsMixin, SampledCompletions, row_value
from .config import OnlineConfig
from .datasets import OnlineDataMixin
from .metrics import OnlineMetricsMixin
from .rewards import EventLoopThread, RewardFunctions, is_async_callable
from .rollout import RolloutBatch, RolloutPlan, Samples


logger = logging.getLogger(__name__)


class OnlineTrainer(CompletionsMixin, OnlineDataMixin, OnlineMetricsMixin, PolicyTrainerBase):
    """Base of the online trainers (RLOO, GRPO, PPO, distillation, online DPO): TRL's constructor and usage surface,
    the rollout and its buffer. Hooks (the core never inspects a trainer's config class): `compute_policy_loss`
    (required), `compute_advantages` or `assign_advantages`, `rollout_plan`, `correct_sampling`, `build_rewards`,
    `score_rollout`; class attributes `old_logps_from_sampling`, `reshuffle_each_iteration`, `shuffles_groups`,
    `batch_class`. What each does: docs/architecture.md ("The online family")."""

    config_class = OnlineConfig
    repeats_prompts = True  # groups of G completions: log-prob forwards encode each prompt once where allowed
    old_logps_from_sampling = False
    reshuffle_each_iteration = False
    shuffles_groups = False  # True: micro-batches hold whole groups (online DPO's loss reads each pair together)
    keeps_incomplete_rounds = False  # True: a last, smaller round is trained on too (A2PO: no groups to complete)
    batch_class = RolloutBatch  # what a rollout returns (a subclass may add views of it)
    prompt_columns = ("prompt",)  # a dataset needs one of them (GKD: also `messages` or pre-tokenised rows)
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
            data_collator=None,  # make_data_collator()
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
        self.rewards = self.build_rewards()
        self._check_prompt_lengths()
        self.use_vllm, self.vllm_mode = self.args.use_vllm, self.args.vllm_mode  # TRL's attributes
        self.vllm_engine = None  # vLLM: one engine for training, evaluation and the tool loop (docs/vllm.md)
        if self.args.use_vllm:
            self.vllm_engine = VLLMEngine.from_args(self.args, self.model, self.accelerator)
            self.vllm_engine.context = self._where
        self.plan = self.rollout_plan()
        self._step, self._buffer, self._rollout, self._step_time = 0, None, None, 0.0
        self.schedule = RoundSchedule(
            window=self.args.steps_per_generation * self.args.num_iterations,
            accumulation=self.args.gradient_accumulation_steps,
        )
        self._producer = None  # asynchronous rollouts: this epoch's producer (online/async_rollouts.py)
        self._trained_environments = None  # the environment instances of the round being trained
        self.completion_log = CompletionLog(self.args.generation_batch_size)
        set_seed(self.args.seed, device_specific=True)  # each process samples differently, reproducibly

    def _setup_agents(self) -> None:
        """Tools, environments and their checks (online/agents.py), once, before the reward functions (an
        environment's `get_reward` is one)."""
        for tool in self._standalone_tools:
            check_tool(tool)
        factory = self._environment_factory
        self._env = Environments(factory, self._standalone_tools) if factory is not None else None
        self.tools = list(self._standalone_tools)
        self.tools += [m for tools in self._env_tools.values() for m in tools if m not in self.tools]
        if self.tools or factory is not None:
            check_tool_support(self.processing_class)
        self.chat_template = prepare_tool_template(self.processing_class) if self.tools else None
        self.max_tool_calling_iterations = self.args.max_tool_calling_iterations
        self._event_loop = EventLoopThread() if any(is_async_callable(t) for t in self.tools) else None

    # ------------------------------------------------------------------ TRL's attributes (callbacks read them)
    reward_weights = property(attrgetter("rewards.weights"))
    reward_funcs = property(attrgetter("rewards.funcs"))
    reward_func_names = property(attrgetter("rewards.names"))
    reward_processing_classes = property(attrgetter("rewards.processing_classes"))
    num_generations = property(attrgetter("args.num_generations"))
    num_generations_eval = property(lambda self: self.args.num_generations_eval or self.args.num_generations)
    _shuffle_unit = property(lambda self: self.num_generations if self.shuffles_groups else 1)
    environment_factories = property(lambda self: self._env.factories if self._env is not None else None)
    environments = property(lambda self: self._current_environments())
    _env_tools = property(lambda self: self._env.tools if self._env is not None else {})
    _environment_pool = property(lambda self: self._env.pool if self._env is not None else {})

    def _current_environments(self) -> list | None:
        """TRL's `environments`: one instance per row of the round being trained (before the first, the last round's
        assigned); None without environments."""
        if self._env is None:
            return None
        return self._trained_environments if self._trained_environments is not None else self._env.instances

    def group_size(self, mode: str) -> int:
        """G: the completions per prompt of `mode`'s generation batches (contiguous groups of G rows)."""
        return self.num_generations if mode == "train" else self.num_generations_eval

    beta = property(attrgetter("args.beta"))
    temperature = property(attrgetter("args.temperature"))
    num_iterations = property(attrgetter("args.num_iterations"))
    _logs = property(attrgetter("completion_log.columns"))  # TRL's completion samples (`CompletionLog.columns`)

    # ------------------------------------------------------------------ hooks
    def assign_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor | None:
        """Set `batch.advantages` (this process's rows). By default from `compute_advantages` over the global
        generation batch; returns the global advantages for the completion log (None if there is no such row view).
        A trainer whose advantages are per token and local (PPO's GAE) overrides this."""
        advantages = self.compute_advantages(rewards, rewards_per_func, batch, mode)
        batch.advantages = advantages[batch.row_index]
        return advantages

    def compute_advantages(
        self, rewards: torch.Tensor, rewards_per_func: torch.Tensor, batch: RolloutBatch, mode: str
    ) -> torch.Tensor:
        """`(N_global,)` advantages. `rewards`: the weighted sum over functions `(N_global,)`, NaN where no function
        scored the row; `rewards_per_func`: `(N_global, num_funcs)`; groups of G rows contiguous."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_advantages.")

    def rollout_plan(self) -> RolloutPlan:
        """Which log-probs a rollout computes, asked once in `setup()` (default: TRL's rule, `RolloutPlan.trl`)."""
        return RolloutPlan.trl(self.args)

    def build_rewards(self) -> RewardFunctions | None:
        """The reward functions (TRL's `reward_funcs`, reward models loaded and frozen, environment rewards)."""
        extra = self._env.reward_funcs if self._env is not None else ()
        rewards = RewardFunctions(*self._reward_sources, self.args.reward_weights, self.args, extra_funcs=extra)
        for i, reward_model in rewards.models():
            rewards.funcs[i] = prepare_frozen_model(reward_model.requires_grad_(False), self.accelerator)
        return rewards

    def correct_sampling(self, batch: RolloutBatch) -> None:
        """Correct `batch` for its sampling engine once π_old is known (default: nothing)."""

    def truncate_rollout(self, batch: RolloutBatch) -> None:
        """Cut the rows of a sampled batch before its log-probs are computed (default: nothing; online DPO: prompts
        lose their first tokens to fit `max_length`, as TRL's)."""

    def generation_options(self) -> dict[str, Any]:
        conditions = dict(
            generation_config=self.make_generation_config(),
            continuous_batching=self.args.use_transformers_continuous_batching,
        )
        with torch.no_grad():  # generation runs without grad (and with checkpointing off)
            shared = self.uses_shared_prefix(self.model, "generation", **conditions)
        return {
            "shared_prefix": shared,
            "gather_deepspeed3_params": self.args.ds3_gather_for_generation,
            "pad_to_multiple_of": self.args.pad_to_multiple_of,
            "continuous_batching": self._continuous_batching_config(),
            "vllm": self._synced_vllm_engine(),
        }

    def _continuous_batching_config(self):
        """transformers' `ContinuousBatchingConfig` with `use_transformers_continuous_batching` (None without it):
        `transformers_continuous_batching_config` over TRL's training-aware default, half the free memory."""
        if not self.args.use_transformers_continuous_batching:
            return None
        from transformers.generation import ContinuousBatchingConfig

        kwargs = self.args.transformers_continuous_batching_config or {}
        return ContinuousBatchingConfig(**{"max_memory_percent": 0.5, **kwargs})

    def _synced_vllm_engine(self) -> VLLMEngine | None:
        """The vLLM engine holding this trainer's current weights, synced once per optimiser step on every process
        (docs/vllm.md, "When weights are synced"); the async producer never syncs (`sync_for_round`)."""
        engine = self.vllm_engine
        if engine is not None and not (self._producer is not None and self._producer.in_producer()):
            engine.ensure_synced(self.model_wrapped or self.model, self.accelerator, self, self.state.global_step)
        return engine

    def _where(self) -> str:
        """Where training stands, for an engine's error messages: the step and the last checkpoint saved."""
        checkpoint = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        return f", at global step {self.state.global_step}; last saved checkpoint: {checkpoint or 'none yet'}"

    def policy_logprobs(self, model, inputs: RolloutBatch) -> TokenLogprobs:
        """The loss forward of a policy-gradient trainer: per-token log-probs (with grad) and entropies of the
        completions of `inputs`, and the MoE load-balancing loss when it is enabled."""
        input_ids, attention_mask, extra = inputs.model_inputs()
        grad, aux = self._entropy_bonus_enabled, self.aux_loss_enabled
        options = dict(compute_entropy=True, entropy_requires_grad=grad, output_router_logits=aux)
        return self.token_logprobs(model, input_ids, attention_mask, inputs.loss_mask.size(1), **options, **extra)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
    ):
        """TRL's extension point for subclasses: `(per-token log-probs, entropies or None, MoE aux loss or None)` of
        the last `logits_to_keep` tokens (entropies keep their gradient when the entropy bonus is on)."""
        aux = kwargs.pop("compute_aux_loss", False)
        options = dict(batch_size=batch_size, compute_entropy=compute_entropy, output_router_logits=aux)
        options["entropy_requires_grad"] = self._entropy_bonus_enabled
        extra = {k: v for k, v in kwargs.items() if v is not None}
        out = self.token_logprobs(model, input_ids, attention_mask, logits_to_keep, **options, **extra)
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
        if self._opens_round(inputs):
            self._start_round(inputs)
        elif self._step % steps == 0 and self.reshuffle_each_iteration:
            self._buffer = self._rollout.shuffled(self._shuffle_unit).split(steps)  # a new order for this pass
        micro_batch = self._buffer[self._step % steps]
        self._step += 1
        return micro_batch

    def _opens_round(self, rows) -> bool:
        """Whether the batch `rows` opens a generation round: the producer's answer on the batches it delivers
        (asynchronous rollouts), else the schedule read at this micro-step (`RoundSchedule.opens_round`)."""
        if isinstance(rows, ScheduledRows):
            return rows.opens_round
        return self.schedule.opens_round(self._step, self._buffer is not None)

    def _start_round(self, rows) -> None:
        """Retire the round trained so far (its environment instances go back to the pool), then finish the new one,
        sampled ahead by the producer or now, and split it into this round's micro-batches."""
        self._release_environments(self._trained_environments)
        samples = self._fresh(rows) if isinstance(rows, ScheduledRows) else self.sample(rows)
        self._rollout = self.finish(samples)
        self._trained_environments = samples.environments
        self._buffer = self._rollout.shuffled(self._shuffle_unit).split(self.args.steps_per_generation)

    # ------------------------------------------------------------------ asynchronous rollouts (async_rollouts.py)
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """With `async_rollouts`, the epoch's batches come through the rollout producer, which samples ahead."""
        if self.args.async_rollouts:
            if self._producer is None or self._producer.source is not epoch_iterator:
                self._close_producer()
                self._producer = self._start_producer(epoch_iterator)
            epoch_iterator = self._producer
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _start_producer(self, epoch_iterator) -> AsyncRollouts:
        """This epoch's producer, given what it needs (online/async_rollouts.py, the thread contract)."""
        a, processes = self.args, self.accelerator.num_processes
        per_round = a.generation_batch_size // processes
        limits = ProducerLimits(
            max_staleness=a.max_staleness,
            queued_rounds=max(1, a.queue_maxsize // max(per_round, 1)),
            heartbeat_stale_after_s=a.heartbeat_stale_after_s,
            stop_timeout_s=30.0,
            weight_sync_timeout=a.weight_sync_timeout,
        )
        start = EpochStart(step=self.state.global_step, micro_step=self._step, has_round=self._buffer is not None)
        return AsyncRollouts(
            epoch_iterator,
            self.sample,
            self.vllm_engine,
            self.schedule,
            start,
            limits,
            prepare_round=self.sync_for_round,
        )

    def sync_for_round(self, step: int) -> None:
        """Before training waits for its round at optimiser `step`: sync the weights when `weight_sync_steps` old or
        older than the staleness gate allows, in the background where the server can (docs/async.md)."""
        a, version = self.args, self.vllm_engine.version
        if version is None or step - version >= min(a.weight_sync_steps, a.max_staleness + 1):
            model = self.model_wrapped or self.model
            seconds = self.vllm_engine.sync_in_background(model, self.accelerator, self, step)
            self.log_metric("perf/weight_sync_s", seconds)  # what training spent on it

    def _fresh(self, rows: ScheduledRows) -> Samples:
        """The round sampled ahead for `rows`, with TRL's async metrics; too stale (the safety net behind the gate):
        dropped, counted and sampled again on the current weights."""
        samples, staleness = rows.samples, self.state.global_step - rows.samples.policy_version
        self.log_metric("sample/staleness_mean", staleness)
        self.log_metric("sample/staleness_max", staleness, reduce="max")
        timings = {
            "perf/rollout_wait_s": rows.wait_s,
            "rollout/generate_s": rows.sample_s,
            "rollout/backpressure_s": rows.backpressure_s,
            "sample/time_in_queue_s": time.monotonic() - rows.enqueued_at,
            "sample/rollout_queue_size": self._producer.queued_rounds * len(rows),
        }
        for name, value in timings.items():
            self.log_metric(name, value)
        dropped = staleness > self.args.max_staleness
        self.log_metric("sample/dropped_stale_total", float(dropped) * len(rows), reduce="sum")
        if dropped:
            self._release_environments(samples.environments)
            self.sync_for_round(self.state.global_step)
            with self.vllm_engine.lock:
                samples = self.sample(rows)
        return samples

    def _close_producer(self) -> None:
        """Stop this epoch's producer; the rounds it sampled that training did not reach give their environment
        instances back."""
        if self._producer is not None:
            self._producer.close()
            for item in self._producer.drain():
                if isinstance(item, ScheduledRows) and item.samples is not None:
                    self._release_environments(item.samples.environments)
            self._producer = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        checkpoint = resume_from_checkpoint
        if checkpoint is True:  # the Trainer's "the last one in output_dir"
            checkpoint = get_last_checkpoint(self.args.output_dir)
        self.before_training(checkpoint if isinstance(checkpoint, str) else None)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._close_producer()  # no thread outlives train()

    def before_training(self, checkpoint: str | None) -> None:
        """Called by `train()` before the data loader is built, with the checkpoint being resumed (or None): work
        done once before the first step (default: nothing; A2PO's value estimation, or its result read back from the
        checkpoint with `checkpoint_state_of`)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What a trainer saves with each checkpoint beside the generation buffer (default: nothing); read back by
        `restore_checkpoint_state` when resuming."""
        return {}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what `checkpoint_state` saved (called when a checkpoint is resumed)."""

    def checkpoint_state_of(self, checkpoint: str | None) -> dict[str, Any] | None:
        """This process's saved state in `checkpoint` (`_save_checkpoint`), or None."""
        path = os.path.join(checkpoint, f"trl_unified_state_{self.accelerator.process_index}.pt") if checkpoint else ""
        return torch.load(path, weights_only=False) if os.path.exists(path) else None

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
        folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
        state = {"step": self._step, "buffer": self._buffer, "rollout": self._rollout}  # a resume continues mid-round
        state["trainer"] = self.checkpoint_state()
        torch.save(state, os.path.join(folder, f"trl_unified_state_{self.accelerator.process_index}.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Resuming: the generation buffer and micro-step counter too (before the first batch is read: a producer
        of asynchronous rollouts starts from them)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        state = self.checkpoint_state_of(checkpoint)
        if state is not None:
            self._step, self._buffer, self._rollout = state["step"], state["buffer"], state.get("rollout")
            self.restore_checkpoint_state(state.get("trainer", {}))

    # ------------------------------------------------------------------ the rollout
    def rollout(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        """One generation round for this process's rows, synchronously: `finish(sample(rows))`, its environment
        instances back in the pool once scored (an evaluation round; a training round: `_start_round`)."""
        samples = self.sample(rows)
        batch = self.finish(samples)
        self._release_environments(samples.environments)
        return batch

    def sample(self, rows: list[dict[str, Any]]) -> Samples:
        """Stage one: the rows' prompts (after each environment's `reset`) and their completions. No collective
        and no metric: it may run ahead of training, on weights `policy_version` steps old."""
        rows = self.rows_of(rows)
        prompts, images, environments = self._rollout_prompts(rows)
        sampled = self.sample_completions(rows, prompts, images, environments)
        rows = [{**row, **{k: row_value(v, i) for k, v in sampled.extra_fields.items()}} for i, row in enumerate(rows)]
        policy_version = self.state.global_step  # the weights generation used: the trainer's, or the engine's copy
        if self.vllm_engine is not None:
            policy_version = self.vllm_engine.version
        return Samples(
            rows=rows,
            prompts=prompts,
            images=images,
            generation=sampled.generation,
            completions=sampled.completions,
            policy_version=policy_version,
            logprobs_are_policy=sampled.logprobs_are_policy,
            tool_calls=sampled.tool_calls,
            tool_failures=sampled.tool_failures,
            environments=environments,
        )

    def make_data_collator(self):
        return list  # a round reads the dataset's rows as they are (`rows_of`)

    def rows_of(self, batch) -> list[dict[str, Any]]:
        """The rows of a data-loader batch: the dataset's rows themselves (the online collator is `list`); a trainer
        with a collator of its own (GKD's ChatML collator) reads its rows from the collated batch."""
        return batch

    def sample_completions(self, rows, prompts, images, environments) -> SampledCompletions:
        """The completions of one round (the hook where they come from): the policy's sampling, by default (a
        `rollout_func`, generation, the tool loop); distillation mixes in the dataset's or a teacher's
        (`CompletionMix`)."""
        return self._generate(prompts, images, environments=environments)

    def finish(self, samples: Samples) -> RolloutBatch:
        """Stage two, under the current weights: the typed batch with its old / reference log-probs, the sampling
        correction, rewards and advantages, and the round's metrics."""
        mode = self.mode
        batch = self.batch_class.from_samples(samples, self.args.mask_truncated_completions)
        batch.staleness = self.state.global_step - (samples.policy_version or 0) if mode == "train" else 0
        batch.num_loss_tokens = self.accelerator.gather(batch.loss_mask.sum()).sum().item()
        n = len(batch)  # this process's rows: their place in the global generation batch
        batch.row_index = torch.arange(n, device=batch.loss_mask.device) + self.accelerator.process_index * n
        self._log_generation_metrics(mode, samples)
        self.truncate_rollout(batch)
        self.rollout_logps(batch, mode)
        self.correct_sampling(batch)
        self.score_rollout(batch, samples, mode)
        return batch

    def score_rollout(self, batch: RolloutBatch, samples: Samples, mode: str) -> None:
        """Rewards `(N_global, F)` from every function, gathered; `batch.rewards` / `row_index` for this process's
        rows; the advantages unless the plan defers them to the loss; the completion log."""
        rewards_per_func = self._score(
            samples.rows, samples.prompts, samples.completions, samples.generation, samples.environments
        )
        rewards = self.rewards.combine(rewards_per_func)  # (N_global,)
        self._log_reward_metrics(rewards_per_func, rewards)
        batch.rewards = rewards[batch.row_index]
        deferred = self.plan.defers_advantages(mode)  # then the loss computes them
        advantages = None if deferred else self.assign_advantages(rewards, rewards_per_func, batch, mode)
        self.completion_log.add_round(
            prompts=samples.prompts,
            completions=samples.completions,
            images=samples.images,
            rewards=rewards,
            rewards_per_func=rewards_per_func,
            reward_names=self.rewards.names,
            advantages=advantages,
            log_images=self.args.log_multimodal,
        )

    def log_unscored_round(self, batch: RolloutBatch, samples: Samples) -> None:
        """A round without rewards (a teacher's distribution is the signal): zero rewards on the batch, no advantages,
        its prompts and completions in the completion log."""
        batch.rewards = torch.zeros(len(batch), device=batch.prompt_ids.device)
        prompts = samples.prompts
        if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], int):
            prompts = get_tokenizer(self.processing_class).batch_decode(prompts, skip_special_tokens=True)
        self.completion_log.add_round(
            prompts=prompts,
            completions=samples.completions,
            images=samples.images,
            rewards=None,
            rewards_per_func=None,
            reward_names=[],
            advantages=None,
            log_images=self.args.log_multimodal,
        )

    def _rollout_prompts(self, rows):
        """This process's prompts (after each environment's `reset` observation), images, and environment instances
        (one per row, taken from the pool until `_release_environments`; None without environments)."""
        environments = None
        if self._env is not None:
            environments = self._env.assign(rows)
            prompts = self._env.reset(rows, [row.get("prompt", EMPTY_PROMPT) for row in rows], environments)
        else:
            prompts = [row["prompt"] for row in rows]
        images = [get_images(row) for row in rows]
        if all(i is None for i in images):
            return prompts, None, environments
        if not is_conversational(rows[0]):
            raise ValueError("Rows with images need conversational prompts (lists of messages), not plain strings.")
        prompts = [prepare_multimodal_messages(p, images=i or []) for p, i in zip(prompts, images, strict=True)]
        return prompts, images, environments

    def _release_environments(self, environments) -> None:
        if environments is not None:
            self._env.release(environments)

    def rollout_logps(self, batch: RolloutBatch, mode: str) -> None:
        """Old (as the plan says, where sampling did not return them) and reference per-token log-probs, no grad,
        in micro-batches."""
        input_ids, attention_mask, extra = batch.model_inputs()
        width = batch.completion_ids.size(1)
        chunk = None  # image inputs are per row: one forward over the batch keeps rows and images aligned
        if not extra:
            chunk = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad():
            if self.plan.needs_old_logps(mode) and batch.old_logps is None:  # not read from sampling logits
                batch.old_logps = self.token_logprobs(
                    self.model, input_ids, attention_mask, width, batch_size=chunk, **extra
                ).logps
            if self.reference_model.available:
                batch.ref_logps = self.reference_logprobs(input_ids, attention_mask, width, batch_size=chunk, **extra)

    def _score(self, rows, prompts, completions, out: GenerationOutput, environments=None) -> torch.Tensor:
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
                **({"environments": environments} if environments is not None else {}),
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
            self.completion_log.report(self.state.global_step, self.args)
        super().log(logs, start_time)
