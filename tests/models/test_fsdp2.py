"""verl_kit.models.fsdp2.enabled: which launches shard with FSDP2, read from the variables `accelerate launch` exports
for an FSDP config, and the fsdp_config values the kit does not implement refused in one line. (FSDP2 runs:
tests/train/test_distributed.py, tests/models/test_lora.py, tests/recipes/test_grpo_runs.py.)"""

import pytest

from verl_kit.errors import UserError
from verl_kit.models import fsdp2


def test_enabled_reads_the_fsdp2_config_and_refuses_what_it_does_not_implement(monkeypatch):
    for var in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_OFFLOAD_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING"):
        monkeypatch.delenv(var, raising=False)
    assert not fsdp2.enabled()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UserError, match="fsdp_version 1 is not supported"):
        fsdp2.enabled()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    assert fsdp2.enabled()
    for var, expected in (("FSDP_OFFLOAD_PARAMS", "zero3_offload.yaml"),
                          ("FSDP_ACTIVATION_CHECKPOINTING", "--gradient_checkpointing true")):
        monkeypatch.setenv(var, "true")
        with pytest.raises(UserError, match=expected) as e:
            fsdp2.enabled()
        assert "\n" not in str(e.value)
        monkeypatch.setenv(var, "false")
    with fsdp2.hidden_from_accelerate():  # the Accelerator is built without it, the kit still sees it after
        assert not fsdp2.enabled()
    assert fsdp2.enabled()
