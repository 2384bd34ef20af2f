"""Agents in the online core: tools, environments and the multi-turn tool loop (TRL 1.16's `GRPOTrainer` behaviour,
for every online trainer).

- **Tools**: Python functions (sync or `async def`) with type hints and a Google-style docstring, rendered into the
  prompt by the chat template (`tools=`). After each model turn the tool calls are parsed from the completion
  (`trl.chat_template_utils.parse_response` with the tokenizer's response template), executed, and their results
  appended as `tool` messages; the model continues until a turn has no tool call, `max_tool_calling_iterations`
  rounds ran, or `max_completion_length` is spent. An unknown tool, bad arguments or a tool that raises become an
  error message the model reads (`{'error': ...}`), never a failure of training.
- **The completion** of a multi-turn rollout is `C1 + S1 + C2 + S2 + ... + Ck`: model turns `Ci` and tool-result
  tokens `Si` (the chat template's rendering of the tool messages and the next generation prompt). The history is
  never re-tokenised: the ids the model sampled are the ids it is trained on. `tool_mask` is 1 on model tokens and
  0 on `Si`; the loss, the KL and the entropy use `completion_mask * tool_mask`.
- **Environments** (`environment_factory`): one instance per rollout row, pooled across batches; `reset(**row)` may
  return text appended to the last user message; public methods are the row's tools; `get_reward()` becomes a
  reward function named after the class (weight 1). A dict of factories routes rows by their `environment` column.
"""

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from trl import add_response_schema, get_training_chat_template, supports_tool_calling
from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response

from ..models.loading import get_tokenizer
from .rewards import EventLoopThread, is_async_callable


logger = logging.getLogger(__name__)

EMPTY_PROMPT = [{"role": "user", "content": ""}]


def check_tool(tool: Callable, where: str = "tools") -> None:
    """A tool is rendered into the prompt from its signature and docstring: both must be there."""
    name = getattr(tool, "__name__", type(tool).__name__)
    if not callable(tool):
        raise TypeError(f"{where} entry {tool!r} is not callable: a tool is a Python function.")
    if not inspect.getdoc(tool):
        raise ValueError(
            f"Tool {name!r} has no docstring. The chat template describes each tool to the model from its "
            "Google-style docstring (a summary, then `Args:` with one line per argument): add one."
        )
    parameters = [p for p in inspect.signature(tool).parameters.values() if p.name != "self"]
    untyped = [p.name for p in parameters if p.annotation is inspect.Parameter.empty]
    if untyped:
        raise ValueError(
            f"Tool {name!r} has arguments without type hints ({untyped}). The chat template's JSON schema needs a "
            f"type per argument: annotate them, e.g. `def {name}({untyped[0]}: int)`."
        )


def environment_methods(instance) -> list[Callable]:
    """The public methods of an environment instance (its tools): functions defined on the class, not starting with
    `_`, other than `reset` and `get_reward`, in alphabetical order, bound to `instance`."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


class Environments:
    """The environments of an online trainer: factories, a pool of instances reused across batches, one instance per
    rollout row, `reset` and the environment-owned rewards.

    Args:
        factory (`Callable` or `dict[str, Callable]`): one factory, or one per name (rows pick theirs with their
            `environment` column).
        standalone_tools (`list[Callable]`): tools every row has besides its environment's methods.
    """

    def __init__(self, factory, standalone_tools: list[Callable]):
        self.multi = isinstance(factory, dict)
        self.factories = dict(factory) if self.multi else {None: factory}
        self.standalone_tools = list(standalone_tools)
        self.pool: dict[Any, list] = {}
        self.tools: dict[Any, list[Callable]] = {}
        self.reward_funcs: list[tuple[str, Callable]] = []
        reward_types = []
        for name, make in self.factories.items():
            if not callable(make):
                raise TypeError(f"environment_factory[{name!r}] is {make!r}; it must be a callable returning an env.")
            instance = make()
            if not callable(getattr(type(instance), "reset", None)):
                raise ValueError(
                    "Each environment instance returned by `environment_factory` must define a callable `reset`. "
                    f"({type(instance).__name__} has none: add `def reset(self, **kwargs)`.)"
                )
            methods = environment_methods(instance)
            for method in methods:
                check_tool(method, f"{type(instance).__name__}.")
            self.tools[name] = list(standalone_tools) + methods
            self.pool[name] = [instance]  # every instance made (TRL's `_environment_pool`)
            if callable(getattr(type(instance), "get_reward", None)) and type(instance) not in reward_types:
                reward_types.append(type(instance))
                self.reward_funcs.append((type(instance).__name__, _environment_reward(type(instance))))
        self.free = {name: list(pool) for name, pool in self.pool.items()}  # instances no round holds
        self.instances: list | None = None  # the last batch's, one per row
        self.names: list | None = None

    def all_methods(self) -> list[Callable]:
        """Every environment's tools (for the checks made once, e.g. whether any tool exists)."""
        return [tool for tools in self.tools.values() for tool in tools]

    def assign(self, rows: list[dict[str, Any]]) -> list:
        """One instance per row, in row order, taken from the pool's free instances (new ones made as needed) until
        `release`: rounds sampled ahead of training (asynchronous rollouts) never share an instance."""
        names = [row.get("environment") if self.multi else None for row in rows]
        for name in names:
            if name not in self.factories:
                raise ValueError(
                    f"Example has `environment={name!r}`, which is not among the environments passed to "
                    f"`environment_factory`. Expected one of: {list(self.factories)}."
                )
        instances = []
        for name in names:
            if not self.free[name]:
                self.pool[name].append(self.factories[name]())
                self.free[name].append(self.pool[name][-1])
            instances.append(self.free[name].pop(0))
        self.names, self.instances = names, instances
        return instances

    def release(self, instances: list) -> None:
        """Return a round's instances to the pool, first in line again (a synchronous run reuses the same ones)."""
        for name in self.factories:
            own = {id(instance) for instance in self.pool[name]}
            self.free[name] = [i for i in instances if id(i) in own] + self.free[name]

    def reset(self, rows: list[dict[str, Any]], prompts: list, instances: list) -> list:
        """`reset(**row)` on each row's instance (without the routing `environment` column in dict mode); a returned
        observation is appended to the last message of the row's prompt (a new list; the row is not changed)."""
        out = []
        for prompt, instance, row in zip(prompts, instances, rows, strict=True):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else row
            observation = instance.reset(**kwargs)
            if observation is not None:
                content = prompt[-1]["content"]
                if isinstance(observation, list) and isinstance(content, str):
                    content = [{"type": "text", "text": content}]
                if isinstance(observation, str) and isinstance(content, list):
                    observation = [{"type": "text", "text": observation}]
                prompt = [*prompt[:-1], {**prompt[-1], "content": content + observation}]
            out.append(prompt)
        return out

    def row_tools(self, instances: list) -> list[list[Callable]]:
        """Each row's tools, bound to the row's own instance."""
        return [self.standalone_tools + environment_methods(instance) for instance in instances]


