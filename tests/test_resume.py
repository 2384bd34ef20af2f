"""Kill a run with SIGKILL after a checkpoint; resume_from_checkpoint=True continues to the same end as an
uninterrupted run: parameters bit-exact and every metric logged after the resume point equal (CPU, fixed seed).
Restored: model, optimizer, scheduler, sampler position (Trainer), RNG states (Trainer), and for online trainers
the generation buffer and micro-step counter (trl_unified_state_<rank>.pt)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(kind, out, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "jobs", "resume_job.py"), kind, str(out), mode],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def finish(job):
    _, job.stderr_text = job.communicate(timeout=300)
    return job


def run(kind, out, mode):
    return finish(start(kind, out, mode))


@pytest.mark.parametrize(
    "kind",
    [
        "rloo",
        pytest.param("rloo_mu2", marks=pytest.mark.slow),  # a variant of "rloo" (num_iterations=2): -m slow
        pytest.param("grm", marks=pytest.mark.slow),  # the SFT-style trainer: -m slow
        pytest.param("dpo", marks=pytest.mark.slow),  # the preference core's resume: -m slow
        pytest.param("dpo_precompute", marks=pytest.mark.slow),  # a variant of "dpo": -m slow
        pytest.param("ppo", marks=pytest.mark.slow),  # the critic's checkpoint: -m slow
    ],
)
def test_resume_after_sigkill_matches_uninterrupted_run(kind, tmp_path):
    # the uninterrupted run and the run to be killed are independent (own folders, 1 thread each): side by side
    full, killed = start(kind, tmp_path / "full", "full"), start(kind, tmp_path / "interrupted", "kill")
    full, killed = finish(full), finish(killed)
    assert full.returncode == 0, full.stderr_text[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr_text[-3000:]
    assert os.path.isdir(tmp_path / "interrupted" / kind / "checkpoint-3")
    assert not os.path.exists(tmp_path / "interrupted" / f"{kind}-kill.pt")  # it really died before the end
    resumed = run(kind, tmp_path / "interrupted", "resume")
    assert resumed.returncode == 0, resumed.stderr_text[-3000:]

    expected = torch.load(tmp_path / "full" / f"{kind}-full.pt")
    got = torch.load(tmp_path / "interrupted" / f"{kind}-resume.pt")
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    logs_full = [
        log for log in json.load(open(tmp_path / "full" / f"{kind}-full.json")) if "loss" in log and log["step"] > 3
    ]
    logs_resumed = [
        log
        for log in json.load(open(tmp_path / "interrupted" / f"{kind}-resume.json"))
        if "loss" in log and log["step"] > 3
    ]
    assert [log["step"] for log in logs_resumed] == [4, 5, 6]
    for a, b in zip(logs_resumed, logs_full):
        for key in b:
            if key not in ("epoch", "step_time", "eps"):  # wall-clock measurements
                assert a[key] == b[key], (key, a[key], b[key])
