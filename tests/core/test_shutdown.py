"""core/shutdown.py: a process whose gloo process group is still referenced (here by a DDP wrapper, as in training)
ends with its own exit status and flushed output, through the path that skips the aborting finalization."""

import os
import subprocess
import sys

import pytest


SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from trl_unified.core import shutdown
shutdown.install_distributed_shutdown()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # keeps the process group alive
model(torch.ones(1, 2)).sum().backward()
alive = shutdown._gloo_threads_alive()
sys.stdout.write(f"threads={alive} unflushed-output")  # no newline, no flush: must still arrive
mode = sys.argv[2]
if mode == "exit3":
    sys.exit(3)
if mode == "builtin_exit4":
    exit(4)
if mode == "raise":
    raise RuntimeError("boom")
if mode == "recorded_systemexit5":  # as pytest ends (tests/conftest.py records the status first)
    shutdown.record_exit_status(5)
    raise SystemExit(5)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "mode, code",  # a clean end and an exception by default; the sys.exit / builtin exit codes with -m slow
    [("normal", 0), pytest.param("exit3", 3, marks=pytest.mark.slow),
     pytest.param("builtin_exit4", 4, marks=pytest.mark.slow), ("raise", 1), ("recorded_systemexit5", 5)],
)  # fmt: skip
@pytest.mark.distributed  # several processes (a gloo group): one at a time under xdist
def test_exit_status_and_output_survive_the_shutdown(mode, code, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(_free_port()), mode], capture_output=True, text=True,
                            env=env, timeout=120)  # fmt: skip
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stdout.endswith("threads=True unflushed-output"), result.stdout[-300:]
    assert ("RuntimeError: boom" in result.stderr) == (mode == "raise")
    assert "terminate called" not in result.stderr
