"""Loading the policy and its processing class from a model id or object; PEFT and quantisation set-up."""

import logging
import os

import torch
from accelerate.utils import is_peft_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoProcessor,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)


logger = logging.getLogger(__name__)


def get_tokenizer(processing_class: PreTrainedTokenizerBase | ProcessorMixin) -> PreTrainedTokenizerBase:
    """The tokenizer of a processor, or the tokenizer itself."""
    return getattr(processing_class, "tokenizer", processing_class)


def base_model(model):
    """The model under a PEFT wrapper (`get_base_model()`), or `model` itself: the one test of "is this a PEFT
    model" (accelerate's `is_peft_model`) that every module uses."""
    return model.get_base_model() if is_peft_model(model) else model


def model_id_of(model) -> str:
    """The id or path a model was loaded from (`config._name_or_path`), or its class name if built in memory."""
    model = base_model(model)
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def default_output_dir(model, trainer_name: str) -> str:
    """TRL's default `output_dir`: `<model name>-<trainer>`, the model name being the last part of its id or path
    (`config._name_or_path`, also for a model object; its class name when it was built in memory)."""
    model_id = model if isinstance(model, str) else model_id_of(model)
    return f"{model_id.rstrip('/').split('/')[-1]}-{trainer_name}"


def moe_aux_loss_setup(model, args) -> tuple[bool, float]:
    """`(aux_loss_enabled, router_aux_loss_coef)` as TRL's trainers set them: a Mixture-of-Experts model (its config
    has `output_router_logits`) adds `coef * load-balancing loss`, `coef` being `args.router_aux_loss_coef`, or the
    model config's own value when that is None; 0.0 disables it."""
    base = base_model(model)
    text_config = base.config.get_text_config()
    coef = args.router_aux_loss_coef
    is_moe = hasattr(text_config, "output_router_logits")
    if coef and not is_moe:
        raise ValueError(
            f"`router_aux_loss_coef` is set to {coef} but {type(base).__name__} is not a Mixture-of-Experts model "
            "that returns its router logits, so there is no auxiliary loss to weight. Leave it at None."
        )
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    return is_moe and coef != 0.0, float(coef or 0.0)


def from_pretrained_checked(auto_class, model_id: str, what: str, **kwargs):
    """`auto_class.from_pretrained(model_id)` with an error that says what to do when the id cannot be resolved."""
    try:
        return auto_class.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as e:
        if os.path.isdir(model_id):
            hint = "The directory exists but does not hold a complete saved model (config and weights)."
        else:
            hint = (
                "It is not a local directory, and the Hugging Face Hub could not resolve it (unknown id, no network, "
                "or HF_HUB_OFFLINE=1). Pass a local path to a saved model, or a model object."
            )
        raise ValueError(f"Could not load the {what} {model_id!r}: {e.__class__.__name__}: {e}. {hint}") from e


def load_model(model_id: str, args, quantization_config=None, what: str = "policy model"):
    """Load the policy (or reference) by id/path with `args.model_init_kwargs` (`load_model_plain`): as in TRL, `dtype`
    defaults to float32, not the checkpoint's; `device_map` is dropped under distributed training (accelerate places
    the model)."""
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["dtype"] = parse_dtype(kwargs.get("dtype", "float32"))
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError(
                "quantization_config is set both as a trainer argument and in args.model_init_kwargs. Set it once, "
                "preferably as the trainer argument."
            )
        kwargs["quantization_config"] = quantization_config
    if args.distributed_state.distributed_type in ("MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP"):
        kwargs["device_map"] = None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return load_model_plain(model_id, what, **kwargs)


def parse_dtype(dtype):
    """A `dtype` for `from_pretrained`: a `torch.dtype`, "auto", None, or the name of a floating dtype."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("bfloat16", "float16", "float32"):
        return getattr(torch, dtype)
    raise ValueError(
        "Invalid `dtype` passed to the config. Expected either 'auto' or a string representing a valid "
        f"`torch.dtype` (e.g., 'float32'), but got {dtype}."
    )


def load_processing_class(processing_class, model, args):
    """The processing class, loaded from the model's id when not given; a tokenizer without a pad token pads with EOS
    (safe: attention masks, not token values, decide what is padding, and completion masks end at the first EOS)."""
    if processing_class is None:
        model_id = model_id_of(model)
        try:
            processing_class = AutoProcessor.from_pretrained(
                model_id, padding_side="left", truncation_side="left", trust_remote_code=args.trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"No processing class was given and none could be loaded from {model_id!r} ({e}). Pass "
                "processing_class=AutoTokenizer.from_pretrained(<path>) explicitly."
            ) from e
    if not isinstance(processing_class, (PreTrainedTokenizerBase, ProcessorMixin)):
        raise TypeError(f"processing_class must be a tokenizer or a processor, got {type(processing_class).__name__}.")
    tokenizer = get_tokenizer(processing_class)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:
        raise ValueError("The tokenizer has neither a pad token nor an EOS token. Set tokenizer.pad_token first.")
    return processing_class


def is_quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def keep_4bit_layers_trainable_on_cpu(model) -> None:
    """Turn off bitsandbytes' (0.50) inference-only repacking of 4-bit weights on CPUs with AVX-512 BF16: the
    repacked layer's kernel has no backward, so QLoRA would silently stop learning (docs/troubleshooting.md)."""
    if not getattr(model, "is_loaded_in_4bit", False):
        return
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and getattr(module, "support_avx512bf16_for_cpu", False):
            if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
                raise ValueError(
                    "A 4-bit layer of the model was already repacked for bitsandbytes' CPU inference kernel (it ran "
                    "a no-grad forward in eval mode before the trainer got it); that kernel has no backward. Pass the "
                    "model to the trainer before using it for inference, or load it by id."
                )
            module.support_avx512bf16_for_cpu = False


