"""How to generate: `GenerationOptions` (how a `generate_batched` call runs; its `generation_config` says what to
decode), EOS ids and a trainer's `GenerationConfig`."""

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from transformers import GenerationConfig

from ..models.loading import get_tokenizer
from ..models.token_ids import embedding_rows, in_table


@dataclass
class GenerationOptions:
    """Every keyword of `generate_batched` after `generation_config`, with the same names and defaults; pass one as
    `generate_batched(..., options=...)` instead of the keywords.

    Attributes:
        batch_size (`int`, *optional*):
            Prompts per `generate` call. Defaults to all at once.
        strip_prompt (`bool`, *optional*, defaults to `True`):
            If `False`, `texts` hold prompt + completion (decoder-only models).
        accelerator (`accelerate.Accelerator`, *optional*):
            Used to unwrap DDP/DeepSpeed/FSDP models and to detect ZeRO-3.
        gather_deepspeed3_params (`bool`, *optional*, defaults to `True`):
            Gather ZeRO-3 parameters once per call (fast, needs the whole model in memory) instead of per layer.
        images (`list[list[PIL.Image] | None]`, *optional*):
            Images per prompt, for vision-language models with a processor.
        videos (`list[list | None]`, *optional*):
            Videos per prompt (each a list of frames, a `(T, H, W, C)` array or a path; see `data/vision.py`), for
            vision-language models whose processor has a video processor.
        pad_to_multiple_of (`int`, *optional*):
            Pad each chunk's prompt length to a multiple of this.
        chat_template_kwargs (`dict`, *optional*):
            Extra arguments for `apply_chat_template`.
        eos_token_ids (`list[int]`, *optional*):
            Tokens that end a completion. Defaults to `get_eos_token_ids(model, processing_class)`.
        shared_prefix (`bool`, *optional*, defaults to `False`):
            Prefill each distinct prompt of a chunk once and expand its KV cache to the rows that repeat it (e.g. the
            G completions of a group), then decode every row; greedy results equal the plain path. Chunks with image
            inputs, encoder-decoder models, beam search and a non-dynamic `cache_implementation` take the plain path.
        continuous_batching (`transformers.ContinuousBatchingConfig`, *optional*):
            Generate with transformers' continuous batching (`model.generate_batch`, paged attention) instead of
            padded `generate` calls (text-only decoder models; `batch_size` is then ignored).
        lean_decoding (`bool`, *optional*, defaults to `True`):
            Decode with the lean loop of generation/lean.py (the same tokens as `model.generate`, less work per token)
            where the model and options allow it, `model.generate` elsewhere (the reason logged once); on CPU,
            multiply by prepacked float32 linear weights while decoding (generation/packed_weights.py). False: always
            `model.generate`, with the model's own linear layers.
        return_logprobs (`bool`, *optional*, defaults to `False`):
            Fill `GenerationOutput.logprobs` with each completion token's log-prob at the sampling temperature, read
            from the logits decoding computed (see `lean.lean_generate`); left None when any chunk was decoded by
            `model.generate`.
        vllm (`VLLMEngine`, *optional*):
            Generate with this vLLM engine (generation/vllm_engine.py, `use_vllm=True`) instead of the model: the
            prompts are sent as token ids, a group of identical prompts once with `n` = its size; the sampled
            tokens' log-probs come back (kept with `return_logprobs`). Text-only; `batch_size` does not apply.
        max_prompt_length (`int`, *optional*):
            Keep each encoded prompt's last `max_prompt_length` tokens (left truncation; text prompts). None: all.
    """

    batch_size: int | None = None
    strip_prompt: bool = True
    accelerator: Any = None
    gather_deepspeed3_params: bool = True
    images: Sequence[list | None] | None = None
    videos: Sequence[list | None] | None = None
    pad_to_multiple_of: int | None = None
    chat_template_kwargs: dict | None = None
    eos_token_ids: Sequence[int] | None = None
    shared_prefix: bool = False
    continuous_batching: Any = None  # a transformers.ContinuousBatchingConfig
    lean_decoding: bool = True
    return_logprobs: bool = False
    vllm: Any = None  # a generation.vllm_engine.VLLMEngine
    max_prompt_length: int | None = None

    @property
    def has_visual_inputs(self) -> bool:
        """Whether the prompts come with images or videos (encoded by the processor)."""
        return self.images is not None or self.videos is not None


