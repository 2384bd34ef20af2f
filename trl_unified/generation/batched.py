"""`generate_batched` and the "unwrap for generation" context, usable with or without a trainer."""

import contextlib
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin

from ..core.models import get_tokenizer
from ..data.datasets import is_conversational_prompt, pad
from ..data.vision import processor_visual_kwargs
from . import lean
from .packed_weights import MIN_NEW_TOKENS, packed_linear_weights
from .sharing import (
    PrefixSharingUnsupported,
    cache_kwarg,
    encode_prefix,
    generation_positions,
    group_prompts,
    report_fallback,
)


@dataclass
class GenerationOutput:
    """What `generate_batched` returns, for `N` prompts.

    Attributes:
        prompt_ids (`torch.LongTensor`): `(N, P)`, left-padded prompt tokens (encoder inputs for encoder-decoders).
        prompt_mask (`torch.LongTensor`): `(N, P)`, 1 on prompt tokens.
        completion_ids (`torch.LongTensor`): `(N, C)`, right-padded with the pad token; cut after the first EOS.
        completion_mask (`torch.LongTensor`): `(N, C)`, 1 up to and including the first EOS.
        texts (`list[str]`): decoded completions (special tokens skipped); prompt + completion if not stripped.
        is_truncated (`torch.BoolTensor`): `(N,)`, True where the completion hit the length limit without EOS.
        image_inputs (`list[dict]`, *optional*): per row, the processor's image tensors (e.g. `pixel_values`,
            `image_grid_thw`) for a later forward pass over prompt + completion; None without images.
        prompt_token_inputs (`dict[str, torch.Tensor]`): other per-token processor outputs (e.g.
            `mm_token_type_ids`), `(N, P)`, left-padded with 0 like `prompt_ids`.
        tool_mask (`torch.LongTensor`, *optional*): `(N, C)`, 1 on tokens the model sampled, 0 on tool-result tokens
            inserted between the turns of a multi-turn (agent) completion; None when every token is the model's.
        logprobs (`torch.FloatTensor`, *optional*): `(N, C)` log-prob of each completion token at the sampling
            temperature, from the decoding logits (`generate_batched(return_logprobs=True)`); 0 on padding.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    is_truncated: torch.Tensor
    image_inputs: list[dict[str, torch.Tensor]] | None = None
    prompt_token_inputs: dict[str, torch.Tensor] | None = None
    tool_mask: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    @property
    def completion_ids_list(self) -> list[list[int]]:
        """Completion tokens per row, padding removed (EOS kept)."""
        return [ids[mask.bool()].tolist() for ids, mask in zip(self.completion_ids, self.completion_mask, strict=True)]

    @property
    def model_token_mask(self) -> torch.Tensor:
        """`(N, C)`: 1 on completion tokens the model sampled (tool-result tokens and padding are 0)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @classmethod
    def from_token_lists(
        cls,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        processing_class,
        eos_token_ids: Sequence[int],
        tool_mask: list[list[int]] | None = None,
        pad_to_multiple_of: int | None = None,
        device=None,
    ) -> "GenerationOutput":
        """The output of a rollout given as token-id lists (a custom `rollout_func`, or a multi-turn tool loop):
        prompts left-padded, completions right-padded and kept whole (a completion ends where its list ends); a
        completion is truncated when its last token is neither an EOS nor the pad token (TRL's rule)."""
        tokenizer = get_tokenizer(processing_class)
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
        completions = [torch.tensor(ids, dtype=torch.long) for ids in completion_ids]
        ends = {*eos_token_ids, pad_token_id}
        masks = None
        if tool_mask is not None:
            masks = pad([torch.tensor(m, dtype=torch.long) for m in tool_mask], 1, "right").to(device)
        return cls(
            prompt_ids=pad(prompts, pad_token_id, "left", pad_to_multiple_of).to(device),
            prompt_mask=pad([torch.ones_like(t) for t in prompts], 0, "left", pad_to_multiple_of).to(device),
            completion_ids=pad(completions, pad_token_id, "right").to(device),
            completion_mask=pad([torch.ones_like(t) for t in completions], 0, "right").to(device),
            texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            is_truncated=torch.tensor([bool(ids) and ids[-1] not in ends for ids in completion_ids], device=device),
            tool_mask=masks,
        )


