"""`generate_batched`: encode the prompts, run the engine the model and options allow (continuous batching for all at
once; per padded chunk the lean loop, else `model.generate`, maybe on a shared-prefix cache), build the output."""

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin

from ..models.loading import get_tokenizer
from ..models.token_ids import embedding_rows, padding_fill_id
from . import lean, transformers_generate
from .continuous_batching import generate_with_continuous_batching
from .fallbacks import report_fallback
from .options import (
    GenerationOptions,
    eos_ids,
    get_eos_token_ids,
    resolve_options,
    with_decoder_start_token,
    with_pad_in_table,
)
from .output import GenerationOutput, build_output, cut_after_eos
from .packed_weights import MIN_NEW_TOKENS, packed_linear_weights
from .prompts import collate_chunk, encode_for_generation, padding_token_id
from .sharing import chunk_groups, generation_prefix_cache
from .unwrap import sharded_parameters, unwrap_for_generation


@torch.no_grad()
def generate_batched(
    model,
    processing_class: PreTrainedTokenizerBase | ProcessorMixin,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[list[dict]],
    generation_config: GenerationConfig | None = None,
    batch_size: int | None = None,
    strip_prompt: bool = True,
    accelerator=None,
    gather_deepspeed3_params: bool = True,
    images: Sequence[list | None] | None = None,
    videos: Sequence[list | None] | None = None,
    pad_to_multiple_of: int | None = None,
    chat_template_kwargs: dict | None = None,
    eos_token_ids: Sequence[int] | None = None,
    shared_prefix: bool = False,
    continuous_batching=None,
    lean_decoding: bool = True,
    return_logprobs: bool = False,
    vllm=None,
    max_prompt_length: int | None = None,
    *,
    options: GenerationOptions | None = None,
) -> GenerationOutput:
    """Generate completions for many prompts in batches of `batch_size`, with left padding.

    Each chunk is padded on the left only to its own longest prompt; each completion is cut after its first EOS (the
    EOS is kept, the rest is padding and masked). Greedy results equal per-prompt generation. The whole call runs
    inside `unwrap_for_generation` (ZeRO-3 parameters gathered once, checkpointing off, modes restored).

    Args:
        model: a decoder-only or encoder-decoder model (or a vision-language model with `images`), maybe wrapped.
        processing_class: its tokenizer or processor; the pad token pads, the tokenizer decodes.
        prompts: plain texts, token ids, or conversations (the chat template is applied with a generation prompt);
            a 2-D tensor of ids, or a tokenised batch whose `attention_mask` marks padding (`normalize_prompts`).
        generation_config (`GenerationConfig`, *optional*): what to decode; the model's own by default.
        batch_size, ..., vllm: how the call runs (batching, engines, visual inputs, what to return), one field each
            of `GenerationOptions`, documented there; or `options`, all of them as one object.

    Returns:
        `GenerationOutput`, rows in the order of `prompts`, e.g.
        `generate_batched(model, tokenizer, ["2+2=", "The capital of France is"], batch_size=2).texts`.
    """
    keywords = GenerationOptions(
        batch_size=batch_size,
        strip_prompt=strip_prompt,
        accelerator=accelerator,
        gather_deepspeed3_params=gather_deepspeed3_params,
        images=images,
        videos=videos,
        pad_to_multiple_of=pad_to_multiple_of,
        chat_template_kwargs=chat_template_kwargs,
        eos_token_ids=eos_token_ids,
        shared_prefix=shared_prefix,
        continuous_batching=continuous_batching,
        lean_decoding=lean_decoding,
        return_logprobs=return_logprobs,
        vllm=vllm,
        max_prompt_length=max_prompt_length,
    )
    options = resolve_options(options, keywords)
    bare = options.accelerator.unwrap_model(model) if options.accelerator is not None else model
    encoded = encode_for_generation(processing_class, prompts, options, bare, generation_config)
    tokenizer = get_tokenizer(processing_class)
    eos = list(options.eos_token_ids) if options.eos_token_ids is not None else get_eos_token_ids(bare, tokenizer)
    device = options.accelerator.device if options.accelerator is not None else next(bare.parameters()).device
    generate = _generate_with_vllm if options.vllm is not None else _generate_with_model
    completions, logprobs, is_encoder_decoder = generate(
        model, encoded, generation_config, options, tokenizer, eos, device
    )
    return build_output(encoded, completions, logprobs, tokenizer, eos, options, is_encoder_decoder, device)


