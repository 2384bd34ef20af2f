r"""Generalized knowledge distillation (GKD: Agarwal et al., 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", arXiv:2306.13649): a drop-in for `trl.experimental.gkd` 1.16 on the
distillation trainer.

Each round (one micro-batch by default, as TRL draws per micro-batch) is, with probability `lmbda`, the student's own
samples of the rows' prompts (temperature `temperature`); otherwise the dataset's completions or, with `seq_kd`, the
teacher's samples (`online/completions.py`, `CompletionMix`). Rows are tokenised by TRL's ChatML collator
(`data/sft.py`, `ChatMLCollator`): `messages` rows, the last turn being the completion. The loss is the generalized
JSD of `core/divergence.py` between the models themselves (temperature 1, as TRL's GKD: `temperature` only samples),

    loss = sum_{i,t in M} D_beta(i, t) / |M|,    M = the round's completion tokens (all processes),

one optimiser step averaging its rounds. Evaluation scores the dataset's completions (TRL's eval loss).
"""

from dataclasses import dataclass
from operator import attrgetter

import torch

from ..core.config import document_fields, option
from ..data.sft import ChatMLCollator
from ..generation.options import eos_ids
from ..generation.output import cut_after_eos
from ..models.loading import default_output_dir, get_tokenizer
from ..online.completions import CompletionMix
from .distillation import DistillationConfig, DistillationTrainer


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


class GKDTrainer(DistillationTrainer):
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
        unsupported = {
            "compute_metrics": (compute_metrics, "GKD's evaluation reports the loss on the dataset's completions"),
            "preprocess_logits_for_metrics": (preprocess_logits_for_metrics, "GKD's evaluation keeps no logits"),
            "formatting_func": (formatting_func, "TRL's GKD skips SFT's preparation; map the rows to messages first"),
        }
        for name, (value, reason) in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{name} is not supported: {reason}.")
        args = args or GKDConfig(output_dir=default_output_dir(model, self._name))
        args.remove_unused_columns = False  # the collator reads the rows' own columns (TRL's GKD does the same)
        self._data_collator = data_collator
        super().__init__(
            model,
            teacher_model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    def make_data_collator(self):
        tokenizer = self.processing_class
        if self.args.pad_token is not None:  # SFTConfig's pad_token, into the tokenizer and the model's configs
            get_tokenizer(tokenizer).pad_token = self.args.pad_token
            self._sync_pad_token(self.model, tokenizer)
        return self._data_collator or ChatMLCollator(tokenizer, self.args.max_length, self.args.chat_template_kwargs)

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

    @staticmethod
    def generate_on_policy_outputs(model, inputs, generation_config):
        """TRL's static method: `model.generate` from `inputs["prompts"]`, returning `(input_ids, attention_mask,
        labels)` with the completion kept up to and including its first stop token (any of `eos_token_id`; all of it
        when there is none) and labels -100 on the prompt and after the stop."""
        prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
        sequences = model.generate(
            input_ids=prompts,
            attention_mask=prompt_mask,
            generation_config=generation_config,
            return_dict_in_generate=True,
        ).sequences
        completion = sequences[:, prompts.size(1) :]
        stops = eos_ids(generation_config)
        completion_mask = cut_after_eos(completion, stops, 0)[1] if stops else torch.ones_like(completion)
        attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
        labels = sequences.masked_fill(attention_mask == 0, -100)
        labels[:, : prompts.size(1)] = -100
        return sequences, attention_mask, labels
