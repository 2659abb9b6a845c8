"""Hidden-state extraction through vLLM (stage 03, --backend vllm), as speculators' offline generation does.

vLLM runs the `extract_hidden_states` speculative method: the verifier stores the aux layers and
its final layer in a cache-only layer, and a KV connector writes them to disk per request. The stock
connector uses pinned memory and a CUDA stream; `CpuSafeHiddenStatesConnector` copies synchronously
when the cache lives on the CPU (vLLM's CPU build), and defers to the stock path on a GPU.
"""
import os
import tempfile

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, cleanup_hidden_states, extract_from_kv_cache, load_hidden_states)

from common.errors import UserError
from common.extract import plan_batches
from common.rows import row_file
from common.verifier import load_vllm


class _Done:
    """Stands in for a CUDA event when the copy already happened synchronously."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        self._write_tensors(tensors, _Done(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()


class VllmBackend:
    def __init__(self, verifier: str, aux_layers: list[int], num_layers: int, tensor_parallel_size: int,
                 dtype: str, trust_remote_code: bool, max_len: int):
        self.slots = len(aux_layers) + 1  # the aux layers, then the final decoder layer's output
        self.scratch = tempfile.mkdtemp(prefix="vllm-hs-")
        self.llm = load_vllm(
            in_process=False,  # the connector writes a request's states in the step after it finishes
            model=verifier, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            trust_remote_code=trust_remote_code, max_model_len=max_len + 1, enforce_eager=True,
            enable_prefix_caching=False,  # every prompt token must be computed to be stored
            language_model_only=True,  # text only: a multimodal wrapper's vision tower is not built
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    # the final decoder layer's output (id N) rides along as the last slot
                                    "eagle_aux_hidden_state_layer_ids": [*aux_layers, num_layers]}}},
            kv_transfer_config={"kv_connector": "CpuSafeHiddenStatesConnector",
                                "kv_connector_module_path": "common.vllm_extract", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": self.scratch}},
        )

    def run(self, token_lists: list[list[int]]) -> list[dict]:
        from vllm import SamplingParams, TokensPrompt
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_lists],
                                    SamplingParams(max_tokens=1), use_tqdm=False)
        results = []
        for out in outputs:
            path = out.kv_transfer_params["hidden_states_path"]
            results.append(load_hidden_states(path))
            cleanup_hidden_states(path)
        return results


def extract_vllm(backend: VllmBackend, rows: dict, out: str, writer, max_tokens: int, on_done) -> None:
    """Token-budget chunks through vLLM; each row's states are re-saved in the pipeline's file format."""
    for chunk in plan_batches({i: len(r["input_ids"]) for i, r in rows.items()}, max_tokens):
        results = backend.run([rows[i]["input_ids"] for i in chunk])
        jobs = []
        for i, res in zip(chunk, results):
            if res["token_ids"].tolist() != rows[i]["input_ids"]:
                raise RuntimeError(f"vLLM returned states of other tokens for row {i}")
            if res["hidden_states"].shape[1] != backend.slots:  # an older vLLM dropped one for DeepSeek-family models
                import vllm
                raise UserError(f"vLLM {vllm.__version__} returned {res['hidden_states'].shape[1]} hidden-state slots a "
                                f"token for row {i}, not {backend.slots} ({backend.slots - 1} aux layers and the final "
                                "layer): use a vLLM with PR #46973 (0.32 has it), or --backend transformers")
            jobs.append((row_file(out, i), rows[i]["input_ids"], res["hidden_states"].to(torch.bfloat16),
                         rows[i]["loss_mask"]))
        writer.submit(jobs, None, lambda n, t=sum(len(rows[i]["input_ids"]) for i in chunk): on_done(n, t))