def _generate_with_model(model, encoded, generation_config, options: GenerationOptions, tokenizer, eos, device):
    """`(new tokens, log-probs, is_encoder_decoder)` from the model itself, inside `unwrap_for_generation`: all
    prompts at once with continuous batching, else padded chunks (the lean loop or `model.generate`)."""
    with unwrap_for_generation(model, options.accelerator, options.gather_deepspeed3_params, generation_config) as m:
        is_encoder_decoder = getattr(m.config, "is_encoder_decoder", False)
        generation_config = with_decoder_start_token(generation_config, m)
        if options.continuous_batching is not None:
            return generate_with_continuous_batching(m, encoded, generation_config, options), [], is_encoder_decoder
        chunks = _generate_in_chunks(m, encoded, generation_config, options, padding_token_id(tokenizer), device)
    return *chunks, is_encoder_decoder


def _generate_with_vllm(model, encoded, generation_config, options: GenerationOptions, tokenizer, eos, device):
    """`(new tokens, log-probs, False)` of every prompt from `options.vllm` (decoder-only: checked when the engine was
    built; the weights are the engine's: the trainer syncs them once per generation round before it calls)."""
    if options.has_visual_inputs:
        raise NotImplementedError(
            "use_vllm=True generates text-only prompts here; rows with images or videos need use_vllm=False."
        )
    prompt_ids = [torch.as_tensor(e["input_ids"]).view(-1).tolist() for e in encoded]
    bare = options.accelerator.unwrap_model(model) if options.accelerator is not None else model
    return *options.vllm.generate(prompt_ids, generation_config or bare.generation_config, eos), False


def _generate_in_chunks(model, encoded, generation_config, options: GenerationOptions, pad_token_id, device):
    """New tokens (and, where the lean loop decoded, log-probs) of every prompt, chunk by chunk of
    `options.batch_size`, with the linear weights prepacked where the lean loop may decode (packed_weights.py)."""
    batch_size = options.batch_size or max(len(encoded), 1)
    is_encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    sharded = sharded_parameters(model, options.accelerator, options.gather_deepspeed3_params)
    lean_obstacle = "lean_decoding=False" if not options.lean_decoding else sharded
    max_new_tokens = getattr(generation_config or model.generation_config, "max_new_tokens", None) or 0
    pack = options.lean_decoding and sharded is None and max_new_tokens >= MIN_NEW_TOKENS
    shared_prefix = options.shared_prefix and not is_encoder_decoder
    # A pad beyond the embedding table (added without resizing) never reaches it: prompts are padded with an id the
    # table holds, generation feeds that id back after a row's EOS, and the new tokens get the tokenizer's pad again.
    fill, config = padding_fill_id(pad_token_id, embedding_rows(model)), with_pad_in_table(model, generation_config)
    refill_after = eos_ids(lean.effective_generation_config(model, config)) if config is not generation_config else []
    completions, logprobs = [], []
    with packed_linear_weights(model, min(batch_size, len(encoded)), enabled=pack):
        for start in range(0, len(encoded), batch_size):
            chunk = collate_chunk(encoded[start : start + batch_size], fill, options.pad_to_multiple_of, device)
            sequences, chunk_logprobs = _generate_chunk(
                model, chunk, config, shared_prefix, lean_obstacle, options.return_logprobs
            )
            logprobs.extend(chunk_logprobs if chunk_logprobs is not None else [None] * len(sequences))
            # decoder-only: drop the prompt; encoder-decoder: drop the decoder start token
            new_tokens = sequences[:, 1:] if is_encoder_decoder else sequences[:, chunk["input_ids"].size(1) :]
            if refill_after:
                new_tokens = cut_after_eos(new_tokens, refill_after, pad_token_id)[0]
            completions.extend(new_tokens.cpu())
    return completions, logprobs


def _generate_chunk(
    model, chunk, generation_config, shared_prefix: bool, lean_obstacle: str | None, return_logprobs: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt + new tokens of one chunk and, with `return_logprobs`, their log-probs (None from `model.generate`):
    the lean loop unless `lean_obstacle` or `lean.unsupported_reason` (logged once), on a shared-prefix cache."""
    generation_config = generation_config or model.generation_config
    lean_reason = lean_obstacle or lean.unsupported_reason(model, generation_config, chunk)
    if lean_reason is not None:
        report_fallback("generation", lean_reason, "lean_decoding")
    groups = chunk_groups(chunk, generation_config) if shared_prefix else None
    cache = generation_prefix_cache(model, chunk, groups) if groups is not None else None
    if lean_reason is None:
        try:
            return lean.generate_chunk(model, chunk, generation_config, cache, return_logprobs)
        except lean.LeanDecodeUnsupported as e:
            report_fallback("generation", str(e), "lean_decoding")
            if cache is not None:  # the failed prefill may have written to it; build it again for generate
                cache = generation_prefix_cache(model, chunk, groups)
    return transformers_generate.generate_chunk(model, chunk, generation_config, cache, return_logprobs)