def resolve_options(options: GenerationOptions | None, keywords: GenerationOptions) -> GenerationOptions:
    """`options` where given (the keywords must then be left at their defaults), else the keywords."""
    if options is None:
        return keywords
    given = [f.name for f in fields(keywords) if getattr(keywords, f.name) is not f.default]
    if given:
        raise TypeError(f"generate_batched got options= and the keywords {given}; set them on the options instead.")
    return options


def get_eos_token_ids(model, processing_class) -> list[int]:
    """The tokenizer's EOS first, then any other EOS of the model's generation config (e.g. `<|im_end|>`)."""
    tokenizer = get_tokenizer(processing_class)
    ids = eos_ids(getattr(model, "generation_config", None))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def build_generation_config(
    args,
    processing_class,
    eos_token_ids: list[int],
    do_sample: bool = True,
    max_new_tokens: int | None = None,
    model_config=None,
) -> GenerationConfig:
    """A `GenerationConfig` from a `PolicyConfig`'s sampling fields; `generation_kwargs` override them.

    With `do_sample=False` the sampling fields are left out (greedy decoding). With a vision-language
    `model_config`, its image / video placeholder tokens are suppressed (unless `suppress_tokens` is set): a generated
    placeholder would ask the next forward for image features that do not exist.
    """
    tokenizer = get_tokenizer(processing_class)
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens or args.max_completion_length,
        "do_sample": do_sample,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(eos_token_ids) or None,  # none: generate max_new_tokens tokens
        "cache_implementation": args.cache_implementation,
        "repetition_penalty": args.repetition_penalty,
        # greedy: explicit neutral values, so the model's own sampling defaults cannot leak in
        **{k: getattr(args, k) if do_sample else None for k in ("temperature", "top_p", "top_k", "min_p")},
    }
    kwargs.update(args.generation_kwargs or {})
    placeholders = [getattr(model_config, k, None) for k in ("image_token_id", "video_token_id")]
    if kwargs.get("suppress_tokens") is None and any(t is not None for t in placeholders):
        kwargs["suppress_tokens"] = [t for t in placeholders if t is not None]
    return GenerationConfig(**kwargs, disable_compile=True)


def eos_ids(generation_config: GenerationConfig | None) -> list[int]:
    """The EOS ids of a generation config, as a list (empty when unset or without a config)."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return list(eos)


def with_decoder_start_token(generation_config: GenerationConfig | None, model) -> GenerationConfig | None:
    """`generation_config`, copied with the model's `decoder_start_token_id` where an encoder-decoder needs it."""
    is_encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    if is_encoder_decoder and generation_config is not None and generation_config.decoder_start_token_id is None:
        generation_config = copy.deepcopy(generation_config)
        generation_config.decoder_start_token_id = model.config.decoder_start_token_id
    return generation_config


def with_pad_in_table(model, generation_config: GenerationConfig | None) -> GenerationConfig | None:
    """`generation_config` (or the model's own), copied with pad id 0 where its pad id is beyond the model's
    embedding table (TRL's PPO recipe adds a pad token without resizing): `generate` and the lean loop feed the pad
    back after a row's EOS, at positions the attention mask does not hide. The output is padded with the tokenizer's
    pad again (`output.build_output`)."""
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    pad_token_id = getattr(config, "pad_token_id", None)
    if pad_token_id is None or in_table(pad_token_id, embedding_rows(model)):
        return generation_config
    config = copy.deepcopy(config)
    config.pad_token_id = 0
    return config
