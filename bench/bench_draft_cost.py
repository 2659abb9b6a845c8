#!/usr/bin/env python3
"""c measured as time on a GPU: one EAGLE-3 draft step against one verifier decode step of k + 1 tokens.

05 estimates what a drafted token costs by the weights it reads (c = draft weights / verifier weights, the
rule of memory-bound decoding). This measures it: random weights of the real shapes (speed does not depend on
their values), bf16, a KV cache holding --context tokens, each step captured as a CUDA graph and replayed,
at batch 1, 8 and 64. The verifier step runs k + 1 tokens a sequence (what a verify step feeds it); the draft
step one token: fc over the three aux states, its first layer over [embedding, state] (2H wide), the other
layers, the norm and its lm head over the draft vocabulary. Prints both c's side by side and their ratio.
Usage: python bench/bench_draft_cost.py --verifiers smollm2 llama8b --batches 1 8 64
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {  # hidden, layers, heads, kv heads, MLP width, vocabulary (the public configs)
    "smollm2": (576, 30, 9, 3, 1536, 49152),      # SmolLM2-135M-Instruct
    "llama8b": (4096, 32, 32, 8, 14336, 128256),  # Llama-3.1-8B
}
DRAFTS = {"standard": (1, 1), "2 layers, 8x MLP": (2, 8)}  # layers, MLP width in multiples of the verifier's


class Block(nn.Module):
    """A Llama decoder layer reading and writing a static KV cache at positions [start, start + T)."""

    def __init__(self, hidden, heads, kv, mlp, attn_in=1):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, hidden // heads
        self.q = nn.Linear(attn_in * hidden, heads * self.hd, bias=False)
        self.k = nn.Linear(attn_in * hidden, kv * self.hd, bias=False)
        self.v = nn.Linear(attn_in * hidden, kv * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, hidden, bias=False)
        self.gate = nn.Linear(hidden, mlp, bias=False)
        self.up = nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)
        self.n1, self.n2 = nn.Parameter(torch.ones(attn_in * hidden)), nn.Parameter(torch.ones(hidden))

    def forward(self, x, attn_in, cache, start, mask):
        b, t, _ = x.shape
        h = F.rms_norm(attn_in, (attn_in.shape[-1],), self.n1)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        cache[0][:, :, start:start + t] = self.k(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        cache[1][:, :, start:start + t] = self.v(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, cache[0][:, :, :start + t], cache[1][:, :, :start + t], attn_mask=mask,
                                           enable_gqa=True)
        x = x + self.o(o.transpose(1, 2).reshape(b, t, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.n2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def weights(module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if not n.startswith("embed"))


def graph_ms(fn, reps: int) -> float:
    """Median milliseconds of one replay of fn captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def measure(shape, draft, batch: int, k: int, context: int, draft_vocab: int, reps: int) -> dict:
    hidden, layers, heads, kv, mlp, vocab = shape
    d_layers, width = draft
    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    with dev:
        verifier = nn.ModuleDict({"embed": nn.Embedding(vocab, hidden),
                                  "layers": nn.ModuleList(Block(hidden, heads, kv, mlp) for _ in range(layers)),
                                  "head": nn.Linear(hidden, vocab, bias=False)}).to(dt)
        draft_model = nn.ModuleDict({"fc": nn.Linear(3 * hidden, hidden, bias=False),
                                     "layers": nn.ModuleList(Block(hidden, heads, kv, mlp * width, 2 if i == 0 else 1)
                                                             for i in range(d_layers)),
                                     "head": nn.Linear(hidden, draft_vocab, bias=False)}).to(dt)
        hd = hidden // heads
        v_cache = [torch.randn(2, batch, kv, context + k + 1, hd, dtype=dt) for _ in range(layers)]
        d_cache = [torch.randn(2, batch, kv, context + 1, hd, dtype=dt) for _ in range(d_layers)]
        tokens = torch.randint(0, vocab, (batch, k + 1))
        aux = torch.randn(batch, 1, 3 * hidden, dtype=dt)
        causal = torch.ones(k + 1, context + k + 1, dtype=torch.bool).tril(context)  # new tokens see the past

    @torch.no_grad()
    def verify():
        x = verifier["embed"](tokens)
        for block, cache in zip(verifier["layers"], v_cache):
            x = block(x, x, cache, context, causal)
        return verifier["head"](x).argmax(-1)

    @torch.no_grad()
    def draft_step():
        h = draft_model["fc"](aux)
        x = verifier["embed"](tokens[:, :1])
        for i, (block, cache) in enumerate(zip(draft_model["layers"], d_cache)):
            h = block(h, torch.cat([x, h], -1) if i == 0 else h, cache, context, None)
        return draft_model["head"](h).argmax(-1)

    t_verify, t_draft = graph_ms(verify, reps), graph_ms(draft_step, reps)
    w_verify, w_draft = weights(verifier), weights(draft_model)
    verifier = draft_model = v_cache = d_cache = None  # frees them (the closures above hold them too)
    torch.cuda.empty_cache()
    return {"verify_ms": t_verify, "draft_ms": t_draft, "c_time": t_draft / t_verify, "c_weights": w_draft / w_verify,
            "draft_weights": w_draft, "verifier_weights": w_verify}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifiers", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="verifier shapes")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64], help="sequences decoded at once")
    p.add_argument("--k", type=int, default=3, help="draft tokens per verify step (the verifier runs k + 1)")
    p.add_argument("--context", type=int, default=1024, help="tokens already in the KV cache")
    p.add_argument("--draft-vocab", type=int, default=32768, help="the draft's vocabulary (its lm head's rows)")
    p.add_argument("--reps", type=int, default=200, help="graph replays per timing (median of 5 timings)")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, bf16, CUDA graphs, k = {args.k}, context {args.context}, "
          f"draft vocabulary {args.draft_vocab}")
    print("| verifier | draft | batch | verify step ms | draft step ms | c (time) | c (weights) | time / weights | "
          "est. speedup at tau 3.0, time / weights |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.verifiers:
        for draft_name, draft in DRAFTS.items():
            for batch in args.batches:
                r = measure(SHAPES[name], draft, batch, args.k, args.context, args.draft_vocab, args.reps)
                est = [3.0 / (1 + args.k * c) for c in (r["c_time"], r["c_weights"])]
                print(f"| {name} ({r['verifier_weights'] / 1e6:,.1f}M) | {draft_name} ({r['draft_weights'] / 1e6:,.1f}M) "
                      f"| {batch} | {r['verify_ms']:.3f} | {r['draft_ms']:.3f} | {r['c_time']:.3f} | {r['c_weights']:.3f} "
                      f"| {r['c_time'] / r['c_weights']:.2f} | {est[0]:.2f}x / {est[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