def _environment_reward(env_type: type) -> Callable:
    """The reward function of an environment class: `get_reward()` of each row's instance of that class, None for
    rows of other environments."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = env_type.__name__
    return get_reward


def check_tool_support(processing_class) -> None:
    """The chat template must render a tool-calling conversation (TRL's check, made for tools and environments)."""
    if not supports_tool_calling(processing_class):
        raise ValueError(
            "The provided chat template does not support tool calling. The template must be able to render a full "
            "tool-calling conversation (user -> assistant with tool_calls -> tool). Use a model whose chat template "
            "has tool support, or set processing_class.chat_template to one (e.g. TRL's qwen2_5 template)."
        )


def prepare_tool_template(processing_class) -> str | None:
    """Set-up for tool calling, as TRL does: the tokenizer gets a response parser if it has none (TRL's templates
    are recognised); a template whose rendering of a conversation is not a prefix of the rendering after a tool turn
    is replaced, for training, by TRL's training variant. Returns that training template, or None to keep the
    model's own."""
    tokenizer = get_tokenizer(processing_class)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(processing_class)
    if not is_chat_template_prefix_preserving(processing_class):
        return get_training_chat_template(processing_class)
    return None


def run_tool_calls(tool_calls: list[dict], tools: list[Callable], event_loop: EventLoopThread | None):
    """Execute one turn's tool calls. Returns `(results, failures)`: `(name, result)` pairs in call order for sync
    tools then async ones (async calls of the turn run concurrently), the failures as `{"error": message}` results."""
    sync_tools = {t.__name__: t for t in tools if not is_async_callable(t)}
    async_tools = {t.__name__: t for t in tools if is_async_callable(t)}
    results, coroutines, failures = [], [], 0
    for call in tool_calls:
        if call.get("type", "function") != "function":
            failures += 1
            results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call['type']}"}))
            continue
        function = call["function"]
        name = function["name"]
        try:
            if name in sync_tools:
                results.append((name, sync_tools[name](**function["arguments"])))
            elif name in async_tools:
                coroutines.append((name, async_tools[name](**function["arguments"])))
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as e:  # the model reads the error and may correct itself: training goes on
            failures += 1
            results.append((name, {"error": str(e)}))
    if coroutines:

        async def gather():
            return await asyncio.gather(*(c for _, c in coroutines), return_exceptions=True)

        loop = event_loop or EventLoopThread()
        for (name, _), value in zip(coroutines, loop.run(gather()), strict=True):
            if isinstance(value, Exception):
                failures += 1
                value = {"error": str(value)}
            results.append((name, value))
    return results, failures


