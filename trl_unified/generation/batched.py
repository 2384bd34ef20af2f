"""`generate_batched`: encode the prompts, run the engine the model and options allow, and build the output.

Engines: transformers' continuous batching (continuous_batching.py) for all prompts at once, or per padded chunk the
lean decode loop (lean.py) or `model.generate` (transformers_generate.py), the lean loop falling back to `generate`
where it cannot decode (the reason logged once), either one optionally on a shared-prefix cache (sharing.py).
"""

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin

from ..core.models import get_tokenizer
from ..core.token_ids import embedding_rows, padding_fill_id
from . import lean, transformers_generate
from .continuous_batching import generate_with_continuous_batching
from .fallbacks import report_fallback
from .options import (
    GenerationOptions,
    build_generation_config,
    eos_ids,
    get_eos_token_ids,
    resolve_options,
    with_decoder_start_token,
    with_pad_in_table,
)
from .output import GenerationOutput, build_output, cut_after_eos
from .packed_weights import MIN_NEW_TOKENS, packed_linear_weights
from .prompts import (
    collate_chunk,
    encode_for_generation,
    max_positions,
    normalize_prompts,
    padding_token_id,
    prompt_lengths,
)
from .sharing import chunk_groups, generation_prefix_cache
from .unwrap import sharded_parameters, unwrap_for_generation


# generate_batched, and the names other modules imported from here before the split (now in `trl_unified.generation`)
__all__ = [
    "GenerationOutput",
    "build_generation_config",
    "cut_after_eos",
    "generate_batched",
    "get_eos_token_ids",
    "max_positions",
    "normalize_prompts",
    "prompt_lengths",
    "unwrap_for_generation",
]


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
    *,
    options: GenerationOptions | None = None,
) -> GenerationOutput:
    """Generate completions for many prompts in batches of `batch_size`, with left padding.

    Each chunk is padded on the left only to its own longest prompt; each completion is cut after its first EOS (the
    EOS is kept, the rest is padding and masked). Greedy results equal per-prompt generation. The whole call runs
    inside `unwrap_for_generation` (ZeRO-3 parameters gathered once, checkpointing off, modes restored).

    Args:
        model (`PreTrainedModel` or a wrapped/PEFT model):
            Decoder-only or encoder-decoder model (or a vision-language model with `images`).
        processing_class (`PreTrainedTokenizerBase` or `ProcessorMixin`):
            Tokenizer or processor; its pad token pads, its tokenizer decodes.
        prompts (`list[str]`, `list[list[int]]`, `list[list[dict]]`, `torch.Tensor` or `BatchEncoding`):
            Plain texts, token ids, or conversations (the chat template is applied with a generation prompt); a 2-D
            tensor of ids, or a tokenised batch whose `attention_mask` marks padding (see `normalize_prompts`).
        generation_config (`GenerationConfig`, *optional*):
            Decoding settings; defaults to the model's own generation config.
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
        options (`GenerationOptions`, *optional*):
            Every keyword from `batch_size` to `return_logprobs` as one object; the keywords are then left unset.

    Returns:
        `GenerationOutput`, rows in the order of `prompts`.

    Example:
    ```python
    >>> out = generate_batched(model, tokenizer, ["2+2=", "The capital of France is"], batch_size=2)
    >>> out.texts, out.completion_mask.sum(1)
    ```
    """
    options = resolve_options(
        options,
        GenerationOptions(
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
        ),
    )
    accelerator = options.accelerator
    tokenizer = get_tokenizer(processing_class)
    unwrapped_for_config = accelerator.unwrap_model(model) if accelerator is not None else model
    encoded = encode_for_generation(processing_class, prompts, options, unwrapped_for_config, generation_config)
    if options.eos_token_ids is not None:
        eos_token_ids = list(options.eos_token_ids)
    else:
        eos_token_ids = get_eos_token_ids(unwrapped_for_config, tokenizer)
    device = accelerator.device if accelerator is not None else next(unwrapped_for_config.parameters()).device
    if options.vllm is not None:
        completions, logprobs = _generate_with_vllm(
            unwrapped_for_config, encoded, generation_config, options, eos_token_ids
        )
        return build_output(encoded, completions, logprobs, tokenizer, eos_token_ids, options, False, device)
    with unwrap_for_generation(model, accelerator, options.gather_deepspeed3_params, generation_config) as unwrapped:
        is_encoder_decoder = getattr(unwrapped.config, "is_encoder_decoder", False)
        generation_config = with_decoder_start_token(unwrapped, generation_config)
        if options.continuous_batching is not None:
            completions = generate_with_continuous_batching(unwrapped, encoded, generation_config, options)
            logprobs = []
        else:
            pad_token_id = padding_token_id(tokenizer)
            completions, logprobs = _generate_in_chunks(
                unwrapped, encoded, generation_config, options, pad_token_id, device
            )
    return build_output(encoded, completions, logprobs, tokenizer, eos_token_ids, options, is_encoder_decoder, device)


def _generate_with_vllm(model, encoded, generation_config, options: GenerationOptions, eos_token_ids):
    """New tokens and their log-probs of every prompt from `options.vllm` (the weights are the engine's: the trainer
    syncs them once per generation round before it calls)."""
    if options.has_visual_inputs:
        raise NotImplementedError(
            "use_vllm=True generates text-only prompts here; rows with images or videos need use_vllm=False."
        )
    prompt_ids = [torch.as_tensor(e["input_ids"]).view(-1).tolist() for e in encoded]
    return options.vllm.generate(prompt_ids, generation_config or model.generation_config, eos_token_ids)


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
    fill = padding_fill_id(pad_token_id, embedding_rows(model))
    decoding_config = with_pad_in_table(model, generation_config)
    refill_after = []  # the EOS ids after which decoding wrote the fill
    if decoding_config is not generation_config:
        refill_after = eos_ids(lean.effective_generation_config(model, decoding_config))
    completions, logprobs = [], []
    with packed_linear_weights(model, min(batch_size, len(encoded)), enabled=pack):
        for start in range(0, len(encoded), batch_size):
            chunk = collate_chunk(encoded[start : start + batch_size], fill, options.pad_to_multiple_of, device)
            sequences, chunk_logprobs = _generate_chunk(
                model, chunk, decoding_config, shared_prefix, lean_obstacle, options.return_logprobs
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
    """Prompt + new tokens for one chunk, as `model.generate` returns them, and with `return_logprobs` the new
    tokens' log-probs when the lean loop decoded (None when `model.generate` did).

    Decoded by the lean loop unless `lean_obstacle` or the model / options rule it out (`lean.unsupported_reason`),
    then by `model.generate`; the reason is logged once. With `shared_prefix`, each distinct prompt is prefilled once
    (`sharing.chunk_groups`, `sharing.generation_prefix_cache`) and either engine continues from that cache."""
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
