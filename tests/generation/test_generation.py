import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

from trl_unified import generate_batched
from trl_unified.generation import cut_after_eos


PROMPTS = ["a b", "c", "d e f g h i j", "k l m", "n o p q", "hello world"]


def greedy(tokenizer, max_new_tokens=8):
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_generate_batched_matches_per_prompt(qwen2_model, tokenizer, batch_size):
    config = greedy(tokenizer)
    out = generate_batched(qwen2_model, tokenizer, PROMPTS, config, batch_size=batch_size)
    singles = [generate_batched(qwen2_model, tokenizer, [p], config) for p in PROMPTS]
    assert out.texts == [s.texts[0] for s in singles]
    assert out.completion_ids_list == [s.completion_ids_list[0] for s in singles]
    # Masks: one row per prompt; the prompt mask counts each prompt's own tokens.
    assert out.completion_ids.shape[0] == len(PROMPTS)
    assert out.prompt_mask.sum(1).tolist() == [len(tokenizer(p)["input_ids"]) for p in PROMPTS]


def test_generate_batched_conversational_and_token_ids(qwen2_model, tokenizer):
    config = greedy(tokenizer)
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    conv = generate_batched(qwen2_model, tokenizer, messages, config, batch_size=2)
    ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for m in messages
    ]
    by_ids = generate_batched(qwen2_model, tokenizer, ids, config, batch_size=3)
    assert conv.completion_ids_list == by_ids.completion_ids_list


def test_strip_prompt_false_returns_prompt_and_completion(qwen2_model, tokenizer):
    config = greedy(tokenizer)
    stripped = generate_batched(qwen2_model, tokenizer, PROMPTS[:2], config)
    full = generate_batched(qwen2_model, tokenizer, PROMPTS[:2], config, strip_prompt=False)
    for prompt, s, f in zip(PROMPTS[:2], stripped.texts, full.texts):
        assert f.startswith(prompt)
        assert f == (prompt + " " + s if s else prompt)


def test_cut_after_eos_keeps_first_eos_and_masks_the_rest():
    eos, pad = 9, 0
    ids = torch.tensor([[5, 9, 6, 9], [5, 6, 7, 8], [9, 1, 2, 3]])
    cut, mask, truncated = cut_after_eos(ids, [eos], pad)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert cut.tolist() == [[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_generate_batched_cuts_at_eos_in_real_generation(qwen2_model, tokenizer, monkeypatch):
    eos = tokenizer.eos_token_id
    tail = torch.tensor([[11, eos, 12, 13], [14, 15, 16, 17]])  # row 0 ends early, row 1 is truncated

    def fake_generate(input_ids, attention_mask, generation_config=None, **kwargs):
        return torch.cat([input_ids, tail[: input_ids.size(0)]], dim=1)

    monkeypatch.setattr(qwen2_model, "generate", fake_generate)
    out = generate_batched(qwen2_model, tokenizer, ["a", "b c"], greedy(tokenizer))  # a replaced generate is honoured
    assert out.completion_ids_list == [[11, eos], [14, 15, 16, 17]]
    assert out.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.is_truncated.tolist() == [False, True]
    assert out.texts[0] == tokenizer.decode([11])


@pytest.mark.parametrize("lean_decoding", [True, False])
def test_generate_batched_restores_mode_and_checkpointing(qwen2_model, tokenizer, lean_decoding):
    qwen2_model.gradient_checkpointing_enable()
    qwen2_model.train()
    seen = set()

    def spy(module, args):  # every forward of the decoding, lean loop or generate
        seen.add(
            (
                module.training,
                any(m.gradient_checkpointing for m in module.modules() if hasattr(m, "gradient_checkpointing")),
            )
        )

    hook = qwen2_model.register_forward_pre_hook(spy)
    generate_batched(qwen2_model, tokenizer, PROMPTS[:2], greedy(tokenizer), lean_decoding=lean_decoding)
    hook.remove()
    assert seen == {(False, False)}
    assert qwen2_model.training and qwen2_model.is_activation_checkpointing


def test_generate_batched_peft_model(qwen2_model, tokenizer):
    from peft import LoraConfig, get_peft_model

    config = greedy(tokenizer)
    base_texts = generate_batched(qwen2_model, tokenizer, PROMPTS, config, batch_size=4).texts
    peft_model = get_peft_model(qwen2_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    out = generate_batched(peft_model, tokenizer, PROMPTS, config, batch_size=4)
    assert out.texts == base_texts  # a fresh LoRA adapter (B = 0) does not change the function
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0)
    trained = generate_batched(peft_model, tokenizer, PROMPTS, config, batch_size=4)
    assert trained.texts == [generate_batched(peft_model, tokenizer, [p], config).texts[0] for p in PROMPTS]


def test_generate_batched_encoder_decoder(t5_path):
    model = AutoModelForSeq2SeqLM.from_pretrained(t5_path)
    tokenizer = AutoTokenizer.from_pretrained(t5_path)
    config = greedy(tokenizer, 6)
    out = generate_batched(model, tokenizer, PROMPTS, config, batch_size=4)
    singles = [generate_batched(model, tokenizer, [p], config).completion_ids_list[0] for p in PROMPTS]
    assert out.completion_ids_list == singles
    assert all(0 < len(ids) <= 6 for ids in singles)


def test_generate_batched_with_no_prompts_returns_empty(qwen2_model, tokenizer):
    out = generate_batched(qwen2_model, tokenizer, [], greedy(tokenizer))
    assert out.texts == [] and out.completion_ids.shape[0] == 0 and out.completion_ids_list == []


def test_generation_options_equal_the_keywords(qwen2_model, tokenizer):
    from trl_unified.generation import GenerationOptions

    config = greedy(tokenizer)
    by_keywords = generate_batched(qwen2_model, tokenizer, PROMPTS, config, batch_size=2, strip_prompt=False)
    options = GenerationOptions(batch_size=2, strip_prompt=False)
    by_options = generate_batched(qwen2_model, tokenizer, PROMPTS, config, options=options)
    assert by_options.texts == by_keywords.texts
    assert by_options.completion_ids_list == by_keywords.completion_ids_list
    with pytest.raises(TypeError, match="batch_size"):
        generate_batched(qwen2_model, tokenizer, PROMPTS, config, batch_size=2, options=options)