def apply_peft(model, peft_config, args):
    """Wrap `model` with a new adapter from `peft_config` (k-bit preparation first when quantised). Returns `(model,
    adapter_is_pretrained)`: True when `model` arrived as a `PeftModel` (its adapter trained before)."""
    keep_4bit_layers_trainable_on_cpu(model)
    if peft_config is None:
        if is_quantized(model) and not is_peft_model(model):
            raise ValueError(
                "The policy is quantised (4/8-bit) but no peft_config was given: quantised weights cannot be trained. "
                "Pass peft_config=LoraConfig(...) (QLoRA)."
            )
        return model, is_peft_model(model)
    from peft import PeftConfig, get_peft_model, prepare_model_for_kbit_training

    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}.")
    if is_peft_model(model):
        raise ValueError(
            "The model is already a PeftModel and a peft_config was also given. Merge and unload the existing adapter "
            "first (model.merge_and_unload()), or pass the PeftModel without peft_config to keep training its adapter."
        )
    if is_quantized(model):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=bool(args.gradient_checkpointing),
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        )
    return get_peft_model(model, peft_config), False


def check_liger_kernel(model, args) -> None:
    """`use_liger_kernel=True` (transformers patches the model's layers with Liger kernels): liger-kernel must be
    installed, and Liger's fused LM-head loss reads `lm_head.weight` directly, so a PEFT adapter on the LM head would
    never be trained (TRL's rule; without Liger, trl_unified trains LM-head adapters through the model's forward)."""
    if not getattr(args, "use_liger_kernel", False):
        return
    if is_peft_model(model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(model.get_output_embeddings(), BaseTunerLayer):
            raise ValueError(
                "Applying a PEFT adapter to `lm_head` is not supported with use_liger_kernel=True: Liger's fused loss "
                "computes the log-probabilities from `lm_head.weight` directly, so the adapter would never be "
                "trained. Remove `'lm_head'` from your `target_modules` (or use `modules_to_save=['lm_head']`)."
            )
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            "use_liger_kernel=True needs the liger-kernel package: `pip install liger-kernel`, or set "
            "use_liger_kernel=False."
        )


def cast_lm_head_to_fp32(model) -> None:
    """Compute the LM head in float32 (as TRL's `cast_lm_head_to_fp32`): its weight becomes float32 and its input
    is cast up, so logits and log-probs keep float32 precision with bf16/fp16 weights. A tied input embedding keeps
    returning the model's dtype."""
    base = base_model(model)
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"cast_lm_head_to_fp32=True, but {type(base).__name__} has no output embeddings (LM head).")
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            "`cast_lm_head_to_fp32=True` is not supported when the lm_head carries a PEFT adapter (e.g. "
            "`target_modules` includes `lm_head`). Remove `lm_head` from the adapter's target modules, or set "
            "`cast_lm_head_to_fp32=False`."
        )
    dtype = head.weight.dtype
    head.float()
    head._fp32_input = lambda module, args: (args[0].float(), *args[1:])  # core/lm_head.py knows this hook
    head.register_forward_pre_hook(head._fp32_input)
    embeddings = base.get_input_embeddings()
    if getattr(base.config.get_text_config(), "tie_word_embeddings", False) and embeddings is not None:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def disable_dropout(model: torch.nn.Module) -> None:
    """Set the probability of every `nn.Dropout` in `model` to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_model_plain(model_id: str, what: str = "model", **kwargs):
    """Load a model by id/path with the auto class its config calls for (no training arguments involved)."""
    config_kwargs = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "revision")}  # the config's too
    config = from_pretrained_checked(AutoConfig, model_id, what, **config_kwargs)
    return from_pretrained_checked(_auto_class_for(config), model_id, what, **kwargs)


def _auto_class_for(config):
    """The auto class a config calls for: Seq2SeqLM for an encoder-decoder, ImageTextToText with a `vision_config`,
    else CausalLM."""
    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
