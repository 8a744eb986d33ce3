import pytest

from tests.e2e.common import run_train


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    """One tokenised-corpus cache for every end-to-end run of the session."""
    return str(tmp_path_factory.mktemp("token-cache"))


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory, token_cache):
    """The reference every layout is compared with: the small recipe in one process."""
    out = str(tmp_path_factory.mktemp("single"))
    proc, metrics = run_train(out, cache_dir=token_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics
