"""The daemon tells glibc's malloc to keep freed buffers (machine.py): a
buffer of a MiB allocated again on a thread after a batch of them was freed
is written without a page fault per 4 KiB. Each case runs in a process of
its own, as the setting is process-wide."""

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import resource, sys, threading
    if sys.argv[1] == "kept":
        from tierd.machine import keep_freed_buffers
        print(keep_freed_buffers(), file=sys.stderr)

    def batch():  # what a batch of replies does: 32 buffers of 1 MiB, each written, then all freed
        bufs = [bytearray(1 << 20) for _ in range(32)]
        for b in bufs:
            b[::4096] = bytes(len(b[::4096]))
        del bufs

    def on_a_thread():
        t = threading.Thread(target=batch)
        t.start()
        t.join()

    on_a_thread()
    on_a_thread()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    on_a_thread()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and Linux's fault counts")
def test_buffers_freed_by_the_dozen_are_written_again_without_page_faults():
    assert faults("default") > 4000  # the counter sees them: 8,192 pages, each faulted in again
    assert faults("kept") < 400
