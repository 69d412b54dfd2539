"""The socket's directory cannot be squatted: with XDG_RUNTIME_DIR unset, the
default socket lives in /tmp/tierd-UID, a name any local user can take first.
Whoever owns the directory, or can write to it, can swap the socket for their
own and receive every client's token and KV. The daemon refuses such a
directory at start, and a client given no address refuses to connect
through it. Each case runs the daemon and the client as a user made for the
test, against a directory made by another real user (nobody)."""

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tierd.testing import ROOT

NOBODY = pwd.getpwnam("nobody")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("useradd") and shutil.which("setpriv")),
                                reason="needs root, useradd and setpriv, to act as two local users")


def as_user(pw, *argv):
    """argv run as another user, through setpriv: with the interpreter under a
    directory closed to other users (/root/.pyenv), subprocess(user=...)
    could not exec it, and setpriv could."""
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *argv]


@pytest.fixture
def user():
    """A local user of its own (and its group), removed afterwards, with its
    default socket directory absent and a data dir it owns."""
    name = f"tierd-t{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    if subprocess.run(as_user(pw, sys.executable, "-c", "import tierd"), cwd=ROOT).returncode:
        subprocess.run(["userdel", name], check=True, capture_output=True)
        pytest.skip("this interpreter does not run as another user")
    socket_dir = f"/tmp/tierd-{pw.pw_uid}"
    data = tempfile.mkdtemp(prefix="tierd-user-")
    os.chown(data, pw.pw_uid, pw.pw_gid)
    _remove(socket_dir)  # left by an earlier user with this uid
    try:
        yield pw, socket_dir, data
    finally:
        _remove(socket_dir)
        shutil.rmtree(data, ignore_errors=True)
        subprocess.run(["userdel", name], check=True, capture_output=True)


def _remove(path):
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _env():
    """No XDG_RUNTIME_DIR: the default socket is /tmp/tierd-UID."""
    drop = ("XDG_RUNTIME_DIR", "TIERD_SOCKET", "TIERD_TOKEN")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONDONTWRITEBYTECODE": "1"}


def start(pw, data, log_path):
    """The daemon run as pw on its default socket, once it serves or has exited."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(as_user(pw, sys.executable, "-m", "tierd", "serve", "--data-dir", data, "--metrics",
                                        "off", "--device", "none", "--host-budget", "16MiB", "--host-slab", "16MiB",
                                        "--disk-budget", "64MiB", "--disk-slab", "64MiB"),
                                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and "serving on" not in log_path.read_text():
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log_path.read_text())
        time.sleep(0.05)
    return proc


def stop(proc):
    proc.terminate()
    assert proc.wait(30) == 0


def refused(pw, data, log_path):
    """The daemon's output, which must say it did not start (exit 1)."""
    proc = start(pw, data, log_path)
    if proc.poll() is None:
        stop(proc)
        raise AssertionError(f"the daemon served:\n{log_path.read_text()}")
    assert proc.returncode == 1, log_path.read_text()
    return log_path.read_text()


CLIENT = """
from tierd.client import Client, TierdError
try:
    with Client() as c:
        print(c.address, c.health(timeout=10))
except TierdError as exc:
    print(type(exc).__name__, exc)
"""


def client(pw):
    """What a client run as pw, given no address, says."""
    out = subprocess.run(as_user(pw, sys.executable, "-c", CLIENT), capture_output=True, text=True, timeout=60,
                         env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def make_dir(socket_dir, mode, owner):
    """The directory as `owner` makes it: a real process of that user."""
    subprocess.run(as_user(owner, "mkdir", "-m", f"{mode:o}", socket_dir), check=True)


@pytest.mark.parametrize("mode,owner,daemon_says,client_says", [
    # another user made it, world-writable and sticky (as /tmp): the case that was accepted
    (0o1777, "nobody", "belongs to uid {nobody}, not to this daemon's user", "belongs to uid {nobody}, not to you"),
    # another user made it private: it is still theirs
    (0o700, "nobody", "belongs to uid {nobody}", "belongs to uid {nobody}"),
    # the user's own, but others may write to it: the sticky bit is no excuse
    (0o1777, "user", "has mode 1777, not 0700", "is writable by others (mode 1777)"),
    (0o770, "user", "has mode 0770, not 0700", "is writable by others (mode 0770)"),
])
def test_a_socket_directory_others_control_is_refused(user, tmp_path, mode, owner, daemon_says, client_says):
    pw, socket_dir, data = user
    make_dir(socket_dir, mode, NOBODY if owner == "nobody" else pw)
    output = refused(pw, data, tmp_path / "daemon.log")
    assert f"the socket directory {socket_dir} {daemon_says.format(nobody=NOBODY.pw_uid)}" in output, output
    assert "Traceback" not in output and os.listdir(socket_dir) == []  # nothing was made in it
    said = client(pw)
    assert said.startswith(f"FailedPrecondition the socket directory {socket_dir} "
                           f"{client_says.format(nobody=NOBODY.pw_uid)}"), said


def test_a_symbolic_link_for_the_socket_directory_is_refused(user, tmp_path):
    """Another user points /tmp/tierd-UID at a private directory of the victim's:
    it looks right through the link, and is refused without following it."""
    pw, socket_dir, data = user
    target = os.path.join(data, "run")
    make_dir(target, 0o700, pw)
    subprocess.run(as_user(NOBODY, "ln", "-s", target, socket_dir), check=True)
    output = refused(pw, data, tmp_path / "daemon.log")
    assert f"the socket directory {socket_dir} is a symbolic link" in output, output
    assert os.listdir(target) == []
    assert client(pw).startswith(f"FailedPrecondition the socket directory {socket_dir} is a symbolic link")


def test_a_missing_socket_directory_is_made_private(user, tmp_path):
    pw, socket_dir, data = user
    serving = f"unix:{socket_dir}/tierd.sock SERVING"
    # the daemon makes it, 0700, its user's; the user's client connects through it
    daemon = start(pw, data, tmp_path / "daemon.log")
    try:
        assert daemon.poll() is None
        st = os.lstat(socket_dir)
        assert (st.st_uid, oct(st.st_mode & 0o7777)) == (pw.pw_uid, "0o700")
        assert client(pw) == serving
    finally:
        stop(daemon)
    # a client that comes first makes it the same way (no one else can take it then), and the daemon accepts it
    shutil.rmtree(socket_dir)
    assert client(pw).startswith("Unavailable")
    st = os.lstat(socket_dir)
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (pw.pw_uid, "0o700")
    daemon = start(pw, data, tmp_path / "daemon.log")
    try:
        assert daemon.poll() is None
        assert client(pw) == serving
    finally:
        stop(daemon)
