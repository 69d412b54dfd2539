"""The layers hold: the import-linter contracts in pyproject.toml are kept,
and `import tierd.client` loads no module of the daemon's."""

import shutil
import subprocess
import sys

import pytest

from tierd.testing import ROOT

DAEMON = ("tierd.core", "tierd.tiers", "tierd.transfer", "tierd.policy", "tierd.api", "tierd.machine", "tierd.daemon",
          "tierd.metrics")


def test_the_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(ROOT / ".venv" / "bin")) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (the test extra installs it)")
    out = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_client_loads_no_module_of_the_daemons():
    code = "import sys, tierd.client; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('tierd'))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    loaded = out.stdout.split()
    assert "tierd.client" in loaded
    assert [m for m in loaded if m.startswith(DAEMON)] == []
