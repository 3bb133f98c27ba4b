"""An environment with a tool, for GRPO on the tiny model: tests/rollout/test_episodes.py's TRLStyleEnv, unchanged
(written for TRL's GRPOTrainer(environment_factory=...): reset(**kwargs), a tool method, get_reward). Kept here, outside
either tree, so that the 'before' and 'after' runs load the same code."""

import json  # noqa: F401 - as in the test's copy


class TRLStyleEnv:
    """Written for TRL's GRPOTrainer(environment_factory=...): reset(**kwargs), a tool method, get_reward."""

    def reset(self, **kwargs):
        assert "prompt" in kwargs and "chosen" in kwargs, kwargs  # the dataset row's columns
        self.calls = 0
        return None

    def lookup(self, word: str) -> str:
        """Look a word up.

        Args:
            word: the word
        """
        self.calls += 1
        return word.upper()

    def get_reward(self) -> float:
        return 10.0
