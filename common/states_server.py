"""Hidden states from a running vLLM server: the `vllm serve` command with 03's extraction settings (the
`extract_hidden_states` method and a hidden-states connector writing to a shared folder), the name that tells a
trainer which layers it stores, and the client 04's server source uses (--states-from server)."""
import json
import os
import time
import urllib.error
import urllib.request

import torch

from common.errors import UserError


def served_name(verifier: str, layer_ids: list[int]) -> str:
    """The model name a states server answers to: the verifier's folder and the layer ids it stores (the last is the
    final layer), so a trainer can tell a server of other layers from its own."""
    return f"{os.path.basename(os.path.normpath(verifier))}@layers={','.join(map(str, layer_ids))}"


def layers_served(name: str) -> list[int] | None:
    """The layer ids in a served_name, or None for a server started otherwise."""
    _, sep, ids = name.rpartition("@layers=")
    try:
        return [int(i) for i in ids.split(",")] if sep else None
    except ValueError:
        return None


def serve_command(verifier: str, layer_ids: list[int], storage: str, host: str, port: int, max_len: int, dtype: str,
                  tensor_parallel_size: int, gpu_memory_utilization: float, trust_remote_code: bool) -> list[str]:
    """`vllm serve` with 03's extraction settings: each request's prompt states go to `storage` (a RAM disk, shared
    with the trainer), named in the answer's kv_transfer_params."""
    import sys
    on_cpu = not torch.cuda.is_available()
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", verifier,
            "--served-model-name", served_name(verifier, layer_ids), "--host", host, "--port", str(port),
            "--max-model-len", str(max_len), "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel_size),
            "--gpu-memory-utilization", str(gpu_memory_utilization), "--no-enable-prefix-caching",
            *(["--enforce-eager"] if on_cpu else []), *(["--trust-remote-code"] if trust_remote_code else []),
            "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                                "draft_model_config": {"hf_config": {
                                                    "eagle_aux_hidden_state_layer_ids": layer_ids}}}),
            "--kv-transfer-config", json.dumps({"kv_connector": "CpuSafeHiddenStatesConnector",
                                                "kv_connector_module_path": "common.vllm_extract",
                                                "kv_role": "kv_producer",
                                                "kv_connector_extra_config": {"shared_storage_path": storage}})]


PROBE = "The quick brown fox jumps over the lazy dog."  # what the tokenizer check encodes on both sides
HEAD_TOLERANCE = 0.25  # nats a token: bf16 rounding stays well below, another model's weights well above


