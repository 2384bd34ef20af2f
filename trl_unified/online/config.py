"""`OnlineConfig`: every field `trl.RLOOConfig` and `trl.GRPOConfig` 1.16 have in common, same names and defaults,
validated once (each trainer's config sets its own defaults where TRL's differ: `num_generations`, `beta`)."""

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from ..core.config import PolicyConfig


logger = logging.getLogger(__name__)

_VLLM = "vLLM generation is not implemented yet; trl_unified generates with transformers' generate."
_VLLM_FIELDS = (
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
)  # fmt: skip


@dataclass
class OnlineConfig(PolicyConfig):
    """Fields shared by `trl.RLOOConfig` and `trl.GRPOConfig` 1.16, same names and defaults, validated once."""

    _unimplemented_fields = {"use_vllm": _VLLM}
    # Completions per prompt the algorithm needs at least (a group baseline needs 2; a learned critic needs 1).
    _min_num_generations: ClassVar[int] = 2
    # Fields that only matter with vLLM generation: set without it, TRL ignores them, and so do we (with a warning).
    _vllm_only_fields: ClassVar[tuple[str, ...]] = (
        *_VLLM_FIELDS[1:],
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap",
    )

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep every dataset column: extra columns reach the reward functions."}
    )
    max_completion_length: int | None = field(
        default=512, metadata={"help": "Maximum length of the generated completion."}
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
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM mode (vLLM only: ignored)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation (vLLM only: ignored)."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode (vLLM only: ignored)."})
    vllm_structured_outputs_regex: str | None = field(
        default=None, metadata={"help": "vLLM structured outputs (vLLM only: ignored)."}
    )
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (vLLM only: ignored)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vLLM server host (vLLM only: ignored)."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (vLLM only: ignored)."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vLLM server timeout (vLLM only: ignored)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM weight-update port (vLLM only: ignored)."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "vLLM memory share (vLLM only: ignored)."}
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "vLLM context window (vLLM only: ignored)."}
    )
    vllm_tensor_parallel_size: int = field(
        default=1, metadata={"help": "vLLM tensor parallelism (vLLM only: ignored)."}
    )
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
        default=False,
        metadata={
            "help": "Generate with transformers' continuous batching (`model.generate_batch`, paged attention) "
            "instead of padded batches; text-only models."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={"help": "ContinuousBatchingConfig kwargs (JSON on the command line); max_memory_percent 0.5."},
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated alias of use_transformers_continuous_batching (as in TRL)."},
    )
    strict_rewards: bool = field(
        default=False,
        metadata={
            "help": "trl_unified only. Raise when every reward function returns None for a whole generation batch "
            "(TRL's behaviour, the default here too, is to warn and train on zero advantages)."
        },
    )

    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the LM head (policy and reference) in float32, for exact log-probs with bf16/fp16 "
            "weights. Not with a PEFT adapter on the LM head."
        },
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most tool-calling rounds per completion (with `tools` / `environment_factory`); None: until a "
            "turn has no tool call or max_completion_length is spent."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True, metadata={"help": "vLLM importance-sampling correction (vLLM only: ignored)."}
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask", metadata={"help": "vLLM importance-sampling mode (vLLM only: ignored)."}
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "vLLM importance-sampling C_max (vLLM only: ignored)."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "vLLM importance-sampling C_min (vLLM only: ignored)."}
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None, metadata={"help": "Deprecated vLLM importance-sampling cap (vLLM only: ignored)."}
    )

    def __post_init__(self):
        if isinstance(self.transformers_continuous_batching_config, str):
            self.transformers_continuous_batching_config = json.loads(self.transformers_continuous_batching_config)
        if self.use_transformers_paged:
            warnings.warn(
                "`use_transformers_paged` is deprecated and will be removed in v2.0.0. Use "
                "`use_transformers_continuous_batching` instead.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching = True
        super().__post_init__()
        self._check_vllm_fields()
        self._check_batch_layout()
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0 (0 disables the KL penalty and the reference model).")

    def clip_range(self) -> tuple[float, float]:
        """The ratio's clipping bounds `(1 - epsilon, 1 + epsilon_high)`, `epsilon_high` defaulting to `epsilon` only
        when it is None (TRL's rule: `epsilon_high=0.0` clips the ratio at 1)."""
        return 1 - self.epsilon, 1 + (self.epsilon_high if self.epsilon_high is not None else self.epsilon)

    def uses_reference_model(self) -> bool:
        return self.beta != 0.0

    def _no_reference_reason(self) -> str:
        return f"`beta={self.beta}`"

    def _check_vllm_fields(self):
        """vLLM generation is not implemented: `use_vllm=True` raises (above, `_unimplemented_fields`); the other
        vLLM fields only matter with it, so setting them without it is ignored with a warning, as TRL ignores them."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [name for name in self._vllm_only_fields if getattr(self, name) != defaults[name]]
        if changed:
            logger.warning(
                f"{', '.join(changed)} only apply to vLLM generation (use_vllm=True), which is off: ignored."
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
        if self.num_generations is None or self.num_generations < self._min_num_generations:
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
