"""The one chat renderer of multi-turn episodes and agents: a prompt with its tool descriptions, the messages an
environment or a tool inserts, the tokens the template adds for them after an assistant turn (suffix ids: rendered
after a dummy exchange, minus that exchange up to its EOS, TRL's `_get_tool_suffix_ids`), and the prefix rule that
makes splicing them exact (a template that extends a conversation by appending). Templates without tool support get
the tools described in the system message and tool results as Hermes-style <tool_response> user messages.
TRL's training templates and --chat_template_kwargs are the tokenizer's defaults, set where it is loaded
(models.load_tokenizer), so every rendering sees them, here and in the offline recipes' data.
"""

from __future__ import annotations

from verl_kit.errors import UserError
from verl_kit.rollout.tools import describe_tools, supports_tools


class ChatRenderer:
    """Renders for one tokenizer; `model_name` names it in the one-line errors. `native_tools`: the template renders
    tool schemas and `tool` messages itself (else the fallback above)."""

    def __init__(self, tokenizer, model_name: str):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.native_tools = supports_tools(tokenizer)

    def _render(self, messages: list[dict], schemas: list[dict], **kw):
        if schemas and self.native_tools:
            kw["tools"] = schemas
        return self.tokenizer.apply_chat_template(messages, **kw)

    def render_prompt(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        """The token ids of `messages` with the generation prompt, and the tools `schemas` (the fallback adds their
        description to the system message of `messages`, in place)."""
        if schemas and not self.native_tools:  # the fallback: the tools described in the system message
            text = describe_tools(schemas)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            else:
                messages.insert(0, {"role": "system", "content": text})
        return list(self._render(messages, schemas, tokenize=True, add_generation_prompt=True, return_dict=False))

    def env_message(self, role: str, content: str, name: str | None = None) -> dict:
        """A tool result as the template expects it: a `tool` message, or (fallback) a user message wrapping it in
        <tool_response> as Hermes does; an environment reply is a user message."""
        if role == "tool" and not self.native_tools:
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": role, "content": content, **({"name": name} if name else {})}

    def suffix_ids(self, messages: list[dict]) -> list[int]:
        """The tokens the chat template adds for `messages` after an assistant turn, up to the next generation
        prompt: rendered after a dummy exchange, minus the exchange up to its EOS (TRL's _get_tool_suffix_ids)."""
        assistant = {"role": "assistant", "content": "dummy"}
        if messages[0]["role"] == "tool" and self.native_tools:
            assistant = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": messages[0].get("name", "tool"), "arguments": {}}}]}
        dummy = [{"role": "user", "content": "dummy"}, assistant]
        prefix = list(self.tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False))
        full = list(self.tokenizer.apply_chat_template(dummy + messages, tokenize=True, return_dict=False,
                                                       add_generation_prompt=True))
        eos = [i for i, t in enumerate(prefix) if t == self.tokenizer.eos_token_id]
        prefix = prefix[:eos[-1] + 1] if eos else prefix
        if full[:len(prefix)] != prefix:
            raise UserError(f"{self.model_name}: the chat template's rendering of a {messages[0]['role']} message "
                            "changes the tokens before it (see docs/environments.md)")
        return full[len(prefix):]

    def appends(self, with_tools: bool) -> bool:
        """Whether the template extends a conversation by appending (check_prefix_property), with tool messages
        when `with_tools` and the template renders them itself."""
        try:
            check_prefix_property(self.tokenizer, self.model_name, with_tools and self.native_tools)
            return True
        except UserError:
            return False


def check_prefix_property(tokenizer, model_name: str, native_tools: bool) -> None:
    """Refuse, in one line naming the model and the first turn where it breaks, a chat template that does not extend a
    conversation by appending: each rendering of the first k turns (with the generation prompt before an assistant
    turn) must be a prefix of the rendering of k + 1 turns. Else the tokens an engine sampled in an earlier turn
    would not be those the template shows the model later (Qwen3's template, for one, drops earlier reasoning)."""
    env = {"role": "tool", "name": "tool", "content": "t"} if native_tools else {"role": "user", "content": "u"}
    turns = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a1"}, env,
             {"role": "assistant", "content": "a2"}, {**env, "content": "t2"}, {"role": "assistant", "content": "a3"}]
    for k in range(1, len(turns)):
        before = tokenizer.apply_chat_template(turns[:k], tokenize=False,
                                               add_generation_prompt=turns[k]["role"] == "assistant")
        after = tokenizer.apply_chat_template(turns[:k + 1], tokenize=False)
        if not after.startswith(before):
            raise UserError(f"{model_name}: the chat template does not extend a conversation by appending: adding "
                            f"turn {k + 1} ({turns[k]['role']}) rewrites the text before it, so multi-turn episodes "
                            "cannot keep the sampled tokens (docs/environments.md: use a template that appends)")
