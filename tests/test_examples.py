"""The examples' TRL-style command lines (YAML config, model path, local dataset, LoRA flags), in one process."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.test_cli import WORDS_REWARD
from trl_unified.pretrained import cache_dir


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_rloo_example_real_run_from_yaml_with_lora(llama_path, tmp_path):
    data_dir = tmp_path / "prompts"
    data_dir.mkdir()
    with open(data_dir / "train.jsonl", "w") as f:
        for p in ["a b c", "d e", "f g", "h i j"] * 4:
            f.write(json.dumps({"prompt": p}) + "\n")
    (tmp_path / "cfg.yaml").write_text(
        f"model_name_or_path: {llama_path}\ndataset_name: {data_dir}\noutput_dir: {tmp_path / 'out'}\n"
        "max_steps: 2\nper_device_train_batch_size: 4\nnum_generations: 2\nmax_completion_length: 6\n"
        "learning_rate: 0.01\nsave_strategy: 'no'\nreport_to: none\ngradient_checkpointing: false\n"
        "use_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\nreward_funcs: [my_rewards.words]\n"
    )
    (tmp_path / "my_rewards.py").write_text(WORDS_REWARD)
    result = run_example("rloo.py", ["--config", str(tmp_path / "cfg.yaml"), "--logging_steps", "1"], tmp_path)
    assert "reward at start" in result.stdout
    for name in ("adapter_model.safetensors", "adapter_config.json", "README.md", "reward_curve.png"):
        assert (tmp_path / "out" / name).exists(), name
    # the YAML's LoRA flags reached the adapter: rank 4 on q_proj and v_proj of each of the model's 2 layers
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    shapes = {name.split("layers.")[1]: tuple(t.shape) for name, t in adapter.items()}
    config = json.load(open(os.path.join(llama_path, "config.json")))
    hidden, kv = (
        config["hidden_size"],
        config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"],
    )
    expected = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            expected[f"{layer}.self_attn.{module}.lora_A.weight"] = (4, hidden)
            expected[f"{layer}.self_attn.{module}.lora_B.weight"] = (out, 4)
    assert shapes == expected


@pytest.mark.slow
def test_grm_example_real_run_from_command_line(llama_path, tmp_path):
    data_dir = tmp_path / "judgments"
    data_dir.mkdir()
    rows = [
        {
            "prompt": [{"role": "user", "content": f"which is larger : {a} or {b} ?"}],
            "completion": [{"role": "assistant", "content": f"<answer> {max(a, b)} </answer>"}],
        }
        for a, b in [(1, 2), (5, 3), (7, 9), (4, 0)]
    ]
    for split in ("train", "test"):
        with open(data_dir / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    result = run_example(
        "grm.py",
        [
            "--model_name_or_path",
            llama_path,
            "--dataset_name",
            str(data_dir),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--per_device_train_batch_size",
            "2",
            "--gradient_checkpointing",
            "false",
            "--max_completion_length",
            "6",
        ],
        tmp_path,
    )
    assert "eval accuracy before training" in result.stdout
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "eval_records").is_dir()


def test_rloo_demo_output_dir_holds_only_the_trained_model(tmp_path):
    """`--push_to_hub` uploads output_dir: the demo's generated base model must live elsewhere (a cache folder)."""
    out, cache = tmp_path / "demo", tmp_path / "cache"
    env_cache = {"TRL_UNIFIED_CACHE": str(cache)}
    os.environ.update(env_cache)
    try:
        run_example("rloo.py", ["--max_steps", "2", "--output_dir", str(out)], tmp_path)
    finally:
        os.environ.pop("TRL_UNIFIED_CACHE")
    weights = sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors"))
    assert weights == ["model.safetensors"], weights
    assert (cache / "online-demo-base-model" / "model.safetensors").exists()


