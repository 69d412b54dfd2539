"""The tiny model every llama.cpp test loads: a Llama-style GGUF the tests
write with the gguf package, random weights, a byte-level vocabulary
(<unk>, <s>, </s> and the 256 bytes): no weights are downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]


def tiny_llama(path: Path, seed: int = 0, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, n_kv: int = 2,
               n_ff: int = 256, ctx: int = 4096) -> Path:
    """Write the GGUF (once per path) and return its path."""
    import gguf

    if path.exists():
        return path
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tierd-test")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all float32
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB)
    w.add_token_scores([0.0] * len(VOCAB))
    w.add_token_types([2, 3, 3] + [6] * 256)  # unknown, control, control, then bytes
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head

    def tensor(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", len(VOCAB), n_embd, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    tensor("output.weight", len(VOCAB), n_embd, scale=0.5)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        tensor(p + "attn_q.weight", n_embd, n_embd)
        tensor(p + "attn_k.weight", n_kv * hd, n_embd)
        tensor(p + "attn_v.weight", n_kv * hd, n_embd)
        tensor(p + "attn_output.weight", n_embd, n_embd)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        tensor(p + "ffn_gate.weight", n_ff, n_embd)
        tensor(p + "ffn_up.weight", n_ff, n_embd)
        tensor(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
