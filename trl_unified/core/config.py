"""`PolicyConfig`: the `TrainingArguments` fields that every policy trainer shares, validated once."""

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import TrainingArguments

from ..evaluation.answers import ANSWER_EXTRACTORS


def document_fields(cls):
    """Class decorator: append an HF-style `Parameters:` section built from each new field's `help` (one source)."""
    parent_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    lines = []
    for f in dataclasses.fields(cls):
        if f.name in parent_fields and f.name not in cls.__dict__.get("__annotations__", {}):
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        type_name = getattr(f.type, "__name__", str(f.type))
        lines.append(f"    {f.name} (`{type_name}`, *optional*, defaults to `{default!r}`):")
        lines.append(f"        {f.metadata.get('help', '')}")
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\nParameters:\n" + "\n".join(lines) + "\n"
    return cls


def option(default=None, help: str = "", default_factory=None):
    """A config field with its help text (the one source of its documentation, see `document_fields`)."""
    kind = {"default_factory": default_factory} if default_factory is not None else {"default": default}
    return field(**kind, metadata={"help": help})


@dataclass
class TruncationConfig:
    """`truncation_mode`, TRL's field of the configs whose rows are cut to `max_length` (DPO, GRM): mixed in before
    the config's base, checked once by `check_truncation_mode`."""

    truncation_mode: str = option(
        "keep_start",
        "Which end of a row longer than max_length is kept: 'keep_start' drops its end, 'keep_end' its beginning (the "
        "prompt's start).",
    )

    def check_truncation_mode(self) -> None:
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode={self.truncation_mode!r} is not one of ['keep_end', 'keep_start'].")


def _has_accelerator(bf16: bool = False) -> bool:
    """A CUDA (bf16-capable, with `bf16`), XPU or MPS device is available."""
    import torch
    from transformers.utils import is_torch_bf16_gpu_available

    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    return (is_torch_bf16_gpu_available() if bf16 else torch.cuda.is_available()) or xpu or mps


