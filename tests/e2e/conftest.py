import pytest

from tests.e2e.server_process import ServerProcess, make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("weights") / "txl-tiny")


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield process
    process.stop()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c
