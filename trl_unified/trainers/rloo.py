r"""REINFORCE Leave-One-Out (RLOO), Ahmadian et al., 2024 (arXiv:2402.14740): a drop-in for `trl.RLOOTrainer`.

For each prompt, G completions y_1..y_G are sampled from the policy. With r_i the (weighted, optionally clipped)
reward of y_i and, when beta > 0, the sequence-level KL estimate (k1 estimator, Schulman 2020) between the policy
at sampling time and the reference, KL_i = sum_t [log pi_old(y_i,t) - log pi_ref(y_i,t)], the shaped reward is

    r'_i = r_i - beta * KL_i

and the leave-one-out advantage over the group's scorable completions (those with a reward) is

    A_i = r'_i - 1/(n-1) * sum_{j != i, j scorable} r'_j  =  n/(n-1) * (r'_i - mean_j r'_j),   n = #scorable

(optionally normalised over the whole generation batch: A <- (A - mean A) / (std A + 1e-4)). The loss is a
sequence-level clipped policy gradient, averaged over the completions of the micro-batch:

    rho_i = exp(log pi_theta(y_i) - log pi_old(y_i)),     log pi(y) = sum_t log pi(y_t | x, y_<t)
    L = -1/B * sum_i min(rho_i * A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) * A_i)

With num_iterations == 1 the ratio is 1 and its gradient is A_i * grad log pi_theta(y_i): plain REINFORCE with the
leave-one-out baseline. The Trainer divides L by the gradient-accumulation steps.
"""

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather, gather_object
from trl import SyncRefModelCallback, is_conversational, prepare_multimodal_messages

from ..base.config import PolicyConfig, document_fields
from ..base.data import get_images, require_columns
from ..base.papers import PAPERS
from ..base.reference import prepare_frozen_model
from ..base.rewards import RewardFunctions
from ..base.trainer import PolicyTrainerBase


_VLLM = "vLLM generation is not implemented yet; trl_unified generates with transformers' generate."


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    r"""Leave-one-out advantage (Ahmadian et al., 2024, arXiv:2402.14740) over each prompt's G completions:

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_j r_j)

    where the sums and n run over the group's scorable (non-NaN) rewards. `rewards`: `(num_prompts * G,)`, groups
    contiguous; returns that shape, NaN where r_i is NaN or fewer than 2 completions of the group are scorable.
    """
    grouped = rewards.view(-1, num_generations)  # (P, G)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # (P, 1)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)  # (P, G)
    return rewards - baselines.view(-1)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs, over `dim` (all entries if None); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim)
    variance = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()


def _model_image_inputs(batch: dict, completion_length: int, device) -> dict[str, torch.Tensor]:
    """Model inputs for the images of `batch`'s rows: per-row tensors (pixel_values, image_grid_thw, ...)
    concatenated, and per-token ones (e.g. mm_token_type_ids, `(B, P)`) extended with zeros over the completion."""
    per_row = batch["image_inputs"]
    inputs = {k: torch.cat([row[k] for row in per_row]).to(device) for k in per_row[0]}
    for key, value in batch.items():
        if key.startswith("prompt_token_inputs."):
            inputs[key.split(".", 1)[1]] = torch.cat([value, value.new_zeros(value.size(0), completion_length)], dim=1)
    return inputs


