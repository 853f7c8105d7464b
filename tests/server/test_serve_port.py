"""`rooflm serve` on a port already in use fails at once, naming host:port, before it loads
the model (it used to load for half a minute, then fail inside uvicorn)."""

import os
import socket
import subprocess
import sys

import pytest

from rooflm.server.commands import bind_listeners
from tests.server.server_utils import REPO_ROOT

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture()
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_serve_on_a_port_in_use_exits_before_loading(busy_port):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "rooflm", "serve", "--model", "smollm2-135m", "--load-format", "dummy",
         "--host", "127.0.0.1", "--port", str(busy_port)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode not in (0, None), proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [f"rooflm: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use "
                     f"(another server? pick another --port)"], proc.stderr
    # Nothing of the model was loaded, and no "serving ... on" line claimed the port.
    assert "loading weights" not in proc.stderr and "serving" not in proc.stderr + proc.stdout


def test_bound_sockets_are_handed_over_not_listening():
    # Clients during the model load are refused, as before: the sockets only listen once
    # uvicorn takes them.
    (sock,) = bind_listeners("127.0.0.1", 0)
    with sock:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert not sock.get_inheritable()

