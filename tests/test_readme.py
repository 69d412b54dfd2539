"""The README's tour runs as written against a real daemon."""

import os
import re
import subprocess
import sys

from tierd.testing import ROOT


def test_the_tour_runs(daemon):
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```")[1]
    assert first.split() == ["make", "serve", "make", "test"]  # the two commands come first, alone
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    leases = next(b for b in blocks if "begin_save" in b)
    shared = next(b for b in blocks if "shared_bytes" in b)
    # the lease block's comments state what each line gives: make them checks
    checks = "\nassert client.lookup('chat-45', ids + [7, 8]).num_tokens == 40\n" \
             "assert restored == [bytes([1]) * spec.page_bytes] * 3\n"
    checks += shared + "\nassert client.stat('chat-47').shared_bytes == 4 * spec.page_bytes\n" \
        "assert client.lookup('chat-48', prompt + [9] * 30, spec).num_tokens == 64\n" \
        "assert client.get('chat-47') == prompt_kv + bytes(spec.page_bytes)\n"
    out = subprocess.run([sys.executable, "-c", blocks[0] + leases + checks + "\nkv.close()\n"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TIERD_SOCKET": daemon.socket})
    assert out.returncode == 0, out.stderr
    with daemon.client() as c:
        info = c.stat("chat-42")
        assert (info.num_tokens, info.num_pages) == (60, 4)
        assert c.stat("chat-45").num_tokens == 40
