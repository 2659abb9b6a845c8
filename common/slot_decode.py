"""Batched generation in a KV cache of fixed slots (01 --regen-batching slots), for Llama-style verifiers.

transformers' own batching is slow where 01 regenerates on a GPU without vLLM: padded generate() waits
for the longest reply of each batch and its cache grows by concatenation; generate_batch()'s Python
scheduler holds one core and starves the GPU (docs/benchmarks.md). Here every row owns one slot of a preallocated
[slots, kv heads, max_len, head dim] cache per layer and its own position; one decode step runs all
slots at once (a finished slot's work is wasted until it is refilled), and free slots are refilled in
groups: the new prompts are prefilled by the model's own forward (right-padded) and their keys and
values copied into the slots. The decode step reuses the model's modules and transformers' rotary
code, so only the attention over the slots is written here: on a GPU in bf16/fp16 by FlashAttention's
varlen kernel, which reads each slot's cache only up to that slot's own position (seqused_k); elsewhere by
SDPA over a span of the cache that holds the longest position in use.
"""
from collections import deque

import torch
import torch.nn.functional as F

from common.errors import UserError
from common.log import log


def supported(model) -> bool:
    """Whether the model is a plain decoder (Llama, Qwen, Mistral-style attention, no sliding window) this
    module knows how to step; MLA (DeepSeek, Kimi) is not."""
    inner = getattr(model, "model", None)
    layer = inner.layers[0] if inner is not None and hasattr(inner, "layers") else None
    return (inner is not None and all(hasattr(inner, n) for n in ["embed_tokens", "layers", "norm", "rotary_emb"])
            and hasattr(model, "lm_head")
            and all(hasattr(layer, n) for n in ["self_attn", "input_layernorm", "post_attention_layernorm", "mlp"])
            and all(hasattr(layer.self_attn, n) for n in ["q_proj", "k_proj", "v_proj", "o_proj"])
            and not getattr(layer.self_attn, "sliding_window", None))


def check_supported(model) -> None:
    if not supported(model):
        raise UserError(f"--regen-batching slots: {type(model).__name__} is not a Llama-style decoder without "
                        "sliding windows; use --regen-batching padded, or --regenerate vllm")


def flash_decode(q, keys, values, used, max_len: int, scale: float, rows: torch.Tensor) -> torch.Tensor:
    """One query per slot ([slots, heads, dim]) over its own cache row ([slots, max_len, kv heads, dim]) up to
    `used` positions, by the FlashAttention varlen kernel in torch's CUDA build: the op SDPA calls inside, taken
    directly because SDPA's public call has no per-row key lengths (seqused_k). `rows` is arange(slots + 1) in
    int32 (query i is row i; slot i's keys start at i * max_len), made once by the caller, not in every layer."""
    slots = keys.shape[0]
    flat_k, flat_v = (t.view(slots * max_len, *t.shape[2:]) for t in (keys, values))
    return torch.ops.aten._flash_attention_forward(q, flat_k, flat_v, rows, rows * max_len, 1, max_len, 0.0, False,  # noqa: SLF001
                                                   False, scale=scale, seqused_k=used)[0]


