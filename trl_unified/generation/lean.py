"""The lean decode loop of `generate_batched`: `GenerationMixin._sample`'s forwards, processors and sampling calls in
its order (the same tokens), without its per-token bookkeeping; what it does not cover (`SUPPORTED_OPTIONS`,
`unsupported_reason`) is decoded by `model.generate`. See docs/decoding.md."""

import copy
import functools
import inspect

import torch
from transformers import (
    Cache,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .options import eos_ids
from .sharing import _base_model, cache_kwarg, generation_positions


_unsupported_models: dict[type, str] = {}  # model classes whose forward turned out not to return a KV cache
_GENERATE = GenerationMixin.generate  # transformers' own, as imported: a later patch of it is a custom generate

# Generation options the lean loop implements; setting any other one to a non-default value selects `generate`.
SUPPORTED_OPTIONS = frozenset(
    "max_new_tokens max_length do_sample temperature top_k top_p min_p repetition_penalty pad_token_id bos_token_id "
    "eos_token_id decoder_start_token_id cache_implementation use_cache disable_compile compile_config "
    "transformers_version _from_model_config".split()
)


class LeanDecodeUnsupported(Exception):
    """The model turned out not to fit the lean loop (found at its first forward); `model.generate` decodes."""


def effective_generation_config(model, generation_config: GenerationConfig | None) -> GenerationConfig:
    """The options `model.generate(generation_config=...)` decodes with: fields left unset take the model's own
    generation config, then transformers' global defaults (e.g. `top_k=50`), through the resolution step `generate`
    itself runs (`_prepare_generation_config`, when this transformers version has it)."""
    base = _base_model(model)
    prepare = getattr(base, "_prepare_generation_config", None)
    if prepare is None:
        return copy.deepcopy(generation_config or base.generation_config)
    return prepare(generation_config)[0]


@functools.cache
def _defaults() -> tuple[dict, dict]:
    """`GenerationConfig`'s class defaults and transformers' global generation defaults (e.g. `top_k=50`)."""
    return GenerationConfig().to_dict(), getattr(GenerationConfig, "_get_default_generation_params", dict)()


def _neutral(name: str, value) -> bool:
    """Whether an option has the value that turns its feature off (the class default or transformers' global one)."""
    class_defaults, global_defaults = _defaults()
    if value is None or value is False or value == class_defaults.get(name):
        return True
    return name in global_defaults and value == global_defaults[name]


def unsupported_reason(model, generation_config: GenerationConfig | None, model_inputs: dict) -> str | None:
    """Why `lean_generate` cannot decode this call (then `model.generate` does), or None when it can."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models decode with generate"
    extra = sorted(set(model_inputs) - {"input_ids", "attention_mask"})
    if extra:
        return f"the prompts carry extra inputs ({', '.join(extra)}), e.g. images"
    base = _base_model(model)
    if "generate" in vars(model) or "generate" in vars(base) or type(base).generate is not _GENERATE:
        return f"{type(base).__name__} has its own generate (a model-specific or replaced generate is honoured)"
    if type(base) in _unsupported_models:
        return _unsupported_models[type(base)]
    generation_config = effective_generation_config(model, generation_config)
    options = {n for n, v in generation_config.to_dict().items() if n not in SUPPORTED_OPTIONS and not _neutral(n, v)}
    if options:
        return f"the generation config sets {', '.join(sorted(options))}"
    if generation_config.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={generation_config.cache_implementation!r}"
    if generation_config.use_cache is False:
        return "use_cache=False"
    if generation_config.max_new_tokens is None:
        return "max_new_tokens is not set"
    parameters = inspect.signature(base.forward).parameters
    missing = [name for name in ("attention_mask", "position_ids") if name not in parameters]
    if missing or not ("cache" in parameters or "past_key_values" in parameters):
        return f"{type(base).__name__}.forward does not take {', '.join(missing) or 'a KV cache'}"
    return None


def logits_processors(generation_config: GenerationConfig, attention_mask: torch.Tensor) -> LogitsProcessorList:
    """The processors `GenerationMixin._get_logits_processor` builds for the supported options, in its order:
    repetition penalty (left padding not penalised), then, when sampling, temperature, top-k, top-p, min-p."""
    processors = LogitsProcessorList()
    penalty = generation_config.repetition_penalty
    if penalty is not None and penalty != 1.0:
        padding_lengths = (attention_mask != 0).int().argmax(dim=1)
        processors.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=padding_lengths))
    if generation_config.do_sample:
        if generation_config.temperature is not None and generation_config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(generation_config.temperature))
        if generation_config.top_k is not None and generation_config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=generation_config.top_k, min_tokens_to_keep=1))
        if generation_config.top_p is not None and generation_config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=generation_config.top_p, min_tokens_to_keep=1))
        if generation_config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=generation_config.min_p, min_tokens_to_keep=1))
    return processors


@torch.no_grad()
def lean_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig | None = None,
    cache: Cache | None = None,
    cached_length: int = 0,
    return_logprobs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode `generation_config.max_new_tokens` tokens (fewer when every row has ended) after left-padded prompts.

    Returns what `model.generate(input_ids, attention_mask=..., generation_config=...)` returns: `(B, P + n)` prompt
    + new tokens, ended rows padded with the pad token. Check `unsupported_reason` first.

    Args:
        model: a decoder-only causal LM (or its PEFT wrapper), in eval mode.
        input_ids (`torch.LongTensor`): `(B, P)` left-padded prompts.
        attention_mask (`torch.LongTensor`): `(B, P)`, 0 on padding.
        generation_config (`GenerationConfig`, *optional*): decoding options (only `SUPPORTED_OPTIONS`), resolved as
            `generate` resolves them (`effective_generation_config`); the model's own when None.
        cache (`transformers.Cache`, *optional*): a KV cache holding the first `cached_length` prompt positions of
            every row (e.g. from `sharing.encode_prefix`); the prefill then runs the remaining prompt positions only.
        cached_length (`int`): how many prompt positions `cache` holds.
        return_logprobs (`bool`): also return `(B, n)` log-probs of the chosen tokens, `log_softmax(logits / T)`
            before the other processors (docs/decoding.md, "Log-probs of the sampled tokens"); 0 after a row ended.
    """
    generation_config = effective_generation_config(model, generation_config)
    batch, prompt_length = input_ids.shape
    new_tokens, do_sample = generation_config.max_new_tokens, generation_config.do_sample
    device, eos = input_ids.device, eos_ids(generation_config)
    pad_token_id = generation_config.pad_token_id if generation_config.pad_token_id is not None or not eos else eos[0]
    eos_tensor = torch.tensor(eos, device=device, dtype=torch.long) if eos else None
    processors = logits_processors(generation_config, attention_mask)

    # Preallocated: tokens and mask for prompt + every new token; each step reads a view.
    ids = torch.cat([input_ids, input_ids.new_empty(batch, new_tokens)], dim=1)
    mask = torch.cat([attention_mask, attention_mask.new_ones(batch, new_tokens)], dim=1)
    positions = generation_positions(attention_mask)
    next_position = positions[:, -1:] + 1  # (B, 1)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    cache_name = cache_kwarg(model)
    outputs, cache = _prefill(model, input_ids, attention_mask, positions, cache, cached_length)
    length = prompt_length
    temperature = (generation_config.temperature or 1.0) if do_sample else 1.0
    logprobs = torch.zeros(batch, new_tokens, dtype=torch.float32, device=device) if return_logprobs else None
    for step in range(new_tokens):
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        if return_logprobs:
            logprobs_step = torch.log_softmax(logits / temperature, dim=-1)  # before the processors modify logits
        scores = processors(ids[:, :length], logits)
        next_tokens = torch.multinomial(scores.softmax(-1), 1).squeeze(1) if do_sample else scores.argmax(-1)
        if eos_tensor is not None:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        ids[:, length] = next_tokens
        if return_logprobs:
            logprobs[:, step] = logprobs_step.gather(1, next_tokens[:, None]).squeeze(1) * unfinished
        length += 1
        if eos_tensor is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos_tensor)
        if step == new_tokens - 1 or (eos_tensor is not None and not bool(unfinished.any())):  # last step or all ended
            break
        outputs = model(
            input_ids=ids[:, length - 1 : length],
            attention_mask=mask[:, :length],
            position_ids=next_position,
            use_cache=True,
            **{cache_name: cache},
        )
        next_position = next_position + 1
    return (ids[:, :length], logprobs[:, : length - prompt_length]) if return_logprobs else ids[:, :length]


