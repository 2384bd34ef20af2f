"""The continuous-batching engine of `generate_batched`: transformers' `generate_batch` (paged attention)."""

from typing import Any

import torch
from transformers import GenerationConfig

from .options import GenerationOptions


def generate_with_continuous_batching(
    model, encoded: list[dict[str, Any]], generation_config: GenerationConfig | None, options: GenerationOptions
) -> list[torch.Tensor]:
    """The new tokens of every encoded prompt, in order, from one `model.generate_batch` call with
    `options.continuous_batching` (`batch_size` does not apply). Text-only decoder models: raises otherwise."""
    if options.has_visual_inputs or getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            "continuous batching (use_transformers_continuous_batching) supports text-only decoder models; "
            "turn it off for vision-language or encoder-decoder models."
        )
    outputs = model.generate_batch(
        [list(e["input_ids"]) for e in encoded],
        generation_config=generation_config,
        continuous_batching_config=options.continuous_batching,
        progress_bar=False,
    )
    if len(outputs) != len(encoded):
        raise RuntimeError(f"Continuous batching returned {len(outputs)} of {len(encoded)} completions.")
    return [torch.tensor(o.generated_tokens, dtype=torch.long) for o in outputs.values()]
