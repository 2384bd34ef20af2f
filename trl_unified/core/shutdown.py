"""A deterministic end for multi-process runs: no SIGABRT at interpreter exit after training succeeded
(docs/architecture.md, "Process shutdown", has the two failure modes and the fixed order).

Facts behind it (2 CPU processes, gloo, DDP and ZeRO-3): gloo's threads (`pt_gloo_runloop`, `gloo_tcp_loop`) outlive
`destroy_process_group()` while the DDP wrapper's `process_group`, DeepSpeed's engine and optimizer and every ZeRO-3
parameter's `ds_process_group` keep `ProcessGroupGloo` referenced; its teardown at finalization aborts one rank in one
run in ten to three, and a late free of the DDP `Reducer` hangs 2 runs of ~15. The exit handler is registered when
trl_unified is imported, so later ones (W&B's) run first; logging's and multiprocessing's, registered earlier, are run
by it. Exit status: 1 after an uncaught exception, the code given to `sys.exit(...)` / `exit(...)`, else 0.
"""

import atexit
import builtins
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


def release_ddp_wrapper(trainer) -> None:
    """After training, drop the trainer's DDP wrapper (the policy stays) and collect it while the process group is
    alive, so its Reducer is never the last holder of the group (see the module docstring). DeepSpeed and FSDP
    wrappers stay: saving after training reads them."""
    wrapped = getattr(trainer, "model_wrapped", None)
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return
    trainer.model_wrapped = trainer.model
    accelerator = trainer.accelerator
    accelerator._models = [m for m in accelerator._models if m is not wrapped]
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
        try:
            stream.flush()
        except Exception:  # a closed or detached stream has nothing left to write
            pass
    os._exit(code)


def _gloo_threads_alive() -> bool:
    """Whether gloo's worker or transport threads still run in this process (Linux: thread names in /proc)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return False
    for task in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, task, "comm")) as f:
                if f.read().startswith(("pt_gloo", "gloo_")):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def _exit_code_of(status) -> int:
    if status is None:
        return 0
    return status if isinstance(status, int) else 1  # a message: Python prints it and exits with 1


def _track_exit_status() -> None:
    """Remember the status of `sys.exit` / `exit` / `quit` and of uncaught exceptions, for `os._exit`."""
    previous_hook = sys.excepthook

    def excepthook(*args):
        _state["exit_code"] = 1
        previous_hook(*args)

    sys.excepthook = excepthook
    previous_exit = sys.exit

    def exit_(status=None):
        _state["exit_code"] = _exit_code_of(status)
        previous_exit(status)

    sys.exit = exit_
    for name in ("exit", "quit"):
        quitter = getattr(builtins, name, None)
        if quitter is not None:
            setattr(builtins, name, _TrackedQuitter(quitter))


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
