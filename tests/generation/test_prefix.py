"""Shared-prefix encoding (`generation/sharing.py`) against the plain path: same log-probs, same gradients, same greedy
generations, with left padding, repeated and distinct prompts in one batch."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import GenerationConfig

from trl_unified import compute_token_logprobs, generate_batched
from trl_unified.generation.sharing import group_prompts, unsupported_reason
from trl_unified.testing import build_causal_lm
from trl_unified.trainers.dpo import LOSS_TYPES as DPO_LOSS_TYPES


def test_group_prompts_by_ids_and_padding():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [5, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = group_prompts(ids, mask)
    torch.testing.assert_close(ids[first][inverse], ids)
    assert inverse.tolist()[0] == inverse.tolist()[2] and inverse.tolist()[1] == inverse.tolist()[4]
    assert len(first) == 3 and sorted(first.tolist()) == [0, 1, 3]  # the first row of each distinct prompt
    assert group_prompts(ids[:2], mask[:2]) is None  # all distinct: nothing to share
    assert group_prompts(ids[:, :1], mask[:, :1]) is None  # one-token prompts: nothing before the last token


def _batch(tokenizer, group_size=3):
    """4 groups of G rows: prompts of different lengths (left padding), one prompt twice as two groups."""
    prompts = ["a b c d e", "f g", "a b c d e", "h i j"]
    rows = [p for p in prompts for _ in range(group_size)]
    enc = tokenizer(rows, padding=True, padding_side="left", return_tensors="pt")
    torch.manual_seed(0)
    completion = torch.randint(5, len(tokenizer), (len(rows), 6))
    completion_mask = torch.ones_like(completion)
    completion_mask[::4, 3:] = 0  # some completions end early
    ids = torch.cat([enc["input_ids"], completion], 1)
    mask = torch.cat([enc["attention_mask"], completion_mask], 1)
    return ids, mask, completion.size(1)


@pytest.mark.parametrize(
    "arch, group_size, peft", [("llama", 3, False), ("qwen2", 3, False), ("qwen2", 2, False), ("llama", 8, False),
                               ("qwen2", 8, True)],
)  # fmt: skip
def test_shared_prefix_logprobs_and_gradients_equal_the_plain_forward(arch, group_size, peft, tokenizer):
    model = build_causal_lm(tokenizer, arch)
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ids, mask, k = _batch(tokenizer, group_size)
    results = {}
    for share in (False, True):
        model.zero_grad()
        out = compute_token_logprobs(model, ids, mask, k, compute_entropy=True, shared_prefix=share)
        ((out.logps * mask[:, -k:]).sum() * 0.1).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = (out.logps.detach(), out.entropy, grads)
    plain, shared = results[False], results[True]
    valid = mask[:, -k:].bool()
    torch.testing.assert_close(shared[0][valid], plain[0][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[1][valid], plain[1][valid], rtol=1e-5, atol=1e-5)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert shared[2].keys() == plain[2].keys() and len(plain[2]) == len(trainable)
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prefix_in_chunks_equals_plain(tokenizer):
    model = build_causal_lm(tokenizer, "llama")
    ids, mask, k = _batch(tokenizer)
    with torch.no_grad():
        plain = compute_token_logprobs(model, ids, mask, k, batch_size=5).logps
        shared = compute_token_logprobs(model, ids, mask, k, batch_size=5, shared_prefix=True).logps
    valid = mask[:, -k:].bool()
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_shared_prefix_generation_equals_plain_greedy(tokenizer, batch_size):
    model = build_causal_lm(tokenizer, "qwen2")
    prompts = [p for p in ["a b c d e", "f g", "h i j", "f g"] for _ in range(3)]
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    plain = generate_batched(model, tokenizer, prompts, config, batch_size=batch_size)
    shared = generate_batched(model, tokenizer, prompts, config, batch_size=batch_size, shared_prefix=True)
    assert shared.texts == plain.texts
    torch.testing.assert_close(shared.completion_ids, plain.completion_ids)


def test_sampled_generation_with_shared_prefix_draws_the_plain_samples(tokenizer):
    """Same seed, same samples: the decode steps draw from the same RNG stream over the same rows."""
    model = build_causal_lm(tokenizer, "qwen2")
    prompts = [p for p in ["a b c d e", "f g", "h i j"] for _ in range(8)]
    config = GenerationConfig(max_new_tokens=10, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    for seed in range(3):
        torch.manual_seed(seed)
        plain = generate_batched(model, tokenizer, prompts, config).texts
        torch.manual_seed(seed)
        shared = generate_batched(model, tokenizer, prompts, config, shared_prefix=True).texts
        assert shared == plain
        assert len(set(shared[:8])) > 1  # each row samples its own continuation from the shared cache


def test_unsupported_models_and_inputs_are_named(tokenizer):
    from trl_unified.testing import build_encoder_decoder

    assert unsupported_reason(build_causal_lm(tokenizer, "llama")) is None
    assert "encoder-decoder" in unsupported_reason(build_encoder_decoder(tokenizer))
    assert "pixel_values" in unsupported_reason(build_causal_lm(tokenizer, "llama"), {"pixel_values": 1})
    model = build_causal_lm(tokenizer, "llama")
    model.gradient_checkpointing_enable()
    assert "gradient checkpointing" in unsupported_reason(model)
    with torch.no_grad():
        assert unsupported_reason(model) is None  # no grad: checkpointing keeps the cache


def test_sharing_decisions_name_their_reason_and_report_it_once(tokenizer, caplog, monkeypatch):
    import logging

    from trl_unified.generation import fallbacks
    from trl_unified.generation.sharing import expands_rows, may_share_prefix, sharing_obstacle

    model = build_causal_lm(tokenizer, "llama")
    assert not expands_rows(GenerationConfig()) and not expands_rows(None)
    assert expands_rows(GenerationConfig(num_beams=2)) and expands_rows(
        GenerationConfig(do_sample=True, num_return_sequences=2)
    )
    assert sharing_obstacle(model) is None
    assert "MoE" in sharing_obstacle(model, router_logits=True)
    assert "beam search" in sharing_obstacle(model, generation_config=GenerationConfig(num_beams=2))
    assert "continuous batching" in sharing_obstacle(model, continuous_batching=True)
    monkeypatch.setattr(fallbacks, "_reported", set())
    with caplog.at_level(logging.INFO, logger="trl_unified.generation.sharing"):
        assert may_share_prefix("generation", model)
        for _ in range(2):
            assert not may_share_prefix("generation", model, obstacle="a test says so")
    lines = [r.message for r in caplog.records]
    assert lines == ["shared_prefix: the generation runs without prompt sharing because a test says so."]


# ------------------------------------------------------------------ in the online trainers
def _train(path, tmp_path, trainer_class, config_class, peft=False, **config):
    from tests.helpers import prompt_dataset, varied_reward

    # SGD: the parameters after 2 steps then differ by the gradients' rounding only. Adam divides each gradient by its
    # own magnitude, so an element whose gradient is ~0 moves by ±lr on rounding noise alone (seen: 3e-5 apart on an
    # AVX-512-BF16 CPU), which would make this comparison CPU-dependent.
    defaults = dict(gradient_checkpointing=False, max_steps=2, per_device_train_batch_size=8, num_generations=4)
    args = config_class(
        output_dir=str(tmp_path / str(config.get("shared_prefix"))),
        max_completion_length=6,
        learning_rate=1e-2,
        optim="sgd",
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        **{**defaults, **config},
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None
    trainer = trainer_class(path, varied_reward, args=args, train_dataset=prompt_dataset(), peft_config=peft_config)
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "name, config",
    [
        ("RLOO", {"beta": 0.1}),
        ("GRPO", {"beta": 0.1}),
        ("GRPO", {"num_iterations": 2}),
        ("RLOO", {"beta": 0.1, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}),
        ("GRPO", {"beta": 0.1, "peft": True}),
        ("GRPO", {"num_generations": 8, "per_device_train_batch_size": 16}),
    ],
)
def test_trainers_share_prompts_by_default_with_the_plain_numbers(name, config, llama_path, tmp_path, monkeypatch):
    import trl_unified
    import trl_unified.core.logprobs as logprobs
    import trl_unified.generation.sharing as sharing

    calls = []
    for module in (sharing, logprobs):  # generation's prefix cache, the log-prob forwards
        original = module.encode_prefix
        monkeypatch.setattr(module, "encode_prefix", lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k))
    trainer_class, config_class = getattr(trl_unified, f"{name}Trainer"), getattr(trl_unified, f"{name}Config")
    # generation, the reference / old-log-prob forwards and the policy forward with grad run on shared prompts
    shared = _train(llama_path, tmp_path, trainer_class, config_class, shared_prefix="auto", **config)
    assert len(calls) >= 4, calls  # 2 steps x (generation + policy), + reference / old forwards
    count = len(calls)
    plain = _train(
        llama_path, tmp_path, trainer_class, config_class, shared_prefix=False, padding_free=False, **config
    )
    assert len(calls) == count  # off means off
    for key in ("loss", "kl", "entropy", "reward") if config.get("beta") else ("loss", "entropy", "reward"):
        ours = [log[key] for log in shared.state.log_history if key in log]
        ref = [log[key] for log in plain.state.log_history if key in log]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=key)
    for (n, p), q in zip(shared.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


def test_fallbacks_are_logged_and_forced_sharing_is_checked(llama_path, tmp_path, caplog, monkeypatch):
    import logging

    from trl_unified import GRPOConfig, GRPOTrainer
    from trl_unified.generation import fallbacks

    monkeypatch.setattr(fallbacks, "_reported", set())  # each reason is logged once per process

    with caplog.at_level(logging.INFO, logger="trl_unified.generation.sharing"):
        _train(llama_path, tmp_path, GRPOTrainer, GRPOConfig, gradient_checkpointing=True, max_steps=1)
    assert "log-prob forward runs without prompt sharing because gradient checkpointing" in caplog.text
    with pytest.raises(ValueError, match="shared_prefix=True, but gradient checkpointing"):
        _train(llama_path, tmp_path, GRPOTrainer, GRPOConfig, gradient_checkpointing=True, shared_prefix=True)
    with pytest.raises(ValueError, match=r"shared_prefix='maybe' must be None \(auto\), True or False"):
        GRPOConfig(output_dir=str(tmp_path), shared_prefix="maybe", bf16=False)


def preference_rows(n=8, paired=True):
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    prompts = [" ".join(words[(i * 3 + j) % 26] for j in range(3 + i % 4)) for i in range(n)]
    chosen = [" " + " ".join(words[(i * 5 + 2 * j) % 26] for j in range(2 + i % 3)) for i in range(n)]
    rejected = [" " + " ".join(words[(i * 7 + j) % 26] for j in range(1 + (i + 1) % 4)) for i in range(n)]
    if paired:
        return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    completions = [c if i % 3 else r for i, (c, r) in enumerate(zip(chosen, rejected))]
    return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": [bool(i % 3) for i in range(n)]})


def _train_preference(path, tmp_path, name, peft=False, **config):
    import trl_unified

    args = getattr(trl_unified, f"{name}Config")(
        output_dir=str(tmp_path / f"{name}-{config.get('shared_prefix')}"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        optim="sgd",  # see _train: parameter comparisons stay CPU-independent
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        **config,
    )
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None
    trainer = getattr(trl_unified, f"{name}Trainer")(
        path, args=args, train_dataset=preference_rows(paired=name == "DPO"), peft_config=peft_config
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "name, config",
    [
        ("DPO", {}),
        ("DPO", {"loss_type": ["sigmoid", "sft"], "ld_alpha": 0.5, "use_weighting": True}),
        ("DPO", {"loss_type": list(DPO_LOSS_TYPES), "label_smoothing": 1e-3}),  # every loss type, summed
        ("DPO", {"model": "qwen2_path"}),
        ("DPO", {"peft": True}),
        ("DPO", {"precompute_ref_log_probs": True}),
        ("DPO", {"max_length": 7}),  # completions cut at the end (keep_start)
        ("DPO", {"max_length": 7, "truncation_mode": "keep_end"}),  # prompts cut at the start: pairs may differ
        ("KTO", {}),
        ("KTO", {"peft": True}),
    ],
)
def test_preference_trainers_share_prompts_by_default_with_the_plain_numbers(
    name, config, tmp_path, monkeypatch, request
):
    import trl_unified.core.logprobs as logprobs

    config = dict(config)
    path = request.getfixturevalue(config.pop("model", "llama_path"))

    calls = []
    original = logprobs.encode_prefix
    monkeypatch.setattr(
        logprobs,
        "encode_prefix",
        lambda *a, _o=original, **k: calls.append((a[1].size(0), a[4][0].numel())) or _o(*a, **k),
    )
    shared = _train_preference(path, tmp_path, name, shared_prefix=None, **config)
    if name == "DPO" and config.get("truncation_mode") != "keep_end":
        # every policy and reference forward encoded the 4 prompts of a batch once for their 8 rows
        assert calls and set(calls) == {(8, 4)}, calls
    if name == "KTO":
        # the reference forward joins each batch's 4 completions and 4 KL rows: 4 prompts, once each; so does the
        # policy pass (KL rows without grad) from step 2 on (step 1 first checks the chunked head on two passes)
        assert calls == [(8, 4)] * 3, calls
    count = len(calls)
    plain = _train_preference(path, tmp_path, name, shared_prefix=False, padding_free=False, **config)
    assert len(calls) == count  # off means off
    keys = ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logits/chosen", "entropy"]
    assert_same_run(shared, plain, keys + (["mean_token_accuracy"] if name == "DPO" else ["kl"]))


def assert_same_run(trainer, other, keys):
    """Two trainings logged the same values of `keys` (each logged at least once) and ended at the same parameters."""
    for key in keys:
        ours = [log[key] for log in trainer.state.log_history if key in log]
        ref = [log[key] for log in other.state.log_history if key in log]
        assert len(ours) == len(ref) > 0, key
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=key)
    for (n, p), q in zip(trainer.model.named_parameters(), other.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)
