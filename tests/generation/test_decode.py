"""The lean decode loop (generation/lean.py) returns model.generate's tokens; prepacked weights
(generation/packed_weights.py) keep the logits to float32 rounding and are put away after generation."""

import logging

import pytest
import torch
from transformers import GenerationConfig

from trl_unified import generate_batched
from trl_unified.generation import fallbacks, lean
from trl_unified.generation.packed_weights import _unavailable_reason, packed_linear_weights
from trl_unified.testing import build_causal_lm


PROMPTS = ["a b", "c", "d e f g h i j", "k l m", "n o p q", "hello world", "a b", "a b"]

# Every supported option, alone and combined; do_sample=False with sampling fields set checks they are ignored.
OPTIONS = {
    "greedy": dict(do_sample=False),
    "greedy_repetition_penalty": dict(do_sample=False, repetition_penalty=1.5),
    "sample": dict(do_sample=True),
    "temperature": dict(do_sample=True, temperature=0.6),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.7),
    "min_p": dict(do_sample=True, min_p=0.2),
    "all": dict(do_sample=True, temperature=1.3, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    "sampling_fields_greedy": dict(do_sample=False, temperature=0.5, top_k=3, top_p=0.5),
}


def config(tokenizer, eos, **options) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, disable_compile=True, **options
    )


def common_eos(model, tokenizer, ids, mask, options) -> list[int]:
    """Three tokens the model often produces with these options, as EOS: rows then end at different steps."""
    torch.manual_seed(3)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(tokenizer, None, **options))
    counts = torch.bincount(out[:, ids.size(1) :].flatten(), minlength=len(tokenizer))
    return counts.topk(3).indices.tolist()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tokenizer):
    return build_causal_lm(tokenizer, request.param).eval()


def batch(tokenizer):
    encoded = tokenizer(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    return encoded["input_ids"], encoded["attention_mask"]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_lean_generate_returns_generates_tokens(model, tokenizer, option):
    ids, mask = batch(tokenizer)
    eos = common_eos(model, tokenizer, ids, mask, OPTIONS[option])
    for eos_ids in (eos, None):  # rows ending at different steps; no EOS (every row runs to the limit)
        generation_config = config(tokenizer, eos_ids, **OPTIONS[option])
        assert lean.unsupported_reason(model, generation_config, {"input_ids": ids, "attention_mask": mask}) is None
        for seed in range(2):
            torch.manual_seed(seed)
            expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)
            after_generate = torch.rand(3)
            torch.manual_seed(seed)
            got = lean.lean_generate(model, ids, mask, generation_config)
            assert torch.equal(got, expected), (option, eos_ids, seed)
            # the random state afterwards is the same too: the next sample of training equals TRL's
            assert torch.equal(torch.rand(3), after_generate)
        if eos_ids is not None:
            ended = torch.isin(got[:, ids.size(1) :], torch.tensor(eos)).any(1)
            assert ended.any(), "the test needs rows that end early"


def test_generate_batched_lean_equals_generate(model, tokenizer):
    """Through generate_batched: chunks, shared prefixes (repeated prompts) and eos lists, lean on vs off."""
    generation_config = config(tokenizer, [tokenizer.eos_token_id], do_sample=True, top_k=10, temperature=0.9)
    for shared_prefix in (False, True):
        for batch_size in (3, 8):
            outputs = []
            for lean_decoding in (True, False):
                torch.manual_seed(0)
                outputs.append(
                    generate_batched(
                        model,
                        tokenizer,
                        PROMPTS,
                        generation_config,
                        batch_size=batch_size,
                        shared_prefix=shared_prefix,
                        lean_decoding=lean_decoding,
                    )
                )
            assert outputs[0].completion_ids_list == outputs[1].completion_ids_list
            assert outputs[0].texts == outputs[1].texts
            assert torch.equal(outputs[0].is_truncated, outputs[1].is_truncated)


