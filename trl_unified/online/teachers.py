"""The teachers of the distillation trainers, one engine for all of them: a frozen model in this process, or a vLLM
server that scores the student's sequences (vLLM's prompt log-probs: the teacher's top-k log-probs at every
completion position, and its log-prob of the token the student sampled), one or several, each with a weight.

A server teacher is reached with TRL's client contract, `get_sequence_logprobs(sequences, prompt_lengths,
top_logprobs, temperature)`: TRL's own `trl.generation.vllm_client.VLLMClient` where TRL can build one (it needs
`requests` and vLLM in the training process), else `TeacherServer` (HTTP from the standard library, retries within
the timeout and errors naming the URL and where training stands, as the generation server's). A server whose
vocabulary is not the student's is refused before training, with both sizes named.

`SelfTeacher` is the teacher of self-distillation (SDFT, SDPO): the policy itself, as it started, as it is, or as an
exponential moving average of its weights.
"""

import contextlib
import logging
import math
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import is_peft_model

from ..core.reference import ReferenceModel, freeze_adapter, prepare_frozen_model
from ..generation.vllm_server import ServerConnection
from ..models.loading import load_model


logger = logging.getLogger(__name__)


@dataclass
class Teacher:
    """One teacher: a frozen, prepared `model` in this process, or a `client` of a vLLM server at `url`."""

    name: str
    weight: float
    model: torch.nn.Module | None = None
    client: Any = None
    url: str | None = None


def build_teachers(sources, urls, weights, args, accelerator, student_vocab_size: int, context) -> list[Teacher]:
    """The teachers of a run: each of `sources` (a model, or an id / path loaded with `teacher_model_init_kwargs`)
    frozen and prepared here, then each server URL of `urls`; `weights` one per teacher in that order (None: equal
    weights summing to 1). Vocabularies are checked against the student's before training."""
    sources = list(sources) if isinstance(sources, (list, tuple)) else [sources] if sources is not None else []
    urls = list(urls) if isinstance(urls, (list, tuple)) else [urls] if urls else []
    count = len(sources) + len(urls)
    weights = list(weights) if weights is not None else [1.0 / max(count, 1)] * count
    if len(weights) != count:
        raise ValueError(f"teacher_weights has {len(weights)} weights for {count} teachers; give one per teacher.")
    teachers = []
    for source, weight in zip(sources, weights, strict=False):
        model = load_teacher(source, args)
        vocabulary = model.config.get_text_config().vocab_size
        if vocabulary != student_vocab_size:
            raise ValueError(
                f"The student model has vocab_size {student_vocab_size} but the teacher model has vocab_size "
                f"{vocabulary}. Distillation compares the teacher's full next-token distribution, which requires a "
                "shared vocabulary. Use a teacher with the same vocab_size."
            )
        name = source if isinstance(source, str) else getattr(model.config, "_name_or_path", "") or "teacher"
        teachers.append(Teacher(name, weight, model=prepare_frozen_model(model.requires_grad_(False), accelerator)))
    for url, weight in zip(urls, weights[len(sources) :], strict=True):
        client = teacher_client(url, args.vllm_server_timeout, context)
        check_server_vocabulary(url, student_vocab_size)
        teachers.append(Teacher(url, weight, client=client, url=url))
    return teachers


def load_teacher(source, args) -> torch.nn.Module:
    """A teacher given as a model, or by id / path (with `teacher_model_init_kwargs` and `teacher_model_revision`)."""
    if not isinstance(source, str):
        if args.teacher_model_init_kwargs is not None:
            raise ValueError(
                "You passed teacher_model_init_kwargs to the config, but your teacher_model is already instantiated."
            )
        return source
    kwargs = dict(args.teacher_model_init_kwargs or {})
    if args.teacher_model_revision is not None:
        kwargs.setdefault("revision", args.teacher_model_revision)
    loading = types.SimpleNamespace(
        model_init_kwargs=kwargs, distributed_state=args.distributed_state, trust_remote_code=args.trust_remote_code
    )
    return load_model(source, loading, what="teacher model")


