"""The `model.generate` engine of `generate_batched`: one padded chunk, optionally on a shared-prefix KV cache."""

import torch
from transformers import Cache, GenerationConfig

from .sharing import cache_kwarg


def generate_chunk(
    model, chunk: dict, generation_config: GenerationConfig, prefix_cache: Cache | None = None, return_logprobs=False
) -> tuple[torch.Tensor, None]:
    """Prompt + new tokens of one chunk (model inputs from `prompts.collate_chunk`) as `model.generate` returns them,
    and None: no log-probs on this engine (`return_logprobs` is accepted for the common engine signature).

    With a `prefix_cache` of every prompt position but the last (`sharing.generation_prefix_cache`), `generate`
    prefills the last position only.
    """
    if prefix_cache is not None:
        sequences = model.generate(
            input_ids=chunk["input_ids"],
            attention_mask=chunk["attention_mask"],
            generation_config=generation_config,
            **{cache_kwarg(model): prefix_cache},
        )
    else:
        sequences = model.generate(**chunk, generation_config=generation_config)
    return sequences, None
