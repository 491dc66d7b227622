import pytest

from tests.integrations import zygote


@pytest.fixture(scope="session", autouse=True)
def _vllm_fork_server():
    """Stops the vLLM fork server (tests/integrations/zygote.py) that this session's vLLM runs started."""
    yield
    zygote.stop()