@document_fields
@dataclass
class RLOOConfig(PolicyConfig):
    """Configuration of `RLOOTrainer`: every field of `trl.RLOOConfig` 1.16, same names and defaults."""

    _unimplemented_fields = {
        **dict.fromkeys(
            (
                "use_vllm",
                "vllm_mode",
                "vllm_model_impl",
                "vllm_enable_sleep_mode",
                "vllm_structured_outputs_regex",
                "vllm_server_base_url",
                "vllm_server_host",
                "vllm_server_port",
                "vllm_server_timeout",
                "vllm_group_port",
                "vllm_gpu_memory_utilization",
                "vllm_max_model_length",
                "vllm_tensor_parallel_size",
            ),
            _VLLM,
        ),
        **dict.fromkeys(
            (
                "use_transformers_continuous_batching",
                "transformers_continuous_batching_config",
                "use_transformers_paged",
            ),
            "Continuous batching is not implemented; generation uses batched generate().",
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
    num_generations: int | None = field(default=2, metadata={"help": "Completions sampled per prompt (G >= 2)."})
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
    beta: float = field(default=0.05, metadata={"help": "KL coefficient β. If 0.0, no reference model is loaded."})
    num_iterations: int = field(default=1, metadata={"help": "Optimisation passes over each generation batch (μ)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the probability ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping range. None uses epsilon (DAPO recommends 0.28)."}
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function. None weighs them all 1.0."}
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Normalise advantages over the generation batch to mean 0, std 1."}
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clip rewards to (min, max) before the KL penalty. None: no clipping."}
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
        default=False, metadata={"help": "Print (and send to W&B) a sample of completions at every logging step."}
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

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str):
            auto = self.pad_to_multiple_of == "auto"
            lowered = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = (
                (128 if self.device.type == "neuron" else None)
                if auto
                else None
                if lowered in ("none", "null")
                else int(lowered)
            )
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
                f"num_generations={self.num_generations}, but the leave-one-out baseline needs at least 2 "
                "completions per prompt. Set num_generations >= 2."
            )
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} (per_device_train_batch_size * num_processes * "
                f"steps_per_generation) must be divisible by num_generations={self.num_generations}."
            )
        g_eval = self.num_generations_eval or self.num_generations
        if self.do_eval and self.eval_strategy != "no" and (self.per_device_eval_batch_size * world) % g_eval:
            raise ValueError(
                f"per_device_eval_batch_size * num_processes = {self.per_device_eval_batch_size * world} must be "
                f"divisible by the eval num_generations ({g_eval})."
            )
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0 (0 disables the KL penalty and the reference model).")
        if self.reward_clip_range is not None and (
            len(self.reward_clip_range) != 2 or self.reward_clip_range[0] > self.reward_clip_range[1]
        ):
            raise ValueError(f"reward_clip_range={self.reward_clip_range} must be (min, max) with min <= max.")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model=True but beta=0.0: there is no reference model to sync. Set beta > 0.")


