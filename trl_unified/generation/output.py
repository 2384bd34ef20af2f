"""`GenerationOutput`, what `generate_batched` returns, and how it is built from the prompts and their completions."""

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data.datasets import pad
from ..models.loading import get_tokenizer
from .options import GenerationOptions
from .prompts import is_sequence_aligned, padding_token_id


def sampled_token_mask(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None) -> torch.Tensor:
    """`(N, C)`: 1 on the completion tokens the model sampled: `completion_mask`, times the `tool_mask` of a
    multi-turn completion (0 on tool-result tokens). What every loss, KL and entropy of a rollout is taken over."""
    return completion_mask if tool_mask is None else completion_mask * tool_mask


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
        visual_inputs (`list[dict]`, *optional*): per row, the processor's image and video tensors (e.g.
            `pixel_values`, `image_grid_thw`, `pixel_values_videos`) for a later forward pass over prompt +
            completion; None without images or videos (`image_inputs` is its deprecated name).
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
    visual_inputs: list[dict[str, torch.Tensor]] | None = None
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
        return sampled_token_mask(self.completion_mask, self.tool_mask)

    @property
    def image_inputs(self) -> list[dict[str, torch.Tensor]] | None:
        """Deprecated name of `visual_inputs` (it also carries video tensors); removed in trl_unified 0.3."""
        warnings.warn("GenerationOutput.image_inputs is deprecated: use visual_inputs.", DeprecationWarning, 2)
        return self.visual_inputs

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
        pad_token_id = padding_token_id(tokenizer)
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]
        completions = [torch.tensor(ids, dtype=torch.long) for ids in completion_ids]
        ends = {*eos_token_ids, pad_token_id}
        if tool_mask is not None:
            tool_mask = pad([torch.tensor(m, dtype=torch.long) for m in tool_mask], 1, "right").to(device)
        return cls(
            prompt_ids=pad(prompts, pad_token_id, "left", pad_to_multiple_of).to(device),
            prompt_mask=pad([torch.ones_like(t) for t in prompts], 0, "left", pad_to_multiple_of).to(device),
            completion_ids=pad(completions, pad_token_id, "right").to(device),
            completion_mask=pad([torch.ones_like(t) for t in completions], 0, "right").to(device),
            texts=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            is_truncated=torch.tensor([bool(ids) and ids[-1] not in ends for ids in completion_ids], device=device),
            tool_mask=tool_mask,
        )


def cut_after_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int], pad_token_id: int):
    """Mask (and pad) every token after the first EOS of each row; the EOS itself is kept.

    Returns `(completion_ids, completion_mask, is_truncated)`; shapes `(N, C)`, `(N, C)`, `(N,)`.
    """
    stops = torch.tensor(list(eos_token_ids), dtype=completion_ids.dtype, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, stops)
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.size(1))  # (N,)
    mask = (torch.arange(completion_ids.size(1), device=completion_ids.device) <= first_eos[:, None]).long()  # (N, C)
    return completion_ids.masked_fill(mask == 0, pad_token_id), mask, ~has_eos


def build_output(
    encoded: list[dict[str, Any]],
    completions: list[torch.Tensor],
    logprobs: list[torch.Tensor | None],
    tokenizer,
    eos_token_ids: Sequence[int],
    options: GenerationOptions,
    is_encoder_decoder: bool,
    device,
) -> GenerationOutput:
    """The output for the encoded prompts and their new tokens: completions cut after their first EOS, all-padding
    columns dropped; `logprobs` (None rows where `model.generate` decoded) kept where every row has them."""
    if not encoded:  # nothing to generate here (e.g. this process's share of a small eval set)
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        return GenerationOutput(
            prompt_ids=empty,
            prompt_mask=empty,
            completion_ids=empty,
            completion_mask=empty,
            texts=[],
            is_truncated=torch.zeros(0, dtype=torch.bool, device=device),
        )
    pad_token_id, multiple = padding_token_id(tokenizer), options.pad_to_multiple_of
    prompt_tensors = [torch.as_tensor(e["input_ids"]).view(-1) for e in encoded]
    prompt_ids = pad(prompt_tensors, pad_token_id, "left", multiple).to(device)
    prompt_mask = pad([torch.ones_like(t) for t in prompt_tensors], 0, "left", multiple).to(device)
    completion_ids = pad(completions, pad_token_id, "right").to(device)
    completion_ids, completion_mask, is_truncated = cut_after_eos(completion_ids, eos_token_ids, pad_token_id)
    width = int(completion_mask.sum(1).max()) if len(completions) else 0  # drop columns that are padding everywhere
    completion_ids, completion_mask = completion_ids[:, :width], completion_mask[:, :width]
    kept = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask, strict=True)]
    if not (options.strip_prompt or is_encoder_decoder):
        kept = [p.tolist() + c for p, c in zip(prompt_tensors, kept)]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    out = GenerationOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        texts=texts,
        is_truncated=is_truncated,
        prompt_token_inputs={},
    )
    if options.return_logprobs and logprobs and all(row is not None for row in logprobs):
        out.logprobs = pad(logprobs, 0.0, "right").to(device)[:, :width] * completion_mask
    for key, value in encoded[0].items():  # per-token processor outputs (e.g. mm_token_type_ids): padded like the ids
        if key not in ("input_ids", "attention_mask") and is_sequence_aligned(value, encoded[0]["input_ids"]):
            out.prompt_token_inputs[key] = pad([e[key].view(-1) for e in encoded], 0, "left", multiple).to(device)
    if options.has_visual_inputs:  # each row's other tensors (pixel_values, ...); ids and mask are (1, L): aligned
        out.visual_inputs = [
            {k: v for k, v in e.items() if isinstance(v, torch.Tensor) and not is_sequence_aligned(v, e["input_ids"])}
            for e in encoded
        ]
    return out
