"""Fixtures of the server tests; see server_utils.py for how servers are run."""

import pytest

from tests.server.server_utils import API_KEY, MAIN_SERVER_ARGS, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The main server: API key required, tight admission limits."""
    process = start_server(tmp_path_factory.mktemp("server"), "main", MAIN_SERVER_ARGS)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture()
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}