class TeacherServer:
    """A vLLM server scoring given sequences (`/v1/completions` with `prompt_logprobs`, one generated token), with
    `VLLMClient.get_sequence_logprobs`'s arguments and result (TRL 1.16)."""

    def __init__(self, base_url: str, timeout: float = 240.0, context=lambda: ""):
        hint = f"Start it first, e.g. `vllm serve TEACHER --port {base_url.rsplit(':', 1)[-1].rstrip('/')}`."
        self.server = ServerConnection(base_url, timeout, context, start_hint=hint)
        self.base_url = self.server.base_url
        self.server.wait_until_up(timeout, "teacher start-up")
        self.model = self.server.request("GET", "/v1/models", phase="teacher start-up")["data"][0]["id"]

    def get_sequence_logprobs(
        self, sequences, prompt_lengths, top_logprobs=100, temperature=1.0, chunk_size=0, max_concurrent_requests=4
    ) -> dict[str, list]:
        """Per sequence, from `prompt_lengths[i]` on: the top `top_logprobs` log-probs sorted by rank and their ids
        (padded with -inf / 0), and the log-prob of the token at each position (-inf when the server omits it)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        chunk_size = chunk_size if chunk_size > 0 else len(sequences)
        starts = range(0, len(sequences), chunk_size)
        chunks = [(sequences[i : i + chunk_size], prompt_lengths[i : i + chunk_size]) for i in starts]

        def send(chunk):
            body = {
                "model": self.model,
                "prompt": chunk[0],
                "max_tokens": 1,
                "temperature": temperature,
                "prompt_logprobs": top_logprobs,
            }
            choices = self.server.request("POST", "/v1/completions", body, phase="teacher scoring")["choices"]
            choices = sorted(choices, key=lambda choice: choice["index"])
            return [_format_sequence_logprobs(c, s, p, top_logprobs) for c, s, p in zip(choices, *chunk, strict=True)]

        with ThreadPoolExecutor(max_workers=max(1, min(max_concurrent_requests, len(chunks)))) as pool:
            results = [result for chunk in pool.map(send, chunks) for result in chunk]
        return {key: [result[key] for result in results] for key in results[0]} if results else {}


def _format_sequence_logprobs(choice: dict, sequence: list[int], prompt_length: int, top_k: int) -> dict:
    logprobs, token_ids, actual, actual_ids = [], [], [], []
    for position in range(prompt_length, len(choice["prompt_logprobs"])):
        entry = choice["prompt_logprobs"][position] or {}
        items = sorted(entry.items(), key=lambda item: item[1]["rank"])[:top_k]
        values = [-math.inf if math.isnan(item["logprob"]) else item["logprob"] for _, item in items]
        logprobs.append(values + [-math.inf] * (top_k - len(values)))
        token_ids.append([int(token) for token, _ in items] + [0] * (top_k - len(items)))
        own = entry.get(str(sequence[position]))
        actual.append([-math.inf if own is None or math.isnan(own["logprob"]) else own["logprob"]])
        actual_ids.append([sequence[position]])
    return {
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
        "actual_logprobs": actual,
        "actual_token_ids": actual_ids,
    }


def teacher_client(url: str, timeout: float = 60.0, context=lambda: ""):
    """A client of the teacher server at `url`: TRL's `VLLMClient` where TRL can build one, else `TeacherServer`."""
    from trl.generation import vllm_client

    try:
        return vllm_client.VLLMClient(base_url=url, connection_timeout=timeout)
    except ImportError:  # TRL's client needs requests and vLLM in this process; the standard library suffices
        return TeacherServer(url, timeout, context)


