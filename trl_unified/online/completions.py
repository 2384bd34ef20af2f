"""Where an online rollout's completions come from: the policy's generation, a user's `rollout_func`, or the
multi-turn tool loop (tools and environments, `online/agents.py`), as token ids and as the reward functions see them.
"""

import copy
from typing import Any, NamedTuple

from trl import is_conversational

from ..generation import GenerationOutput, max_positions
from ..models.loading import get_tokenizer
from .agents import ToolLoop, parse_turn


class SampledCompletions(NamedTuple):
    """What `_generate` returns: the completions as a `GenerationOutput` (with the tool mask of multi-turn rows), as
    the reward functions see them (texts, or lists of messages), the extra per-row fields of a `rollout_func`, the
    tool calls / failures of this process, and whether the output's log-probs are the trained policy's own (the
    lean decode loop's) rather than another engine's (vLLM's)."""

    generation: GenerationOutput
    completions: list
    extra_fields: dict[str, Any]
    tool_calls: int = 0
    tool_failures: int = 0
    logprobs_are_policy: bool = True


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
        row_tools = self._row_tools(len(prompts), environments) if self.tools else [self.tools] * len(prompts)
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
        tool_mask, calls, failures = extra_fields.pop("env_mask", None) if not self.tools else None, 0, 0
        if self.tools:
            loop = ToolLoop(
                self.processing_class,
                lambda contexts, new_tokens: (
                    self.generate(contexts, do_sample=do_sample, max_new_tokens=new_tokens).completion_ids_list
                ),
                max_new_tokens or self.args.max_completion_length,
                max_positions(self.accelerator.unwrap_model(self.model)),
                self.max_tool_calling_iterations,
                self.chat_template,
                self.args.chat_template_kwargs,
                self._event_loop,
            )
            completion_ids, tool_mask, completions, calls, failures = loop.run(
                prompt_ids, completion_ids, completions, row_tools
            )
        out = GenerationOutput.from_token_lists(
            prompt_ids,
            completion_ids,
            self.processing_class,
            self.eos_token_ids,
            tool_mask,
            self.args.pad_to_multiple_of,
            self.accelerator.device,
        )
        return SampledCompletions(out, completions, extra_fields, calls, failures)

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

    def _row_tools(self, n: int, environments=None) -> list[list]:
        if self._env is None:
            return [self.tools] * n
        return self._env.row_tools(environments if environments is not None else self._env.instances)

    def _tokenize_with_tools(self, prompts, row_tools) -> list[list[int]]:
        """Each prompt rendered with its row's tools (and the training chat template, when one is needed)."""
        if not is_conversational({"prompt": prompts[0]}):
            raise ValueError(
                "Tools need conversational prompts (lists of messages): the chat template renders the tools. Turn "
                "plain prompts into [{'role': 'user', 'content': prompt}]."
            )
        template_kwargs = dict(self.args.chat_template_kwargs or {})
        return [
            list(
                self.processing_class.apply_chat_template(
                    [prompt],
                    tools=tools or None,
                    chat_template=self.chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **template_kwargs,
                )["input_ids"][0]
            )
            for prompt, tools in zip(prompts, row_tools, strict=True)
        ]

    def _parse_completions(self, prompts, prompt_ids, completion_ids, row_tools) -> list:
        """Conversational rows: a list of messages per row (tool calls parsed when the tokenizer has a response
        parser); plain rows: the decoded text."""
        tokenizer = get_tokenizer(self.processing_class)
        if not is_conversational({"prompt": prompts[0]}):
            return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            return [[{"role": "assistant", "content": text}] for text in texts]
        return [
            [parse_turn(self.processing_class, ids, prefix, tools)]
            for ids, prefix, tools in zip(completion_ids, prompt_ids, row_tools, strict=True)
        ]


def row_value(values, i):
    """A rollout_func extra field for row i: lists are per row, anything else is shared by every row (TRL's rule)."""
    return values[i] if isinstance(values, list) and i < len(values) else values
