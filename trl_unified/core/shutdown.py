"""A deterministic end for multi-process runs: no SIGABRT at interpreter exit after training succeeded
(docs/architecture.md, "Process shutdown", has the two failure modes and the fixed order). Measured on 2 CPU
processes (gloo, DDP and ZeRO-3): the teardown of a still-referenced `ProcessGroupGloo` at finalization aborts one
rank in one run in ten to three, and a late free of the DDP `Reducer` hangs 2 runs of ~15. The exit handler is
registered at import, so later ones (W&B's) run first; it runs logging's and multiprocessing's itself."""

import atexit
import builtins
import contextlib
import gc
import logging
import os
import sys

import torch


_state = {"active": False, "exit_code": None}


def install_distributed_shutdown() -> None:
    """Arm the exit handler for this process (trainers call it; a no-op without an initialised process group)."""
    if _state["active"] or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    _track_exit_status()
    _state["active"] = True


def record_exit_status(code: int) -> None:
    """The status this process will end with, for a program that ends with `raise SystemExit(code)` (as `python -m
    pytest` does), which no hook sees: without it, such an end after a distributed run exits with 0."""
    _state["exit_code"] = _exit_code_of(code)


def release_ddp_wrapper(trainer) -> None:
    """After training, drop the trainer's DDP wrapper (the policy stays) and collect it while the process group is
    alive, so its Reducer is never the last holder of the group (see the module docstring). DeepSpeed and FSDP
    wrappers stay: saving after training reads them."""
    wrapped = getattr(trainer, "model_wrapped", None)
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return
    trainer.model_wrapped = trainer.model
    trainer.accelerator._models = [m for m in trainer.accelerator._models if m is not wrapped]
    del wrapped
    gc.collect()


def _shutdown() -> None:
    if not _state["active"]:
        return
    gc.disable()  # no collection may free a DDP Reducer between the group's destruction and the exit
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if not _gloo_threads_alive():
        return  # nothing left that could abort during finalization
    code = _state["exit_code"]
    if code is None:
        code = 1 if getattr(sys, "last_value", None) is not None else 0  # last_value: an uncaught exception
    logging.shutdown()
    if "multiprocessing.util" in sys.modules:  # its exit handler: child processes and finalizers
        sys.modules["multiprocessing.util"]._exit_function()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or detached stream has nothing left to write
            stream.flush()
    os._exit(code)


def _gloo_threads_alive() -> bool:
    """Whether gloo's worker or transport threads still run in this process (Linux: thread names in /proc)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return False
    for task in os.listdir(tasks):
        with contextlib.suppress(OSError), open(os.path.join(tasks, task, "comm")) as f:  # OSError: the thread ended
            if f.read().startswith(("pt_gloo", "gloo_")):
                return True
    return False


def _track_exit_status() -> None:
    """Remember the status of `sys.exit` / `exit` / `quit` and of uncaught exceptions, for `os._exit`."""
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(*args):
        _state["exit_code"] = 1
        previous_hook(*args)

    def exit_(status=None):
        _state["exit_code"] = _exit_code_of(status)
        previous_exit(status)

    sys.excepthook = excepthook
    sys.exit = exit_
    for name in ("exit", "quit"):
        quitter = getattr(builtins, name, None)
        if quitter is not None:
            setattr(builtins, name, _TrackedQuitter(quitter))


def _exit_code_of(status) -> int:
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    return 1  # a message: Python prints it and exits with 1


class _TrackedQuitter:
    """`exit(code)` / `quit(code)` of the interactive builtins, remembering the code."""

    def __init__(self, quitter):
        self._quitter = quitter

    def __repr__(self):
        return repr(self._quitter)

    def __call__(self, code=None):
        _state["exit_code"] = _exit_code_of(code)
        return self._quitter(code)


atexit.register(_shutdown)  # at import: it runs after the exit handlers registered later (LIFO)
