"""Several chat sessions taking turns against a running tierd (`make serve`).

A random-weight Llama-style model (built from a config: nothing is downloaded)
serves three sessions for three turns. After each turn the session's KV cache
is saved to tierd (only what the turn added) and released; between turns the
sessions are pushed to disk, as they would be on a busy node, then prefetched
before their next turn. Each turn prints where the session was restored from,
how long the restore took, and how long recomputing the same tokens takes.

    python examples/chat_resume.py [--address SOCKET] [--turn-tokens 512]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tierd.adapters.hf import CacheStore, forward
from tierd.client import Client, Unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="the daemon's socket (default: TIERD_SOCKET or the default socket)")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=512, help="tokens each user message adds")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()
    client = Client(args.address)
    try:
        client.stats()
    except Unavailable:
        raise SystemExit(f"no tierd at {client.address}: start one with `make serve`") from None

    history: dict[str, torch.Tensor] = {}
    store = CacheStore(client, config, model_id="example/llama-random")
    print(f"{'session':<10}{'turn':>5}{'context':>9}  {'restored from':<14}{'restore':>10}{'recompute':>11}")
    for t in range(args.turns):
        for s in range(args.sessions):
            sid = f"chat-{s}"
            message = torch.randint(0, config.vocab_size, (1, args.turn_tokens))
            if t == 0:
                cache, source, restore_ms = DynamicCache(config=config), "-", 0.0
            else:
                client.wait_ready(sid, timeout=30)
                source = client.stat(sid).tier
                t0 = time.perf_counter()
                cache = store.restore(sid)
                restore_ms = (time.perf_counter() - t0) * 1e3
            context = history.get(sid)
            t0 = time.perf_counter()
            if context is not None:
                forward(model.model, context, DynamicCache(config=config))  # what a restore saves: the prefill so far
            recompute_ms = (time.perf_counter() - t0) * 1e3
            forward(model.model, message, cache)
            history[sid] = message if context is None else torch.cat([context, message], dim=1)
            store.save(sid, cache)  # only the pages this turn added
            client.release(sid)
            ctx = history[sid].shape[1] - args.turn_tokens
            restored = f"{restore_ms:8.1f}ms" if t else f"{'-':>10}"
            recomputed = f"{recompute_ms:9.1f}ms" if t else f"{'-':>11}"
            print(f"{sid:<10}{t + 1:>5}{ctx:>9}  {source:<14}{restored}{recomputed}")
        if t + 1 < args.turns:
            # A busy node: squeeze the host tier so idle sessions go to disk, then give the room back.
            budget = next(x.budget for x in client.stats()["tiers"] if x.name == "host")
            client.set_budget("host", 0)
            client.set_budget("host", budget)
            print(f"-- sessions now on {sorted({client.stat(f'chat-{s}').tier for s in range(args.sessions)})};"
                  " prefetching for the next turn")
            for s in range(args.sessions):
                client.prefetch(f"chat-{s}")
    for s in range(args.sessions):
        client.drop(f"chat-{s}")
    store.close()


if __name__ == "__main__":
    main()
