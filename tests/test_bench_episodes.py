"""The chat template bench/episodes_vs_trl.py gives both sides of its comparison: TRL 1.16 refuses the embedded one
for tools and accepts this one (tool calling, prefix-preserving), its response parser and our kit's reader take the
bench's tool call alike and plain text as no call, and without tools it renders exactly as the embedded template."""

import importlib.util

from helpers import REPO


def test_bench_tool_template(tiny_model_path):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from verl_kit.rollout.episodes import check_prefix_property
    from verl_kit.rollout.tools import parse_tool_calls, supports_tools

    spec = importlib.util.spec_from_file_location("episodes_vs_trl", REPO / "bench" / "episodes_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Describe the sea."},
            {"role": "assistant", "content": "Well, the sea is lovely."}]
    embedded = tok.apply_chat_template(chat, tokenize=False)
    assert not supports_tool_calling(tok)  # why the bench sets a template at all
    tok.chat_template, tok.response_template = bench.TOOL_TEMPLATE, bench.RESPONSE_TEMPLATE
    assert tok.apply_chat_template(chat, tokenize=False) == embedded
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok) and supports_tools(tok)
    check_prefix_property(tok, "bench", native_tools=True)

    env = bench.Explore()
    env.reset()
    prompt = tok.apply_chat_template(chat[1:2], tools=[env.look], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    call = tok(bench.CALL + tok.eos_token, add_special_tokens=False)["input_ids"]
    text = tok("Well, the sea is lovely." + tok.eos_token, add_special_tokens=False)["input_ids"]
    assert parse_response(tok, call, prefix=prompt, tools=[env.look])["tool_calls"] == [
        {"type": "function", "function": {"name": "look", "arguments": {}}}]
    assert parse_tool_calls(tok.decode(call, skip_special_tokens=True), tok) == [{"name": "look", "arguments": {}}]
    assert "tool_calls" not in parse_response(tok, text, prefix=prompt, tools=[env.look])
    assert parse_tool_calls(tok.decode(text, skip_special_tokens=True), tok) == []
