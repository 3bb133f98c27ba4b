"""The worker's side of the weight sync: the kit's engine for vLLM's weight-transfer API, which every engine the kit
syncs creates (`weight_transfer_config={"backend": "verl_kit"}`, rollout.synced.WEIGHT_TRANSFER_BACKEND) and the trainer
drives through that API (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`,
`shutdown_weight_transfer_engine`: `LLM` methods for the colocated engine, the server's routes of the same names). The
trainer's side is rollout.weight_sync.

vLLM creates the engine by name from its factory while a worker loads the model; the name is registered when this
module is imported, which the worker does first because it is the engine's `worker_extension_cls`
(`rollout.synced.WORKER_EXTENSION`, given to the colocated engine and the kit's server; the trainer's process
never imports this module, which imports vLLM). No RPC of the kit's own is left: the
dev endpoint /collective_rpc is not used.

An update's `update_info` is `{"buckets": [reference, ...]}`: where each bucket's bytes are (rollout.transport: a
same-host slot in /dev/shm, or the trainer's stream). The update runs vLLM's layerwise reload, as its own nccl and ipc
engines do: `start_weight_update` begins it, each bucket goes through the model's `load_weights` (HF checkpoint names,
q/k/v and gate/up fusion; a layer is processed once all its weights arrived, so a fused layer may straddle buckets),
and `finish_weight_update` ends it, which runs the platform's post-load processing. That step is why this route works
on CPU, where vLLM repacks linear weights at load time (a oneDNN-packed copy that the matmul reads instead of
`weight`) and a plain in-place copy would leave the packed copy stale.

Tied parameters (`tie_word_embeddings`): vLLM ties the output layer to the input embedding, and on CPU `lm_head`
computes the logits from its own packed copy, made when it is post-processed; the layerwise reload post-processes a
module only when its own weights arrive. So every name of a tied tensor is fed to `load_weights` (the trainer sends
the others as aliases), and the finish re-runs the post-load step on every module that shares a parameter
(`reprocess_shared`), as vLLM's first load does. Untied models have neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from verl_kit.rollout.synced import WEIGHT_TRANSFER_BACKEND
from verl_kit.rollout.transport import SHM_PREFIX, decode, release_mappings, slot_ref


class WorkerExtension:
    """The engine's `worker_extension_cls`: importing it registers the kit's weight-transfer engine in the worker
    before the worker creates it. It adds no method to the worker."""


@dataclass
class InitInfo(WeightTransferInitInfo):
    """Nothing to open: each update's references say where its buckets are."""


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    buckets: list[str] = field(default_factory=list)  # rollout.transport references, in the trainer's order


class KitWeightTransfer(WeightTransferEngine[InitInfo, UpdateInfo]):
    """vLLM's weight-transfer engine over the kit's transports (see the module docstring)."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False
    _received: set[str] = frozenset()  # this update's references already loaded
    _reloading = False  # vLLM's layerwise reload is under way (the first bucket began it)

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        """The reload itself begins with the first bucket that decodes (`receive_weights`): a refused reference
        leaves every weight where it was."""
        self._received = set()

    def update_weights(self, update_info: dict) -> None:
        """vLLM's, without its device synchronize when there is no accelerator (CPU: nothing is asynchronous, and
        torch.accelerator.synchronize raises)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        try:
            for ref in update_info.buckets:
                if ref in self._received:  # a retried request whose first try was loaded but not answered
                    continue
                tensors, aliases = decode(ref)
                if not self._reloading:
                    initialize_layerwise_reload(self.model)
                    self._reloading = True
                # Every name of a tied tensor (see the module docstring): its aliases after it.
                self.model.load_weights(list(tensors.items()) + [(a, tensors[n]) for a, n in aliases.items()])
                self._received.add(ref)
        except BaseException:
            # vLLM ends the update; the reload must end too, or the layers still waiting for weights stay on the
            # meta device and the next forward kills the engine: those keep their old weights (vLLM warns).
            self._end_reload()
            raise

    def finish_weight_update(self) -> None:
        self._end_reload()
        release_mappings({slot_ref(r)[0] for r in self._received if r.startswith(SHM_PREFIX)})

    def _end_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_shared(self.model, self.vllm_config)

    def shutdown(self) -> None:
        """The trainer closed its backend: drop every slot mapping (the slots' memory goes once unmapped)."""
        release_mappings(set())


def reprocess_shared(model: torch.nn.Module, vllm_config) -> None:
    """Re-run vLLM's post-load step (`quant_method.process_weights_after_loading`, what the first load runs on every
    module once all weights are in) on each module of `model` that shares a parameter with another module. The
    layerwise reload only post-processes a module whose own weights arrive through the model's `load_weights`; a
    module whose weight is written through its partner (a tied lm_head, when a model's loader drops the
    `lm_head.weight` alias) would keep state derived from the old weight, e.g. the oneDNN-packed copy vLLM on CPU
    computes the logits with. The same inputs as at first load (the shared, already processed tensor), so the same
    result; for unquantized embeddings it rebuilds that packed copy on CPU and is a no-op on GPU. vLLM has no call
    that re-processes a module without reloading it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    modules = list(model.modules())
    holders: dict[int, int] = {}
    for m in modules:
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    shared = [m for m in modules if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
              and any(holders[id(p)] > 1 for p in m.parameters(recurse=False))]
    with set_current_vllm_config(vllm_config):
        for m in shared:
            m.quant_method.process_weights_after_loading(m)


if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:  # vLLM's factory has no "is registered"
    WeightTransferEngineFactory.register_engine(WEIGHT_TRANSFER_BACKEND, KitWeightTransfer)