@document_fields
@dataclass
class PolicyConfig(TrainingArguments):
    """Configuration shared by every trl_unified policy trainer.

    Subclass it with the algorithm's own fields. Fields listed in `_unimplemented_fields` are accepted for
    compatibility with TRL's configs but raise a `NotImplementedError` when set to a non-default value.
    """

    # Fields accepted for TRL compatibility whose feature is not implemented: {name: what to do instead}.
    _unimplemented_fields: ClassVar[dict[str, str]] = {}

    # TRL's defaults for TrainingArguments fields (same as trl's _BaseConfig).
    logging_steps: float = option(10, "Log every X update steps (a float in [0, 1): a ratio of total steps).")
    gradient_checkpointing: bool = option(True, "Gradient checkpointing: less activation memory, ~20%% more compute.")
    bf16: bool | None = option(
        None,
        "Use bf16 mixed precision. If not set: `True` unless `fp16` is set (as in TRL), except on a machine with no "
        "accelerator and use_cpu=False, where TRL's default would fail and `False` is used.",
    )
    lr_scheduler_kwargs: dict | str | None = option(None, "Learning-rate scheduler keywords, e.g. {'num_cycles': 1}.")
    use_liger_kernel: bool = option(False, "Patch the model's layers with Liger kernels (deprecated in TRL).")
    torch_empty_cache_steps: int | None = option(None, "Steps between `torch.<device>.empty_cache()` (None: never).")

    # Model loading
    model_init_kwargs: dict[str, Any] | str | None = option(
        None,
        "Keyword arguments for `from_pretrained` when `model` is a string (e.g. dtype, attn_implementation, "
        "revision). A JSON string is accepted on the command line.",
    )
    trust_remote_code: bool = option(False, "Allow custom model code from the Hub when loading by id.")
    disable_dropout: bool = option(False, "Set every dropout probability of the policy and reference models to 0.")
    router_aux_loss_coef: float | None = option(
        None, "Weight of the MoE load-balancing loss; None uses the model config's value, 0.0 disables it."
    )
    pad_to_multiple_of: int | str | None = option(
        "auto", "Pad batches to a multiple of this length. 'auto': 128 on Neuron devices, else no padding."
    )

    # Reference model (trainers that use one)
    sync_ref_model: bool = option(False, "Every ref_model_sync_steps, set π_ref = α π_θ + (1 - α) π_ref (TR-DPO).")
    ref_model_mixup_alpha: float = option(0.6, "α of the reference-model sync (TR-DPO).")
    ref_model_sync_steps: int = option(512, "τ, steps between reference-model syncs (TR-DPO).")

    # Generation (training and generative evaluation)
    max_completion_length: int | None = option(256, "Maximum number of tokens generated per completion.")
    temperature: float = option(1.0, "Sampling temperature; log-probs are computed from logits divided by it too.")
    top_p: float = option(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p.")
    top_k: int = option(0, "Keep only the top_k most likely tokens when sampling. 0 disables top-k filtering.")
    min_p: float | None = option(None, "Minimum token probability, relative to the most likely one's (None: off).")
    repetition_penalty: float = option(1.0, "Penalty on tokens already in the prompt or completion (1.0: none).")
    cache_implementation: str | None = option(None, "KV-cache implementation for `GenerationConfig`.")
    generation_kwargs: dict | str | None = option(None, "Extra `GenerationConfig` keywords (override the above).")
    chat_template_kwargs: dict | str | None = option(None, "Keywords for `apply_chat_template` (enable_thinking).")

    # Generative evaluation accuracy
    generative_eval: bool = option(
        True,
        "During `evaluate`, generate for eval rows that carry a reference answer, extract the predicted answer and "
        "log `eval_accuracy`. Rows without the answer field are skipped.",
    )
    eval_answer_field: str = option("answer", "The eval column of reference answers (generative accuracy).")
    answer_extractor: str = option(
        "tags",
        "How an answer is read from a generation: 'tags' (<answer>...</answer>), 'boxed' (\\boxed{...}), 'auto' "
        "(tags, then boxed) or 'regex:<pattern>' (first capture group).",
    )
    eval_max_new_tokens: int | None = option(
        None, "Tokens generated per eval prompt for generative accuracy. None uses max_completion_length."
    )
    eval_do_sample: bool = option(False, "Sample in generative evaluation (the fields above) instead of greedy.")

    shared_prefix: bool | None = option(
        None,
        "trl_unified only. Encode a prompt once for all the rows that repeat it (Prefix Grouper, arXiv:2506.05433): "
        "an online group's G completions, a preference pair, distillation's common prefix; the same numbers with "
        "less compute (docs/shared_prefix.md). None (auto): wherever the model and inputs allow it (a fallback is "
        "logged); True: the same, but an unsupported model raises at construction; False: off.",
    )

    chunked_lm_head: bool = option(
        True,
        "trl_unified only. Per-token log-probs from the hidden states through the LM head in chunks of positions "
        "(docs/lm_head.md): no (batch, positions, vocabulary) tensor; the same numbers to float rounding. Falls back "
        "to the model's logits (one log line) under ZeRO-3 / FSDP. False: always the model's logits.",
    )

    padding_free: bool | None = option(
        None,
        "Run the log-prob passes on the rows packed into one sequence without padding (docs/padding_free.md); the "
        "same numbers. None (auto): in passes that do not share prompts, where at least 10% of the slots are "
        "padding; True: every such pass, instead of prompt sharing; False: padded rows. TRL: a DPO field, default "
        "False (DPOConfig keeps it).",
    )

    lean_decoding: bool = option(
        True,
        "trl_unified only. Decode with the lean loop (the same tokens as model.generate, without its per-token "
        "bookkeeping; on CPU with linear weights packed once per call, docs/decoding.md) wherever the model and "
        "options allow it; other cases use model.generate (the reason logged once). False: always model.generate.",
    )

    def __post_init__(self):
        self._default_precision_and_device()
        self._parse_command_line_fields()
        self._check_padding_free()
        super().__post_init__()
        self._check_unimplemented_fields()
        self._check_generation_fields()
        self._check_answer_extractor()
        self.pad_to_multiple_of = self._parse_pad_to_multiple_of(self.pad_to_multiple_of)
        self._check_reference_fields()

    def _default_precision_and_device(self) -> None:
        """`bf16` left unset: TRL's default where the machine can run it; several processes without any accelerator:
        `use_cpu`."""
        if self.bf16 is None:
            self.bf16 = not self.fp16 and (self.use_cpu or _has_accelerator(bf16=True))
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
            # Launched on several processes without any accelerator: without use_cpu, accelerate would run each
            # process as an independent single-process job. Use gloo across CPU processes instead.
            self.use_cpu = True

    def _parse_command_line_fields(self) -> None:
        """JSON strings → dicts; `shared_prefix` / `padding_free` strings → None, True or False (the command line)."""
        for name in ("model_init_kwargs", "generation_kwargs", "chat_template_kwargs"):
            if isinstance(getattr(self, name), str):  # JSON from the command line
                setattr(self, name, json.loads(getattr(self, name)))
        for name in ("shared_prefix", "padding_free"):  # None (auto) / True / False
            value = getattr(self, name)
            if isinstance(value, str):  # 'auto' / 'true' / 'false' (command line, older configs)
                value = {"auto": None, "none": None, "true": True, "false": False}.get(value.lower(), value)
                setattr(self, name, value)
            if value not in (None, True, False):
                raise ValueError(f"{name}={value!r} must be None (auto), True or False.")

    def _check_padding_free(self) -> None:
        if self.padding_free and self.shared_prefix is True:
            raise ValueError(
                "padding_free=True packs the rows of the log-prob passes, where shared_prefix=True demands prompt "
                "sharing: choose one (shared_prefix=None keeps prompt sharing in generation)."
            )

    def _check_unimplemented_fields(self) -> None:
        """Raise on a field of `_unimplemented_fields` set away from its default."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, advice in self._unimplemented_fields.items():
            value = getattr(self, name)
            if value != defaults[name]:
                raise NotImplementedError(
                    f"{name}={value!r} is accepted for compatibility with TRL but not implemented in trl_unified. "
                    f"Leave it at its default ({defaults[name]!r}). {advice}"
                )

    def _check_generation_fields(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature}, but it must be > 0. Use eval_do_sample=False for greedy."
            )
        if not 0 <= self.top_p <= 1:  # as transformers' TopPLogitsWarper: 0 keeps only the most likely token
            raise ValueError(f"top_p={self.top_p} must be in [0, 1]. Use 1.0 to disable nucleus sampling.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k).")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be >= 1.")

    def _check_answer_extractor(self) -> None:
        """`answer_extractor` is a known name, or a `regex:` pattern that compiles and has a capture group."""
        if self.answer_extractor not in ANSWER_EXTRACTORS and not self.answer_extractor.startswith("regex:"):
            raise ValueError(
                f"answer_extractor={self.answer_extractor!r} is not one of {sorted(ANSWER_EXTRACTORS)} "
                "nor 'regex:<pattern>'."
            )
        if not self.answer_extractor.startswith("regex:"):
            return
        try:
            groups = re.compile(self.answer_extractor[len("regex:") :]).groups
        except re.error as e:
            raise ValueError(
                f"answer_extractor={self.answer_extractor!r}: the pattern does not compile ({e}). Fix the regular "
                "expression, e.g. 'regex:Answer: (\\S+)'."
            ) from e
        if groups < 1:
            raise ValueError(
                f"answer_extractor={self.answer_extractor!r} has no capture group; the answer is read from the "
                "first one. Wrap the answer part in parentheses, e.g. 'regex:Answer: (\\S+)'."
            )

    def _parse_pad_to_multiple_of(self, value):
        """'auto' → 128 on Neuron (it compiles once per shape), else None; strings from the command line → int."""
        if not isinstance(value, str):
            return value
        lowered = value.lower()
        if lowered == "auto" and self.device.type == "neuron":
            return 128
        if lowered in ("auto", "none", "null"):
            return None
        try:
            return int(value)
        except ValueError as e:
            raise ValueError(f"pad_to_multiple_of={value!r} must be an integer, 'auto' or None.") from e

    def _check_reference_fields(self) -> None:
        if self.sync_ref_model and not self.uses_reference_model():
            raise ValueError(
                f"You passed `sync_ref_model=True` while {self._no_reference_reason()}: this configuration uses no "
                "reference model, so there is nothing to sync. Set beta > 0 or sync_ref_model=False."
            )
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1].")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1.")

    def uses_reference_model(self) -> bool:
        """Whether this configuration trains against a frozen reference policy (the trainer builds one iff True)."""
        return False

    def _no_reference_reason(self) -> str:
        """Why `uses_reference_model()` is False, for error messages (a subclass names its field)."""
        return "the algorithm has no reference model"

    def __getstate__(self):
        # The Trainer pickles its args into training_args.bin, which push_to_hub uploads: never write the token.
        return {**self.__dict__, "hub_token": None}
