"""The bench scripts' own pieces. The chat template bench/episodes_vs_trl.py gives both sides of its comparison: TRL
1.16 refuses the embedded one for tools and accepts this one (tool calling, prefix-preserving), its response parser and
our kit's reader take the bench's tool call alike and plain text as no call, and without tools it renders exactly as
the embedded template. The device check's dry run (bench/gpu_check.py, `make gpu-check`), in an interpreter where the
packages the GPU image lacks cannot be imported."""

import importlib.util
import json
import subprocess
import sys

from helpers import REPO, env


def test_bench_tool_template(tiny_model_path):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from verl_kit.rollout.chat import check_prefix_property
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


BLOCKER = r'''
import importlib.machinery, runpy, sys
find = importlib.machinery.PathFinder.find_spec
def find_spec(cls, name, path=None, target=None):  # the GPU image has none of these: not found, as there
    return None if name.split(".")[0] in ("deepspeed", "trl", "datasets", "ray", "vllm") else find(name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def test_gpu_check_dry_run(tmp_path):
    """`make gpu-check`'s script, tiny shapes: every *_gpu.yaml trains, the packed/padded equality holds and its
    negative control differs, the summary is written to $OUT; deepspeed/trl/datasets/ray/vllm cannot be imported."""
    p = subprocess.run([sys.executable, "-c", BLOCKER, str(REPO / "bench" / "gpu_check.py")], cwd=tmp_path,
                       env=env(GPU_CHECK_DRY_RUN=1, OUT=tmp_path / "out", OMP_NUM_THREADS=1), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    s = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    gpu_configs = {f.name.removesuffix("_gpu.yaml") for f in (REPO / "recipes" / "configs").glob("*_gpu.yaml")}
    assert set(s["recipes"]) == gpu_configs and s["stopped"] is None
    for name, r in s["recipes"].items():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["params"] > 0, (name, r)
    eq = s["equalities"]["packed_vs_padded"]
    assert eq["ok"] and eq["fp32"] < 1e-4 and eq["fp32_packed_without_mask"] > 0.1, eq
    assert any("ZeRO-3" in line for line in s["skipped"]) and any("vLLM" in line for line in s["skipped"])
    assert "packed vs padded" in p.stdout