def verifier_head(verifier: str, eps: float, offset: float = 0.0):
    """The verifier's final RMSNorm and lm_head (its embedding where tied), read from its shards: last-layer states
    [tokens, hidden] -> full-vocabulary log-probabilities, to check that a server runs the same weights. `offset`:
    1 where the norm scales by 1 + weight (Gemma's), 0 where by the weight (Llama, Qwen, DeepSeek)."""
    from speculators.utils.loading import load_model_layers
    w = load_model_layers(["model.norm.weight"], verifier)
    try:
        w.update(load_model_layers(["lm_head.weight"], verifier))
    except (KeyError, ValueError):  # a tied head
        w.update(load_model_layers(["embed_tokens.weight"], verifier))
    head, norm = w.get("lm_head.weight", w.get("embed_tokens.weight")), w["model.norm.weight"].float() + offset

    def logprobs(h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm
        return (h.to(head.dtype) @ head.T).float().log_softmax(-1)
    return logprobs


class StatesClient:
    """Requests to a states server: each row's token ids go as a prompt with max_tokens 1; the answer names the file
    of its states, which is read and removed. A failed request is retried; a server that is down, serves another
    tokenizer or verifier, or stores other layers is a one-line error naming the URL and what differs."""

    def __init__(self, url: str, tokenizer, layer_ids: list[int], hidden_size: int, tries: int = 3,
                 timeout: float = 600.0, file_wait: float = 60.0, head=None):
        self.url, self.tries, self.timeout, self.file_wait = url.rstrip("/"), tries, timeout, file_wait
        try:
            models = self._call("GET", "/v1/models", None, tries=1, timeout=10)["data"]
        except UserError as e:
            raise UserError(f"--states-url {self.url}: no vLLM server answers ({str(e).split(': ', 1)[-1]}); start one "
                            "with serve_states.py")
        self.model = models[0]["id"]
        served = layers_served(self.model)
        if served is None:
            raise UserError(f"--states-url {self.url} serves '{self.model}', not a states server of serve_states.py "
                            "(its name carries the layers it stores); start one with serve_states.py")
        if served != layer_ids:
            raise UserError(f"--states-url {self.url} stores layers {served}, this run trains on {layer_ids} (aux layers "
                            "and the final one): pass --layers as the server's, or serve these")
        theirs = self._call("POST", "/tokenize", {"model": self.model, "prompt": PROBE, "add_special_tokens": False})
        if theirs.get("tokens") != tokenizer.encode(PROBE, add_special_tokens=False):
            raise UserError(f"--states-url {self.url} serves '{self.model}', whose tokenizer is not --verifier-path's: "
                            "serve the verifier you train for")
        probe = tokenizer.encode(PROBE, add_special_tokens=False)
        answer = self._call("POST", "/v1/completions", {"model": self.model, "prompt": probe, "max_tokens": 1,
                                                        "prompt_logprobs": 0})
        states = self._read(answer, probe)
        if states.shape[-1] != hidden_size:
            raise UserError(f"--states-url {self.url} serves '{self.model}' with hidden size {states.shape[-1]}, "
                            f"--verifier-path has {hidden_size}: serve the verifier you train for")
        if head is not None:  # one family's base and instruct models share tokenizer and widths, not weights
            theirs = torch.tensor([d[str(t)]["logprob"] for d, t in
                                   zip(answer["choices"][0]["prompt_logprobs"][1:], probe[1:])])
            ours = head(states[:-1, -1]).gather(1, torch.tensor(probe[1:])[:, None])[:, 0]
            gap = (ours - theirs).abs().mean().item()
            if gap > HEAD_TOLERANCE:
                raise UserError(f"--states-url {self.url} serves '{self.model}', whose log-probabilities of a probe "
                                f"sentence differ from --verifier-path's head on the server's own last-layer states "
                                f"by {gap:.2f} nats a token: it serves another verifier; serve the one you train for")

    def _call(self, method: str, path: str, body, tries: int = 0, timeout: float = 0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        error = None
        for attempt in range(tries or self.tries):
            request = urllib.request.Request(self.url + path, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout or self.timeout) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"
                if e.code < 500:  # the request itself is wrong: another try gives the same answer
                    break
            except (urllib.error.URLError, OSError, ValueError) as e:
                error = str(getattr(e, "reason", e))
            time.sleep(min(2 ** attempt, 10))
        raise UserError(f"--states-url {self.url}{path}: {error}")

    def states(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), layers, hidden] of the prompt `ids`, as the server computed them."""
        answer = self._call("POST", "/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1})
        return self._read(answer, ids)

    def on_policy(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
        """The row with every assistant reply (a run of loss mask 1) written anew by the server, greedy, each at most
        as long as the one it replaces (04 plans its packs from the rows' lengths): (ids, loss mask on the generated
        tokens only, states). A reply that ended with the end-of-turn token is followed by the row's next user turn;
        one cut at that length ends the row; a reply that opens the row stays as written, unmasked. Each request keeps the states of its generated tokens too
        (kv_transfer_params.include_output_tokens), so the last one holds the states of the whole new row but its
        final token (never fed to the model), which the row leaves out."""
        # a reply that opens the row has no prompt to answer: kept as written, without loss, like the user turns
        spans = [(a, b) for a, b in runs_of_ones(mask) if a > 0]
        if not spans:
            return ids, [0] * len(ids), self.states(ids)  # nothing generated: nothing to learn from this row
        out, out_mask, cursor, answer = [], [], 0, None
        for start, end in spans:
            if answer is not None:
                self._read(answer, None)  # an earlier turn's states: the next request recomputes them
            out += ids[cursor:start]
            out_mask += [0] * (start - cursor)
            answer = self._call("POST", "/v1/completions", {
                "model": self.model, "prompt": out, "max_tokens": end - start, "temperature": 0,
                "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}})
            choice = answer["choices"][0]
            reply = choice.get("token_ids")
            if not reply:
                raise UserError(f"--states-url {self.url} answered a generation without its token ids (vLLM older "
                                "than return_token_ids?): serve with this project's vLLM")
            out += reply
            out_mask += [1] * len(reply)
            cursor = end
            if choice.get("finish_reason") != "stop":
                break
        return out[:-1], out_mask[:-1], self._read(answer, out[:-1])

    def _read(self, answer: dict, ids: list[int] | None) -> torch.Tensor | None:
        """The states file an answer names, read (checked to hold `ids`; None: only removed) and removed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states, load_hidden_states)
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path is None:
            raise UserError(f"--states-url {self.url} answered without a hidden_states_path: it is not serving with "
                            "the hidden-states connector; start it with serve_states.py")
        waited = time.time()
        while not os.path.exists(path + ".lock"):  # the connector may write after the answer is sent
            if time.time() - waited > self.file_wait:
                raise UserError(f"--states-url {self.url} wrote its states to {path}, which this machine does not see "
                                f"after {self.file_wait:.0f} s: the server's --storage must be a folder the trainer "
                                "shares")
            time.sleep(0.005)
        try:
            out = load_hidden_states(path) if ids is not None else None
        finally:
            cleanup_hidden_states(path)
        if out is None:
            return None
        if out["token_ids"].tolist() != list(ids):
            raise UserError(f"--states-url {self.url} returned states of other tokens than it was sent")
        return out["hidden_states"]


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask: the assistant replies of a row."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs
