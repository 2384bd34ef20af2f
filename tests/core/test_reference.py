import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from tests.helpers import prompt_dataset, rloo_args
from tests.helpers import varied_reward as count_a
from trl_unified import RLOOTrainer, compute_token_logprobs


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def probe(tokenizer):
    ids = torch.tensor([tokenizer("a b c d e f")["input_ids"], tokenizer("g h i j k l")["input_ids"]])
    return ids, torch.ones_like(ids), 4


def test_beta_zero_builds_no_reference(llama_path, tokenizer, tmp_path):
    trainer = RLOOTrainer(llama_path, count_a, args=rloo_args(tmp_path, beta=0.0), train_dataset=prompt_dataset())
    assert trainer.reference_model.kind == "none" and not trainer.reference_model.available
    with pytest.raises(RuntimeError, match="no reference model"):
        with trainer.reference_model.use():
            pass


def test_plain_model_gets_frozen_copy_in_eval_mode(llama_path, tmp_path):
    trainer = RLOOTrainer(llama_path, count_a, args=rloo_args(tmp_path, beta=0.1), train_dataset=prompt_dataset())
    ref = trainer.reference_model.model
    assert trainer.reference_model.kind == "copy" and ref is not trainer.model
    assert not any(p.requires_grad for p in ref.parameters())
    assert not ref.training
    for (name, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    trainer.train()
    changed = [not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), ref.parameters())]
    assert all(changed)  # the policy moved; the frozen copy did not follow


def test_in_memory_model_never_saved_gets_a_reference(llama_model, tokenizer, tmp_path):
    llama_model.config._name_or_path = ""  # built in memory: there is nothing to reload by name
    trainer = RLOOTrainer(
        llama_model,
        count_a,
        args=rloo_args(tmp_path, beta=0.1),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    assert trainer.reference_model.kind == "copy"
    trainer.train()
    kl = [log["kl"] for log in trainer.state.log_history if "loss" in log]
    assert len(kl) == 2 and all(math.isfinite(v) for v in kl)
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy as it arrived
    assert abs(kl[1]) > 1e-6  # the policy moved; the reference did not follow


def test_peft_reference_is_the_base_model(llama_model, tokenizer, tmp_path):
    ids, mask, keep = probe(tokenizer)
    with torch.no_grad():
        base_logps = compute_token_logprobs(llama_model, ids, mask, keep).logps
    trainer = RLOOTrainer(
        llama_model,
        count_a,
        args=rloo_args(tmp_path, beta=0.1, max_steps=3),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    assert trainer.reference_model.kind == "adapter_disabled" and trainer.reference_model.model is None  # no copy kept
    trainer.train()
    with torch.no_grad():
        ref_logps = trainer.reference_logprobs(ids, mask, keep)
        policy_logps = compute_token_logprobs(trainer.model, ids, mask, keep).logps
    torch.testing.assert_close(ref_logps, base_logps, rtol=1e-5, atol=1e-6)
    assert (policy_logps - base_logps).abs().max() > 1e-3  # the adapter trained


def test_pretrained_adapter_reference_is_a_frozen_copy_of_it(llama_model, tokenizer, tmp_path):
    ids, mask, keep = probe(tokenizer)
    peft_model = get_peft_model(llama_model, LoraConfig(**LORA))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a "pretrained" adapter: not the identity
        start_logps = compute_token_logprobs(peft_model, ids, mask, keep).logps
        with peft_model.disable_adapter():
            base_logps = compute_token_logprobs(peft_model, ids, mask, keep).logps
    assert (start_logps - base_logps).abs().max() > 1e-3
    trainer = RLOOTrainer(
        peft_model,
        count_a,
        args=rloo_args(tmp_path, beta=0.1, max_steps=3),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.model, PeftModel) and trainer.reference_model.kind == "ref_adapter"
    ref_params = {n: p.clone() for n, p in trainer.model.named_parameters() if ".ref." in n}
    assert ref_params and not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".ref." in n)
    trainer.train()
    with torch.no_grad():
        ref_logps = trainer.reference_logprobs(ids, mask, keep)
        policy_logps = compute_token_logprobs(trainer.model, ids, mask, keep).logps
    torch.testing.assert_close(ref_logps, start_logps, rtol=1e-5, atol=1e-6)  # the adapter as it arrived
    assert (policy_logps - start_logps).abs().max() > 1e-3
    for name, p in trainer.model.named_parameters():
        if ".ref." in name:
            assert torch.equal(p, ref_params[name]) and not p.requires_grad, name
    assert trainer.model.active_adapter == "default"


def test_explicit_ref_model_by_path(llama_path, qwen2_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path, count_a, args=rloo_args(tmp_path, beta=0.1), train_dataset=prompt_dataset(), ref_model=llama_path
    )
    assert trainer.reference_model.kind == "copy" and not any(
        p.requires_grad for p in trainer.reference_model.model.parameters()
    )


# A ref_model together with a PEFT policy is the reference (TRL's rule): tests/test_drop_in.py.


def test_pretrained_adapter_on_expert_parameters_gets_a_frozen_copy(tokenizer, tmp_path):
    """PEFT hosts one adapter per model when LoRA targets parameters (MoE experts): no "ref" adapter; the starting
    policy (base + adapter as it arrived) is kept as a frozen copy, and the base weights stay untouched."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, layer_types=["full_attention"] * 2,
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    peft_model = get_peft_model(GptOssForCausalLM(config).float(), lora)
    ids, mask, keep = probe(tokenizer)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
        start_logps = compute_token_logprobs(peft_model, ids, mask, keep).logps
    base = {n: p.clone() for n, p in peft_model.named_parameters() if "lora_" not in n}
    trainer = RLOOTrainer(
        peft_model,
        count_a,
        args=rloo_args(tmp_path, beta=0.1, max_steps=2, learning_rate=0.1),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    assert "ref" not in trainer.model.peft_config and trainer.reference_model.kind == "copy"
    trainer.train()
    with torch.no_grad():
        torch.testing.assert_close(trainer.reference_logprobs(ids, mask, keep), start_logps, rtol=1e-5, atol=1e-6)
    for name, p in trainer.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name]), name