def check_server_vocabulary(url: str, student_vocab_size: int) -> None:
    """Refuse a teacher server whose vocabulary differs from the student's (before training); warn where the server
    cannot be asked (`served_vocab_size`)."""
    served = served_vocab_size(url, student_vocab_size)
    if served is None:
        logger.warning(f"The teacher server at {url} does not report its vocabulary size: it was not checked.")
    elif served != student_vocab_size:
        raise ValueError(
            f"The student model has vocab_size {student_vocab_size} but the teacher server at {url} serves a model "
            f"with vocab_size {served}. Distillation compares the teacher's next-token distribution over the "
            "student's vocabulary: serve a teacher with the same vocabulary."
        )


def served_vocab_size(url: str, guess: int) -> int | None:
    """The vocabulary bound of the model a vLLM server serves, as vLLM enforces it (the smallest token id it refuses
    as "out of vocabulary": the larger of the model's vocabulary and the tokenizer's ids), found with one-token
    requests: `guess` and `guess - 1` first (the student's size: two requests when they agree), else by bisection.
    None where the server answers otherwise (no such check, or unreachable)."""
    server = ServerConnection(url, timeout=10)

    def accepts(token_id: int) -> bool | None:
        try:
            model = server.send("GET", "/v1/models", None, 10)["data"][0]["id"]
            body = {"model": model, "prompt": [[token_id]], "max_tokens": 1}
            status, text = server.exchange("POST", "/v1/completions", body, 60)
        except Exception:  # noqa: BLE001 (unreachable: not checked)
            return None
        if status == 200:
            return True
        return False if "out of vocabulary" in text else None

    below, at = accepts(guess - 1), accepts(guess)
    if below is None or at is None:
        return None
    if below and not at:
        return guess
    low, high = (guess, 2 * guess) if at else (0, guess - 1)  # accepts(low), refuses(high) once found
    while at and accepts(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepts(middle) else (low, middle)
    return high


def build_teacher_request_inputs(input_ids, attention_mask, prompt_attention_mask=None, labels=None):
    """TRL's helper: each row trimmed by `attention_mask`, its prompt length (from `prompt_attention_mask`, else the
    row's length minus its labelled tokens) and its completion length, as lists."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must have the same shape, got {input_ids.shape} and {attention_mask.shape}."
        )
    mask = attention_mask.detach().cpu().bool()
    if prompt_attention_mask is not None:
        prompt_lengths = prompt_attention_mask.detach().cpu().sum(dim=1)
    else:
        if labels is None:
            raise ValueError("labels are required when prompt_attention_mask is not provided.")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must match input_ids shape, got {labels.shape} and {input_ids.shape}.")
        prompt_lengths = mask.sum(dim=1) - (labels.detach().cpu() != -100).sum(dim=1)
    sequences, prompts, completions = [], [], []
    for row, row_mask, length in zip(input_ids.detach().cpu(), mask, prompt_lengths.tolist(), strict=True):
        kept = row[row_mask].tolist()
        if not 0 <= length <= len(kept):
            raise ValueError(f"Invalid prompt length {length} for trimmed sequence of length {len(kept)}.")
        sequences.append(kept)
        prompts.append(int(length))
        completions.append(len(kept) - int(length))
    return sequences, prompts, completions


def server_token_logprobs(client, inputs, aligned_prompt_length: int, top_k: int, temperature: float) -> dict:
    """TRL's `_get_teacher_token_logprobs_from_server`: the teacher's log-probs of the rows of `inputs`
    (`input_ids`, `attention_mask`, `labels`, optionally `prompt_attention_mask`), placed in the student's loss
    coordinates (column 0 = position `aligned_prompt_length`; each row shifted to its first labelled token):
    `actual_logprobs` `(B, T)`, `topk_logprobs` `(B, T, K)` (-inf where missing), `topk_token_ids` `(B, T, K)`."""
    input_ids, labels = inputs["input_ids"], inputs.get("labels")
    sequences, prompt_lengths, completion_lengths = build_teacher_request_inputs(
        input_ids, inputs["attention_mask"], prompt_attention_mask=inputs.get("prompt_attention_mask"), labels=labels
    )
    result = client.get_sequence_logprobs(
        sequences=sequences, prompt_lengths=prompt_lengths, top_logprobs=top_k, temperature=temperature
    )
    if labels is None:
        raise ValueError("labels are required to align teacher-server logprobs with the student loss tensors.")
    offsets = [
        int(torch.nonzero(row != -100)[0].item()) - aligned_prompt_length if length else 0
        for row, length in zip(labels, completion_lengths, strict=True)
    ]
    width = max((o + len(lps) for o, lps in zip(offsets, result["logprobs"], strict=True)), default=0)
    batch, device = input_ids.size(0), input_ids.device
    actual = torch.full((batch, width), -math.inf)
    topk = torch.full((batch, width, top_k), -math.inf)
    ids = torch.zeros((batch, width, top_k), dtype=torch.long)
    for i, offset in enumerate(offsets):
        if result["logprobs"][i]:
            n = len(result["logprobs"][i])
            actual[i, offset : offset + n] = torch.tensor(result["actual_logprobs"][i], dtype=torch.float32)[:, 0]
            topk[i, offset : offset + n] = torch.tensor(result["logprobs"][i], dtype=torch.float32)
            ids[i, offset : offset + n] = torch.tensor(result["logprob_token_ids"][i], dtype=torch.long)
    return {"actual_logprobs": actual.to(device), "topk_logprobs": topk.to(device), "topk_token_ids": ids.to(device)}


TEACHER_ADAPTER = "teacher"
SELF_TEACHER_KINDS = ("base", "live", "ema")


class SelfTeacher:
    """The policy as its own teacher (SDFT, SDPO): one more teacher kind of the engine above, read on the same
    sequences with a privileged prompt. Kinds (TRL's `teacher_model_kind`):

      - `"live"`: the policy's current weights (no copy).
      - `"base"`: the starting policy, frozen (a `ReferenceModel`: the PEFT policy with its adapter disabled, else a
        frozen copy prepared for DeepSpeed / FSDP).
      - `"ema"`: an exponential moving average of the policy, θ_T ← (1 - r) θ_T + r θ_S every `sync_steps` optimiser
        steps (r = `update_rate`), updated in place by `update`: a frozen copy of a full policy, or, for a LoRA policy,
        a second adapter named "teacher" that starts at zero (the base model) and averages the student adapter's A
        and B matrices (TRL's `PEFTAdapterEMACallback`).

    Use it only through `use(policy_wrapped)`, under `torch.no_grad()`: it yields the module to run.
    """

    def __init__(self, kind: str, policy, reference=None, update_rate: float = 0.0, sync_steps: int = 1):
        self.kind, self.policy, self.reference = kind, policy, reference
        self.update_rate, self.sync_steps = update_rate, sync_steps
        self.shadow = None  # the LoRA EMA teacher's adapter weights (PEFT state-dict keys)
        self.student_adapter = None  # the LoRA EMA teacher: the policy's own adapter, which it averages

    @classmethod
    def build(cls, kind: str, policy, args, accelerator, adapter_is_pretrained: bool = False) -> "SelfTeacher":
        """The self-teacher of `kind` for `policy` (unwrapped, before training), prepared on the engine in use."""
        if kind not in SELF_TEACHER_KINDS:
            raise ValueError(f"teacher_model_kind={kind!r} is not one of {SELF_TEACHER_KINDS}.")
        rate, steps = args.teacher_update_rate, args.teacher_sync_steps
        if kind == "live":
            return cls(kind, policy)
        if kind == "ema" and is_peft_model(policy):
            if not is_pure_lora(policy):
                raise ValueError(
                    "`teacher_model_kind='ema'` with a non-pure-LoRA PEFT model is not supported: the EMA teacher "
                    "of a PEFT policy averages its LoRA adapter, so every trainable parameter must be a LoRA "
                    "weight. Use teacher_model_kind='base' or 'live', or a LoRA adapter."
                )
            teacher = cls(kind, policy, update_rate=rate, sync_steps=steps)
            teacher._add_teacher_adapter()
            return teacher
        if kind == "base" and adapter_is_pretrained:
            logger.warning(
                "The provided self-distillation student model already contains a PEFT adapter. With "
                "teacher_model_kind='base' the teacher is the base model with that adapter disabled."
            )
        reference = ReferenceModel.build(policy, None, args, needed=True, adapter_is_pretrained=False)
        reference.prepare(accelerator)
        return cls(kind, policy, reference, rate, steps)

    @property
    def model(self) -> torch.nn.Module:
        """TRL's `trainer.teacher_model`: the separate frozen model, else the policy itself."""
        return self.reference.model if self.reference is not None and self.reference.kind == "copy" else self.policy

    @contextlib.contextmanager
    def use(self, policy_wrapped, accelerator):
        """Yield the module that computes the teacher's logits (the policy in its teacher state, or the copy)."""
        if self.reference is not None:
            with self.reference.use(accelerator, policy_wrapped) as model:
                yield model
            return
        if self.kind == "live":
            yield policy_wrapped
            return
        peft_model = accelerator.unwrap_model(policy_wrapped)
        active = peft_model.active_adapter
        peft_model.set_adapter(TEACHER_ADAPTER)
        try:
            yield policy_wrapped
        finally:
            peft_model.set_adapter(active)
            freeze_adapter(peft_model, TEACHER_ADAPTER)

    @torch.no_grad()
    def update(self, policy, global_step: int) -> None:
        """One EMA step after optimiser step `global_step` (every `sync_steps`; nothing for "base" and "live")."""
        if self.kind != "ema" or global_step % self.sync_steps != 0:
            return
        if self.reference is not None:
            from trl import SyncRefModelCallback  # ZeRO-3: gathers the partitioned parameters

            SyncRefModelCallback.sync_target_model(policy, self.reference.model, self.update_rate)
            return
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        student = get_peft_model_state_dict(policy, adapter_name=self.student_adapter)
        for key, value in student.items():
            self.shadow[key].mul_(1 - self.update_rate).add_(value.detach(), alpha=self.update_rate)
        set_peft_model_state_dict(policy, self.shadow, adapter_name=TEACHER_ADAPTER)
        freeze_adapter(policy, TEACHER_ADAPTER)

    def _add_teacher_adapter(self) -> None:
        """The LoRA EMA teacher's adapter "teacher", zero-initialised (the base model), frozen, and its shadow."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        policy = self.policy
        active = self.student_adapter = policy.active_adapter
        student = get_peft_model_state_dict(policy, adapter_name=active)
        self.shadow = {k: torch.zeros_like(v) for k, v in student.items()}
        policy.add_adapter(TEACHER_ADAPTER, policy.peft_config[active])
        set_peft_model_state_dict(policy, self.shadow, adapter_name=TEACHER_ADAPTER)
        policy.set_adapter(active)
        freeze_adapter(policy, TEACHER_ADAPTER)

    def state_dict(self) -> dict[str, Any]:
        """The EMA teacher's weights, saved with checkpoints (nothing for "base" and "live")."""
        if self.kind != "ema":
            return {}
        if self.reference is not None:
            return {"weights": {k: v.detach().cpu() for k, v in self.reference.model.state_dict().items()}}
        return {"shadow": {k: v.detach().cpu() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "weights" in state:
            self.reference.model.load_state_dict(state["weights"])
        elif "shadow" in state:
            from peft import set_peft_model_state_dict

            for key, value in state["shadow"].items():
                self.shadow[key].copy_(value)
            set_peft_model_state_dict(self.policy, self.shadow, adapter_name=TEACHER_ADAPTER)
            freeze_adapter(self.policy, TEACHER_ADAPTER)


def is_pure_lora(model) -> bool:
    """TRL's `is_pure_lora_training`: the active adapter is LoRA and every trainable parameter a LoRA weight."""
    config = model.peft_config.get(model.active_adapter or "default")
    if config is None or str(config.peft_type).split(".")[-1] != "LORA":
        return False
    return all("lora_" in name for name, param in model.named_parameters() if param.requires_grad)
