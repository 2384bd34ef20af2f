"""The `trl-unified` command: each trainer's script for 2 steps through `accelerate launch` (one with 2
processes), a YAML config overridden by the command line, `env`, and bad flags named by argparse."""

import os
import subprocess
import sys

import pytest

from tests.distributed.test_multiprocess import free_port
from trl_unified.cli import _without_subsequence, accelerate_config_argument, main


def run_cli(args, tmp_path, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true",
           "TRL_UNIFIED_CACHE": str(tmp_path / "cache")}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "trl_unified.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=tmp_path)  # fmt: skip


def test_env_prints_the_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("trl_unified", "torch", "transformers", "trl", "accelerate", "vllm"):
        assert f"- {name} version: " in out


def test_help_lists_every_trainer(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "{rloo,grpo,ppo,dpo,kto,distillation,env}" in out


def test_a_bad_flag_is_named(tmp_path):
    result = run_cli(["rloo", "--max_steps", "1", "--no_such_flag", "3"], tmp_path)
    assert result.returncode != 0 and "unrecognized arguments: --no_such_flag" in result.stderr


def test_launch_flags_go_to_accelerate_and_the_rest_to_the_script():
    args = ["--max_steps", "2", "--num_processes", "2", "--beta", "0.1"]
    assert _without_subsequence(args, ["--num_processes", "2"]) == ["--max_steps", "2", "--beta", "0.1"]
    resolved = accelerate_config_argument(["--accelerate_config", "zero3", "--num_processes", "2"])
    assert (
        resolved[0] == "--config_file"
        and resolved[1].endswith("zero3.yaml")
        and resolved[2:] == ["--num_processes", "2"]
    )
    with pytest.raises(SystemExit, match="neither a file nor one of TRL's configs"):
        accelerate_config_argument(["--accelerate_config", "no-such-config"])


@pytest.mark.slow  # ~40 s; the flag split and the YAML parsing have their own unit tests above
def test_rloo_from_a_yaml_config_with_command_line_overrides(llama_path, tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.jsonl").write_text("".join(f'{{"prompt": "a b {w}"}}\n' for w in "cdefgh"))
    (tmp_path / "rloo.yaml").write_text(
        f"model_name_or_path: {llama_path}\ndataset_name: {tmp_path / 'prompts'}\nmax_steps: 5\nlogging_steps: 1\n"
        "per_device_train_batch_size: 4\nnum_generations: 2\nmax_completion_length: 6\nsave_strategy: 'no'\n"
        "report_to: none\ngradient_checkpointing: false\nenv:\n  TRL_UNIFIED_TEST_ENV: from-yaml\n"
    )
    result = run_cli(["rloo", "--config", "rloo.yaml", "--max_steps", "2", "--output_dir", "out"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 2 logs" in result.stdout  # the command line's max_steps, not the YAML's
    assert (tmp_path / "out" / "model.safetensors").exists()


TRAINER_ARGS = {
    "grpo": ["--max_steps", "2"],
    "dpo": ["--max_steps", "2", "--eval_steps", "1"],
    "kto": ["--max_steps", "2", "--eval_steps", "1"],
    "ppo": ["--total_episodes", "32"],
    "distillation": ["--max_steps", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAINER_ARGS))
def test_each_trainer_runs_two_steps(name, tmp_path):
    result = run_cli([name, *TRAINER_ARGS[name], "--output_dir", "out"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.distributed
def test_grpo_with_two_processes(tmp_path):
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
    result = run_cli(["grpo", *launch, "--max_steps", "2", "--output_dir", "out", "--logging_steps", "1"], tmp_path,
                     timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "over 2 logs" in result.stdout and (tmp_path / "out" / "model.safetensors").exists()
