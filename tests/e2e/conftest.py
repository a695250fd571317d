import pytest

from tests.e2e.server_process import ServerProcess, make_checkpoint, make_checkpoints


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("weights") / "txl-tiny")


# a tiny random checkpoint of every architecture but Transformer-XL (tiny_checkpoint), by name;
# shared by the architecture tests, which must not change them (copy one to change it)
TINY_ARCHITECTURES = {
    "inf-tiny": "infinity-former", "vanilla-tiny": "vanilla", "xlnet-tiny": "xlnet", "longformer-tiny": "longformer",
    "logsparse-tiny": "logsparse", "adaptive-span-tiny": "adaptive-span", "performer-tiny": "performer",
    "linformer-tiny": "linformer", "conformer-tiny": "conformer", "lite-tiny": "lite-transformer",
    "reformer-tiny": "reformer", "mamba-tiny": "mamba", "mamba2-tiny": "mamba2", "rwkv-tiny": "rwkv",
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    return make_checkpoints(tmp_path_factory.mktemp("tiny-weights"), TINY_ARCHITECTURES)


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    process = ServerProcess([tiny_checkpoint], log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield process
    process.stop()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    """The openai package's client of `server`: this directory's, or the one a module defines."""
    with server.openai_client(timeout=120) as client:
        yield client
