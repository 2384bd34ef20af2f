"""The reference model: build it, freeze it, prepare it for the distributed engine, and hand it out."""

import contextlib
import copy

import torch
from accelerate.utils import is_peft_model

from ..models.loading import disable_dropout, load_model


REF_ADAPTER = "ref"


class ReferenceModel:
    """One handle on the reference policy, whatever form it takes. Use it only through `use()`:

    ```python
    with trainer.reference_model.use() as ref_model:
        ref_logps = compute_token_logprobs(ref_model, ids, mask, logits_to_keep).logps
    ```

    Kinds:
      - `"none"`: the algorithm needs no reference (e.g. `beta == 0`); `use()` raises.
      - `"adapter_disabled"`: PEFT policy with a fresh adapter: the policy with its adapter disabled *is* the base
        model, so no copy is kept.
      - `"ref_adapter"`: PEFT policy that arrived with a pretrained adapter: disabling it would give the base model,
        not the starting policy, so a frozen copy of the adapter, named "ref", is switched in.
      - `"policy"`: the policy itself, valid only before training changes it (reference log-probs precomputed
        before the first step, with no ref_model given: no copy is kept).
      - `"copy"`: a separate frozen model in eval mode (from `ref_model`, also beside a PEFT policy, as TRL; or a
        deep copy of the policy; also for a PEFT policy whose pretrained adapter targets parameters, which PEFT
        cannot pair with a "ref" adapter), prepared by accelerate / DeepSpeed / FSDP.
    """

    def __init__(self, kind: str, model: torch.nn.Module | None = None, policy: torch.nn.Module | None = None):
        self.kind, self.model, self.policy = kind, model, policy

    @classmethod
    def build(
        cls,
        policy,
        ref_model,
        args,
        needed: bool,
        adapter_is_pretrained: bool,
        quantization_config=None,
        policy_is_reference: bool = False,
    ):
        """Build (before `accelerator.prepare`) the reference for `policy`. See the class docstring for the rules."""
        if not needed:
            if ref_model is not None:
                raise ValueError(
                    "A ref_model was given but this configuration uses no reference model (e.g. beta=0.0). "
                    "Set beta > 0 or drop ref_model."
                )
            return cls("none")
        if is_peft_model(policy) and ref_model is None:  # a given ref_model is the reference, PEFT or not (TRL)
            if adapter_is_pretrained and _adapter_targets_parameters(policy):
                # PEFT hosts one adapter per model when LoRA targets parameters (peft#3340): no "ref" adapter can
                # be added, so the starting policy is kept as a frozen copy (TRL falls back to the base model).
                return cls("copy", model=copy.deepcopy(policy).requires_grad_(False).eval())
            if adapter_is_pretrained:
                _add_frozen_ref_adapter(policy)
                return cls("ref_adapter", policy=policy)
            return cls("adapter_disabled", policy=policy)
        if policy_is_reference and ref_model is None:
            return cls("policy", policy=policy)
        if isinstance(ref_model, str):
            ref = load_model(ref_model, args, quantization_config, what="reference model")
        elif ref_model is not None:
            ref = ref_model
        elif _is_zero3_partitioned(policy):  # a ZeRO-3 partitioned policy cannot be deep-copied: reload it
            ref = load_model(policy.config._name_or_path, args, quantization_config, what="reference model")
        else:  # a deep copy works for models built in memory and never saved (reloading by name would fail there)
            ref = copy.deepcopy(policy)
        _check_same_vocabulary(policy, ref)
        if args.disable_dropout:
            disable_dropout(ref)
        return cls("copy", model=ref.requires_grad_(False).eval())

    def prepare(self, accelerator) -> None:
        """Place a separate reference on the engine in use (`prepare_frozen_model`)."""
        if self.kind == "copy":
            self.model = prepare_frozen_model(self.model, accelerator)

    @property
    def available(self) -> bool:
        return self.kind != "none"

    @contextlib.contextmanager
    def use(self, accelerator=None, policy_wrapped=None):
        """Yield the model that computes reference outputs; with PEFT, the policy in its reference state."""
        if self.kind == "none":
            raise RuntimeError(
                "This trainer has no reference model (beta == 0). Check trainer.reference_model.available."
            )
        if self.kind == "copy":
            yield self.model
            return
        callable_model = policy_wrapped if policy_wrapped is not None else self.policy
        if self.kind == "policy":
            yield callable_model
            return
        peft_model = accelerator.unwrap_model(policy_wrapped) if accelerator is not None else self.policy
        if self.kind == "adapter_disabled":
            with peft_model.disable_adapter():
                yield callable_model
            return
        active = peft_model.active_adapter
        peft_model.set_adapter(REF_ADAPTER)
        try:
            yield callable_model
        finally:
            peft_model.set_adapter(active)
            freeze_adapter(peft_model, REF_ADAPTER)


