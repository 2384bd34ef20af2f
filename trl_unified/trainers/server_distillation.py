r"""On-policy distillation from a teacher served by vLLM: a drop-in for `trl.experimental.server_distillation` 1.16.

The distillation trainer whose teacher is a vLLM server (`online/teachers.py`): the server scores each sampled
sequence (vLLM's prompt log-probs) and the loss is D_beta over the support it reports (`core/divergence.py`,
"sparse supports"), both sides at `temperature`. With s the student's log-probs, t the teacher's, y the sampled token:

    beta = 0:      forward KL on the teacher's top-k (`loss_top_k`),
    0 < beta < 1:  the generalized JSD on {teacher's top-1, y},
    beta = 1:      reverse KL on {y},

each support completed by the tail bucket log(1 - sum p) on both sides (`loss_add_tail`), or renormalised over the
support. The loss is normalised as the distillation trainer's (the mean over the optimiser step's completion tokens;
TRL divides each micro-batch's mean by the accumulation steps: equal when they hold the same number of tokens).
"""

from dataclasses import dataclass

from ..core.config import document_fields, option
from .distillation import DistillationConfig, DistillationTrainer


@document_fields
@dataclass
class ServerDistillationConfig(DistillationConfig):
    """Configuration of `ServerDistillationTrainer`: every field of TRL 1.16's, same names and defaults."""

    _inapplicable_fields = (
        *DistillationConfig._inapplicable_fields,
        "teacher_model_name_or_path",
        "teacher_model_revision",
        "teacher_model_init_kwargs",
        "teacher_weights",
    )
    _inapplicable_reason = "server distillation (the teacher is the server at teacher_model_server_url)"

    vllm_server_port: int = option(8001, "Server mode: port of the student's vLLM server (the teacher's is another).")
    teacher_model_server_url: str | None = option(None, "Base URL of the teacher's vLLM server (required).")
    loss_top_k: int = option(1, "Teacher top-k log-probs requested: the forward-KL support at beta = 0; 1 otherwise.")
    loss_add_tail: bool = option(True, "Add the tail bucket (the mass outside the support) on both sides.")
    reverse_kl_top_1_mode: str = option("sampled", "The reverse-KL token: 'sampled' (the only one a server scores).")

    def __post_init__(self):
        if self.reverse_kl_top_1_mode not in {"sampled", "argmax"}:
            raise ValueError("reverse_kl_top_1_mode must be one of: 'sampled', 'argmax'")
        if self.use_liger_kernel:
            raise ValueError(
                "use_liger_kernel=True is not supported by ServerDistillationTrainer because the Liger loss path "
                "requires a local teacher model."
            )
        if not self.teacher_model_server_url or not str(self.teacher_model_server_url).strip():
            raise ValueError("teacher_model_server_url must be set for ServerDistillationTrainer.")
        if self.beta == 0 and self.loss_top_k < 1:
            self._check_server_support()
        if self.reverse_kl_top_1_mode == "argmax":
            raise ValueError(
                "reverse_kl_top_1_mode='argmax' is not supported by ServerDistillationTrainer because the server "
                "cannot provide teacher logprobs for arbitrary student-selected tokens."
            )
        super().__post_init__()


class ServerDistillationTrainer(DistillationTrainer):
    """Distillation from a vLLM teacher server (see the module docstring). Same constructor as TRL 1.16's."""

    _name = "Server Distillation"
    _tag_names = ["trl", "server-distillation", "trl_unified"]
    config_class = ServerDistillationConfig

    def __init__(
        self,
        model,
        args: ServerDistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        super().__init__(
            model,
            None,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )

    reverse_kl_top_1_mode = property(lambda self: self.args.reverse_kl_top_1_mode)
