"""`OnlineConfig`: every field `trl.RLOOConfig` and `trl.GRPOConfig` 1.16 have in common, same names and defaults,
validated once (each trainer's config sets its own defaults where TRL's differ: `num_generations`, `beta`)."""

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass
from typing import ClassVar

from ..core.config import PolicyConfig, option
from ..generation.vllm_engine import check_vllm_config


logger = logging.getLogger(__name__)

_VLLM_FIELDS = (
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_weight_transfer",
    "request_timeout", "weight_sync_timeout", "max_inflight_tasks",
)  # fmt: skip


@dataclass
class OnlineConfig(PolicyConfig):
    """Fields shared by `trl.RLOOConfig` and `trl.GRPOConfig` 1.16, same names and defaults, validated once."""

    _min_num_generations: ClassVar[int] = 2  # completions per prompt needed at least (group baseline: 2, critic: 1)
    _batch_unit: ClassVar[int] = 1  # completions per per_device_train_batch_size unit (online DPO: 2, as TRL)
    _vllm_only_fields: ClassVar[tuple[str, ...]] = _VLLM_FIELDS[1:]  # without use_vllm: ignored, as TRL (a warning)
    # OnlineConfig fields a trainer's algorithm has no use for (distillation: no reward, ratio or clipping), with
    # why: set to a non-default value they raise.
    _inapplicable_fields: ClassVar[tuple[str, ...]] = ()
    _inapplicable_reason: ClassVar[str] = ""

    learning_rate: float = option(1e-6, "Initial AdamW learning rate.")
    remove_unused_columns: bool | None = option(False, "Keep every dataset column (extra ones reach rewards).")
    max_completion_length: int | None = option(512, "Maximum length of the generated completion.")
    num_generations: int | None = option(8, "Completions sampled per prompt (G >= 2).")
    num_generations_eval: int | None = option(None, "Completions per prompt in evaluation (None: num_generations).")
    ds3_gather_for_generation: bool = option(True, "ZeRO-3: gather the weights once per generation (fast, memory).")
    shuffle_dataset: bool | None = option(True, "Shuffle the training prompts.")
    generation_batch_size: int | None = option(
        None, "Completions per generation round, all processes (None: per-device batch * processes * steps)."
    )
    steps_per_generation: int | None = option(None, "Micro-steps per generation round (None: grad. accumulation).")
    use_vllm: bool = option(False, "Generate with vLLM (docs/vllm.md): colocate or server mode, see vllm_mode.")
    vllm_mode: str = option(
        "colocate", "'colocate': a vLLM engine in each training process; 'server': a vLLM server (docs/vllm.md)."
    )
    vllm_model_impl: str = option("vllm", "vLLM's model implementation: 'vllm', 'transformers' or 'auto'.")
    vllm_enable_sleep_mode: bool = option(False, "Free the colocated engine's memory between generations (CUDA only).")
    vllm_structured_outputs_regex: str | None = option(None, "Constrain completions to this regex (vLLM).")
    vllm_server_base_url: str | None = option(None, "Server mode: the server's base URL (overrides host, port).")
    vllm_server_host: str = option("0.0.0.0", "Server mode: host of the vLLM server.")
    vllm_server_port: int = option(8000, "Server mode: port of the vLLM server.")
    vllm_server_timeout: float = option(240.0, "Server mode: seconds to wait for the server to answer /health.")
    vllm_group_port: int = option(51216, "TRL's NCCL group port; unused here (must stay 51216, docs/vllm.md).")
    vllm_gpu_memory_utilization: float = option(0.3, "Colocate: the engine's share of device (CPU: host) memory.")
    vllm_max_model_length: int | None = option(None, "Colocate: the engine's context length (None: the model's).")
    vllm_tensor_parallel_size: int = option(1, "Colocate: training processes per tensor-parallel engine.")
    beta: float = option(0.0, "KL coefficient β. If 0.0, no reference model is loaded.")
    num_iterations: int = option(1, "Optimisation passes over each generation batch (μ).")
    epsilon: float = option(0.2, "Lower clipping range of the probability ratio.")
    epsilon_high: float | None = option(None, "Upper clipping range. None uses epsilon (DAPO recommends 0.28).")
    reward_weights: list[float] | None = option(None, "One weight per reward function. None weighs them all 1.0.")
    mask_truncated_completions: bool = option(False, "Leave completions cut without EOS out of the loss.")
    log_completions: bool = option(False, "Print (and send to W&B) a sample of completions at every logging step.")
    log_multimodal: bool = option(True, "Include images in the logged completion samples.")
    num_completions_to_print: int | None = option(None, "Completions printed by log_completions (None: all).")
    log_unique_prompts: bool = option(False, "Log each prompt once in completion samples.")
    use_transformers_continuous_batching: bool = option(
        False, "Generate with transformers' continuous batching (paged attention, `generate_batch`); text only."
    )
    transformers_continuous_batching_config: dict | str | None = option(
        None, "ContinuousBatchingConfig kwargs (JSON on the command line); max_memory_percent 0.5."
    )
    use_transformers_paged: bool = option(False, "Deprecated: use_transformers_continuous_batching (as in TRL).")
    strict_rewards: bool = option(
        False, "trl_unified only. Raise when no reward function scores a whole generation batch (TRL: warn)."
    )

    cast_lm_head_to_fp32: bool = option(
        False, "LM head (policy, reference) in float32: exact log-probs with bf16/fp16 weights; not with PEFT on it."
    )
    max_tool_calling_iterations: int | None = option(None, "Most tool-calling rounds per completion (None: no limit).")
    vllm_weight_transfer: str = option(
        "checkpoint",
        "Server mode: how weights reach the server: 'checkpoint' (a safetensors folder the server "
        "reloads, any device) or 'nccl' (vLLM's NCCL weight-transfer engine, CUDA).",
    )
    request_timeout: int = option(600, "Server mode: seconds a generation request may take.")
    weight_sync_timeout: int = option(1800, "Server mode: seconds a weight sync may take.")
    max_inflight_tasks: int = option(-1, "Server mode: most completions requested at once (-1: a round per request).")
    # Asynchronous rollouts (docs/async.md): trl_unified's addition; AsyncGRPOConfig turns them on (TRL's defaults).
    async_rollouts: bool = option(
        False,
        "trl_unified only. Sample ahead of training in a producer thread (vLLM server mode), on weights at "
        "most max_staleness optimiser steps old; max_staleness=0 is synchronous training (docs/async.md).",
    )
    max_staleness: int = option(1, "Async: most optimiser steps between the weights that sampled and training.")
    weight_sync_steps: int = option(1, "Async: optimiser steps between weight syncs (sooner when staleness needs).")
    queue_maxsize: int = option(1024, "Async: most completions sampled and waiting to be trained on.")
    heartbeat_stale_after_s: float = option(300.0, "Async: seconds without progress before the producer is hung.")

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
        # vLLM's fields: with use_vllm, one engine and their own rules (`check_vllm_config`; whether vLLM is installed
        # is checked when the engine starts). Without it they change nothing: set, they are ignored (as TRL does).
        if self.use_vllm:
            if self.use_transformers_continuous_batching:
                raise ValueError("Set use_vllm or use_transformers_continuous_batching, not both.")
            check_vllm_config(self)
        else:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            changed = [name for name in self._vllm_only_fields if getattr(self, name) != defaults[name]]
            if changed:
                logger.warning(
                    f"{', '.join(changed)} only apply to vLLM generation (use_vllm=True), which is off: ignored."
                )
        if self.async_rollouts and not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError(
                "async_rollouts=True needs a generation engine that runs beside training: use_vllm=True with "
                "vllm_mode='server' (a vLLM server). Colocated vLLM and the in-process decode loop share the "
                "trainer's devices and cores, so sampling ahead would only take turns with training."
            )
        for name, low in (("max_staleness", 0), ("weight_sync_steps", 1), ("queue_maxsize", 1)):
            if self.async_rollouts and getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}.")
        self._check_batch_layout()
        self._check_inapplicable_fields()
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations={self.num_iterations} must be >= 1.")
        self._check_beta()

    def _check_inapplicable_fields(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in self._inapplicable_fields:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} does not apply to {self._inapplicable_reason}; leave it at its "
                    f"default ({defaults[name]!r})."
                )

    def _check_beta(self):
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

    def _check_batch_layout(self):
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True would break prompt groups of num_generations. Set it to False."
            )
        world, per_device = self.world_size, self.per_device_train_batch_size * self._batch_unit
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
