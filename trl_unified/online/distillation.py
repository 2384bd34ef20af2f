r"""The distillation core (DistillationTrainer, GKD, ServerDistillation, IW-OPD, AsyncDistillation): a student pulled
toward its teachers (`online/teachers.py`: models in this process or vLLM servers, each with a weight w_k) by the
generalized Jensen-Shannon divergence D_beta of `core/divergence.py`, per completion position

    D(i, t) = sum_k w_k D_beta(student || teacher_k)(i, t)

dense (the whole vocabulary, from both models' final hidden states in chunks) for a teacher in this process, sparse
(the support a server reports: its top-k, or its top-1 and the sampled token, with a tail bucket) for a teacher on a
server. A round's completions come from `CompletionMix` (the student's samples, or the dataset's, or a teacher's);
there is no reward, ratio or reference model. Batches in TRL's keys (`input_ids`, `attention_mask`, `labels`) reach
the same divergence (`labelled_loss`), as TRL's static API and tests call it.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..core.divergence import (
    CHUNK_ELEMENTS,
    generalized_jsd_loss,
    reduce_divergence,
    sparse_divergence,
    token_divergence,
    top1_support,
    topk_support,
)
from ..core.lm_head import HiddenStateHead
from ..core.logprobs import position_ids_from_mask
from ..generation import generate_batched
from ..generation.fallbacks import report_fallback
from ..generation.packed_weights import packed_linear_weights
from ..generation.sharing import PrefixSharingUnsupported, cache_kwarg, common_prefix, common_prefix_cache
from ..models.token_ids import embedding_rows, mask_padding
from .completions import CompletionMix, SampledCompletions
from .rollout import RolloutBatch, RolloutPlan, Samples
from .teachers import Teacher, build_teachers, server_token_logprobs
from .trainer import OnlineTrainer


class DistillationCore(OnlineTrainer):
    """The online core with teachers instead of rewards (see the module docstring). A trainer passes its teachers'
    sources as `self._teacher_source` (set before `super().__init__`) and implements `compute_policy_loss`."""

    # TRL 1.10's static loss API (GKDTrainer's too): the loss below goes through `_reduce_divergence_loss`
    generalized_jsd_loss = staticmethod(generalized_jsd_loss)
    _reduce_divergence_loss = staticmethod(reduce_divergence)

    def setup(self) -> None:
        super().setup()
        student_vocabulary = self.accelerator.unwrap_model(self.model).config.get_text_config().vocab_size
        self.teachers = self.build_teachers(student_vocabulary)
        del self._teacher_source
        self.mix = self.completion_mix()

    def build_teachers(self, student_vocabulary: int) -> list[Teacher]:
        args = self.args
        sources = self._teacher_source if self._teacher_source is not None else args.teacher_model_name_or_path
        urls = args.teacher_model_server_url
        if sources is None and not urls:
            raise ValueError(
                f"{type(self).__name__} needs a teacher: pass teacher_model= (a model or an id / path, or a list of "
                "them), or set args.teacher_model_name_or_path or args.teacher_model_server_url."
            )
        return build_teachers(
            sources, urls, args.teacher_weights, args, self.accelerator, student_vocabulary, self._where
        )

    # TRL's attributes: the (first) teacher model in this process, the (first) teacher server's client
    @property
    def teacher_model(self):
        return next((t.model for t in self.teachers if t.model is not None), None)

    @property
    def teacher_client(self):
        return next((t.client for t in self.teachers if t.client is not None), None)

    @teacher_client.setter
    def teacher_client(self, client) -> None:
        server = next((t for t in self.teachers if t.client is not None), None)
        if server is None:
            raise ValueError("This trainer has no teacher server whose client could be replaced.")
        server.client = client

    # A server teacher's support: the top-k it reports (`loss_top_k`), with the sampled token too at beta = 0 when
    # `support_includes_sampled` (TRL's asynchronous trainer), and the tail bucket (`loss_add_tail`).
    loss_top_k = property(lambda self: self.args.loss_top_k)
    loss_add_tail = property(lambda self: self.args.loss_add_tail)
    support_includes_sampled = False

    # ------------------------------------------------------------------ the rollout: no reward, no ratio
    def completion_mix(self) -> CompletionMix:
        """Where each round's completions come from: always the student's samples (on-policy distillation); GKD mixes
        in the dataset's or the teacher's."""
        return CompletionMix()

    @property
    def divergence_temperature(self) -> float:
        """The temperature both models' logits are divided by in D: the sampling temperature (TRL's
        DistillationTrainer); GKD's loss reads the models themselves (1.0)."""
        return self.args.temperature

    def rows_of(self, batch) -> list[dict]:
        """Rows as the dataset has them, or (a collator of TRL's keys: GKD's, IW-OPD's) each row's prompt tokens (what
        the student continues) and the dataset's completion tokens."""
        if isinstance(batch, list):
            return batch
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompts"], batch["prompt_attention_mask"])]
        completions = [labels[labels != -100].tolist() for labels in batch["labels"]]
        return [{"prompt": p, "completion_ids": c} for p, c in zip(prompts, completions, strict=True)]

    def sample_completions(self, rows, prompts, images, environments) -> SampledCompletions:
        source = self.mix.draw(self.mode)
        if source == "policy":
            return super().sample_completions(rows, prompts, images, environments)
        if source == "dataset":
            return self.given_completions(prompts, [row["completion_ids"] for row in rows], conversational=False)
        return self.teacher_samples(prompts)

    def teacher_samples(self, prompts) -> SampledCompletions:
        """The teacher's own completions of `prompts` (sequence-level KD), with the student's sampling settings."""
        if self.teacher_model is None:
            raise ValueError("seq_kd needs a teacher model in this process to generate from (not a teacher server).")
        out = generate_batched(
            self.teacher_model,
            self.processing_class,
            prompts,
            generation_config=self.make_generation_config(),
            accelerator=self.accelerator,
            chat_template_kwargs=self.args.chat_template_kwargs,
            eos_token_ids=self.eos_token_ids,
            lean_decoding=self.args.lean_decoding,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
        )
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(out.prompt_ids, out.prompt_mask, strict=True)]
        return self.given_completions(prompt_ids, out.completion_ids_list, conversational=False)

    def rollout_plan(self) -> RolloutPlan:
        return RolloutPlan(old_logps_train=False, old_logps_eval=False)  # no ratio in the loss: π_old is never read

    def build_rewards(self) -> None:
        return None  # the teachers' distributions are the signal

    def score_rollout(self, batch: RolloutBatch, samples: Samples, mode: str) -> None:
        """No rewards and no advantages: the round is only logged."""
        self.log_unscored_round(batch, samples)

    # ------------------------------------------------------------------ the divergence
    def labelled_loss(self, model, inputs, num_items_in_batch=None):
        """The loss of a batch in TRL's keys (GKD's collator, TRL 1.10's distillation batches): `input_ids`,
        `attention_mask`, `labels` (-100 off the completion); D at every position whose next token is labelled,
        summed and divided by `num_items_in_batch` when given, else averaged over those positions."""
        input_ids, attention_mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        mask = (labels[:, 1:] != -100).long()
        divergence, _ = self.token_divergence(
            model, input_ids, attention_mask, input_ids.size(1) - 1, mask, labels, inputs.get("prompt_attention_mask")
        )
        return self._reduce_divergence_loss(divergence, completion_mask=mask, num_items_in_batch=num_items_in_batch)

    def token_divergence(
        self, model, input_ids, attention_mask, width: int, mask=None, labels=None, prompt_mask=None, routing=None
    ):
        """`(D, student entropy)` `(B, width)` of the last `width` tokens, at `mask`'s positions if given (0
        elsewhere): the teachers' weighted sum, or with `routing` `(B,)` (a teacher index per row: TRL's multi-teacher
        routing) each row's own teacher's. A server teacher aligns its rows by `labels` (-100 off the completion) and
        `prompt_mask`."""
        divergence = entropy = None
        for index, teacher in enumerate(self.teachers):
            rows = torch.ones(len(input_ids), dtype=torch.bool, device=input_ids.device)
            if routing is not None:
                rows = routing == index
                if not rows.any():
                    continue
            part = [t[rows] if t is not None else None for t in (input_ids, attention_mask, mask, labels, prompt_mask)]
            d, e = self.teacher_divergence(model, teacher, width, *part)
            weight = teacher.weight if routing is None else 1.0
            if divergence is None:
                divergence = torch.zeros(len(input_ids), width, dtype=d.dtype, device=d.device)
                entropy = torch.zeros_like(divergence)
            divergence[rows] += weight * d
            entropy[rows] = e.to(entropy.dtype)
        return divergence, entropy

    def teacher_divergence(self, model, teacher: Teacher, width, input_ids, attention_mask, mask, labels, prompt_mask):
        """One teacher's `(D, student entropy)`: dense, on a local support, or on a server's."""
        if teacher.model is not None and self.local_support_size:
            return self.local_support_divergence(model, teacher.model, input_ids, attention_mask, width, mask)
        if teacher.model is not None:
            return self.dense_divergence(model, teacher.model, input_ids, attention_mask, width, mask)
        return self.server_divergence(model, teacher, input_ids, attention_mask, width, mask, labels, prompt_mask)

    local_support_size = 0  # > 0: a teacher in this process is read on a support of that many tokens, as a server's

    def local_support_divergence(self, model, teacher_model, input_ids, attention_mask, width: int, mask=None):
        """D on a support of a local teacher's distribution (IW-OPD's `loss_top_k`): its top-1 and the sampled token
        (beta > 0, one token), else `topk_support`; the tail bucket or renormalised, as a server's."""
        student_logits, teacher_log_probs = self.both_log_probs(model, teacher_model, input_ids, attention_mask, width)
        student = torch.log_softmax(student_logits.float() / self.divergence_temperature, dim=-1)
        tokens, beta, k = input_ids[:, -width:], self.args.beta, self.local_support_size
        if beta > 0 and k == 1:
            reverse = tokens if self.args.reverse_kl_top_1_mode == "sampled" else student_logits.argmax(-1)
            top1 = teacher_log_probs.max(-1)
            sampled = teacher_log_probs.gather(-1, reverse[..., None])[..., 0]
            ids, teacher, support = top1_support(top1.indices, top1.values, reverse, sampled, beta)
        else:
            ids, support = topk_support(student, teacher_log_probs, beta, k)
            teacher = teacher_log_probs.gather(-1, ids)
        divergence = sparse_divergence(student, ids, teacher, support, beta, self.loss_add_tail)
        with torch.no_grad():
            entropy = -(student.exp() * student).sum(-1)
        return divergence if mask is None else divergence * mask, entropy

    def both_log_probs(self, model, teacher_model, input_ids, attention_mask, width: int):
        """The student's logits `(B, width, V)` (with grad) and the teacher's log-probs at the divergence's
        temperature (without), predicting the last `width` tokens."""
        student = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width + 1).logits[:, :-1]
        with torch.no_grad():
            teacher = teacher_model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width + 1)
        return student, torch.log_softmax(teacher.logits[:, :-1].float() / self.divergence_temperature, dim=-1)

    def sampled_token_logprobs(self, model, teacher: Teacher, input_ids, attention_mask, width, labels, prompt_mask):
        """The student's logits `(B, width, V)` and the teacher's log-prob of each of the last `width` tokens
        `(B, width)` (-inf where a server omits one), from a teacher in this process or a server."""
        if teacher.model is not None:
            logits, teacher_log_probs = self.both_log_probs(model, teacher.model, input_ids, attention_mask, width)
            return logits, teacher_log_probs.gather(-1, input_ids[:, -width:, None])[..., 0]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if prompt_mask is not None:
            inputs["prompt_attention_mask"] = prompt_mask
        start, temperature = input_ids.size(1) - width, self.divergence_temperature
        result = server_token_logprobs(teacher.client, inputs, start, self.loss_top_k, temperature)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width + 1).logits[:, :-1]
        return logits, fit_to_width(result["actual_logprobs"], width)

    def _get_teacher_token_logprobs_from_server(self, inputs, aligned_prompt_length: int) -> dict:
        """TRL's method: the teacher's log-probs of `inputs` in the loss's coordinates (`server_token_logprobs`)."""
        return server_token_logprobs(
            self.teacher_client, inputs, aligned_prompt_length, self.loss_top_k, self.temperature
        )

    def _store_completions_in_buffer(
        self,
        slices,
        on_policy_indices,
        local_slice_indices,
        local_prompts,
        completion_ids,
        logprobs=None,
        logprob_token_ids=None,
    ):
        """TRL's buffer helper (IW-OPD's vLLM path): each on-policy slice rebuilt from its sampled completions in TRL's
        keys (`batch_in_trl_keys`, completions at `max_new_tokens`), with the sampled tokens' log-probs."""
        pad, width = self.processing_class.pad_token_id or 0, self.generation_config.max_new_tokens
        decode = functools.partial(
            self.processing_class.batch_decode, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        for index in on_policy_indices:
            rows = [i for i, owner in enumerate(local_slice_indices) if owner == index]
            sampled = None
            if logprobs is not None:  # each sampled token's log-prob among those vLLM returned at its step
                steps = [zip(logprobs[i], logprob_token_ids[i], completion_ids[i], strict=True) for i in rows]
                sampled = [[values[ids.index(token)] for values, ids, token in row] for row in steps]
            prompts, completions = [local_prompts[i] for i in rows], [completion_ids[i][:width] for i in rows]
            batch = batch_in_trl_keys(prompts, completions, pad, width, sampled, self.accelerator.device)
            self._buffered_inputs[index] = {**slices[index], **batch}
            self._buffered_text_logs[index] = (decode(prompts), decode(completions))

    def _compute_prompt_length(self, inputs) -> int:
        """TRL's method: the shortest real prompt of a batch in TRL's keys (where every row's completion has begun)."""
        if inputs.get("labels") is not None:
            return int((inputs["attention_mask"].sum(1) - (inputs["labels"] != -100).sum(1)).min().item())
        return inputs["prompts"].shape[1]

    def dense_divergence(self, model, teacher_model, input_ids, attention_mask, width: int, mask=None):
        """D over the whole vocabulary from both models' final hidden states in chunks (a common prompt prefix
        encoded once where `shared_prefix` allows), else from their logits (ZeRO-3 / FSDP shards, a compiled
        model); docs/distillation.md."""
        teacher_model.eval()
        student = teacher = student_hidden = teacher_hidden = None
        if self.args.chunked_lm_head:
            student, teacher = HiddenStateHead.of(model), HiddenStateHead.of(teacher_model)
        if student is not None and teacher is not None:
            shared = all(self.uses_shared_prefix(m, "distillation forward") for m in (model, teacher_model))
            layout = common_prefix(input_ids, attention_mask, input_ids.size(1) - width) if shared else None
            # The frozen teacher first, its float32 CPU linear weights packed once for the pass (freed before the
            # student's activations exist): each product would otherwise repack its weight (generation/packed_weights)
            with torch.no_grad(), packed_linear_weights(teacher.decoder, input_ids.numel()):
                teacher_hidden = self._hidden(teacher, input_ids, attention_mask, width, layout)
            student_hidden = self._hidden(student, input_ids, attention_mask, width, layout)
        if student_hidden is None or teacher_hidden is None:
            return self._divergence_from_logits(model, teacher_model, input_ids, attention_mask, width)
        real = None if mask is None or bool(mask.all()) else mask.bool()
        if real is not None:  # only the positions the loss reads go to the vocabulary
            student_hidden, teacher_hidden = student_hidden[real][None], teacher_hidden[real][None]
        linear = (student.linear(), teacher.linear())  # both plain linear heads: the gradient in the forward
        divergence, entropy = token_divergence(
            student_hidden,
            teacher_hidden,
            student.head,
            teacher.head,
            self.args.beta,
            self.divergence_temperature,
            student.transform,
            teacher.transform,
            linear=None if None in linear else linear,
        )
        if real is None:
            return divergence, entropy
        return tuple(v.new_zeros(real.shape).masked_scatter(real, v[0]) for v in (divergence, entropy))

    def server_divergence(self, model, teacher: Teacher, input_ids, attention_mask, width, mask, labels, prompt_mask):
        """D over the support a teacher server reports (`core/divergence.py`, "sparse supports"): its top-k at
        beta = 0; its top-1 and the sampled token otherwise (the sampled token alone at beta = 1); the student's
        log-probs over the whole vocabulary at the positions the loss reads, from its final hidden states (a common
        prompt prefix encoded once, as the local divergence) a chunk of positions at a time
        (`student_support_divergence`), else from its logits."""
        mask = torch.ones_like(input_ids[:, -width:]) if mask is None else mask
        if labels is None:  # the completion block, aligned at its first token
            completion = input_ids[:, -width:].masked_fill(mask == 0, -100)
            labels = torch.cat([torch.full_like(input_ids[:, :-width], -100), completion], dim=1)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if prompt_mask is not None:
            inputs["prompt_attention_mask"] = prompt_mask
        temperature, start = self.divergence_temperature, input_ids.size(1) - width
        try:
            result = server_token_logprobs(teacher.client, inputs, start, self.loss_top_k, temperature)
        except OSError as error:  # unreachable beyond its client's retries (requests' errors are OSErrors too)
            if "global step" in str(error):  # `TeacherServer` named where training stands already
                raise
            raise ConnectionError(
                f"The teacher server at {teacher.url} could not score the batch{self._where()}: {error}. Restart "
                "the server, then resume with `trainer.train(resume_from_checkpoint=True)`."
            ) from error
        required = mask.bool()
        keys = ("actual_logprobs", "topk_logprobs", "topk_token_ids")
        actual, topk, ids = (fit_to_width(result[key], width)[required] for key in keys)
        tokens = input_ids[:, -width:][required]
        support = (tokens, actual, topk, ids, self.args.beta, self.loss_add_tail, self.support_includes_sampled)
        head = HiddenStateHead.of(model) if self.args.chunked_lm_head else None
        shared = head is not None and self.uses_shared_prefix(model, "distillation forward")
        layout = common_prefix(input_ids, attention_mask, input_ids.size(1) - width) if shared else None
        hidden = self._hidden(head, input_ids, attention_mask, width, layout) if head is not None else None
        if hidden is not None:
            divergence, entropy = student_support_divergence(hidden[required], head, temperature, support)
        else:  # ZeRO-3 / FSDP shards, a compiled model: the logits at the loss's positions, (N, V) at once
            ids_ = mask_padding(input_ids, attention_mask, embedding_rows(self.accelerator.unwrap_model(model)))
            logits = model(input_ids=ids_, attention_mask=attention_mask, logits_to_keep=width + 1).logits[:, :-1]
            divergence, entropy = student_support_divergence(logits[required], None, temperature, support)
        return tuple(v.new_zeros(required.shape).masked_scatter(required, v) for v in (divergence, entropy))

    def _hidden(self, head: HiddenStateHead, input_ids, attention_mask, width, layout=None):
        """The final hidden states `(B, width, H)` that predict the last `width` tokens, or None where they do not
        reproduce the model's logits. With a `common_prefix` layout `(k, order)`, the rows' first `k` tokens are
        encoded once and the rest of each row runs on that cache (positions counted over real tokens)."""
        input_ids = mask_padding(input_ids, attention_mask, embedding_rows(head.model))
        kwargs = {"use_cache": False, **head.keep_one()}
        if layout is not None:
            k, order = layout
            input_ids, attention_mask = input_ids.gather(1, order), attention_mask.gather(1, order)
            positions = position_ids_from_mask(attention_mask)
            try:
                cache = common_prefix_cache(head.model, input_ids, attention_mask, positions, k)
                kwargs.update({"use_cache": True, "position_ids": positions[:, k:], cache_kwarg(head.model): cache})
                input_ids = input_ids[:, k:]
            except PrefixSharingUnsupported as e:
                report_fallback("distillation forward", str(e))
        with self.accelerator.autocast(), head.capture():
            out = head.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if not head.matches(out.logits):
            return None
        return head.hidden[:, -(width + 1) : -1]  # position i predicts completion token i

    def _divergence_from_logits(self, model, teacher_model, input_ids, attention_mask, width):
        def logits(m):
            ids = mask_padding(input_ids, attention_mask, embedding_rows(self.accelerator.unwrap_model(m)))
            return m(input_ids=ids, attention_mask=attention_mask, logits_to_keep=width + 1).logits[:, :-1]

        student_logits = logits(model)
        with torch.no_grad():
            teacher_logits = logits(teacher_model)
        temperature = self.divergence_temperature
        terms = self.generalized_jsd_loss(
            student_logits, teacher_logits, beta=self.args.beta, temperature=temperature, reduction="none"
        )
        with torch.no_grad():
            log_probs = torch.log_softmax(student_logits.float() / temperature, dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return terms.sum(-1), entropy


def fit_to_width(values: torch.Tensor, width: int) -> torch.Tensor:
    """A teacher tensor `(B, T, ...)` cut or padded (-inf, ids 0) to `width` positions."""
    if values.size(1) >= width:
        return values[:, :width]
    fill = 0 if values.dtype == torch.long else float("-inf")
    padding = values.new_full((values.size(0), width - values.size(1), *values.shape[2:]), fill)
    return torch.cat([values, padding], dim=1)


def student_support_divergence(student, head, temperature: float, support: tuple, chunk_size: int | None = None):
    """`(D, student entropy)` at N positions, `(N,)` each: `teacher_support_divergence` on `support` (the sampled
    ids, the teacher's log-probs of them, its top-k log-probs and ids, beta, add_tail, with_sampled), the student's
    log-probs from `head.logits(student)` (`student`: final hidden states `(N, H)`, `head` its `HiddenStateHead`; with
    `head` None, logits `(N, V)`), a chunk of positions at a time under `checkpoint`: a chunk's `(n, V)` log-probs
    exist only while it is computed, and again in the backward. The entropy carries no gradient."""
    tokens, actual, topk, ids, beta, add_tail, with_sampled = support
    check_teacher_support(actual, topk, beta)  # once, over all N positions
    vocabulary = head.head.weight.size(0) if head is not None else student.size(-1)
    chunk_size = chunk_size or max(1, CHUNK_ELEMENTS // max(1, vocabulary))

    def chunk(x, rows):
        log_probs = torch.log_softmax((head.logits(x) if head is not None else x).float() / temperature, dim=-1)
        divergence = teacher_support_divergence(
            log_probs, tokens[rows], actual[rows], topk[rows], ids[rows], beta, add_tail, with_sampled
        )
        with torch.no_grad():
            return divergence, -(log_probs.exp() * log_probs).sum(-1)

    grad = torch.is_grad_enabled() and student.requires_grad
    parts = []
    starts = range(0, student.size(0), chunk_size)
    if len(starts) == 0:  # no position: one empty chunk, so that the loss still reaches the autograd graph
        starts = [0]
    for start in starts:
        rows = slice(start, start + chunk_size)
        x = student[rows]
        if grad and x.numel():
            parts.append(checkpoint(chunk, x, rows, use_reentrant=False))
        else:
            parts.append(chunk(x, rows))
    return tuple(torch.cat(values) for values in zip(*parts))


def check_teacher_support(sampled_log_probs, topk_log_probs, beta: float) -> None:
    """A server's log-probs must cover what the loss reads: the sampled token at beta > 0 (reverse KL's part), its
    top-1 at 0 < beta < 1."""
    if beta == 0:
        return
    missing = (~torch.isfinite(sampled_log_probs)).sum().item()
    if missing:
        raise ValueError(
            "Teacher server is missing actual-token logprobs for required reverse-KL positions: "
            f"{missing}/{sampled_log_probs.numel()}."
        )
    missing = (~torch.isfinite(topk_log_probs[:, 0])).sum().item() if beta < 1 else 0
    if missing:
        raise ValueError(
            "Teacher server is missing top-1 logprobs for required forward-KL positions: "
            f"{missing}/{len(topk_log_probs)}."
        )


def teacher_support_divergence(
    student_log_probs, sampled_ids, sampled_log_probs, topk_log_probs, topk_ids, beta, add_tail, with_sampled=False
):
    """D at N positions from what a teacher server reports there (TRL's ServerDistillation losses): forward KL on
    its top-k at beta = 0; otherwise the generalized JSD on its top-1 and the sampled token (`top1_support`).
    `student_log_probs` `(N, V)`; the sampled token's teacher log-prob `(N,)`; its top-k `(N, K)`. The caller checks
    that they cover what D reads (`check_teacher_support`, once per batch, as `student_support_divergence` does)."""
    if beta == 0:
        ids, log_probs, mask = topk_ids, topk_log_probs, topk_log_probs > -torch.inf
        if with_sampled:  # the sampled token too, where it is outside the top-k and scored
            outside = (topk_ids != sampled_ids[:, None]).all(-1) & torch.isfinite(sampled_log_probs)
            ids = torch.cat([ids, sampled_ids[:, None]], dim=-1)
            log_probs = torch.cat([log_probs, sampled_log_probs[:, None]], dim=-1)
            mask = torch.cat([mask, outside[:, None]], dim=-1)
        return sparse_divergence(student_log_probs, ids, log_probs, mask, 0.0, add_tail)
    ids, log_probs, mask = top1_support(topk_ids[:, 0], topk_log_probs[:, 0], sampled_ids, sampled_log_probs, beta)
    return sparse_divergence(student_log_probs, ids, log_probs, mask, beta, add_tail)


def batch_in_trl_keys(prompts, completions, pad_token_id: int, width: int, sampled_logprobs=None, device=None) -> dict:
    """Rows sampled elsewhere (prompt token tensors, completion id lists) as a batch in TRL's keys: `prompts` /
    `prompt_attention_mask` left-padded, completions cut or right-padded to `width`, `input_ids`, `attention_mask`,
    `labels` (-100 off the completions); with each sampled token's log-prob, `rollout_logprobs` at the sequence's
    width (0 over the prompt and the padding), so that it is sliced as `labels` is."""
    prompt_width = max(len(p) for p in prompts)
    prompt_ids = torch.stack(
        [torch.nn.functional.pad(torch.as_tensor(p), (prompt_width - len(p), 0), value=pad_token_id) for p in prompts]
    )
    prompt_mask = torch.stack([(torch.arange(prompt_width) >= prompt_width - len(p)).long() for p in prompts])
    cut = [list(c)[:width] for c in completions]
    completion_ids = torch.tensor([c + [pad_token_id] * (width - len(c)) for c in cut])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in cut])
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = input_ids.masked_fill(torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1) == 0, -100)
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "prompts": prompt_ids,
        "prompt_attention_mask": prompt_mask,
    }
    if sampled_logprobs is not None:
        values = [list(v)[:width] + [0.0] * (width - len(list(v)[:width])) for v in sampled_logprobs]
        batch["rollout_logprobs"] = torch.nn.functional.pad(
            torch.tensor(values, dtype=torch.float32), (prompt_width, 0)
        )
    return {key: value.to(device) for key, value in batch.items()}