def tool_messages(results: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """`tool` messages of a turn's results (a list result is content blocks, anything else its `str`)."""
    return [
        {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
        for name, result in results
    ]


def tool_suffix_ids(processing_class, messages, chat_template, template_kwargs) -> list[int]:
    """Token ids the chat template puts after a model turn that called tools: the tool messages and the next
    generation prompt. Rendered on a minimal conversation (the suffix does not depend on the history), and cut
    at the end of the assistant turn (its EOS), so `completion + suffix` continues the sampled ids exactly."""
    calls = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    render = dict(tokenize=True, chat_template=chat_template, return_dict=False, **template_kwargs)
    prefix = list(processing_class.apply_chat_template(dummy, add_generation_prompt=False, **render))
    full = list(processing_class.apply_chat_template(dummy + messages, add_generation_prompt=True, **render))
    eos = get_tokenizer(processing_class).eos_token_id
    positions = [i for i, token in enumerate(prefix) if token == eos]
    if positions:
        prefix = prefix[: positions[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("Unexpected tokenization: the EOS-trimmed prefix IDs are not a prefix of the full IDs.")
    return full[len(prefix) :]


def parse_turn(processing_class, ids: list[int], prefix: list[int], tools) -> dict[str, Any]:
    """The assistant message of a turn (content, and `tool_calls` when the response parser finds valid ones; a turn
    that does not parse is plain content)."""
    return parse_response(get_tokenizer(processing_class), ids, prefix=prefix, tools=tools or None)


class ToolLoop:
    """The multi-turn rollout of rows whose first turn was generated: execute tool calls, append the results, let the
    model continue, until no row calls a tool, `max_iterations` rounds ran, or the completion budget is spent.

    Args:
        processing_class: the policy's tokenizer or processor.
        generate (`Callable[[list[list[int]], int], list[list[int]]]`): continuation ids (cut after EOS) of each id
            list, with at most the given number of new tokens.
        max_completion_length (`int`): the budget of a whole completion, tool-result tokens included.
        max_positions (`int`, *optional*): the model's context length.
        max_iterations (`int`, *optional*): tool rounds at most (None: unlimited).
        chat_template (`str`, *optional*): the training chat template, when the model's own is not prefix-preserving.
        template_kwargs (`dict`): `chat_template_kwargs`.
        event_loop (`EventLoopThread`, *optional*): where async tools run.
    """

    def __init__(
        self,
        processing_class,
        generate,
        max_completion_length,
        max_positions=None,
        max_iterations=None,
        chat_template=None,
        template_kwargs=None,
        event_loop=None,
    ):
        self.processing_class, self.generate = processing_class, generate
        self.budget, self.max_positions = max_completion_length, max_positions
        self.max_iterations = max_iterations if max_iterations is not None else float("inf")
        self.chat_template, self.template_kwargs = chat_template, dict(template_kwargs or {})
        self.event_loop = event_loop

    def run(self, prompt_ids, completion_ids, completions, row_tools):
        """Continue every row whose last turn called tools. `prompt_ids`/`completion_ids`: lists of id lists;
        `completions`: per row, the list of messages so far (one parsed assistant turn). Returns
        `(completion_ids, tool_mask, completions, calls, failures)`, lists extended in place."""
        tool_mask = [[1] * len(ids) for ids in completion_ids]
        active = [i for i, messages in enumerate(completions) if messages[-1].get("tool_calls")]
        calls = failures = iteration = 0
        while active and iteration < self.max_iterations:
            continued, contexts = [], []
            for i in active:
                tool_calls = completions[i][-1]["tool_calls"]
                calls += len(tool_calls)
                results, failed = run_tool_calls(tool_calls, row_tools[i], self.event_loop)
                failures += failed
                messages = tool_messages(results)
                context = prompt_ids[i] + completion_ids[i] + self._suffix(messages)
                length = len(context) - len(prompt_ids[i])
                if length > self.budget or (self.max_positions is not None and len(context) >= self.max_positions):
                    continue  # no room for another turn: the row ends with its tool call (TRL's rule)
                completions[i].extend(messages)
                continued.append(i)
                contexts.append(context)
            if not continued:
                break
            room = [self.budget - (len(c) - len(prompt_ids[i])) for i, c in zip(continued, contexts, strict=True)]
            new_tokens = max(room)
            if self.max_positions is not None:
                new_tokens = min(new_tokens, self.max_positions - max(len(c) for c in contexts))
            turns = self.generate(contexts, max(new_tokens, 1))
            active = []
            for i, context, ids, limit in zip(continued, contexts, turns, room, strict=True):
                ids = ids[: max(limit, 0)]
                suffix = len(context) - len(prompt_ids[i]) - len(completion_ids[i])
                tool_mask[i] += [0] * suffix + [1] * len(ids)
                completion_ids[i] = context[len(prompt_ids[i]) :] + ids
                message = parse_turn(self.processing_class, ids, context, row_tools[i]) if ids else {}
                if message:
                    completions[i].append(message)
                    if message.get("tool_calls"):
                        active.append(i)
            iteration += 1
        return completion_ids, tool_mask, completions, calls, failures

    def _suffix(self, messages):
        return tool_suffix_ids(self.processing_class, messages, self.chat_template, self.template_kwargs)