def get_eos_token_ids(model, processing_class) -> list[int]:
    """The tokenizer's EOS first, then any other EOS of the model's generation config (e.g. `<|im_end|>`)."""
    tokenizer = get_tokenizer(processing_class)
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def build_generation_config(
    args, processing_class, eos_token_ids: list[int], do_sample: bool = True, max_new_tokens: int | None = None
) -> GenerationConfig:
    """A `GenerationConfig` from a `PolicyConfig`'s sampling fields; `generation_kwargs` override them.

    With `do_sample=False` the sampling fields are left out (greedy decoding).
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
    }
    if do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    else:  # explicit neutral values, so the model's own sampling defaults cannot leak in
        kwargs.update(temperature=None, top_p=None, top_k=None, min_p=None)
    kwargs.update(args.generation_kwargs or {})
    return GenerationConfig(**kwargs, disable_compile=True)


def _deepspeed_zero3(accelerator) -> bool:
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def _gathered_parameters(model, accelerator, gather_deepspeed3_params: bool):
    """Gather ZeRO-3 shards once (or FSDP full params) for the whole generation call."""
    if _deepspeed_zero3(accelerator) and gather_deepspeed3_params:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
        return
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        FSDP = None
    if FSDP is not None and isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False, recurse=False):
            yield
        return
    if hasattr(model, "unshard") and hasattr(model, "reshard"):  # FSDP2 module
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
        return
    yield


@contextlib.contextmanager
def unwrap_for_generation(
    model, accelerator=None, gather_deepspeed3_params: bool = True, generation_config: GenerationConfig | None = None
):
    """Yield the bare model ready for `generate`, then put everything back.

    Inside: DDP/DeepSpeed wrappers removed, ZeRO-3 parameters gathered once (not per forward), gradient
    checkpointing off (it disables the KV cache), eval mode (no dropout), and `generation_config` installed as the
    model's own (so the checkpoint's sampling defaults cannot override it). On exit: checkpointing (with its original
    kwargs), train/eval mode and the generation config are restored.
    """
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    was_training = unwrapped.training
    # Flip the per-layer flags instead of disable/enable: that keeps the checkpoint function and its kwargs.
    checkpointed = [m for m in unwrapped.modules() if getattr(m, "gradient_checkpointing", False) is True]
    saved_generation_config = getattr(base, "generation_config", None)
    for module in checkpointed:
        module.gradient_checkpointing = False
    if generation_config is not None:
        base.generation_config = generation_config
    unwrapped.eval()
    try:
        with _gathered_parameters(
            model if accelerator is not None else unwrapped, accelerator, gather_deepspeed3_params
        ):
            yield unwrapped
    finally:
        if generation_config is not None:
            base.generation_config = saved_generation_config
        for module in checkpointed:
            module.gradient_checkpointing = True
        unwrapped.train(was_training)


def normalize_prompts(prompts, pad_token_id: int | None = None) -> list:
    """The prompt forms `generate_batched` accepts, as a list of texts, token-id lists or conversations.

    Accepted: a list (or tuple) of strings, of token-id lists, or of conversations (lists of message dicts); a 2-D
    `(batch, length)` tensor of token ids (every position is a prompt token: a row that starts or ends with
    `pad_token_id` raises, since its padding would be read as prompt); a `BatchEncoding` or dict with `input_ids` (a
    tensor or lists, ragged allowed) and optionally `attention_mask` (positions with mask 0 are padding, on either
    side, and are dropped). A bare string, a 1-D tensor, or a list mixing forms raises a `TypeError` saying what to
    pass instead.
    """
    if isinstance(prompts, str):
        raise TypeError(
            f"prompts is a single string ({prompts[:40]!r}); generate_batched takes a list of prompts. "
            "Pass [prompt] to generate for one prompt."
        )
    if isinstance(prompts, Mapping):
        return _normalize_encoding(prompts)
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise TypeError(
                f"prompts is a {prompts.dim()}-D {prompts.dtype} tensor; pass token ids as a 2-D (batch, length) "
                "integer tensor, or a BatchEncoding with an attention_mask when rows are padded."
            )
        if pad_token_id is not None and prompts.numel():
            padded = (prompts[:, 0] == pad_token_id) | (prompts[:, -1] == pad_token_id)
            if padded.any():
                row = int(padded.nonzero()[0, 0])
                raise ValueError(
                    f"prompts is a padded tensor: row {row} starts or ends with the pad token id {pad_token_id}, "
                    "which would be read as a prompt token. Pass the tokenizer's BatchEncoding (input_ids and "
                    "attention_mask) or a list of unpadded token-id lists."
                )
        return [row.tolist() for row in prompts]
    if not isinstance(prompts, (list, tuple)) and hasattr(prompts, "__getitem__") and hasattr(prompts, "__len__"):
        prompts = list(prompts)  # sequence-like, e.g. a datasets Column
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts is a {type(prompts).__name__}; pass a list of strings, token-id lists or conversations, a 2-D "
            "tensor of token ids, or a BatchEncoding."
        )
    kinds = [_prompt_kind(p) for p in prompts]
    for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
        if kind is None or kind != kinds[0]:
            raise TypeError(
                f"prompts[{i}] is {str(prompt)[:60]!r} ({type(prompt).__name__}); every prompt must be of the same "
                "form: a non-empty string, list of token ids, or conversation (list of {'role', 'content'} dicts)."
            )
    return [p.tolist() if isinstance(p, torch.Tensor) else p for p in prompts]


def _normalize_encoding(prompts: Mapping) -> list[list[int]]:
    """A tokenised batch (`input_ids`, optional `attention_mask`; tensors or lists, ragged allowed) → id lists."""
    if "input_ids" not in prompts:
        raise TypeError(
            f"prompts is a mapping with keys {sorted(prompts)}, but a tokenised batch needs 'input_ids' "
            "(and optionally 'attention_mask')."
        )
    ids, mask = prompts["input_ids"], prompts.get("attention_mask")
    rows = [torch.as_tensor(r).view(-1) for r in ids] if not isinstance(ids, torch.Tensor) else list(ids)
    if isinstance(ids, torch.Tensor) and ids.dim() != 2:
        raise TypeError(f"prompts['input_ids'] has shape {tuple(ids.shape)}; expected (batch, length).")
    if mask is None:
        return [r.tolist() for r in rows]
    masks = [torch.as_tensor(m).view(-1).bool() for m in mask]
    if len(masks) != len(rows) or any(m.numel() != r.numel() for r, m in zip(rows, masks)):
        raise ValueError("prompts['attention_mask'] must have one mask of the same length per row of input_ids.")
    return [r[m].tolist() for r, m in zip(rows, masks, strict=True)]


def _prompt_kind(prompt) -> str | None:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, torch.Tensor):
        return "ids" if prompt.dim() == 1 and not prompt.is_floating_point() else None
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return "ids"
        if all(isinstance(m, Mapping) and "role" in m for m in prompt):
            return "conversation"
    return None


def max_positions(model) -> int | None:
    """The longest sequence a decoder-only model's config allows (`max_position_embeddings` / `n_positions`)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return None
    config = config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def prompt_lengths(processing_class, prompts, chat_template_kwargs=None) -> list[int]:
    """Token count of each prompt as `generate_batched` encodes it (chat template with a generation prompt)."""
    encoded = _encode_prompts(processing_class, normalize_prompts(prompts), None, chat_template_kwargs or {})
    return [len(e["input_ids"]) for e in encoded]


