"""The `model.generate` engine of `generate_batched`: one padded chunk, optionally on a shared-prefix KV cache; TRL
1.12's PPO `batch_generation` (`generate` with its scores), importable from `trl_unified.trainers.ppo`; and TRL's
GKD `generate_on_policy_outputs` (`generate_with_labels`: sequences with their mask and labels)."""

import torch
from torch import nn
from transformers import Cache, GenerationConfig

from .lean import effective_generation_config
from .options import eos_ids, with_pad_in_table
from .output import cut_after_eos
from .sharing import cache_kwarg


def generate_chunk(
    model, chunk: dict, generation_config: GenerationConfig, prefix_cache: Cache | None = None, return_logprobs=False
) -> tuple[torch.Tensor, None]:
    """Prompt + new tokens of one chunk as `model.generate` returns them, and None (no log-probs on this engine);
    with a `prefix_cache` of every prompt position but the last, `generate` prefills the last position only."""
    cache = {cache_kwarg(model): prefix_cache} if prefix_cache is not None else {}  # chunk: ids and mask only then
    return model.generate(**chunk, generation_config=generation_config, **cache), None


@torch.no_grad()
def batch_generation(
    model,
    queries: torch.Tensor,
    local_rollout_forward_batch_size: int,
    pad_token_id: int,
    generation_config: GenerationConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.12's PPO `batch_generation`, same signature and return: `model.generate` over `queries`,
    `local_rollout_forward_batch_size` rows at a time, with the scores.

    Args:
        model (`PreTrainedModel`): a causal LM (the policy: TRL's `trainer.model.policy`).
        queries (`torch.LongTensor`): `(B, P)` prompts left-padded with `pad_token_id` (which marks the padding).
        local_rollout_forward_batch_size (`int`): rows per `generate` call.
        pad_token_id (`int`): the tokenizer's pad token; it may lie beyond the embedding table (TRL's PPO recipe adds
            `[PAD]` without resizing): padding reaches the model as 0, as in TRL.
        generation_config (`GenerationConfig`): what to decode; a pad id beyond the table is fed back as 0 after a
            row's EOS and written out as the config's pad id again.

    Returns:
        `(query_responses, logitss)`: `(B, P + C)` the queries followed by their new tokens, chunks right-padded with
        `pad_token_id` to the longest; `(B, C, V)` the processed logits (`generate`'s scores) of each new token,
        0-padded.
    """
    config = with_pad_in_table(model, generation_config)
    refill_after = eos_ids(effective_generation_config(model, config)) if config is not generation_config else []
    query_responses, logitss = [], []
    for start in range(0, queries.size(0), local_rollout_forward_batch_size):
        query = queries[start : start + local_rollout_forward_batch_size]
        attention_mask = query != pad_token_id
        output = model.generate(
            input_ids=query.masked_fill(~attention_mask, 0),  # TRL's fill: the mask hides these positions
            attention_mask=attention_mask,
            generation_config=config,
            return_dict_in_generate=True,
            output_scores=True,
        )
        responses = output.sequences[:, query.size(1) :]
        if refill_after:  # the fill written after EOS back to the config's pad id
            responses = cut_after_eos(responses, refill_after, generation_config.pad_token_id)[0]
        query_responses.append(torch.cat((query, responses), dim=1))
        logitss.append(torch.stack(output.scores, 1))
    width = max(r.size(1) for r in query_responses)
    steps = max(s.size(1) for s in logitss)
    query_responses = [nn.functional.pad(r, (0, width - r.size(1)), value=pad_token_id) for r in query_responses]
    logitss = [nn.functional.pad(s, (0, 0, 0, steps - s.size(1)), value=0.0) for s in logitss]
    return torch.cat(query_responses), torch.cat(logitss)


def generate_with_labels(model, inputs: dict, generation_config: GenerationConfig):
    """TRL's GKD `generate_on_policy_outputs`: `model.generate` from `inputs["prompts"]` (and its
    `prompt_attention_mask`), returning `(input_ids, attention_mask, labels)` with the completion kept up to and
    including its first stop token (any of `eos_token_id`; all of it when there is none) and labels -100 on the
    prompt and after the stop."""
    prompts, prompt_mask = inputs["prompts"], inputs["prompt_attention_mask"]
    sequences = model.generate(
        input_ids=prompts,
        attention_mask=prompt_mask,
        generation_config=generation_config,
        return_dict_in_generate=True,
    ).sequences
    completion = sequences[:, prompts.size(1) :]
    stops = eos_ids(generation_config)
    completion_mask = cut_after_eos(completion, stops, 0)[1] if stops else torch.ones_like(completion)
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)
    labels = sequences.masked_fill(attention_mask == 0, -100)
    labels[:, : prompts.size(1)] = -100
    return sequences, attention_mask, labels
