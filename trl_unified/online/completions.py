"""Where an online rollout's completions come from: the policy's generation, a user's `rollout_func`, or the
multi-turn tool loop (tools and environments, `online/agents.py`), as token ids and as the reward functions see them.
"""

import copy
import random
from typing import Any, NamedTuple

from trl import is_conversational
from trl.chat_template_utils import parse_response

from ..generation import GenerationOutput, max_positions
from ..models.loading import get_tokenizer
from .agents import run_tool_calls, tool_suffix_ids


class SampledCompletions(NamedTuple):
    """What `_generate` returns: the fields of `Samples` (`online/rollout.py`), and a `rollout_func`'s extra keys."""

    generation: GenerationOutput
    completions: list
    extra_fields: dict[str, Any]
    tool_calls: int = 0
    tool_failures: int = 0
    logprobs_are_policy: bool = True


class CompletionMix:
    """The on/off-policy mix of generalized knowledge distillation (GKD: Agarwal et al., 2024, "On-Policy
    Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649, Algorithm 1): each
    training round is, with probability `lmbda`, the policy's own samples ("policy"); otherwise the dataset's
    completions ("dataset", supervised KD) or, with `seq_kd`, the teacher's samples ("teacher", sequence-level KD).
    Evaluation rounds read `eval_source`. The coin is Python's `random` (TRL's `random.random() <= lmbda`), whose
    state every checkpoint saves, so a resumed run draws the same rounds."""

    def __init__(self, lmbda: float = 1.0, seq_kd: bool = False, eval_source: str = "policy"):
        self.lmbda, self.seq_kd, self.eval_source = lmbda, seq_kd, eval_source

    def draw(self, mode: str) -> str:
        if mode == "eval":
            return self.eval_source
        if self.lmbda >= 1.0 or random.random() <= self.lmbda:
            return "policy"
        return "teacher" if self.seq_kd else "dataset"