@pytest.mark.slow
def test_grpo_demo_trains_and_saves(tmp_path):
    out = tmp_path / "grpo"
    result = run_example("grpo.py", ["--max_steps", "10", "--logging_steps", "2", "--output_dir", str(out)], tmp_path)
    assert "reward at start" in result.stdout
    for name in ("model.safetensors", "tokenizer.json", "README.md", "reward_curve.png"):
        assert (out / name).exists(), name
    assert "GRPO" in (out / "README.md").read_text()
    trained = load_file(out / "model.safetensors")
    initial = load_file(os.path.join(cache_dir(), "online-demo-base-model", "model.safetensors"))  # the demo's base
    # every tensor moved (k_proj.bias has a zero gradient: softmax ignores a score shift shared by all keys)
    assert [n for n in trained if torch.equal(trained[n], initial[n]) and not n.endswith("k_proj.bias")] == []


@pytest.mark.slow
def test_dpo_and_kto_demos_learn_and_save(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    demos = (("dpo.py", "DPO"), ("kto.py", "KTO"))
    with ThreadPoolExecutor(2) as pool:  # two independent 1-thread processes, side by side
        results = list(pool.map(lambda d: run_example(d[0], ["--output_dir", str(tmp_path / d[0])], tmp_path), demos))
    for (name, trainer), result in zip(demos, results):
        out = tmp_path / name
        start, end = (float(v) for v in result.stdout.split("held-out reward margin:")[1].split()[0:3:2])
        assert start == 0.0 and end > 0.5, result.stdout  # policy = reference before training: margin 0
        for file in ("model.safetensors", "tokenizer.json", "README.md", "rewards.png"):
            assert (out / file).exists(), file
        assert f"{trainer}Trainer" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_preference_example_real_run_from_command_line(name, llama_path, tmp_path):
    """The TRL-style CLI of examples/dpo.py (and of examples/orpo.py, TRL's dpo script with ORPO's classes): a model
    path, a local dataset folder (train/test splits), LoRA flags."""
    data_dir = tmp_path / "pairs"
    data_dir.mkdir()
    rows = [{"prompt": "a b", "chosen": " c d", "rejected": " e"}, {"prompt": "f", "chosen": " g", "rejected": " h i"}]
    for split in ("train", "test"):
        with open(data_dir / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows * 2)
    out = tmp_path / f"{name}-lora"
    result = run_example(
        f"{name}.py",
        ["--model_name_or_path", llama_path, "--dataset_name", str(data_dir), "--output_dir", str(out),
         "--max_steps", "2", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
         "--eval_strategy", "steps", "--eval_steps", "2", "--report_to", "none", "--save_strategy", "no",
         "--gradient_checkpointing", "false", "--bf16", "false", "--use_peft", "--lora_r", "4",
         "--lora_target_modules", "q_proj", "v_proj"],
        tmp_path,
    )  # fmt: skip
    assert "held-out reward margin" in result.stdout
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()


@pytest.mark.slow
def test_ppo_demo_learns_and_saves_the_policy_only(tmp_path):
    out = tmp_path / "ppo"
    result = run_example("ppo.py", ["--output_dir", str(out)], tmp_path)
    words = result.stdout.split("score at start:")[1].split()  # "<start> score at end: <end> ..."
    start, end = float(words[0]), float(words[4])
    assert end > start + 0.3, result.stdout  # the demo's fraction of "a" rises
    for name in ("model.safetensors", "tokenizer.json", "README.md", "reward_curve.png"):
        assert (out / name).exists(), name
    assert not (out / "value_model").exists()
    assert "PPOTrainer" in (out / "README.md").read_text() and "1909.08593" in (out / "README.md").read_text()


@pytest.mark.slow
def test_gkd_recovers_a_dropped_layer_student_on_the_arithmetic_task(tmp_path):
    """examples/distill.py with GKD (lmbda 0.5): SmolLM2-135M-Instruct with 6 of its 30 layers dropped, 10 steps.
    Measured: held-out accuracy 0.075 -> 0.350 (teacher 0.750), divergence 0.21 -> 0.04, 4.3 s/step."""
    args = ["--trainer", "gkd", "--max_steps", "10", "--eval_steps", "10", "--output_dir", str(tmp_path / "gkd")]
    result = run_example("distill.py", args, tmp_path)
    line = next(line for line in result.stdout.splitlines() if line.startswith("held-out accuracy"))
    before, after = (float(x) for x in line.split(":")[1].split("(")[0].split("->"))
    assert after >= before + 0.15, line