def _encode_prompts(processing_class, prompts, images, chat_template_kwargs, videos=None) -> list[dict[str, Any]]:
    """Tokenise each prompt to a dict (`input_ids` list, plus image / video tensors for processors)."""
    if images is not None or videos is not None:
        texts = [
            processing_class.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
            if is_conversational_prompt(p)
            else p
            for p in prompts
        ]
        images = images if images is not None else [None] * len(texts)
        videos = videos if videos is not None else [None] * len(texts)
        return [
            dict(
                processing_class(text=[t], **processor_visual_kwargs([imgs or []], [vids or []]), return_tensors="pt")
            )
            for t, imgs, vids in zip(texts, images, videos, strict=True)
        ]
    if prompts and is_conversational_prompt(prompts[0]):
        encoded = processing_class.apply_chat_template(
            list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
        )
        return [{"input_ids": list(ids)} for ids in encoded["input_ids"]]
    if prompts and isinstance(prompts[0], str):
        tokenizer = get_tokenizer(processing_class)
        return [{"input_ids": ids} for ids in tokenizer(list(prompts))["input_ids"]]
    return [{"input_ids": list(p)} for p in prompts]  # already token ids


def _collate_chunk(encoded: list[dict[str, Any]], pad_token_id: int, pad_to_multiple_of, device) -> dict[str, Any]:
    ids = [torch.as_tensor(e["input_ids"]).view(-1) for e in encoded]
    batch = {
        "input_ids": pad(ids, pad_token_id, "left", pad_to_multiple_of).to(device),
        "attention_mask": pad([torch.ones_like(t) for t in ids], 0, "left", pad_to_multiple_of).to(device),
    }
    for key in encoded[0]:
        if key in ("input_ids", "attention_mask"):
            continue
        values = [e[key] for e in encoded]
        if _is_sequence_aligned(values[0], encoded[0]["input_ids"]):  # e.g. token_type_ids: padded like the ids
            batch[key] = pad([v.view(-1) for v in values], 0, "left", pad_to_multiple_of).to(device)
        else:
            batch[key] = torch.cat(values).to(device) if isinstance(values[0], torch.Tensor) else values
    return batch


