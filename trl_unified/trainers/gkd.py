r"""Generalized knowledge distillation (GKD: Agarwal et al., 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", arXiv:2306.13649): a drop-in for `trl.experimental.gkd` 1.16 on the
distillation trainer.

Each round (one micro-batch by default, as TRL draws per micro-batch) is, with probability `lmbda`, the student's own
samples of the rows' prompts (temperature `temperature`); otherwise the dataset's completions or, with `seq_kd`, the
teacher's samples (`online/completions.py`, `CompletionMix`). Rows are tokenised by TRL's ChatML collator
(`data/sft.py`, `ChatMLCollator`, as `MessagesDistillationTrainer` sets up): `messages` rows, the last turn being the
completion. The loss is the generalized JSD of `core/divergence.py` between the models themselves (temperature 1, as
TRL's GKD: `temperature` only samples),

    loss = sum_{i,t in M} D_beta(i, t) / |M|,    M = the round's completion tokens (all processes),

one optimiser step averaging its rounds. Evaluation scores the dataset's completions (TRL's eval loss).
"""

from dataclasses import dataclass
from operator import attrgetter

from ..core.config import document_fields, option
from ..generation.transformers_generate import generate_with_labels
from ..models.loading import get_tokenizer
from ..online.completions import CompletionMix
from .distillation import DistillationConfig, MessagesDistillationTrainer


# SFTConfig fields that shape SFT's dataset preparation, which TRL's GKD skips (its collator tokenises the rows).
_SFT_PREPARATION = (
    "dataset_text_field", "dataset_num_proc", "packing", "packing_strategy", "eval_packing", "completion_only_loss",
    "assistant_only_loss", "loss_type", "eos_token", "truncation_mode",
)  # fmt: skip


@document_fields
@dataclass
class GKDConfig(DistillationConfig):
    """Configuration of `GKDTrainer`: every field of `trl.experimental.gkd.GKDConfig` 1.16 (GKD's and SFTConfig's),
    same names and defaults, except `shuffle_dataset` (see its help)."""

    _inapplicable_fields = (*DistillationConfig._inapplicable_fields, *_SFT_PREPARATION)
    _inapplicable_reason = "GKD (its collator tokenises the rows, as TRL's GKD skips SFT's dataset preparation)"
    _unimplemented_fields = {
        **DistillationConfig._unimplemented_fields,
        "chat_template_path": "Set processing_class.chat_template before building the trainer.",
        "activation_offloading": "Activation offloading to the CPU is not implemented; use gradient_checkpointing.",
    }

    learning_rate: float = option(2e-5, "Initial AdamW learning rate.")
    remove_unused_columns: bool | None = option(True, "TRL's default; the trainer keeps every column (as TRL's).")
    temperature: float = option(0.9, "Sampling temperature of the student's (and seq_kd teacher's) completions.")
    lmbda: float = option(0.5, "Probability that a round is the student's own samples (on-policy).")
    beta: float = option(0.5, "Generalized JSD interpolation: 0 forward KL, 1 reverse KL, 0.5 symmetric JSD.")
    max_new_tokens: int = option(128, "Maximum tokens generated per completion.")
    max_completion_length: int | None = option(None, "Same as max_new_tokens (None: max_new_tokens).")
    disable_dropout: bool = option(True, "Disable dropout in the student.")
    seq_kd: bool = option(False, "Off-policy rounds use the teacher's samples instead of the dataset's completions.")
    steps_per_generation: int | None = option(1, "Micro-steps per round: 1 draws on/off-policy per micro-batch.")
    shuffle_dataset: bool | None = option(
        True, "Shuffle the training rows. TRL's GKD ignores this field (default False) and shuffles anyway."
    )
    max_length: int | None = option(1024, "Longest prompt + completion row; longer rows keep their last tokens.")
    dataset_kwargs: dict | None = option(None, "SFT's; GKD skips dataset preparation (only skip_prepare_dataset).")
    pad_token: str | None = option(None, "Padding token (None: the tokenizer's, else its EOS token).")
    dataset_text_field: str = option("text", "SFT's; not used by GKD.")
    dataset_num_proc: int | None = option(None, "SFT's; not used by GKD.")
    packing: bool = option(False, "SFT's; not used by GKD.")
    packing_strategy: str = option("bfd", "SFT's; not used by GKD.")
    eval_packing: bool | None = option(None, "SFT's; not used by GKD.")
    completion_only_loss: bool | None = option(None, "SFT's; GKD's loss is on the completion always.")
    assistant_only_loss: bool = option(False, "SFT's; not used by GKD.")
    loss_type: str = option("nll", "SFT's; GKD's loss is the generalized JSD.")
    eos_token: str | None = option(None, "SFT's; not used by GKD.")
    truncation_mode: str = option("keep_start", "SFT's; GKD's collator keeps the end of long rows.")
    chat_template_path: str | None = option(None, "Not implemented (see _unimplemented_fields).")
    activation_offloading: bool = option(False, "Not implemented (see _unimplemented_fields).")

    def __post_init__(self):
        if self.max_completion_length is None:
            self.max_completion_length = self.max_new_tokens
        elif self.max_completion_length != self.max_new_tokens:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} and max_new_tokens={self.max_new_tokens} name "
                "the same limit in GKD; set max_new_tokens only."
            )
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError("lmbda must be in the range [0.0, 1.0].")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError("beta must be in the range [0.0, 1.0].")
        extra = set(self.dataset_kwargs or {}) - {"skip_prepare_dataset"}
        if extra:
            raise ValueError(f"dataset_kwargs {sorted(extra)} shape SFT's dataset preparation, which GKD skips.")
        super().__post_init__()


class GKDTrainer(MessagesDistillationTrainer):
    """GKD (see the module docstring). Same constructor as `trl.experimental.gkd.GKDTrainer` 1.16."""

    _name = "GKD"
    config_class = GKDConfig
    prompt_columns = ("messages", "prompt", "input_ids")

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args: GKDConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
    ):
        if formatting_func is not None:
            raise NotImplementedError(
                "formatting_func is not supported by GKD: TRL's GKD skips SFT's preparation; map the rows to messages."
            )
        data = (data_collator, train_dataset, eval_dataset, processing_class, compute_metrics, callbacks, optimizers)
        super().__init__(model, teacher_model, args, *data, preprocess_logits_for_metrics, peft_config)

    def make_data_collator(self):
        if self.args.pad_token is not None:  # SFTConfig's pad_token, into the tokenizer and the model's configs
            get_tokenizer(self.processing_class).pad_token = self.args.pad_token
            self._sync_pad_token(self.model, self.processing_class)
        return super().make_data_collator()

    def completion_mix(self) -> CompletionMix:
        return CompletionMix(self.args.lmbda, self.args.seq_kd, eval_source="dataset")

    @property
    def divergence_temperature(self) -> float:
        return 1.0

    @property
    def generation_config(self):
        """TRL's attribute: the sampling settings of on-policy rounds, with the model's own EOS (TRL's rule)."""
        config = self.make_generation_config(True, self.args.max_new_tokens)
        model_eos = getattr(self.accelerator.unwrap_model(self.model).generation_config, "eos_token_id", None)
        if model_eos is not None:
            config.eos_token_id = model_eos
        return config

    lmbda = property(attrgetter("args.lmbda"))  # TRL's attributes (`beta`, `temperature`: the online core's)
    seq_kd = property(attrgetter("args.seq_kd"))

    generate_on_policy_outputs = staticmethod(generate_with_labels)  # TRL's static method
