"""The distributed engine a run asked for against the one accelerate engaged: a warning before training when an
FSDP run is not sharded (a multi-process CPU launch runs as DDP over gloo; docs/distributed.md)."""

import logging
import os

from accelerate.utils import DistributedType


logger = logging.getLogger(__name__)


def engine_notice(accelerator, args) -> str | None:
    """The notice for a run that asked for FSDP and got another engine, or None."""
    requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes") or bool(args.fsdp)
    if not requested or accelerator.distributed_type == DistributedType.FSDP:
        return None
    engine = accelerator.distributed_type.value
    return (
        f"FSDP was requested, but accelerate runs this job as {engine} on {accelerator.device.type}: accelerate "
        "engages FSDP only on accelerator devices (CUDA, XPU, NPU, ...), and a CPU launch is routed to DDP over "
        f"gloo. Each of the {accelerator.num_processes} process(es) holds the whole model, optimizer state included; "
        "nothing is sharded. Launch on GPUs to shard, or use a DeepSpeed ZeRO config "
        "(examples/accelerate_configs/deepspeed_zero3.yaml), which shards on CPU too."
    )


def warn_if_engine_differs(accelerator, args) -> None:
    """Log `engine_notice` as a warning (once, on the main process) before training starts."""
    notice = engine_notice(accelerator, args)
    if notice is not None and accelerator.is_main_process:
        logger.warning(notice)
