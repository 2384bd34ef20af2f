"""TRL 1.12's PPO recipe, in our words: a pad token added to the tokenizer without an embedding row, value and reward
models from classification checkpoints whose embedding table is larger than the tokenizer (Qwen2.5's checkpoints
share one tokenizer of 151,665 tokens over tables of 151,665 or 152,064 rows), `trainer.model.policy` and
`trainer.model.value_model`, and TRL's PPO utilities. Pad ids never reach an embedding, in any trainer."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig

from tests.helpers import PROMPTS, UNSET, tiny_run_args, varied_reward
from trl_unified import (
    DPOConfig,
    DPOTrainer,
    GRMConfig,
    GRMTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    PPOConfig,
    PPOTrainer,
    RLOOConfig,
    RLOOTrainer,
    compute_token_logprobs,
    generate_batched,
)
from trl_unified.online.critic import VALUE_WEIGHTS, load_value_model
from trl_unified.online.rewards import TokenIdsRewardModel
from trl_unified.testing import build_causal_lm, build_sequence_classifier, build_tokenizer, save_tiny_model


ROWS = len(build_tokenizer())  # the tiny models' embedding rows: one per token of the tokenizer they were built on


def recipe_tokenizer():
    """TRL's PPO recipe: the policy's tokenizer, left padding, a pad token added and no row for it (id ROWS)."""
    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    assert tokenizer.pad_token_id == ROWS
    return tokenizer


def larger_table(model, extra: int = 11):
    """`model` with `extra` embedding rows beyond the tokenizer's (a checkpoint of another size, same tokenizer)."""
    model.resize_token_embeddings(ROWS + extra, mean_resizing=False)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A policy (llama: AutoTokenizer loads its word-level tokenizer as saved), a sequence classifier and a causal LM
    with larger tables, saved: the recipe loads each by path."""
    root, tokenizer = tmp_path_factory.mktemp("recipe"), build_tokenizer()
    models = {
        "policy": build_causal_lm(tokenizer, "llama"),
        "classifier": larger_table(build_sequence_classifier(tokenizer, seed=3)),
        "causal_lm": larger_table(build_causal_lm(tokenizer, "llama", seed=4), 7),
    }
    return {name: save_tiny_model(model, tokenizer, str(root / name)) for name, model in models.items()}


def tokenized_prompts(tokenizer, n=8):
    """TRL's PPO test data: tokenised prompts (`input_ids`, `attention_mask`), EOS appended."""
    rows = [tokenizer(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    ids = [r["input_ids"] + [tokenizer.eos_token_id] for r in rows]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


def ppo_args(tmp_path, **overrides):
    defaults = dict(
        max_steps=UNSET, total_episodes=4, num_ppo_epochs=1, response_length=6, stop_token="eos",
        num_sample_generations=0, learning_rate=1e-3,
    )  # fmt: skip
    return tiny_run_args(PPOConfig, tmp_path / "ppo", **{**defaults, **overrides})


def recipe_trainer(tmp_path, tokenizer=None, value_model=None, reward_model=None, **overrides):
    tokenizer = tokenizer or recipe_tokenizer()
    return PPOTrainer(
        ppo_args(tmp_path, **overrides),
        tokenizer,
        build_causal_lm(build_tokenizer(), "llama"),
        None,
        reward_model or build_sequence_classifier(build_tokenizer(), seed=2),
        tokenized_prompts(tokenizer),
        value_model or build_sequence_classifier(build_tokenizer(), seed=1),
    )


# ------------------------------------------------------------------ the recipe, end to end
@pytest.mark.parametrize("reward", ["classifier", "causal_lm"])
def test_trl_ppo_recipe_trains_and_saves_a_policy_that_loads(reward, checkpoints, tmp_path):
    """TRL's PPO test and scripts, in our words: models loaded by path, a pad token added to the tokenizer, value and
    reward models from a checkpoint with a larger table (a sequence classifier, or a causal LM's checkpoint read as
    one), TRL's own checks of `trainer.model.value_model` and `trainer.model.policy` by parameter name."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["policy"], padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    policy = AutoModelForCausalLM.from_pretrained(checkpoints["policy"])
    ref_policy = AutoModelForCausalLM.from_pretrained(checkpoints["policy"])
    value_model = AutoModelForSequenceClassification.from_pretrained(checkpoints[reward], num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(checkpoints[reward], num_labels=1)
    assert tokenizer.pad_token_id == policy.get_input_embeddings().num_embeddings == ROWS
    assert value_model.get_input_embeddings().num_embeddings > ROWS
    initial_critic = {n: p.detach().clone() for n, p in value_model.named_parameters()}
    initial_policy = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer = PPOTrainer(
        args=ppo_args(tmp_path, total_episodes=8, per_device_eval_batch_size=2),
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=tokenized_prompts(tokenizer),
        eval_dataset=tokenized_prompts(tokenizer, 4),
    )
    trainer.train()
    assert trainer.model.value_model is value_model and trainer.model.policy is policy
    critic = dict(trainer.model.value_model.named_parameters())
    assert critic.keys() == initial_critic.keys()  # the value model's own names
    assert any(not torch.equal(initial_critic[n], p) for n, p in critic.items())
    assert any(
        not torch.equal(initial_policy[n], p)
        for n, p in trainer.model.policy.named_parameters()
        if n in initial_policy
    )
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == initial_policy.keys()  # the policy alone
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))  # no pad id beyond its table
    torch.testing.assert_close(reloaded.lm_head.weight, policy.lm_head.weight)


# ------------------------------------------------------------------ value and reward tables
def test_value_and_reward_models_may_have_a_larger_table(tmp_path):
    value, reward = (larger_table(build_sequence_classifier(build_tokenizer(), seed=s)) for s in (1, 2))
    trainer = recipe_trainer(tmp_path, build_tokenizer(), value, reward)  # tables of ROWS + 11 rows
    assert trainer.value_head.rows == trainer.rewards.funcs[0].rows == ROWS + 11


@pytest.mark.parametrize("which", ["value_model", "reward_model"])
def test_a_table_too_small_for_the_tokenizer_is_refused(which, tmp_path):
    small = build_sequence_classifier(build_tokenizer(["zz", "yy", *"abc"]))  # 10 rows for ids up to ROWS - 1
    with pytest.raises(
        ValueError, match=rf"{which.replace('_', ' ')}'s embedding table has 10 rows, too few .* up to"
    ):
        recipe_trainer(tmp_path, **{which: small})


def test_an_id_beyond_the_value_or_reward_table_is_named(tmp_path):
    """A policy with padding rows may sample an id its own table holds and the critic's or the reward model's does
    not (here written into a rollout): a clear error naming the id, not an IndexError."""
    trainer = recipe_trainer(tmp_path, build_tokenizer())  # value and reward tables of ROWS rows
    batch = trainer.rollout([trainer.train_dataset[i] for i in range(4)])
    batch.completion_ids[0, 0] = ROWS + 5
    with pytest.raises(
        ValueError, match=rf"token id {ROWS + 5}, but the value model's embedding table has {ROWS} rows"
    ):
        trainer.token_values(batch)
    scorer = TokenIdsRewardModel(build_sequence_classifier(build_tokenizer()), pad_token_id=ROWS)
    with pytest.raises(ValueError, match=rf"token id {ROWS + 5}, but the reward model's embedding table has {ROWS}"):
        scorer([], [], [[ROWS + 5]], [[5, 6]])


# ------------------------------------------------------------------ a pad token beyond the table
def greedy(pad_token_id, eos_token_id, max_new_tokens=8):
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, eos_token_id=eos_token_id
    )


@pytest.mark.parametrize("lean_decoding", [True, False])
def test_generation_with_a_pad_beyond_the_table_gives_the_tokens_of_an_in_table_pad(lean_decoding):
    """Left-padded prompts and the pad fed back after a row's EOS (the lean loop, `model.generate`): the same tokens
    as with the tokenizer's in-table pad, and the output padded with the tokenizer's pad id."""
    tokenizer, recipe, model = build_tokenizer(), recipe_tokenizer(), build_causal_lm(build_tokenizer(), "llama")
    prompts = PROMPTS[:6]
    probe = generate_batched(model, tokenizer, prompts, greedy(tokenizer.pad_token_id, None), eos_token_ids=[])
    stop = int(probe.completion_ids[0, 1])  # row 0 ends after its 2nd token; rows that go on read the fill
    options = dict(eos_token_ids=[stop], lean_decoding=lean_decoding, batch_size=6)
    expected = generate_batched(model, tokenizer, prompts, greedy(tokenizer.pad_token_id, stop), **options)
    out = generate_batched(model, recipe, prompts, greedy(recipe.pad_token_id, stop), **options)
    assert out.completion_ids_list == expected.completion_ids_list
    lengths = expected.completion_mask.sum(1)
    assert lengths[0] <= 2 and lengths.max() > lengths[0]  # a row ended while another went on
    assert (out.completion_ids[out.completion_mask == 0] == ROWS).all()
    assert (out.prompt_ids[out.prompt_mask == 0] == ROWS).all() and (out.prompt_mask == 0).any()


def test_logprob_forwards_read_a_pad_beyond_the_table_as_hidden_padding():
    model = build_causal_lm(build_tokenizer(), "llama")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 13, 14, 15]])
    expected = compute_token_logprobs(model, ids, mask, logits_to_keep=3).logps
    out = compute_token_logprobs(model, ids.masked_fill(mask == 0, ROWS), mask, logits_to_keep=3).logps
    keep = mask[:, -3:].bool()
    torch.testing.assert_close(out[keep], expected[keep], rtol=0, atol=0)


def test_a_prompt_token_beyond_the_table_is_named():
    model, recipe = build_causal_lm(build_tokenizer(), "llama"), recipe_tokenizer()
    with pytest.raises(ValueError, match=rf"Prompt 1 holds token id {ROWS} \('\[PAD\]'\), but .* has {ROWS} rows"):
        generate_batched(model, recipe, [[5, 6], [7, ROWS]], greedy(recipe.pad_token_id, None))


def trainer_with_recipe_tokenizer(name, tmp_path):
    """Each trainer on the recipe's tokenizer (pad beyond the policy's table), TRL's data format, 2 steps."""
    tokenizer, policy, out = recipe_tokenizer(), build_causal_lm(build_tokenizer(), "qwen2"), tmp_path / name
    words = "a b c d e f g h i j k l m n o p".split()
    pairs = Dataset.from_dict({
        "prompt": [" ".join(words[: 1 + i % 4]) for i in range(8)],
        "chosen": [" " + " ".join(words[i : i + 1 + i % 3]) for i in range(8)],
        "rejected": [" " + words[-1 - i] for i in range(8)],
    })  # fmt: skip
    if name in ("dpo", "kto"):
        config, cls = (DPOConfig, DPOTrainer) if name == "dpo" else (KTOConfig, KTOTrainer)
        return cls(
            policy, args=tiny_run_args(config, out, max_length=16), train_dataset=pairs, processing_class=tokenizer
        )
    if name == "grm":
        data = pairs.rename_column("chosen", "completion").remove_columns("rejected")
        args = tiny_run_args(GRMConfig, out, max_completion_length=6)
        return GRMTrainer(policy, args=args, train_dataset=data, processing_class=tokenizer)
    if name == "ppo_generate":
        return recipe_trainer(tmp_path, tokenizer, lean_decoding=False)
    config, cls = (RLOOConfig, RLOOTrainer) if name == "rloo" else (GRPOConfig, GRPOTrainer)
    args = tiny_run_args(config, out, num_generations=2, max_completion_length=6)
    data = Dataset.from_dict({"prompt": PROMPTS})
    return cls(policy, reward_funcs=varied_reward, args=args, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize("name", ["ppo_generate", "rloo", "grpo", "dpo", "kto", "grm"])
def test_every_trainer_trains_with_a_pad_beyond_the_table(name, tmp_path):
    """A pad id never reaches an embedding: each trainer's forwards (generation, log-probs, the critic and reward
    model, the SFT forward) read hidden padding as an id the table holds. (PPO with the lean loop: the recipe test.)"""
    trainer = trainer_with_recipe_tokenizer(name, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step >= 1
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


# ------------------------------------------------------------------ TRL 1.12's wrapper attributes
@pytest.mark.parametrize("peft", [False, True])
def test_trainer_model_policy_and_value_model_are_what_trl_112_users_read(peft, tmp_path):
    tokenizer, policy = build_tokenizer(), build_causal_lm(build_tokenizer(), "llama")
    value_model = build_sequence_classifier(tokenizer, seed=1)
    names = [n for n, _ in value_model.named_parameters()]
    trainer = PPOTrainer(
        ppo_args(tmp_path), tokenizer, policy, None, build_sequence_classifier(tokenizer),
        tokenized_prompts(tokenizer), value_model,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )  # fmt: skip
    assert trainer.model.value_model is value_model is trainer.value_model
    assert [n for n, _ in trainer.model.value_model.named_parameters()] == names
    assert trainer.model.policy is trainer.model  # the policy, the critic riding in it as its submodule
    assert all(p.requires_grad for p in value_model.parameters())
    lora = [n for n, _ in trainer.model.policy.named_parameters() if "lora" in n]
    assert bool(lora) == peft and not any("value_model" in n for n in lora)


def test_checkpoints_store_the_value_model_under_its_own_names(tmp_path):
    trainer = recipe_trainer(tmp_path, build_tokenizer(), save_strategy="steps", save_steps=1)
    trainer.train()
    folder = tmp_path / "ppo" / "checkpoint-1"
    state = torch.load(folder / VALUE_WEIGHTS, weights_only=True)
    assert state.keys() == trainer.value_model.state_dict().keys()  # the value model passed, not a wrapper
    # a checkpoint of the earlier layout (the value model inside a wrapper: names prefixed "model.") still loads
    torch.save({f"model.{k}": torch.zeros_like(v) for k, v in state.items()}, folder / VALUE_WEIGHTS)
    assert load_value_model(trainer.value_head, str(folder))
    assert all(not p.any() for p in trainer.model.value_model.parameters())


# ------------------------------------------------------------------ TRL 1.12's PPO utilities
def test_trl_ppo_utilities_are_importable_from_the_ppo_module():
    from trl_unified.trainers.ppo import batch_generation, masked_mean, masked_var, masked_whiten

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    assert masked_mean(values, mask) == torch.tensor(2.5)  # TRL's TestCore: the unmasked [2, 3]
    assert masked_var(values, mask) == torch.tensor([2.0, 3.0]).var()
    torch.testing.assert_close(masked_whiten(values, mask)[0, 1:3], (torch.tensor([2.0, 3.0]) - 2.5) / 0.5**0.5)

    recipe, model = recipe_tokenizer(), build_causal_lm(build_tokenizer(), "llama")
    queries = recipe(PROMPTS[:5], padding=True, return_tensors="pt")["input_ids"]  # left-padded with id ROWS
    width = queries.size(1)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=recipe.pad_token_id)
    expected = generate_batched(model, recipe, PROMPTS[:5], config)  # greedy: the same tokens, padded with ROWS
    for chunk in (3, 5):  # TRL's mini-batch and single-batch generation
        query_responses, logits = batch_generation(model, queries, chunk, recipe.pad_token_id, config)
        assert query_responses.shape[0] == 5 and logits.shape == (5, query_responses.size(1) - width, ROWS)
        assert torch.equal(query_responses[:, :width], queries)
        responses = query_responses[:, width:]
        steps = expected.completion_ids.size(1)
        assert torch.equal(responses[:, :steps], expected.completion_ids) and (responses[:, steps:] == ROWS).all()
        mask = expected.completion_mask.bool()
        assert torch.equal(logits[:, :steps].argmax(-1)[mask], expected.completion_ids[mask])