def _prefill(model, input_ids, attention_mask, positions, cache, cached_length):
    """The prompt's forward (after the `cached_length` positions `cache` holds), projecting its last position only:
    `(outputs, the KV cache)`; a model that returns no transformers `Cache` is remembered as unsupported."""
    parameters = inspect.signature(_base_model(model).forward).parameters
    outputs = model(
        input_ids=input_ids[:, cached_length:],
        attention_mask=attention_mask,
        position_ids=positions[:, cached_length:],
        use_cache=True,
        **({"logits_to_keep": 1} if "logits_to_keep" in parameters else {}),  # the prompt's other logits: unused
        **({cache_kwarg(model): cache} if cache is not None else {}),
    )
    cache = outputs.cache if getattr(outputs, "cache", None) is not None else outputs.past_key_values
    if not isinstance(cache, Cache):
        reason = f"{type(_base_model(model)).__name__} returns no transformers Cache from a forward with use_cache"
        _unsupported_models[type(_base_model(model))] = reason
        raise LeanDecodeUnsupported(reason)
    return outputs, cache


def generate_chunk(
    model, chunk: dict, generation_config: GenerationConfig, prefix_cache: Cache | None = None, return_logprobs=False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lean loop as a `generate_batched` engine: one padded chunk (`input_ids`, `attention_mask`), optionally on
    a `prefix_cache` of every prompt position but the last; prompt + new tokens, and with `return_logprobs` their
    log-probs (else None). Raises `LeanDecodeUnsupported` when the model turns out not to fit."""
    ids, mask = chunk["input_ids"], chunk["attention_mask"]
    cached = ids.size(1) - 1 if prefix_cache is not None else 0
    out = lean_generate(model, ids, mask, generation_config, prefix_cache, cached, return_logprobs)
    return out if return_logprobs else (out, None)