def prepare_frozen_model(model, accelerator):
    """Place a frozen model (reference, reward model) on the engine in use: DeepSpeed (ZeRO-3 sharded, lower stages
    inference-only), FSDP (sharded like the policy), or plain device placement without DDP. Returns it in eval mode."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        model = _prepare_deepspeed(model, accelerator)
    elif getattr(accelerator.state, "fsdp_plugin", None) is not None:
        model = _prepare_fsdp(model, accelerator)
    else:
        model = accelerator.prepare_model(model, evaluation_mode=True)
    model.eval()  # (DeepSpeedEngine.eval() returns None: do not chain it)
    return model


def freeze_adapter(model, name: str) -> None:
    """Keep PEFT adapter `name` out of training (PEFT's `set_adapter` makes the adapter it activates trainable)."""
    for param_name, param in model.named_parameters():
        if f".{name}." in param_name:
            param.requires_grad_(False)


def _adapter_targets_parameters(model) -> bool:
    """Whether the active adapter targets parameters (`target_parameters`, e.g. MoE experts) rather than modules."""
    return bool(getattr(model.peft_config[model.active_adapter], "target_parameters", None))


def _add_frozen_ref_adapter(model) -> None:
    """Add adapter "ref" as a frozen copy of the active adapter (its weights as they arrived)."""
    active = model.active_adapter
    model.add_adapter(REF_ADAPTER, model.peft_config[active])
    params = dict(model.named_parameters())
    for name, param in params.items():
        if f".{active}." in name:
            params[name.replace(f".{active}.", f".{REF_ADAPTER}.")].data.copy_(param.data)
    model.set_adapter(active)
    freeze_adapter(model, REF_ADAPTER)


def _is_zero3_partitioned(model) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned the model's parameters (they carry a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _check_same_vocabulary(policy, ref) -> None:
    """Reference log-probs are read at the policy's token ids: both models must share the vocabulary."""
    weights = [m.get_input_embeddings().weight for m in (policy, ref) if m.get_input_embeddings() is not None]
    sizes = [getattr(w, "ds_shape", w.shape)[0] for w in weights]  # ZeRO-3 keeps the full shape in ds_shape
    if len(sizes) == 2 and sizes[0] != sizes[1]:
        raise ValueError(
            f"The reference model's vocabulary ({sizes[1]} tokens) differs from the policy's ({sizes[0]}): its "
            "log-probs would be read at the wrong token ids. Use a reference with the policy's tokenizer (usually "
            "the same checkpoint), or omit ref_model to get a frozen copy of the policy."
        )


def _prepare_deepspeed(model, accelerator):
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    stage = config["zero_optimization"]["stage"]
    hidden = getattr(model.config, "hidden_size", None)
    if hidden is not None and stage == 3:
        config["zero_optimization"].update(
            reduce_bucket_size=hidden * hidden,
            stage3_param_persistence_threshold=10 * hidden,
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
        )
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config["zero_optimization"].pop("offload_optimizer", None)
    if stage != 3:  # ZeRO-1/2 shard optimizer state only: an inference-only engine (stage 0) suffices
        config["zero_optimization"]["stage"] = 0
    return deepspeed.initialize(model=model, config=config)[0]  # (engine, optimizer, dataloader, scheduler)


def _prepare_fsdp(model, accelerator):
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) == 2:
        from torch.distributed.fsdp import fully_shard

        layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin.set_auto_wrap_policy(model)
    return FSDP(
        model,
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        backward_prefetch=plugin.backward_prefetch,
        forward_prefetch=plugin.forward_prefetch,
        use_orig_params=plugin.use_orig_params,
        limit_all_gathers=plugin.limit_all_gathers,
        device_id=accelerator.device,
    )