@pytest.mark.parametrize(
    "options, reason",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
        (dict(cache_implementation="static"), "cache_implementation"),
    ],
)
def test_unsupported_options_fall_back_to_generate(qwen2_model, tokenizer, caplog, monkeypatch, options, reason):
    generation_config = config(tokenizer, [tokenizer.eos_token_id], do_sample=False, **options)
    found = lean.unsupported_reason(qwen2_model, generation_config, {"input_ids": None, "attention_mask": None})
    assert found is not None and reason in found
    if "output_scores" in options:
        return  # generate_batched does not return scores; the reason above is what matters
    monkeypatch.setattr(fallbacks, "_reported", set())  # each reason is logged once per process
    with caplog.at_level(logging.INFO, logger="trl_unified.generation.lean"):
        fallen_back = generate_batched(qwen2_model, tokenizer, PROMPTS[:4], generation_config)
    assert any(reason in r.message and "model.generate" in r.message for r in caplog.records)
    plain = generate_batched(qwen2_model, tokenizer, PROMPTS[:4], generation_config, lean_decoding=False)
    assert fallen_back.completion_ids_list == plain.completion_ids_list


def test_extra_inputs_and_encoder_decoder_are_unsupported(qwen2_model, t5_path, tokenizer):
    from transformers import AutoModelForSeq2SeqLM

    generation_config = config(tokenizer, None, do_sample=False)
    reason = lean.unsupported_reason(qwen2_model, generation_config, {"input_ids": 0, "pixel_values": 0})
    assert "pixel_values" in reason
    t5 = AutoModelForSeq2SeqLM.from_pretrained(t5_path)
    assert "encoder-decoder" in lean.unsupported_reason(t5, generation_config, {"input_ids": 0})


@pytest.mark.skipif(_unavailable_reason() is not None, reason="this PyTorch build cannot pack linear weights")
def test_packed_weights_match_linear_and_are_put_away(tokenizer):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=64).eval()
    ids = torch.randint(5, len(tokenizer), (4, 7))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linear_weights(model, rows=4):
            assert all("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
            packed = model(input_ids=ids).logits
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in model.modules())  # the class forward again
    # With grad enabled (never the case in generation) the layer keeps F.linear, so a backward still works.
    with packed_linear_weights(model, rows=4):
        model(input_ids=ids).logits.sum().backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.skipif(_unavailable_reason() is not None, reason="this PyTorch build cannot pack linear weights")
def test_packed_generation_gives_generates_tokens(tokenizer):
    """generate_batched (lean loop + packed weights) against plain model.generate, greedy and seeded sampling."""
    model = build_causal_lm(tokenizer, "llama", hidden_size=64).eval()
    for options in (dict(do_sample=False), dict(do_sample=True, top_p=0.9)):
        generation_config = config(tokenizer, [tokenizer.eos_token_id], **options)
        torch.manual_seed(0)
        fast = generate_batched(model, tokenizer, PROMPTS, generation_config)
        torch.manual_seed(0)
        plain = generate_batched(model, tokenizer, PROMPTS, generation_config, lean_decoding=False)
        assert fast.completion_ids_list == plain.completion_ids_list


def test_packing_probe_leaves_the_random_state_alone(tokenizer):
    """The once-per-process check that packing works must not draw from the global generator (sampling would
    then differ from generate's)."""
    from trl_unified.generation import packed_weights

    packed_weights._status.clear()
    model = build_causal_lm(tokenizer, "qwen2")
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with packed_linear_weights(model, rows=2):
        pass
    assert torch.equal(torch.rand(3), expected)


def test_a_patched_generate_is_honoured(qwen2_model, tokenizer, monkeypatch):
    """`GenerationMixin.generate` patched (as TRL's tests mock it): generate decodes, not the lean loop."""
    from transformers import GenerationMixin

    def scripted(self, input_ids, **kwargs):
        return torch.cat([input_ids, torch.full((input_ids.size(0), 2), 7)], dim=1)

    monkeypatch.setattr(GenerationMixin, "generate", scripted)
    generation_config = config(tokenizer, None, do_sample=False)
    assert "own generate" in lean.unsupported_reason(qwen2_model, generation_config, {"input_ids": 0})
    assert generate_batched(qwen2_model, tokenizer, PROMPTS[:2], generation_config).completion_ids_list == [[7, 7]] * 2