class CompletionsMixin:
    """Sampling for `OnlineTrainer` (a mixin: it reads `self.generate`, `self.tools`, `self._env`, `self.args`)."""

    def generate_eval_texts(self, rows, prompts):
        """With tools or environments, generative evaluation runs the agent: the tool loop, greedy unless
        `eval_do_sample`, the answer read from the last assistant turn."""
        if not rows or not (self.tools or self._env is not None):
            return super().generate_eval_texts(rows, prompts)
        prompts, _, environments = self._rollout_prompts(rows)
        sampled = self._generate(prompts, None, self.args.eval_do_sample, self.args.eval_max_new_tokens, environments)
        self._release_environments(environments)
        return [c[-1].get("content", "") if isinstance(c, list) else c for c in sampled.completions]

    def _generate(
        self, prompts: list, images=None, do_sample=True, max_new_tokens=None, environments=None
    ) -> "SampledCompletions":
        """The completions of `prompts` (one per prompt; the sampler already repeats each num_generations times):
        from `rollout_func` when given, else the policy's generation; then, with tools, the multi-turn tool loop
        (each row's tools bound to its environment instance in `environments`)."""
        prompts = copy.deepcopy(prompts)
        row_tools = [self.tools] * len(prompts)
        if self.tools and self._env is not None:  # a bare trainer without tools may lack `_env` (TRL's tests)
            row_tools = self._env.row_tools(environments if environments is not None else self._env.instances)
        sampling = dict(do_sample=do_sample, max_new_tokens=max_new_tokens)
        extra_fields: dict[str, Any] = {}
        if self.rollout_func is not None:
            prompt_ids, completion_ids, extra_fields = self._call_rollout_func(prompts)
        elif self.tools:
            if images is not None:
                raise NotImplementedError("Tools with image rows are not implemented; drop the images or the tools.")
            prompt_ids = self._tokenize_with_tools(prompts, row_tools)
            completion_ids = self.generate(prompt_ids, **sampling).completion_ids_list
        else:
            policy = self.vllm_engine is None  # vLLM's log-probs: compared with π_old by a sampling correction
            out = self.generate(
                prompts, images=images, return_logprobs=self.old_logps_from_sampling or not policy, **sampling
            )
            conversational = is_conversational({"prompt": prompts[0]})
            completions = [[{"role": "assistant", "content": t}] for t in out.texts] if conversational else out.texts
            return SampledCompletions(out, completions, {}, logprobs_are_policy=policy)
        completions = self._parse_completions(prompts, prompt_ids, completion_ids, row_tools)
        if self.tools:
            budget = max_new_tokens or self.args.max_completion_length
            completion_ids, tool_mask, completions, calls, failures = self._run_tool_loop(
                prompt_ids, completion_ids, completions, row_tools, do_sample, budget
            )
        else:
            calls = failures = 0
            tool_mask = extra_fields.pop("env_mask", None)  # a rollout_func's mask of the tokens it did not sample
        multiple, device = self.args.pad_to_multiple_of, self.accelerator.device
        out = GenerationOutput.from_token_lists(
            prompt_ids, completion_ids, self.processing_class, self.eos_token_ids, tool_mask, multiple, device
        )
        return SampledCompletions(out, completions, extra_fields, calls, failures)

    def given_completions(self, prompt_ids, completion_ids, conversational: bool) -> SampledCompletions:
        """Completions this policy did not sample (the dataset's, a teacher's) as a round's: token ids as given, the
        texts decoded; no sampling log-probs."""
        multiple, device = self.args.pad_to_multiple_of, self.accelerator.device
        out = GenerationOutput.from_token_lists(
            prompt_ids, completion_ids, self.processing_class, self.eos_token_ids, None, multiple, device
        )
        completions = [[{"role": "assistant", "content": t}] for t in out.texts] if conversational else out.texts
        return SampledCompletions(out, completions, {})

    def _call_rollout_func(self, prompts):
        """TRL's contract: `rollout_func(prompts, trainer)` returns `prompt_ids`, `completion_ids` and `logprobs`
        (one list per prompt); any other key (e.g. `env_mask`, `logprob_token_ids`) is forwarded to the reward
        functions as a column."""
        output = self.rollout_func(prompts, self)
        missing = {"prompt_ids", "completion_ids", "logprobs"} - set(output)
        if missing:
            raise ValueError(f"rollout_func must return keys {sorted(missing)} in its output dict.")
        for key in ("prompt_ids", "completion_ids"):
            if len(output[key]) != len(prompts):
                raise ValueError(
                    f"rollout_func returned {len(output[key])} {key} for {len(prompts)} prompts; it must return one "
                    "per prompt (each prompt already appears num_generations times)."
                )
        extra = {k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs")}
        return [list(p) for p in output["prompt_ids"]], [list(c) for c in output["completion_ids"]], extra

    def _tokenize_with_tools(self, prompts, row_tools) -> list[list[int]]:
        """Each prompt rendered with its row's tools (and the training chat template, when one is needed)."""
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError(
                "Tools need conversational prompts (lists of messages): the chat template renders the tools. Turn "
                "plain prompts into [{'role': 'user', 'content': prompt}]."
            )
        render = dict(
            add_generation_prompt=True, tokenize=True, return_dict=True, **(self.args.chat_template_kwargs or {})
        )
        apply = self.processing_class.apply_chat_template
        return [
            list(apply([prompt], tools=tools or None, chat_template=self.chat_template, **render)["input_ids"][0])
            for prompt, tools in zip(prompts, row_tools, strict=True)
        ]

    def _parse_completions(self, prompts, prompt_ids, completion_ids, row_tools) -> list:
        """Conversational rows: a list of messages per row (tool calls parsed when the tokenizer has a response
        parser); plain rows: the decoded text."""
        tokenizer = get_tokenizer(self.processing_class)
        if not is_conversational({"prompt": prompts[0]}):
            return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if all(getattr(tokenizer, name, None) is None for name in ("response_template", "response_schema")):
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            return [[{"role": "assistant", "content": text}] for text in texts]
        return [
            [parse_response(tokenizer, ids, prefix=prefix, tools=tools or None)]
            for ids, prefix, tools in zip(completion_ids, prompt_ids, row_tools, strict=True)
        ]

    def _run_tool_loop(self, prompt_ids, completion_ids, completions, row_tools, do_sample, budget):
        """The multi-turn rollout of rows whose first turn was generated (docs/agents.md, "The rollout"; a tool's
        list result is content blocks, anything else its `str`; `budget` counts tool-result tokens too). Returns
        `(completion_ids, tool_mask, completions, calls, failures)`, lists extended in place."""
        tokenizer, template_kwargs = get_tokenizer(self.processing_class), dict(self.args.chat_template_kwargs or {})
        context_length = max_positions(self.accelerator.unwrap_model(self.model)) or float("inf")
        rounds = self.max_tool_calling_iterations if self.max_tool_calling_iterations is not None else float("inf")
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        active = [i for i, messages in enumerate(completions) if messages[-1].get("tool_calls")]
        calls = failures = iteration = 0
        while active and iteration < rounds:
            continued, contexts = [], []
            for i in active:
                tool_calls = completions[i][-1]["tool_calls"]
                calls += len(tool_calls)
                results, failed = run_tool_calls(tool_calls, row_tools[i], self._event_loop)
                failures += failed
                messages = [
                    {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                    for name, result in results
                ]
                suffix = tool_suffix_ids(self.processing_class, messages, self.chat_template, template_kwargs)
                context = prompt_ids[i] + completion_ids[i] + suffix
                if len(context) - len(prompt_ids[i]) > budget or len(context) >= context_length:
                    continue  # no room for another turn: the row ends with its tool call (TRL's rule)
                completions[i].extend(messages)
                continued.append(i)
                contexts.append(context)
            if not continued:
                break
            room = [budget - (len(c) - len(prompt_ids[i])) for i, c in zip(continued, contexts, strict=True)]
            new_tokens = min(max(room), context_length - max(len(c) for c in contexts))
            turns = self.generate(contexts, do_sample=do_sample, max_new_tokens=max(new_tokens, 1)).completion_ids_list
            active = []
            for i, context, ids, limit in zip(continued, contexts, turns, room, strict=True):
                ids = ids[: max(limit, 0)]
                suffix = len(context) - len(prompt_ids[i]) - len(completion_ids[i])
                tool_mask[i] += [0] * suffix + [1] * len(ids)
                completion_ids[i] = context[len(prompt_ids[i]) :] + ids
                message = parse_response(tokenizer, ids, prefix=context, tools=row_tools[i] or None) if ids else {}
                if message:
                    completions[i].append(message)
                    if message.get("tool_calls"):
                        active.append(i)
            iteration += 1
        return completion_ids, tool_mask, completions, calls, failures


def row_value(values, i):
    """A rollout_func extra field for row i: lists are per row, anything else is shared by every row (TRL's rule)."""
    return values[i] if isinstance(values, list) and i < len(values) else values
