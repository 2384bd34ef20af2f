"""Agents in the online core: tools, environments and their checks (TRL 1.16's `GRPOTrainer` behaviour, for every
online trainer). The multi-turn loop is `CompletionsMixin._run_tool_loop`; the rules (the completion `C1 + S1 + ... +
Ck` never re-tokenised, `tool_mask`, errors the model reads, environments per row) are in docs/agents.md.
"""

import inspect
import threading
from collections.abc import Callable
from typing import Any

from trl import add_response_schema, get_training_chat_template, supports_tool_calling
from trl.chat_template_utils import is_chat_template_prefix_preserving

from ..models.loading import get_tokenizer
from .rewards import EventLoopThread, is_async_callable


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


def check_tool_support(processing_class) -> None:
    """Tools are rendered by the chat template: it must render a whole tool-calling conversation."""
    if not supports_tool_calling(processing_class):
        raise ValueError(
            "The provided chat template does not support tool calling. The template must be able to render a "
            "full tool-calling conversation (user -> assistant with tool_calls -> tool). Use a model whose chat "
            "template has tool support, or set processing_class.chat_template to one (e.g. TRL's qwen2_5 one)."
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
    rollout row, `reset` and the environment-owned rewards. `assign` and `release` may run in different threads (the
    rollout producer assigns, the trainer releases): the free lists change under one lock, so an instance is never
    held by two rounds.

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
        self.instances: list | None = None  # the last round assigned, one per row
        self._lock = threading.Lock()  # guards `pool`, `free` and `instances`

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
        with self._lock:
            for name in names:
                if not self.free[name]:
                    self.free[name].append(self._new_instance(name))
                instances.append(self.free[name].pop(0))
            self.instances = instances
        return instances

    def _new_instance(self, name):
        """A new instance of environment `name`, added to the pool (held by the caller's round)."""
        instance = self.factories[name]()
        self.pool[name].append(instance)
        return instance

    def release(self, instances: list) -> None:
        """Return a round's instances to the pool, first in line again (a synchronous run reuses the same ones)."""
        with self._lock:
            for name in self.factories:
                own = {id(instance) for instance in self.pool[name]}
                returned = [i for i in instances if id(i) in own]
                self.free[name] = returned + self.free[name]

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


def prepare_tool_template(processing_class) -> str | None:
    """Set-up for tool calling, as TRL does: a response parser for a tokenizer without one (TRL's templates are
    recognised), and TRL's training template, returned, for one that is not prefix-preserving (None: the model's)."""
    tokenizer = get_tokenizer(processing_class)
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        add_response_schema(processing_class)
    if not is_chat_template_prefix_preserving(processing_class):
        return get_training_chat_template(processing_class)
    return None


def run_tool_calls(tool_calls: list[dict], tools: list[Callable], event_loop: EventLoopThread | None):
    """Execute one turn's tool calls. Returns `(results, failures)`: `(name, result)` pairs in call order for sync
    tools then async ones (async calls of the turn run concurrently), the failures as `{"error": message}` results."""
    by_name = {t.__name__: t for t in tools}
    results, coroutines, failures = [], [], 0
    for call in tool_calls:
        if call.get("type", "function") != "function":
            failures += 1
            results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call['type']}"}))
            continue
        name = call["function"]["name"]
        try:
            if name not in by_name:
                raise ValueError(f"Tool {name} not found.")
            result = by_name[name](**call["function"]["arguments"])
            (coroutines if is_async_callable(by_name[name]) else results).append((name, result))
        except Exception as e:  # the model reads the error and may correct itself: training goes on
            failures += 1
            results.append((name, {"error": str(e)}))
    if coroutines:
        loop = event_loop or EventLoopThread()
        for (name, _), value in zip(coroutines, loop.gather([c for _, c in coroutines]), strict=True):
            if isinstance(value, Exception):
                failures += 1
                value = {"error": str(value)}
            results.append((name, value))
    return results, failures


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
