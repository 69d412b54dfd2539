"""A real vLLM OpenAI server on the CPU for the connector's tests and benchmark:
a random-weight Llama built from a config, a tokenizer trained on the spot
(nothing is downloaded), and a small HTTP client for /v1/completions."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests import helpers

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had "
         "by hot word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first who "
         "may down side been now find any new work part take get place made live where after back little only round "
         "man year came show every good me give our under name very through just form sentence great think say help "
         "low line differ turn cause much mean before move right boy old too same tell does set three want air well "
         "also play small end put home read hand port large spell add even land here must big high such follow act "
         "why ask men change went light kind off need house picture try us again animal point mother world near "
         "build self earth father head stand own page should country found answer school grow study still learn "
         "plant cover food sun four between state keep eye never last let thought city tree cross farm hard start "
         "might story saw far sea draw left late run while press close night real life few north").split()


def text(n_words: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


BLOCK = 32  # the servers' block size, in tokens
OUT = 24  # tokens generated per turn in the tests


def conversation(tok, seed: int, words: tuple[int, int] = (400, 60)) -> tuple[list[int], list[int]]:
    """The prompt of turn 1 and the user's next message, as token ids."""
    return tok(text(words[0], seed))["input_ids"], tok(" " + text(words[1], seed + 1000))["input_ids"]


def served(r: dict) -> int:
    """The prompt tokens vLLM did not compute: the connector loaded them."""
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def expected_served(p1: list[int], out1: list[int], p2: list[int]) -> int:
    # turn 1 left KV for every token but its last; vLLM loads whole blocks and computes the prompt's last token
    return min(len(p1) + len(out1) - 1, len(p2) - 1) // BLOCK * BLOCK


# A session the connector saves just after the response may not be found yet: that counts as not yet.
wait_for = functools.partial(helpers.wait_for, missing_ok=True)


def tiny_llama(path: str | Path, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
               max_len: int = 4096, seed: int = 0) -> str:
    """Write a random-weight Llama (head size hidden // heads) and a BPE
    tokenizer trained on generated text to path; returns the path."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([text(200, i) for i in range(200)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random weights large enough that greedy picks are clear, not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in a subprocess; with a
    tierd socket, the TierdConnector is loaded."""

    def __init__(self, model: str, log_path: str | Path, tierd_socket: str | None = None,
                 python: str = sys.executable, block_size: int = BLOCK, max_len: int = 4096,
                 prefix_caching: bool = False, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.port),
               "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_len),
               "--block-size", str(block_size), "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details",
               "--max-num-seqs", "4", "--seed", "0", "--served-model-name", "tiny"]
        if tierd_socket is not None:
            cmd += ["--kv-transfer-config", json.dumps({
                "kv_connector": "TierdConnector", "kv_connector_module_path": "tierd.adapters.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"address": "unix:" + tierd_socket}})]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1",
                   **(extra_env or {}))
        self.cmd = cmd
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 600.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not come up in {timeout:.0f} s:\n{self.log()[-6000:]}")

    def complete(self, prompt: list[int], max_tokens: int, session: str | None = None) -> dict:
        """Greedy completion of a prompt given as token ids; returns the
        output token ids, usage and the time to the first token."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}
        headers = {"Content-Type": "application/json"}
        if session is not None:
            headers["X-Session-ID"] = session
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(), headers)
        t0 = time.perf_counter()
        first, ids, usage = None, [], None
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                for choice in msg.get("choices") or []:
                    if choice.get("token_ids"):
                        if first is None:
                            first = time.perf_counter() - t0
                        ids += choice["token_ids"]
                if msg.get("usage"):
                    usage = msg["usage"]
        return {"token_ids": ids, "usage": usage, "ttft": first, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
