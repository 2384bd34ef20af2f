"""Batched generation: `generate_batched` over one engine per module (`model.generate`, the lean decode loop with
prepacked weights, continuous batching), with prompt encoding and the shared-prefix decisions in one place each."""

from .batched import generate_batched
from .options import GenerationOptions, build_generation_config, get_eos_token_ids
from .output import GenerationOutput, cut_after_eos
from .prompts import max_positions, normalize_prompts, prompt_lengths
from .sharing import encode_prefix, group_prompts
from .unwrap import unwrap_for_generation


__all__ = [
    "GenerationOptions",
    "GenerationOutput",
    "build_generation_config",
    "cut_after_eos",
    "encode_prefix",
    "generate_batched",
    "get_eos_token_ids",
    "group_prompts",
    "max_positions",
    "normalize_prompts",
    "prompt_lengths",
    "unwrap_for_generation",
]