def _is_sequence_aligned(value, input_ids) -> bool:
    length = torch.as_tensor(input_ids).view(-1).numel()
    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.size(0) == 1 and value.size(1) == length


def _check_fits_positions(model, encoded, generation_config) -> None:
    limit = max_positions(model)
    new_tokens = getattr(generation_config, "max_new_tokens", None)
    if limit is None or new_tokens is None or not encoded:
        return
    longest = max(range(len(encoded)), key=lambda i: torch.as_tensor(encoded[i]["input_ids"]).numel())
    length = torch.as_tensor(encoded[longest]["input_ids"]).numel()
    if length + new_tokens > limit:
        raise ValueError(
            f"Prompt {longest} has {length} tokens; with max_new_tokens={new_tokens} that is {length + new_tokens} "
            f"positions, beyond the model's maximum of {limit} (config.max_position_embeddings). Shorten the prompt "
            "or generate fewer tokens."
        )


def _generate_chunk(
    model,
    chunk: dict[str, Any],
    generation_config,
    shared_prefix: bool,
    lean_obstacle: str | None,
    return_logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt + new tokens for one chunk, as `model.generate` returns them, and with `return_logprobs` the new
    tokens' log-probs when the lean loop decoded (None when `model.generate` did).

    Decoded by the lean loop (base/decode.py) unless `lean_obstacle` or the model / options rule it out, then by
    `model.generate` (the reason logged once). With `shared_prefix`, each distinct prompt is prefilled once
    (base/prefix.py): the prefill covers every prompt position but the last, with the positions `generate` itself
    derives from the attention mask, so either loop continues from the cache exactly as from its own prefill."""
    generation_config = generation_config or model.generation_config
    lean_reason = lean_obstacle or lean.unsupported_reason(model, generation_config, chunk)
    if lean_reason is not None:
        lean.report_fallback(lean_reason)
    groups = None
    cache_implementation = getattr(generation_config, "cache_implementation", None)
    expands_rows = (getattr(generation_config, "num_beams", 1) or 1) > 1 or (
        getattr(generation_config, "num_return_sequences", 1) or 1
    ) > 1
    if shared_prefix and set(chunk) == {"input_ids", "attention_mask"} and cache_implementation is None:
        groups = None if expands_rows else group_prompts(chunk["input_ids"], chunk["attention_mask"])
    ids, mask = chunk["input_ids"], chunk["attention_mask"]
    cache = None
    if groups is not None:
        positions = generation_positions(mask)
        try:
            cache = encode_prefix(model, ids, mask, ids.size(1) - 1, groups, position_ids=positions)
        except PrefixSharingUnsupported as e:
            report_fallback("generation", str(e))
    if lean_reason is None:
        try:
            cached = ids.size(1) - 1 if cache is not None else 0
            out = lean.lean_generate(model, ids, mask, generation_config, cache, cached, return_logprobs)
            return out if return_logprobs else (out, None)
        except lean.LeanDecodeUnsupported as e:
            lean.report_fallback(str(e))
            if cache is not None:  # the failed prefill may have written to it; build it again for generate
                cache = encode_prefix(model, ids, mask, ids.size(1) - 1, groups, position_ids=positions)
    if cache is not None:
        sequences = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=generation_config, **{cache_kwarg(model): cache}
        )
    else:
        sequences = model.generate(**chunk, generation_config=generation_config)
    return sequences, None


def _sharded_parameters(model, accelerator, gather_deepspeed3_params: bool) -> str | None:
    """Why every process must run every decode step in step (generate's `synced_gpus`), or None."""
    if _deepspeed_zero3(accelerator) and not gather_deepspeed3_params:
        return "DeepSpeed ZeRO-3 parameters are gathered per layer (gather_deepspeed3_params=False)"
    if any(hasattr(m, "unshard") or type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "FSDP parameters are gathered per layer"
    return None


def cut_after_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int], pad_token_id: int):
    """Mask (and pad) every token after the first EOS of each row; the EOS itself is kept.

    Returns `(completion_ids, completion_mask, is_truncated)`; shapes `(N, C)`, `(N, C)`, `(N,)`.
    """
    stops = torch.tensor(list(eos_token_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, stops)
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.size(1))  # (N,)
    positions = torch.arange(completion_ids.size(1), device=completion_ids.device).expand_as(completion_ids)
    mask = (positions <= first_eos.unsqueeze(1)).long()  # (N, C)
    return completion_ids.masked_fill(mask == 0, pad_token_id), mask, ~has_eos


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
            Videos per prompt (each a list of frames, a `(T, H, W, C)` array or a path; see `base/vision.py`), for
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
            Decode with the lean loop of base/decode.py (the same tokens as `model.generate`, less work per token)
            where the model and options allow it, `model.generate` elsewhere (the reason logged once); on CPU,
            multiply by prepacked float32 linear weights while decoding (base/packed_weights.py). False: always
            `model.generate`, with the model's own linear layers.
        return_logprobs (`bool`, *optional*, defaults to `False`):
            Fill `GenerationOutput.logprobs` with each completion token's log-prob at the sampling temperature, read
            from the logits decoding computed (see `lean.lean_generate`); left None when any chunk was decoded by
            `model.generate`.

    Returns:
        `GenerationOutput`, rows in the order of `prompts`.

    Example:
    ```python
    >>> out = generate_batched(model, tokenizer, ["2+2=", "The capital of France is"], batch_size=2)
    >>> out.texts, out.completion_mask.sum(1)
    ```
    """
    tokenizer = get_tokenizer(processing_class)
    prompts = normalize_prompts(prompts, tokenizer.pad_token_id)
    unwrapped_for_config = accelerator.unwrap_model(model) if accelerator is not None else model
    eos_token_ids = (
        list(eos_token_ids) if eos_token_ids is not None else get_eos_token_ids(unwrapped_for_config, tokenizer)
    )
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = _encode_prompts(processing_class, prompts, images, chat_template_kwargs or {}, videos)
    empty = [i for i, e in enumerate(encoded) if torch.as_tensor(e["input_ids"]).numel() == 0]
    if empty:
        raise ValueError(
            f"prompts{empty[:5]} encode to no tokens (empty prompt {prompts[empty[0]]!r}); a decoder-only model needs "
            "at least one prompt token to generate from. Remove empty prompts or give the tokenizer a BOS token."
        )
    batch_size = batch_size or max(len(encoded), 1)
    _check_fits_positions(unwrapped_for_config, encoded, generation_config)
    device = accelerator.device if accelerator is not None else next(unwrapped_for_config.parameters()).device

    completions, logprobs = [], []
    with unwrap_for_generation(model, accelerator, gather_deepspeed3_params, generation_config) as unwrapped:
        is_encoder_decoder = getattr(unwrapped.config, "is_encoder_decoder", False)
        if is_encoder_decoder and generation_config is not None and generation_config.decoder_start_token_id is None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.decoder_start_token_id = unwrapped.config.decoder_start_token_id
        if continuous_batching is not None:
            if images is not None or videos is not None or is_encoder_decoder:
                raise ValueError(
                    "continuous batching (use_transformers_continuous_batching) supports text-only decoder models; "
                    "turn it off for vision-language or encoder-decoder models."
                )
            outputs = unwrapped.generate_batch(
                [list(e["input_ids"]) for e in encoded],
                generation_config=generation_config,
                continuous_batching_config=continuous_batching,
                progress_bar=False,
            )
            if len(outputs) != len(encoded):
                raise RuntimeError(f"Continuous batching returned {len(outputs)} of {len(encoded)} completions.")
            completions.extend(torch.tensor(o.generated_tokens, dtype=torch.long) for o in outputs.values())
        sharded = _sharded_parameters(unwrapped, accelerator, gather_deepspeed3_params)
        lean_obstacle = "lean_decoding=False" if not lean_decoding else sharded
        max_new_tokens = getattr(generation_config or unwrapped.generation_config, "max_new_tokens", None) or 0
        pack = lean_decoding and sharded is None and continuous_batching is None and max_new_tokens >= MIN_NEW_TOKENS
        with packed_linear_weights(unwrapped, min(batch_size, len(encoded)), enabled=pack):
            for start in range(0, len(encoded) if continuous_batching is None else 0, batch_size):
                chunk = _collate_chunk(encoded[start : start + batch_size], pad_token_id, pad_to_multiple_of, device)
                sequences, chunk_logprobs = _generate_chunk(
                    unwrapped,
                    chunk,
                    generation_config,
                    shared_prefix and not is_encoder_decoder,
                    lean_obstacle,
                    return_logprobs,
                )
                logprobs.extend(chunk_logprobs if chunk_logprobs is not None else [None] * len(sequences))
                # decoder-only: drop the prompt; encoder-decoder: drop the decoder start token
                new_tokens = sequences[:, 1:] if is_encoder_decoder else sequences[:, chunk["input_ids"].size(1) :]
                completions.extend(new_tokens.cpu())

    if not encoded:  # nothing to generate here (e.g. this process's share of a small eval set)
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        return GenerationOutput(empty, empty, empty, empty, [], torch.zeros(0, dtype=torch.bool, device=device))
    prompt_tensors = [torch.as_tensor(e["input_ids"]).view(-1) for e in encoded]
    prompt_ids = pad(prompt_tensors, pad_token_id, "left", pad_to_multiple_of).to(device)
    prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], 0, "left", pad_to_multiple_of).to(device)
    completion_ids = pad(completions, pad_token_id, "right").to(device)
    completion_ids, completion_mask, is_truncated = cut_after_eos(completion_ids, eos_token_ids, pad_token_id)
    width = int(completion_mask.sum(1).max()) if len(completions) else 0  # drop columns that are padding everywhere
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    token_logprobs = None
    if return_logprobs and logprobs and all(row is not None for row in logprobs):
        token_logprobs = pad(logprobs, 0.0, "right").to(device)[:, :width] * completion_mask
    kept = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask, strict=True)]
    if strip_prompt or is_encoder_decoder:
        texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    else:
        texts = tokenizer.batch_decode(
            [p.tolist() + c for p, c in zip(prompt_tensors, kept)], skip_special_tokens=True
        )
    image_inputs, prompt_token_inputs = None, {}
    for key, value in encoded[0].items():
        if key not in ("input_ids", "attention_mask") and _is_sequence_aligned(value, encoded[0]["input_ids"]):
            prompt_token_inputs[key] = pad([e[key].view(-1) for e in encoded], 0, "left", pad_to_multiple_of).to(
                device
            )
    if images is not None or videos is not None:
        image_inputs = [
            {
                k: v
                for k, v in e.items()
                if k not in ("input_ids", "attention_mask")
                and isinstance(v, torch.Tensor)
                and not _is_sequence_aligned(v, e["input_ids"])
            }
            for e in encoded
        ]
    return GenerationOutput(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        texts,
        is_truncated,
        image_inputs,
        prompt_token_inputs,
        logprobs=token_logprobs,
    )
