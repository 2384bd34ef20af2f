"""`unwrap_for_generation`: the bare model ready to decode (wrappers off, parameters gathered), and sharding checks."""

import contextlib

from transformers import GenerationConfig

from ..models.loading import base_model


def _deepspeed_zero3(accelerator) -> bool:
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


@contextlib.contextmanager
def zero3_gathered(parameters):
    """The ZeRO-3 shards of `parameters` gathered into whole tensors for the block (`GatheredParameters`)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(parameters)):
        yield


def fsdp1_class():
    """`torch.distributed.fsdp.FullyShardedDataParallel`, or None where torch has no FSDP."""
    with contextlib.suppress(ImportError):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    return None  # pragma: no cover


@contextlib.contextmanager
def _gathered_parameters(model, accelerator, gather_deepspeed3_params: bool):
    """Gather ZeRO-3 shards once (or FSDP full params) for the whole generation call."""
    FSDP = fsdp1_class()
    if _deepspeed_zero3(accelerator) and gather_deepspeed3_params:
        with zero3_gathered(model.parameters()):
            yield
    elif FSDP is not None and isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False, recurse=False):
            yield
    elif hasattr(model, "unshard") and hasattr(model, "reshard"):  # FSDP2 module
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
    else:
        yield


@contextlib.contextmanager
def unwrap_for_generation(
    model, accelerator=None, gather_deepspeed3_params: bool = True, generation_config: GenerationConfig | None = None
):
    """Yield the bare model ready for `generate`, then put everything back.

    Inside: DDP/DeepSpeed wrappers removed, ZeRO-3 parameters gathered once (not per forward), gradient
    checkpointing off (it disables the KV cache), eval mode (no dropout), and `generation_config` installed as the
    model's own (so the checkpoint's sampling defaults cannot override it). On exit: checkpointing (with its original
    kwargs), train/eval mode and the generation config are restored.
    """
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)  # torch.compile'd (torch_compile=True): decode eagerly
    base = base_model(unwrapped)
    was_training = unwrapped.training
    # Flip the per-layer flags instead of disable/enable: that keeps the checkpoint function and its kwargs.
    checkpointed = [m for m in unwrapped.modules() if getattr(m, "gradient_checkpointing", False) is True]
    saved_generation_config = getattr(base, "generation_config", None)
    for module in checkpointed:
        module.gradient_checkpointing = False
    if generation_config is not None:
        base.generation_config = generation_config
    unwrapped.eval()
    try:
        sharded = model if accelerator is not None else unwrapped  # the wrapper that holds the shards, if any
        with _gathered_parameters(sharded, accelerator, gather_deepspeed3_params):
            yield unwrapped
    finally:
        if generation_config is not None:
            base.generation_config = saved_generation_config
        for module in checkpointed:
            module.gradient_checkpointing = True
        unwrapped.train(was_training)


def sharded_parameters(model, accelerator, gather_deepspeed3_params: bool) -> str | None:
    """Why every process must run every decode step in step (generate's `synced_gpus`), or None."""
    if _deepspeed_zero3(accelerator) and not gather_deepspeed3_params:
        return "DeepSpeed ZeRO-3 parameters are gathered per layer (gather_deepspeed3_params=False)"
    if any(hasattr(m, "unshard") or type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "FSDP parameters are gathered per layer"
    return None