def flash_works(device, dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether FlashAttention's varlen kernel (in torch's CUDA build) runs here: a GPU, bf16/fp16, and one
    tiny call that must agree with SDPA; anything else decodes with SDPA."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(2, heads, head_dim, generator=g, device=device, dtype=dtype)
        kv = torch.randn(2, 2, 16, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
        used = torch.tensor([5, 16], dtype=torch.int32, device=device)
        out = flash_decode(q, kv[0], kv[1], used, 16, head_dim ** -0.5, torch.arange(3, dtype=torch.int32, device=device))
        for r, n in enumerate(used.tolist()):
            k, v = (t[r, :n].transpose(0, 1).repeat_interleave(heads // kv_heads, 0) for t in kv)
            want = F.scaled_dot_product_attention(q[r][:, None], k, v)[:, 0]
            if not torch.allclose(out[r].float(), want.float(), atol=2e-2, rtol=2e-2):
                log.warning("slots: FlashAttention's varlen kernel disagrees with SDPA here; decoding with SDPA")
                return False
        return True
    except (RuntimeError, TypeError) as e:
        log.warning(f"slots: FlashAttention's varlen kernel is not usable here ({str(e)[:160]}); decoding with SDPA")
        return False


class SlotDecoder:
    def __init__(self, model, slots: int, max_len: int, prefill_tokens: int):
        check_supported(model)
        self.model, self.inner = model, model.model
        c = model.config
        self.heads = c.num_attention_heads
        self.kv_heads = getattr(c, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        p = next(model.parameters())
        # positions before heads: the layout FlashAttention's varlen kernel reads ([slots * max_len, heads, dim])
        shape = (len(self.inner.layers), slots, max_len, self.kv_heads, self.head_dim)
        self.keys = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.values = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.slots, self.max_len, self.prefill_tokens = slots, max_len, prefill_tokens
        self.rows = torch.arange(slots, device=p.device)
        self.flash_rows = torch.arange(slots + 1, dtype=torch.int32, device=p.device)
        self.span = torch.arange(max_len, device=p.device)
        # attention reads the cache only up to the longest position in use, rounded up to one of these
        # spans: a step over the whole max_len read mostly empty cache (its bytes bound the step)
        self.spans = sorted({min(max_len, 256 << i) for i in range(max(1, max_len.bit_length()))})
        self.flash = flash_works(p.device, p.dtype, self.heads, self.kv_heads, self.head_dim)
        if self.flash:  # each slot reads its own length: one span, one graph
            self.spans = [max_len]
        self.graphs = {}
        if p.device.type == "cuda":
            try:
                self.capture()
            except RuntimeError as e:  # a model whose step cannot be recorded still runs, eagerly
                log.warning(f"slots: decode step not captured as a CUDA graph, running eagerly ({str(e)[:200]})")
                self.graphs = {}

    def capture(self) -> None:
        """Record the decode step once per span as a CUDA graph (one memory pool): one launch a step instead
        of a thousand small kernels launched from Python, which held the eager step to ~60 ms at 256 rows."""
        self.graph_tokens = torch.zeros(self.slots, dtype=torch.long, device=self.keys.device)
        self.graph_pos = torch.zeros_like(self.graph_tokens)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (its writes at position 0 are overwritten by every prefill)
            for span in self.spans:
                self.step(self.graph_tokens, self.graph_pos, span)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for span in reversed(self.spans):  # the largest first, so the others fit in its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.step(self.graph_tokens, self.graph_pos, span)
            pool = graph.pool()
            self.graphs[span] = (graph, logits)

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, longest: int) -> torch.Tensor:
        """step() over the smallest span that holds position `longest`, replayed from its CUDA graph on a GPU."""
        span = next(s for s in self.spans if s > longest)
        if not self.graphs:
            return self.step(tokens, pos, span)
        graph, logits = self.graphs[span]
        self.graph_tokens.copy_(tokens)
        self.graph_pos.copy_(pos)
        graph.replay()
        return logits

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Fill `slots` with the prompts' keys and values; the logits after each prompt's last token."""
        device = self.keys.device
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(p)
            attn[r, :len(p)] = 1
        out = self.inner(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=True)
        index = torch.tensor(slots, device=device)
        for i, layer in enumerate(out.past_key_values.layers):
            self.keys[i, index, :width] = layer.keys.transpose(1, 2)
            self.values[i, index, :width] = layer.values.transpose(1, 2)
        last = torch.tensor([len(p) - 1 for p in prompts], device=device)
        return self.model.lm_head(out.last_hidden_state[torch.arange(len(prompts), device=device), last]).float()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One token for every slot: `tokens` [slots] at positions `pos` [slots], each below `span`; the
        next-token logits."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        n, hd, groups = self.slots, self.head_dim, self.heads // self.kv_heads
        x = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(x, pos[:, None])
        # a slot sees its cache up to its own position; the query heads that share a key head ride as
        # that head's rows of queries, so grouped attention needs no copies of the cache
        mask = None if self.flash else (self.span[None, :span] <= pos[:, None])[:, None, None, :]
        used = (pos + 1).to(torch.int32)
        for i, layer in enumerate(self.inner.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(n, 1, self.heads, hd)
            k = a.k_proj(h).view(n, 1, self.kv_heads, hd)
            if hasattr(a, "q_norm"):  # Qwen3's per-head norms
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            self.keys[i][self.rows, pos] = k[:, :, 0]
            self.values[i][self.rows, pos] = a.v_proj(h).view(n, self.kv_heads, hd)
            if self.flash:
                o = flash_decode(q[:, :, 0], self.keys[i], self.values[i], used, self.max_len, a.scaling,
                                 self.flash_rows)
            else:
                o = F.scaled_dot_product_attention(
                    q.reshape(n, self.kv_heads, groups, hd), self.keys[i][:, :span].transpose(1, 2),
                    self.values[i][:, :span].transpose(1, 2), attn_mask=mask, scale=a.scaling)
            x = x + a.o_proj(o.reshape(n, 1, self.heads * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.inner.norm(x)[:, 0]).float()

    def generate(self, prompts, max_new, pick, eos: int, follow=None, stop=None,
                 first=None) -> list[tuple[list[int], bool]]:
        """Replies to `prompts`, each up to its max_new tokens or its eos; `pick(logits)` chooses tokens.
        `follow(i, reply, finished)`, called as reply i ends, may return a new (prompt, max_new): it is
        appended to `prompts` and `max_new` and queued, so a conversation's next turn needs no new batch.
        `stop(reply)`, if given, ends a reply early as if cut by its length limit (a greedy loop, say).
        `first`, if given, is the order in which the prompts start (the conversations with the most turns to
        come first), and a next turn goes to the front of the queue: long conversations are under way from the
        start and go on as soon as they can, rather than running last with most slots idle. Without it the
        shortest prompts start first and a next turn waits at the back. `steps` and `busy` count the decode
        steps and the slots that held a live reply in them (busy / (steps * slots): the cache's occupancy)."""
        device = self.keys.device
        # similar lengths prefill together unless the caller orders them
        queue = deque(first if first is not None else sorted(range(len(prompts)), key=lambda i: len(prompts[i])))
        self.steps = self.busy = 0
        replies = [[] for _ in prompts]
        results = [None] * len(prompts)
        owner = {}  # slot -> prompt index
        free = list(range(self.slots))
        tokens = torch.zeros(self.slots, dtype=torch.long, device=device)
        pos = torch.zeros(self.slots, dtype=torch.long, device=device)
        at_pos = [0] * self.slots  # the positions on the host, for the attention span

        def take(slot, i, token) -> bool:  # True while prompt i goes on
            replies[i].append(token)
            if token == eos or len(replies[i]) >= max_new[i] or (stop is not None and stop(replies[i])):
                results[i] = (replies[i][:-1], True) if token == eos else (replies[i], False)
                free.append(slot)
                if follow is not None and (nxt := follow(i, *results[i])) is not None:
                    prompts.append(nxt[0])
                    max_new.append(nxt[1])
                    replies.append([])
                    results.append(None)
                    (queue.append if first is None else queue.appendleft)(len(prompts) - 1)
                return False
            owner[slot] = i
            return True

        # one step in flight: step n + 1 is launched (from step n's tokens, still on the GPU) before the host
        # reads step n's tokens and ends replies, so the GPU does not wait for the host's bookkeeping (a finished
        # reply's next turn is tokenized here). A slot whose reply ended at step n runs step n + 1 for nothing;
        # each step remembers whom it ran for, and a token of a slot since ended or refilled is dropped.
        pending = None  # (tokens on their way to the host, the event that says they are there, slot -> prompt)
        while queue or owner or pending:
            # refill once an eighth of the slots is free (or nothing runs): one prefill serves many slots
            while queue and free and (not owner or len(free) >= max(1, self.slots // 8)):
                group, width = [], 0  # the shortest first, as many as the prefill budget holds (at least one)
                while queue and free and (not group or (len(group) + 1) * max(width, len(prompts[queue[0]]))
                                          <= self.prefill_tokens):
                    width = max(width, len(prompts[queue[0]]))
                    group.append((free.pop(), queue.popleft()))
                first = pick(self.prefill([s for s, _ in group], [prompts[i] for _, i in group])).tolist()
                going = [(s, t, len(prompts[i])) for (s, i), t in zip(group, first) if take(s, i, t)]
                if going:
                    at = torch.tensor([s for s, _, _ in going], device=device)
                    tokens[at] = torch.tensor([t for _, t, _ in going], device=device)
                    pos[at] = torch.tensor([n for _, _, n in going], device=device)
                    for s, _, n in going:
                        at_pos[s] = n
            launched = None
            if owner:  # (a slot that ended unseen may stand at max_len: its step is clamped, and dropped)
                tokens = pick(self.decode(tokens, pos, min(max(at_pos[s] for s in owner), self.max_len - 1)))
                pos = torch.clamp(pos + 1, max=self.max_len - 1)  # free slots run on harmlessly, masked
                for slot in owner:
                    at_pos[slot] += 1
                self.steps, self.busy = self.steps + 1, self.busy + len(owner)
                host = tokens.to("cpu", non_blocking=True, copy=True)  # (into pinned memory, from a GPU)
                ready = torch.cuda.Event() if device.type == "cuda" else None
                if ready is not None:
                    ready.record()
                launched = (host, ready, dict(owner))
            if pending is not None:
                host, ready, ran = pending
                if ready is not None:
                    ready.synchronize()
                host = host.tolist()
                for slot, i in ran.items():
                    if owner.get(slot) == i:  # else its reply ended at an earlier step
                        del owner[slot]
                        take(slot, i, host[slot])
            pending = launched
        return results
