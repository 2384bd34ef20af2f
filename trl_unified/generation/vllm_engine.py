"""The vLLM engine of `generate_batched` (`use_vllm=True`): colocate mode here, server mode in vllm_server.py; each
group's prompt sent once with `n=G`, the sampled tokens' log-probs after temperature, weight sync. See docs/vllm.md."""

import contextlib
import importlib.util
import itertools
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import GenerationConfig

from ..models.loading import base_model
from .options import eos_ids
from .unwrap import _deepspeed_zero3, fsdp1_class, zero3_gathered


logger = logging.getLogger(__name__)

VLLM_EXTRA = "pip install 'trl_unified[vllm]'"
CRITIC_PREFIX = "value_model."  # the submodule PPO's critic is attached as (online/critic.attach_value_model)
_ENGINES: dict[str, Any] = {}  # colocate engines of this process, by their settings (reused across trainers)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(what: str = "use_vllm=True with vllm_mode='colocate'") -> None:
    """Raise a clear ImportError (naming the extra) when vLLM is not installed."""
    if not vllm_available():
        raise ImportError(f"{what} needs vLLM, which is not installed: {VLLM_EXTRA} (or `pip install vllm`).")


# ---------------------------------------------------------------------------------------------------- weights
def _vllm_name(name: str) -> str:
    """A parameter name as the checkpoint (and vLLM's loader) spells it: wrapper prefixes removed (TRL's rule)."""
    for prefix in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.", "modules_to_save.default."):
        name = name.replace(prefix, "")
    return name


def named_weights(model, accelerator=None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(checkpoint name, full tensor)` for every weight of the policy, one at a time, as docs/vllm.md ("When
    weights are synced") lists them for PEFT, ZeRO-3 and FSDP; every process must iterate (gathering is collective).
    Buffers are not needed by vLLM and are skipped."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
    is_peft = is_peft_model(unwrapped)
    gather_each = _deepspeed_zero3(accelerator) and not is_peft  # ZeRO-3: one parameter at a time (PEFT: all at once)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_full_parameters(unwrapped, accelerator, everything=is_peft))
        if is_peft:
            unwrapped.merge_adapter()
            stack.callback(unwrapped.unmerge_adapter)
        adapter_prefix = getattr(unwrapped, "prefix", "lora_") if is_peft else None
        for name, param in unwrapped.named_parameters():
            if is_peft:
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                if adapter_prefix in name or "original_module" in name:
                    continue
            if name.startswith(CRITIC_PREFIX):  # PPO's critic rides on the policy (online/critic.py)
                continue
            with zero3_gathered([param]) if gather_each else contextlib.nullcontext():
                tensor = param.data
                if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor
                    tensor = tensor.full_tensor()
                elif _deepspeed_zero3(accelerator):  # the gathered storage is released when the context exits
                    tensor = tensor.clone()
                yield _vllm_name(name), tensor


@contextlib.contextmanager
def _full_parameters(model, accelerator, everything: bool):
    """ZeRO-3 with PEFT (`everything`): every parameter gathered at once (merging needs base and adapter together);
    FSDP1: the full parameters summoned. Otherwise nothing (ZeRO-3 parameters are then gathered one at a time)."""
    if _deepspeed_zero3(accelerator) and everything:
        with zero3_gathered(model.parameters()):
            yield
        return
    FSDP = fsdp1_class()
    wrapped = (getattr(accelerator, "_models", None) or [None])[0]
    if FSDP is not None and isinstance(wrapped, FSDP):
        with FSDP.summon_full_params(wrapped, writeback=False):
            yield
        return
    yield


# ---------------------------------------------------------------------------------------------------- sampling
def sampling_settings(generation_config: GenerationConfig, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM's sampling parameters for a trainer's `GenerationConfig` (the same fields TRL passes): greedy when
    `do_sample` is off (temperature 0), generation stopped at the EOS ids, the sampled tokens' log-probs returned."""
    if generation_config.num_beams not in (None, 1):
        raise ValueError("use_vllm=True does not run beam search (num_beams > 1): vLLM samples or decodes greedily.")
    sample = bool(generation_config.do_sample)
    return {
        "temperature": float(generation_config.temperature or 1.0) if sample else 0.0,
        "top_p": float(generation_config.top_p or 1.0) if sample else 1.0,
        "top_k": int(generation_config.top_k or 0) if sample else 0,
        "min_p": float(generation_config.min_p or 0.0) if sample else 0.0,
        "repetition_penalty": float(generation_config.repetition_penalty or 1.0),
        "max_tokens": int(generation_config.max_new_tokens),
        "stop_token_ids": list(eos_token_ids) or list(eos_ids(generation_config)),
        "logprobs": 0,  # the sampled token's log-prob only
    }


def group_runs(prompt_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Consecutive identical prompts as `(prompt, count)`: a group of G rows becomes one request with `n=G`."""
    return [(ids, sum(1 for _ in run)) for ids, run in itertools.groupby(list(p) for p in prompt_ids)]


class VLLMEngine:
    """One of the two modes of the module docstring, behind the same three calls: `generate`, `sync_weights`,
    `close`. Built by `VLLMEngine.from_args` (a trainer's `OnlineConfig`)."""

    mode = "colocate"

    def __init__(self, args, structured_outputs_regex: str | None = None, generation_kwargs: dict | None = None):
        self.args = args
        self.structured_outputs_regex = structured_outputs_regex
        self.generation_kwargs = dict(generation_kwargs or {})
        self.synced = None  # (owner, version) of the weights the engine holds
        # Held while this process generates and while the weights are replaced: a reload never overlaps a request
        # (asynchronous rollouts generate in a producer thread).
        self.lock = threading.RLock()
        self.context = lambda: ""  # where the trainer stands, for error messages (OnlineTrainer sets it)
        self.syncing, self.sync_error = None, None  # a sync running in the background, and what stopped one

    @staticmethod
    def from_args(args, model, accelerator) -> "VLLMEngine":
        check_vllm_settings(args, model, accelerator)
        if args.vllm_mode == "server":
            from .vllm_server import VLLMServerEngine

            return VLLMServerEngine(args, accelerator)
        return VLLMColocateEngine(args, model, accelerator)

    @property
    def version(self) -> int | None:
        """The optimiser step (`state.global_step`) of the weights the engine holds; None before the first sync."""
        return self.synced[1] if self.synced is not None else None

    def ensure_synced(self, model, accelerator, owner, version) -> float:
        """Sync the policy's weights unless the engine already holds this `(owner, version)` of them; the seconds
        it took (0.0 when already synced)."""
        self.wait_for_sync()
        if self.synced == (id(owner), version):
            return 0.0
        start = time.perf_counter()
        with self.lock:
            self.synced = None  # until the new weights are in: a failed sync leaves the engine marked unsynced
            self.sync_weights(model, accelerator)
            self.synced = (id(owner), version)
        logger.debug(f"vLLM weights synced in {time.perf_counter() - start:.2f}s")
        return time.perf_counter() - start

    def sync_in_background(self, model, accelerator, owner, version) -> float:
        """Start a sync that completes while training goes on; the seconds training spent on it. An engine that
        cannot load a snapshot in the background syncs here (`ensure_synced`)."""
        return self.ensure_synced(model, accelerator, owner, version)

    def wait_for_sync(self) -> None:
        """Wait for a sync running in the background; raise what stopped it."""
        if self.syncing is not None:
            self.syncing.join()
            self.syncing = None
        if self.sync_error is not None:
            error, self.sync_error = self.sync_error, None
            raise error

    def sampling_settings(self, generation_config, eos_token_ids) -> dict[str, Any]:
        settings = {**sampling_settings(generation_config, eos_token_ids), **self.generation_kwargs}
        if self.structured_outputs_regex is not None:
            settings["structured_outputs"] = {"regex": self.structured_outputs_regex}
        return settings

    def generate(
        self, prompt_ids: list[list[int]], generation_config: GenerationConfig, eos_token_ids: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`(new tokens, their log-probs)` per prompt, in order."""
        raise NotImplementedError

    def sync_weights(self, model, accelerator) -> None:
        raise NotImplementedError

    def responsive(self, timeout: float) -> bool:
        """Whether the engine answers now (a server: its `/health` within `timeout` seconds). While a long request
        is in flight, an engine that answers is working; one that does not is stalled."""
        return True

    def abort_requests(self, thread: threading.Thread) -> None:
        """Make `thread`'s request in flight fail at once, and its later requests too (a producer being stopped)."""

    def close(self) -> None:
        pass


def check_vllm_config(args) -> None:
    """The rules on a config's vLLM fields alone, checked when the config is built (`OnlineConfig`); what depends on
    the machine (vLLM installed, CUDA) is checked when the trainer builds its engine (`check_vllm_settings`), so a
    config can be written where it will not run."""
    if args.vllm_mode not in ("colocate", "server"):
        raise ValueError(f"vllm_mode={args.vllm_mode!r} must be 'colocate' or 'server'.")
    if args.vllm_group_port != 51216:
        raise NotImplementedError(
            f"vllm_group_port={args.vllm_group_port} is the port of TRL's NCCL weight-update group "
            "(`trl vllm-serve`); trl_unified's server mode syncs weights through the server's /collective_rpc and "
            "needs no such port. Leave it at its default (51216)."
        )
    if args.vllm_weight_transfer not in ("checkpoint", "nccl"):
        raise ValueError(f"vllm_weight_transfer={args.vllm_weight_transfer!r} must be 'checkpoint' or 'nccl'.")
    if args.vllm_weight_transfer == "nccl" and args.vllm_mode != "server":
        raise ValueError("vllm_weight_transfer='nccl' is server mode's: set vllm_mode='server'.")
    if args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size < 1:
        raise ValueError(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} must be >= 1.")


def check_vllm_settings(args, model, accelerator) -> None:
    """What cannot work with this model and launch, named before any engine starts (the config's own rules were
    checked when it was built: `check_vllm_config`)."""
    config = getattr(accelerator.unwrap_model(model) if accelerator is not None else model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("use_vllm=True needs a decoder-only policy; vLLM does not train-sync encoder-decoder models.")
    if args.vllm_weight_transfer == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("vllm_weight_transfer='nccl' needs a CUDA device (NCCL).")
        require_vllm("vllm_weight_transfer='nccl' (the trainer joins vLLM's NCCL group)")
    if args.vllm_mode == "colocate":
        require_vllm()
        if args.vllm_enable_sleep_mode and not torch.cuda.is_available():
            raise ValueError("vllm_enable_sleep_mode=True needs a CUDA device (vLLM's sleep mode is CUDA-only).")
        world = accelerator.num_processes if accelerator is not None else 1
        tp = args.vllm_tensor_parallel_size
        if world % tp:
            raise ValueError(
                f"vllm_tensor_parallel_size={tp} must divide the number of training processes ({world}): in "
                "colocate mode each tensor-parallel group is made of training processes."
            )
        if config is not None and args.vllm_model_impl == "vllm":
            from vllm import ModelRegistry

            architectures = list(getattr(config, "architectures", None) or [])
            if architectures and not set(architectures) & set(ModelRegistry.get_supported_archs()):
                raise ValueError(
                    f"vLLM has no implementation of {architectures} (vllm_model_impl='vllm'). Set vllm_model_impl="
                    "'transformers' to run the transformers implementation inside vLLM, or use_vllm=False."
                )


def _engine_dtype(model) -> str:
    """vLLM's `dtype` for the policy's weights: float32, bfloat16 or float16 by name, else vLLM's choice."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _free_port() -> int:
    """A TCP port on loopback that no one listens on now (the colocated engine's process group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VLLMColocateEngine(VLLMEngine):
    def __init__(self, args, model, accelerator):
        super().__init__(args, args.vllm_structured_outputs_regex, engine_generation_kwargs(args))
        unwrapped = accelerator.unwrap_model(model)
        base = base_model(getattr(unwrapped, "_orig_mod", unwrapped))
        tp = args.vllm_tensor_parallel_size
        self.tp_group = None
        if tp > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(accelerator.num_processes // tp)]
            )
        settings = dict(
            tensor_parallel_size=tp,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_length,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            model_impl=args.vllm_model_impl,
            dtype=_engine_dtype(base),
            seed=accelerator.process_index // tp,
        )
        key = json.dumps([base.config.to_diff_dict(), settings], sort_keys=True, default=str)
        self.sleeping = False
        if key in _ENGINES:
            self.llm = _ENGINES[key]
            return
        # The engine starts from the config alone, with placeholder weights: the first generation syncs the policy's
        # weights into it (`ensure_synced`).
        folder = tempfile.mkdtemp(prefix="trl_unified-vllm-")
        base.config.save_pretrained(folder)
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        if accelerator.device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU backend's own default is larger
        from vllm import LLM

        self.llm = LLM(
            model=folder,
            skip_tokenizer_init=True,  # token ids in and out: the trainer's tokenizer does the text
            load_format="dummy",
            distributed_executor_backend="external_launcher",
            max_num_batched_tokens=4096,
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer's log-probs
            generation_config="vllm",  # the checkpoint's sampling defaults never apply
            enforce_eager=accelerator.device.type == "cpu",
            **settings,
        )
        _ENGINES[key] = self.llm

    def sync_weights(self, model, accelerator) -> None:
        if self.args.vllm_enable_sleep_mode and self.sleeping:
            self.llm.wake_up(tags=["weights"])
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": named_weights(model, accelerator), "is_checkpoint_format": True},
        )
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids, generation_config, eos_token_ids):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        settings = self.sampling_settings(generation_config, eos_token_ids)
        if isinstance(settings.get("structured_outputs"), dict):
            settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
        rows = slice(0, len(prompt_ids))
        if self.tp_group is not None:  # every rank of a tensor-parallel group generates the group's prompts
            gathered = [None] * self.args.vllm_tensor_parallel_size
            torch.distributed.all_gather_object(gathered, prompt_ids, group=self.tp_group)
            rank = torch.distributed.get_rank(group=self.tp_group)
            start = sum(len(part) for part in gathered[:rank])  # ranks may hold different numbers of prompts
            rows = slice(start, start + len(prompt_ids))
            prompt_ids = [p for part in gathered for p in part]
        runs = group_runs(prompt_ids)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in runs],
            sampling_params=[SamplingParams(n=n, detokenize=False, **settings) for _, n in runs],
            use_tqdm=False,
        )
        if self.args.vllm_enable_sleep_mode:
            self.llm.sleep(level=2)  # frees the weights too: the next generation syncs them again
            self.sleeping, self.synced = True, None
        completions, logprobs = [], []
        for output in outputs:
            for sample in output.outputs:
                completions.append(torch.tensor(list(sample.token_ids), dtype=torch.long))
                steps = sample.logprobs or [{}] * len(sample.token_ids)  # NaN where vLLM gave none, as TRL
                values = [float(s[t].logprob) if t in s else float("nan") for s, t in zip(steps, sample.token_ids)]
                logprobs.append(torch.tensor(values, dtype=torch.float32))
        return completions[rows], logprobs[rows]


# vLLM sampling parameters a `generation_kwargs` entry may set (passed through, as TRL does); the sampling fields
# both libraries share (temperature, top_p, ...) come from the GenerationConfig the kwargs already shaped.
_VLLM_SAMPLING_KEYS = {
    "seed", "frequency_penalty", "presence_penalty", "min_tokens", "ignore_eos", "structured_outputs", "stop",
    "bad_words", "logit_bias", "include_stop_str_in_output", "allowed_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "min_p", "top_k", "top_p", "temperature",
    "repetition_penalty", "max_tokens", "n", "logprobs",
}  # fmt: skip


def engine_generation_kwargs(args) -> dict:
    """`generation_kwargs` entries vLLM's sampling parameters know; any other key must be a `GenerationConfig`
    attribute (applied to the config the settings are read from), else it is named in an error."""
    kwargs = dict(args.generation_kwargs or {})
    unknown = [k for k in kwargs if k not in _VLLM_SAMPLING_KEYS and not hasattr(GenerationConfig(), k)]
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are neither vLLM sampling parameters nor GenerationConfig fields: with "
            "use_vllm=True they would have no effect."
        )
    return {k: v for k, v in kwargs.items() if k in _VLLM_SAMPLING_KEYS - {"n", "logprobs"}}


def write_checkpoint(folder, config, weights, write: bool) -> None:
    """`config.json` and `model.safetensors` (the named weights) in `folder`. The weights are iterated on every
    process (gathering may be collective); `write` says whether this process writes them."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in weights:  # every process iterates: each step may gather a sharded weight (a collective)
        if write:
            tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    if write:
        os.makedirs(folder, exist_ok=True)
        config.save_pretrained(folder)
        tmp = os.path.join(folder, "model.safetensors.tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, "model.safetensors"))
