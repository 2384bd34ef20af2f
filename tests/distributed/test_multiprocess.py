"""2 CPU processes (gloo) through `accelerate launch`: the code paths that only exist with several processes."""

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DDP_CONFIG = os.path.join(ROOT, "examples", "accelerate_configs", "multi_gpu.yaml")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script_args, config=DDP_CONFIG, timeout=600):
    """`accelerate launch` of a job on its own rendezvous port (test files run side by side under xdist)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    cmd += ["--main_process_port", str(free_port()), *script_args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.mark.distributed
def test_two_processes_train_and_gather_eval_records_without_duplicates(tmp_path):
    launch([os.path.join(ROOT, "tests", "jobs", "run_rloo_eval.py"), str(tmp_path)])
    result = json.load(open(tmp_path / "result.json"))
    assert result["num_processes"] == 2
    assert result["changed"] == result["total"]
    indices = [r["index"] for r in result["records"]]
    assert indices == list(range(7))  # every row once: no sampler padding duplicates, nothing lost
    assert "eval_accuracy" in result["metrics"] and "eval_loss" in result["metrics"]
    assert sum(r["correct"] for r in result["records"]) / 7 == result["metrics"]["eval_accuracy"]
    assert any("kl" in log and "reward" in log for log in result["logs"])


@pytest.mark.distributed
def test_example_runs_with_two_processes(tmp_path):
    out = tmp_path / "demo"
    launch([os.path.join(ROOT, "examples", "rloo.py"), "--max_steps", "6", "--output_dir", str(out)])
    for name in ("model.safetensors", "tokenizer.json", "README.md", "reward_curve.png", "config.json"):
        assert (out / name).exists(), name


@pytest.mark.distributed
@pytest.mark.slow  # the RLOO example's 2-process run stays in the default suite
def test_grm_example_runs_with_two_processes(tmp_path):
    out = tmp_path / "grm"
    result = launch([os.path.join(ROOT, "examples", "grm.py"), "--max_steps", "10", "--output_dir", str(out)])
    assert "eval accuracy before training" in result.stdout
    records = sorted((out / "eval_records").glob("eval-step10.jsonl"))
    assert records and len(records[0].read_text().splitlines()) == 20  # every held-out row once across 2 processes
    for name in ("model.safetensors", "README.md", "tokenizer.json"):
        assert (out / name).exists(), name


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kind",  # one online and one preference trainer by default; the others with -m slow
    ["rloo", pytest.param("grpo", marks=pytest.mark.slow), pytest.param("grm", marks=pytest.mark.slow), "dpo",
     pytest.param("kto", marks=pytest.mark.slow)],
)  # fmt: skip
def test_ddp_two_processes_equal_one_process_and_accumulation(kind, tmp_path):
    """2 processes x bs 4 == 1 process x bs 8 == bs 4 x accumulation 2 after 2 SGD steps (tolerance 1e-5)."""
    script = os.path.join(ROOT, "tests", "jobs", "run_equivalence.py")
    launch([script, kind, str(tmp_path), "ddp"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [  # the two 1-process layouts side by side (one core each)
        subprocess.Popen(
            [sys.executable, script, kind, str(tmp_path), layout],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for layout in ("single", "ga")
    ]
    for job in jobs:
        _, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr[-3000:]
    import torch

    runs = {layout: torch.load(tmp_path / f"{kind}-{layout}.pt") for layout in ("ddp", "single", "ga")}
    assert runs["ddp"]["processes"] == 2 and runs["single"]["processes"] == 1
    initial = __import__("trl_unified.testing", fromlist=["x"]).build_causal_lm(
        __import__("trl_unified.testing", fromlist=["x"]).build_tokenizer(), "llama"
    )
    moved = 0
    for name, p in runs["single"]["params"].items():
        torch.testing.assert_close(runs["ddp"]["params"][name], p, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(runs["ga"]["params"][name], p, rtol=1e-5, atol=1e-5, msg=name)
        moved += not torch.equal(p, dict(initial.named_parameters())[name].detach())
    assert moved > 0


@pytest.mark.distributed
def test_ppo_two_processes_keep_policy_and_critic_in_sync(tmp_path):
    """PPO on 2 processes: the attached value model is trained through the same DDP wrapper as the policy, so both
    ranks end with identical policy and critic parameters; the rollout metrics are gathered."""
    launch([os.path.join(ROOT, "tests", "jobs", "run_equivalence.py"), "ppo", str(tmp_path), "ddp"])
    import torch

    ranks = [torch.load(tmp_path / f"ppo-ddp-rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["processes"] == 2
    assert any(name.startswith("value_model.") for name in ranks[0]["params"])
    initial = dict(
        __import__("trl_unified.testing", fromlist=["x"])
        .build_sequence_classifier(__import__("trl_unified.testing", fromlist=["x"]).build_tokenizer(), seed=1)
        .named_parameters()
    )
    moved = 0
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0, msg=name)
        if name.startswith("value_model."):  # the value model's own names under the policy's `value_model.`
            moved += not torch.equal(value, initial[name[len("value_model.") :]].detach())
    assert moved > 0  # the critic was trained, in step on both ranks
    assert [log["episode"] for log in ranks[0]["logs"] if "episode" in log] == [8, 16]  # 2 processes x 4 rows
