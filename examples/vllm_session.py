"""A conversation on a vLLM server that runs the TierdConnector, driven the
way a router or an application would drive it.

Start the daemon (`make serve`) and vLLM with the connector:

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config \\
      '{"kv_connector": "TierdConnector", "kv_connector_module_path": "tierd.adapters.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

then:

    python examples/vllm_session.py --vllm http://127.0.0.1:8000 --session chat-7

Each turn goes to vLLM with the X-Session-ID header: vLLM resumes the session
from tierd and saves the turn back when it ends. The one thing the caller adds
is a Prefetch as soon as it knows the session is coming back (the user opened
the chat, started typing, a tool call returned): tierd starts moving the
session up from disk while the request is still on its way.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from tierd.client import Client, NotFound

SYSTEM = ("system: you are a helpful assistant who answers in plain words. keep each answer short, say what you "
          "know and what you do not know, and ask when a question is not clear. the user may come back to this "
          "conversation after a long time; answer as if no time had passed.")
QUESTIONS = ["tell me about the sea and the ships", "and what about the land far in the north",
             "which of the two would you pick"]


def turn(url: str, model: str, session: str, prompt: str, tierd: Client, max_tokens: int = 32) -> dict:
    try:
        tierd.prefetch(session)  # returns at once; the move runs in the background
    except NotFound:
        pass  # the first turn: nothing to bring back
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Session-ID": session})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    usage = reply["usage"]
    details = usage.get("prompt_tokens_details") or {}  # vLLM fills it with --enable-prompt-tokens-details
    return {"text": reply["choices"][0]["text"], "prompt_tokens": usage["prompt_tokens"],
            "from_tierd": details.get("cached_tokens"), "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000", help="the vLLM server")
    parser.add_argument("--model", help="the served model name (default: the server's first)")
    parser.add_argument("--session", default="chat-7")
    parser.add_argument("--tierd", help="tierd's address (default: TIERD_SOCKET or the default socket)")
    args = parser.parse_args()
    if args.model is None:
        with urllib.request.urlopen(f"{args.vllm}/v1/models", timeout=30) as r:
            args.model = json.load(r)["data"][0]["id"]
    conversation = SYSTEM
    with Client(args.tierd) as tierd:
        for n, question in enumerate(QUESTIONS, 1):
            conversation += f"\nuser: {question}\nassistant:"
            r = turn(args.vllm, args.model, args.session, conversation, tierd)
            conversation += r["text"]
            served = "?" if r["from_tierd"] is None else r["from_tierd"]
            print(f"turn {n}: {served} of {r['prompt_tokens']} prompt tokens from tierd, {r['seconds'] * 1e3:.0f} ms")
            time.sleep(0.5)  # the connector saves the turn just after the response
            print(f"  tierd holds {tierd.stat(args.session).num_tokens} tokens of {args.session!r}")


if __name__ == "__main__":
    main()
