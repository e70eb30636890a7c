"""Fixtures shared by the test files of mcore-inference."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """One torch thread per test module: tiny matmuls only lose to thread start-up and spinning
    on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory):
    """The tiny Qwen2 checkpoint with varied greedy text that the ``serve`` test files serve."""
    from _serve_helpers import varied_checkpoint

    return varied_checkpoint(tmp_path_factory.mktemp("serve_ckpt"))
