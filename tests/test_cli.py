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
    assert "{rloo,grpo,ppo,dpo,kto,orpo,cpo,tpo,distillation,gkd,online_dpo,env}" in out


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
        "reward_funcs: [my_rewards.words]\n"
    )
    (tmp_path / "my_rewards.py").write_text(WORDS_REWARD)
    result = run_cli(["rloo", "--config", "rloo.yaml", "--max_steps", "2", "--output_dir", "out"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 2 logs" in result.stdout  # the command line's max_steps, not the YAML's
    assert (tmp_path / "out" / "model.safetensors").exists()


TRAINER_ARGS = {
    "grpo": ["--max_steps", "2"],
    "dpo": ["--max_steps", "2", "--eval_steps", "1"],
    "kto": ["--max_steps", "2", "--eval_steps", "1"],
    "orpo": ["--max_steps", "2", "--eval_steps", "1"],
    "cpo": ["--max_steps", "2", "--eval_steps", "1", "--loss_type", "simpo"],
    "tpo": ["--max_steps", "2", "--eval_steps", "1"],
    "ppo": ["--total_episodes", "32"],
    "distillation": ["--max_steps", "2"],
    "gkd": ["--max_steps", "2"],
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


# One YAML per command in TRL's usual shape: a dataset mixture (`datasets:`) or a dataset name, TRL's registry reward
# and a dotted import path (`reward_funcs`), an accelerate key (`num_processes`, which TRL hands to accelerate) and
# trainer fields. `trl <cmd>` and `trl-unified <cmd>` run it; the logged numbers must agree.
COMMON_YAML = (
    "model_name_or_path: {model}\noutput_dir: {out}\nmax_steps: 3\nlogging_steps: 1\nsave_strategy: steps\n"
    "save_steps: 3\nreport_to: none\ngradient_checkpointing: false\nbf16: false\nuse_cpu: true\nseed: 0\n"
    "per_device_train_batch_size: 4\nlearning_rate: 0.01\nnum_processes: 1\n"
)
COMMAND_YAML = {
    "grpo": "datasets:\n  - path: {data}/prompts\nreward_funcs: [my_rewards.words, think_format_reward]\n"
    "num_generations: 2\nmax_completion_length: 6\nbeta: 0.1\n",
    "rloo": "dataset_name: {data}/prompts\nreward_funcs: [my_rewards.words]\nnum_generations: 2\n"
    "max_completion_length: 6\n",
    "dpo": "dataset_name: {data}/pairs\nmax_length: 16\n",
    "kto": "dataset_name: {data}/unpaired\nmax_length: 16\n",
    "distillation": "dataset_name: {data}/prompts\nteacher_model_name_or_path: {teacher}\nmax_completion_length: 6\n",
}
WORDS_REWARD = (  # a reward module in the working directory, named by its import path as in TRL's YAML
    "def words(completions, **kwargs):\n"
    "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
    "    return [len(t.split()) / 6 for t in texts]\n"
)
LOGGED = ("loss", "reward", "rewards/words/mean", "kl", "entropy", "rewards/margins", "rewards/chosen", "grad_norm")


def write_cli_data(root):
    """Local datasets (conversational prompts, preference pairs, unpaired rows) and a reward module on `root`."""
    import json

    words = "c d e f g h i j".split()
    rows = {
        "prompts": [{"prompt": [{"role": "user", "content": f"a b {w}"}]} for w in words],
        "pairs": [{"prompt": f"a {w}", "chosen": " c d", "rejected": " e"} for w in words],
        "unpaired": [{"prompt": f"a {w}", "completion": " c d" if i % 2 else " e", "label": bool(i % 2)}
                     for i, w in enumerate(words)],
    }  # fmt: skip
    for name, data in rows.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (root / "my_rewards.py").write_text(
        "def words(completions, **kwargs):\n    return [len(c[0]['content'].split()) / 6 for c in completions]\n"
    )


def run_command(module, argv, cwd):
    """`trl` or `trl-unified` (their console entry points, `<module>.main`) with `argv`, in `cwd`."""
    entry = f"import sys; from {module} import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", entry, *argv], capture_output=True, text=True, timeout=300,
                            cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "grpo" else pytest.mark.slow) for n in COMMAND_YAML]
)
def test_trl_yaml_trains_the_same_numbers_with_trl_and_trl_unified(name, llama_path, qwen2_path, tmp_path):
    """TRL's YAML as it is (`reward_funcs` by registry name and import path, a `datasets:` mixture, a key for
    accelerate): `trl <cmd>` and `trl-unified <cmd>` train the same logged numbers."""
    import json

    write_cli_data(tmp_path)
    logs = {}
    for command, out in (("trl.cli", "trl"), ("trl_unified.cli", "ours")):
        yaml = COMMON_YAML + COMMAND_YAML[name]
        yaml = yaml.format(model=llama_path, teacher=qwen2_path, out=tmp_path / out, data=tmp_path)
        (tmp_path / f"{out}.yaml").write_text(yaml)
        run_command(command, [name, "--config", f"{out}.yaml"], tmp_path)
        state = json.loads((tmp_path / out / "checkpoint-3" / "trainer_state.json").read_text())
        logs[out] = [{k: v for k, v in log.items() if k in LOGGED} for log in state["log_history"] if "loss" in log]
    assert len(logs["ours"]) == 3 and logs["ours"][0], logs
    for theirs, ours in zip(logs["trl"], logs["ours"], strict=True):
        assert set(theirs) == set(ours), (theirs, ours)
        for key in theirs:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, theirs, ours)
