"""The code vLLM loads into every worker of an engine the kit syncs (`--worker-extension-cls` of the server,
`worker_extension_cls` of the colocated engine: `WORKER_EXTENSION`). Its methods are called by name through vLLM's
public RPC surface (`LLM.collective_rpc`, `POST /collective_rpc` of a server started with VLLM_SERVER_DEV_MODE=1) by
the trainer's side of the sync, rollout.weight_sync.

Buckets (rollout.transport) are staged, then committed with the worker's `reload_weights`, which runs the model's own
`load_weights` (HF checkpoint names, q/k/v and gate/up fusion) and then the platform's post-load processing, layer by
layer. That last step is why this route works on CPU, where vLLM repacks linear weights at load time (a oneDNN-packed
copy that the matmul reads instead of `weight`) and a plain in-place `load_weights` has no weight loader to call.

Tied parameters (`tie_word_embeddings`): vLLM ties the output layer to the input embedding, and on CPU `lm_head`
computes the logits from its own packed copy, made when it is post-processed; the layerwise reload post-processes a
module only when its own weights arrive. So the commit feeds `load_weights` every name of a tied tensor (the trainer
sends the others as aliases), and re-runs the post-load step on every module that shares a parameter
(`_verl_kit_reprocess_shared`), as vLLM's first load does. Untied models have neither.
"""

from __future__ import annotations

from verl_kit.rollout.transport import SHM_PREFIX, decode, release_mappings, slot_ref

WORKER_EXTENSION = "verl_kit.rollout.worker_extension.WorkerExtension"


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); its methods are called by name through collective_rpc.
    Buckets are staged on the worker and committed at once: vLLM's layerwise reload processes a layer when all its
    weights have arrived, and a fused qkv layer may straddle two buckets."""

    def verl_kit_stage(self, *blobs: str) -> int:
        """Stage encoded buckets (all of a same-host sync's slots in one call; an inline bucket per call)."""
        staged = self.__dict__.setdefault("_verl_kit_staged", {})
        refs = self.__dict__.setdefault("_verl_kit_refs", set())  # same-host buckets staged since the last commit
        if not staged:
            refs.clear()
        for blob in blobs:
            if blob in refs:  # a retried request whose first try was staged but not answered
                continue
            tensors, aliases = decode(blob)
            staged.update(tensors)
            self.__dict__.setdefault("_verl_kit_aliases", {}).update(aliases)
            if blob.startswith(SHM_PREFIX):
                refs.add(blob)
        return len(staged)

    def verl_kit_commit(self) -> int:
        staged = self.__dict__.pop("_verl_kit_staged", {})
        aliases = self.__dict__.pop("_verl_kit_aliases", {})
        # Every name of a tied tensor, the aliases last (as in a checkpoint that stores lm_head separately): the
        # model's load_weights then loads the tied output layer like any other layer, see the module docstring.
        weights = list(staged.items()) + [(a, staged[name]) for a, name in aliases.items()]
        n = len(weights)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._verl_kit_reprocess_shared()
        del staged, weights
        release_mappings({slot_ref(r)[0] for r in self.__dict__.get("_verl_kit_refs", ())})
        return n

    def verl_kit_release(self) -> int:
        """Drop what a trainer staged and every slot mapping (it closed its backend: the slots' memory goes once
        unmapped). Returns the number of mappings dropped."""
        for key in ("_verl_kit_staged", "_verl_kit_aliases", "_verl_kit_refs"):
            self.__dict__.pop(key, None)
        return release_mappings(set())

    def _verl_kit_reprocess_shared(self) -> None:
        """Re-run vLLM's post-load step (`quant_method.process_weights_after_loading`, what the first load runs on
        every module once all weights are in) on each module that shares a parameter with another module. The
        layerwise reload only post-processes a module whose own weights arrive through the model's `load_weights`;
        a module whose weight is written through its partner (a tied lm_head, when a model's loader drops the
        `lm_head.weight` alias) would keep state derived from the old weight, e.g. the oneDNN-packed copy vLLM on
        CPU computes the logits with. The same inputs as at first load (the shared, already processed tensor),
        so the same result; for unquantized embeddings it rebuilds that packed copy on CPU and is a no-op on GPU.
        Uses the worker's public `get_model()` and `vllm_config` (the context `Worker.reload_weights` sets too):
        vLLM has no call that re-processes a module without reloading it."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        modules = list(self.get_model().modules())
        holders: dict[int, int] = {}
        for m in modules:
            for p in m.parameters(recurse=False):
                holders[id(p)] = holders.get(id(p), 0) + 1
        shared = [m for m in modules if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
                  and any(holders[id(p)] > 1 for p in m.parameters(recurse=False))]
        with set_current_vllm_config(self.vllm_config):
            for m in shared:
                m.quant_method.process_weights_after_loading(m)