class RLOOTrainer(PolicyTrainerBase):
    """REINFORCE Leave-One-Out (see the module docstring for the maths). Same constructor as `trl.RLOOTrainer`."""

    _name = "RLOO"
    _tag_names = ["trl", "rloo", "trl_unified"]
    _paper = PAPERS["rloo"]
    _online = True
    config_class = RLOOConfig

    def __init__(
        self,
        model,
        reward_funcs,
        args: RLOOConfig | None = None,
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
        super().__init__(
            model,
            args,
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
        self.loss_is_scaled_for_ga = False  # per-micro-batch mean: the Trainer divides by gradient accumulation
        text_config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        coef = self.args.router_aux_loss_coef
        if coef and not hasattr(text_config, "output_router_logits"):
            raise ValueError(f"router_aux_loss_coef={coef} but the policy is not a Mixture-of-Experts model.")
        self.aux_coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.aux_loss_enabled = hasattr(text_config, "output_router_logits") and bool(self.aux_coef)
        self._completions_log = deque(maxlen=self.args.generation_batch_size)
        self._pending_extra: dict[str, list] = defaultdict(list)
        if self.args.sync_ref_model:
            if self.reference.kind != "copy":
                raise NotImplementedError(
                    "sync_ref_model=True needs a separate reference model; it is not supported with PEFT."
                )
            self.add_callback(SyncRefModelCallback(ref_model=self.reference.model, accelerator=self.accelerator))

    def prepare_dataset(self, dataset, processing_class, args, name):
        if dataset is None and name == "train":
            raise ValueError("train_dataset is required: RLOOTrainer needs prompts to generate from.")
        if dataset is not None:
            require_columns(dataset, [["prompt"]], f"{name} dataset", "RLOOTrainer")
        return dataset

    def needs_reference(self, args) -> bool:
        return args.beta != 0.0

    @property
    def _reuses_policy_logps(self) -> bool:
        """True when the policy is unchanged between generation and every use of the batch (one pass, one optimiser
        step per generation round): then log pi_old == log pi_theta numerically and the extra no-grad forward that
        TRL always runs is skipped. With beta > 0 the KL shaping then happens in the loss, which needs the whole
        generation batch in one micro-batch (steps_per_generation == 1)."""
        args = self.args
        aligned = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
        return aligned and (args.beta == 0.0 or args.steps_per_generation == 1)

    def generate_and_score(self, rows):
        mode, device, args = ("train" if self.model.training else "eval"), self.accelerator.device, self.args
        prompts = [row["prompt"] for row in rows]
        images = [get_images(row) for row in rows]
        images = images if any(i is not None for i in images) else None
        if images is not None:
            if not is_conversational(rows[0]):
                raise ValueError(
                    "Rows with images need conversational prompts (lists of messages), not plain strings."
                )
            prompts = [prepare_multimodal_messages(p, images=i or []) for p, i in zip(prompts, images, strict=True)]
        out = self.generate(prompts, images=images)
        completion_mask = out.completion_mask
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~out.is_truncated).unsqueeze(1).long()
        conversational = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": t}] for t in out.texts] if conversational else out.texts
        self._log_generation_metrics(mode, out)
        batch = {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "completion_ids": out.completion_ids,
            "completion_mask": completion_mask,
        }
        input_ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
        attention_mask = torch.cat([out.prompt_mask, completion_mask], dim=1)
        k, chunk = (
            out.completion_ids.size(1),
            args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size,
        )
        image_kwargs = {}
        if out.image_inputs is not None:  # kept per row so shuffling and splitting keep rows and images together
            batch["image_inputs"] = out.image_inputs
            batch.update({f"prompt_token_inputs.{k}": v for k, v in out.prompt_token_inputs.items()})
            image_kwargs, chunk = _model_image_inputs(batch, out.completion_ids.size(1), device), None
        old_tok = ref_tok = None
        with torch.no_grad():
            if not self._reuses_policy_logps or mode == "eval":
                old_tok = self.token_logprobs(
                    self.model, input_ids, attention_mask, k, batch_size=chunk, **image_kwargs
                ).logps
                batch["old_logps"] = (old_tok * completion_mask).sum(1)
            if self.reference.available:
                ref_tok = self.reference_logprobs(input_ids, attention_mask, k, batch_size=chunk, **image_kwargs)
        extra = {
            key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")
        }
        try:
            local_rewards = self.rewards(
                prompts,
                completions,
                out.completion_ids_list,
                extra,
                device,
                args.chat_template_kwargs,
                trainer_state=self.state,
                log_metric=self.log_metric,
                log_extra=self._log_extra,
            )
        except (RuntimeError, ValueError, TypeError) as e:
            raise type(e)(
                f"{e} [at global step {self.state.global_step}, on the batch whose first prompt is "
                f"{prompts[0]!r}; the last saved checkpoint is untouched]"
            ) from e
        rewards_per_func = gather(local_rewards)
        rewards = self.rewards.combine(rewards_per_func)  # (N_global,)
        if torch.isnan(rewards).all():
            raise ValueError(
                f"Every reward function returned None/NaN for all {rewards.numel()} completions at global step "
                f"{self.state.global_step} (functions: {self.rewards.names}; first row: prompt {prompts[0]!r}, "
                f"completion {completions[0]!r}). At least one function must score each batch."
            )
        self._log_reward_metrics(mode, rewards_per_func, rewards)
        # Every process must join each gather: agree on the column names first (a column may be logged on one rank).
        names = (
            sorted(set(gather_object(list(self._pending_extra))))
            if self.accelerator.num_processes > 1
            else sorted(self._pending_extra)
        )
        extra_columns = {name: gather_object(self._pending_extra.get(name, [None] * len(rows))) for name in names}
        self._pending_extra.clear()
        extras = [{k: v[i] for k, v in extra_columns.items() if i < len(v)} for i in range(rewards.numel())]
        self._completions_log.extend(zip(gather_object(prompts), gather_object(completions), rewards.tolist(), extras))
        n, rank = len(rows), self.accelerator.process_index
        if old_tok is None:  # advantages are computed in the loss, from the same forward
            batch["rewards"] = rewards[rank * n : (rank + 1) * n]
            batch["row_index"] = torch.arange(rank * n, (rank + 1) * n, device=device)
            if ref_tok is not None:
                batch["ref_per_token_logps"] = ref_tok
        else:
            kl = gather(self._sequence_kl(old_tok, ref_tok, completion_mask)) if ref_tok is not None else None
            batch["advantages"] = self._advantages(rewards, kl, mode)[rank * n : (rank + 1) * n]
        return batch

    def _log_extra(self, column: str, values: list) -> None:
        """`log_extra` for reward functions: a column (one value per completion) for the completions log."""
        self._pending_extra[column].extend(values)

    def _sequence_kl(self, policy_tok, ref_tok, mask):
        """Per-sequence k1 KL estimate `sum_t (log pi - log pi_ref)` `(B,)`; logs the per-token mean as `kl`."""
        per_token = (policy_tok - ref_tok) * mask
        stats = self.accelerator.reduce(torch.stack([per_token.sum(), mask.sum().float()]), reduction="sum")
        self.log_metric("kl", (stats[0] / stats[1].clamp(min=1.0)).item())
        return per_token.sum(1)

    def _advantages(self, rewards, kl, mode):
        """Advantages of the global generation batch: clip, KL-shape, leave-one-out, optional normalisation.
        `rewards` and `kl` are `(N_global,)`, groups of G contiguous; NaN (unscorable) rows get advantage 0."""
        args = self.args
        if args.reward_clip_range:
            rewards = rewards.clamp(*args.reward_clip_range)
        if kl is not None:
            rewards = rewards - args.beta * kl
        g = args.num_generations if mode == "train" else (args.num_generations_eval or args.num_generations)
        group_std = nanstd(rewards.view(-1, g), dim=1)
        self.log_metric(
            "frac_reward_zero_std", torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item()
        )
        advantages = rloo_advantages(rewards, g) if g > 1 else torch.zeros_like(rewards)
        if args.normalize_advantages:
            advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
        return torch.nan_to_num(advantages, nan=0.0)

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        mask = inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], mask], dim=1)
        image_kwargs = _model_image_inputs(inputs, mask.size(1), mask.device) if "image_inputs" in inputs else {}
        out = self.token_logprobs(
            model,
            input_ids,
            attention_mask,
            mask.size(1),
            compute_entropy=True,
            output_router_logits=self.aux_loss_enabled,
            **image_kwargs,
        )
        logps = (out.logps * mask).sum(1)  # (B,); padding and post-EOS tokens masked
        old_logps = inputs["old_logps"] if "old_logps" in inputs else logps.detach()
        advantages = (
            inputs["advantages"] if "advantages" in inputs else self._deferred_advantages(inputs, out.logps.detach())
        )
        assert logps.shape == advantages.shape, (logps.shape, advantages.shape)
        ratio = torch.exp(logps - old_logps)  # (B,)
        low, high = (
            1 - self.args.epsilon,
            1 + (self.args.epsilon_high if self.args.epsilon_high is not None else self.args.epsilon),
        )
        loss = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages).mean()
        if self.aux_loss_enabled and out.aux_loss is not None:
            loss = loss + self.aux_coef * out.aux_loss
            self.log_metric("aux_loss", out.aux_loss.item())
        entropy = self.accelerator.reduce(
            torch.stack([(out.entropy * mask).sum(), mask.sum().float()]), reduction="sum"
        )
        self.log_metric("entropy", (entropy[0] / entropy[1].clamp(min=1.0)).item())
        low_clip = gather(((ratio < low) & (advantages < 0)).float())
        high_clip = gather(((ratio > high) & (advantages > 0)).float())
        for name, value in (
            ("low_mean", low_clip.mean()),
            ("low_min", low_clip.min()),
            ("high_mean", high_clip.mean()),
            ("high_max", high_clip.max()),
            ("region_mean", (low_clip + high_clip).clamp(max=1).mean()),
        ):
            self.log_metric(f"clip_ratio/{name}", value.item())
        return loss

    def _deferred_advantages(self, inputs, policy_tok):
        """Advantages for a batch whose KL shaping waited for the loss's forward (see `_reuses_policy_logps`).
        Rows may have been shuffled: `row_index` puts every process's rows back in generation order."""
        own = inputs["row_index"]
        order = gather(own)
        rewards = torch.empty(order.numel(), device=order.device)
        rewards[order] = gather(inputs["rewards"])
        kl = None
        if inputs.get("ref_per_token_logps") is not None:
            kl = torch.empty_like(rewards)
            kl[order] = gather(self._sequence_kl(policy_tok, inputs["ref_per_token_logps"], inputs["completion_mask"]))
        return self._advantages(rewards, kl, "train" if self.model.training else "eval")[own]

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

    def _log_reward_metrics(self, mode, rewards_per_func, rewards):
        for i, name in enumerate(self.rewards.names):
            self.log_metric(f"rewards/{name}/mean", torch.nanmean(rewards_per_func[:, i]).item())
            self.log_metric(f"rewards/{name}/std", nanstd(rewards_per_func[:, i]).item())
        self.log_metric("reward", torch.nanmean(rewards).item())
        self.log_metric("reward_std", nanstd(rewards).item())

    def log(self, logs, start_time=None):
        if self.args.log_completions and self.accelerator.is_main_process and self._completions_log:
            rows = list(self._completions_log)
            if self.args.log_unique_prompts:
                rows = list({str(r[0]): r for r in rows}.values())
            rows = rows[: self.args.num_completions_to_print or len(rows)]
            for prompt, completion, reward, extra in rows:
                extra_text = "".join(f"\n  {k}: {v}" for k, v in extra.items())
                print(
                    f"[step {self.state.global_step}] reward={reward:.3f}\n  prompt: {prompt}\n  completion: {completion}{extra_text}"
                )
            self._log_completions_table(rows)
            self._completions_log.clear()  # each sample is shown once
        super().log(logs, start_time)

    def _log_completions_table(self, rows):
        report_to = self.args.report_to or []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                columns = ["step", "prompt", "completion", "reward", *sorted({k for *_, e in rows for k in e})]
                data = [
                    [self.state.global_step, str(p), str(c), r, *[e.get(k) for k in columns[4:]]]
                    for p, c, r, e in rows
                ]
                wandb.log({"completions": wandb.Table(columns=columns, data=data)})
