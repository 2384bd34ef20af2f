"""Model loading by id/path, PEFT with gradient checkpointing, QLoRA, and the errors of bad model inputs."""

import os

import pytest
import torch
from peft import LoraConfig, PeftModel

from tests.helpers import prompt_dataset, rloo_args, varied_reward
from trl_unified import GRMConfig, GRMTrainer, RLOOTrainer
from trl_unified.testing import build_causal_lm, save_tiny_model


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_policy_and_processing_class_load_by_path(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, model_init_kwargs={"dtype": "float32"}),
        train_dataset=prompt_dataset(),
    )
    assert type(trainer.model).__name__ == "LlamaForCausalLM"
    assert trainer.processing_class.padding_side == "left"
    assert trainer.model.config._name_or_path == llama_path


def test_pad_token_falls_back_to_eos(llama_model, tmp_path):
    from trl_unified.testing import build_tokenizer

    tokenizer = build_tokenizer(pad_token=None)
    trainer = RLOOTrainer(
        llama_model,
        varied_reward,
        args=rloo_args(tmp_path),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    assert tokenizer.pad_token == tokenizer.eos_token
    assert trainer.model.config.pad_token_id == tokenizer.eos_token_id
    trainer.train()


def test_unknown_model_id_with_hub_offline_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="could not resolve it .*Pass a local path"):
        RLOOTrainer(
            "no-such-org/no-such-model", varied_reward, args=rloo_args(tmp_path), train_dataset=prompt_dataset()
        )


def test_peft_with_gradient_checkpointing_trains_the_adapter_only(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, gradient_checkpointing=True, beta=0.1),
        train_dataset=prompt_dataset(),
        peft_config=LoraConfig(**LORA),
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.accelerator.unwrap_model(trainer.model).base_model.model.model.layers[0].gradient_checkpointing
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) != ("lora_" in name), name  # adapters moved, the base did not


def test_peft_model_and_peft_config_together_is_rejected(llama_model, tokenizer, tmp_path):
    from peft import get_peft_model

    with pytest.raises(ValueError, match="already a PeftModel"):
        GRMTrainer(
            get_peft_model(llama_model, LoraConfig(**LORA)),
            args=GRMConfig(output_dir=str(tmp_path), bf16=False),
            train_dataset=prompt_dataset().add_column("completion", ["x"] * 16),
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )


def _bitsandbytes_cpu():
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig  # noqa: F401

        return True
    except Exception:  # pragma: no cover
        return False


@pytest.fixture(scope="module")
def llama64_path(tmp_path_factory, tokenizer):
    """A Llama whose linear layers are multiples of 64 wide: shapes bitsandbytes' 4-bit kernels take on every CPU."""
    path = str(tmp_path_factory.mktemp("llama64") / "llama64")
    return save_tiny_model(build_causal_lm(tokenizer, "llama", hidden_size=64), tokenizer, path)


@pytest.mark.skipif(not _bitsandbytes_cpu(), reason="bitsandbytes is not installed (the 'quantization' extra)")
def test_qlora_policy_trains_and_saves_an_adapter(llama64_path, tmp_path):
    from transformers import BitsAndBytesConfig

    llama_path = llama64_path

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    args = rloo_args(tmp_path, beta=0.1, model_init_kwargs={"device_map": "cpu"})
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=args,
        train_dataset=prompt_dataset(),
        quantization_config=quantization,
        peft_config=LoraConfig(**LORA),
    )
    assert trainer.model.is_loaded_in_4bit and trainer.reference_model.kind == "adapter_disabled"
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if "lora_" in n)
    trainer.save_model(str(tmp_path / "adapter"))
    assert os.path.exists(tmp_path / "adapter" / "adapter_model.safetensors")
    assert not os.path.exists(tmp_path / "adapter" / "model.safetensors")
    reloaded = PeftModel.from_pretrained(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(llama_path), str(tmp_path / "adapter")
    )
    assert any("lora_" in n for n, _ in reloaded.named_parameters())


def test_quantised_policy_without_peft_is_rejected(llama_path, tmp_path):
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="quantised .* no peft_config"):
        RLOOTrainer(
            llama_path,
            varied_reward,
            args=rloo_args(tmp_path, model_init_kwargs={"device_map": "cpu"}),
            train_dataset=prompt_dataset(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )


def test_trust_remote_code_is_off_unless_asked(llama_path, tmp_path, monkeypatch):
    import transformers

    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    RLOOTrainer(llama_path, varied_reward, args=rloo_args(tmp_path), train_dataset=prompt_dataset())
    RLOOTrainer(
        llama_path, varied_reward, args=rloo_args(tmp_path, trust_remote_code=True), train_dataset=prompt_dataset()
    )
    assert seen == [False, True]


@pytest.mark.skipif(not _bitsandbytes_cpu(), reason="bitsandbytes is not installed (the 'quantization' extra)")
def test_4bit_layers_keep_their_gradient_after_generation_on_every_cpu(llama_path, tmp_path):
    """bitsandbytes repacks 4-bit weights for an inference kernel without backward at the first no-grad eval forward
    on AVX-512 BF16 CPUs; the trainer must keep the layers differentiable (and 32-wide layers must not crash)."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    trainer = RLOOTrainer(
        llama_path,  # 32-wide layers: shapes the repacked kernel cannot take
        varied_reward,
        args=rloo_args(tmp_path, model_init_kwargs={"device_map": "cpu"}),
        train_dataset=prompt_dataset(),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        peft_config=LoraConfig(**LORA),
    )
    layer = next(m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit))
    # The behaviour, on any CPU: the repacked inference layout never engages (bitsandbytes sets the flag to False
    # or 0 depending on the CPU; it is only falsy), and the gradient flows after a generation-style forward.
    assert not layer.support_avx512bf16_for_cpu
    layer.eval()
    with torch.no_grad():  # what generation does
        layer(torch.randn(2, layer.in_features))
    layer.train()
    x = torch.randn(2, layer.in_features, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)


def test_saving_a_composite_config_without_its_own_pad_id():
    """Llava's config has no pad_token_id of its own (its text config has): saving must not read it (TRL's KTO/DPO
    vision tests save a Llava checkpoint)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from trl_unified.models.token_ids import saved_without_unusable_pad

    text = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)  # fmt: skip
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_id=39))
    model.config.get_text_config().pad_token_id = 45  # as Trainer.train copies a tokenizer's added pad id
    assert not hasattr(model.config, "pad_token_id")
    with saved_without_unusable_pad(model):
        assert model.config.get_text_config().pad_token_id is None  # 45 is beyond the 40-row table
    assert model.config.get_text_config().pad_token_id == 45
