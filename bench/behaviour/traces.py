"""The toolcaller fixture's SFT data: 64 warm-start traces of envs.py:TRLStyleEnv, rendered as an episode renders them
(Episodes.trace), written as `messages` rows to the path given. Run by fixtures.py with the tree's verl_kit."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envs import TRLStyleEnv  # noqa: E402

from verl_kit.models import TINY_PREFS, load_tokenizer, resolve_model_path  # noqa: E402
from verl_kit.rollout.episodes import Episodes  # noqa: E402

CALL = '<tool_call>{"name": "lookup", "arguments": {"word": "kind"}}</tool_call>'

if __name__ == "__main__":
    tok = load_tokenizer(resolve_model_path("tiny-llama"))
    episodes = Episodes(None, tok, "tiny-llama", TRLStyleEnv)
    with open(f"{TINY_PREFS}/train.jsonl") as f:
        rows = [json.loads(line) for line in f][:64]
    with open(sys.argv[1], "w") as f:
        for i, row in enumerate(rows, 1):
            f.write(json.dumps({"messages": episodes.trace(row, [CALL, "It is kind."], i)}) + "\n")
