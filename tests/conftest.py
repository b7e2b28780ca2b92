"""Shared test setup: Triton's interpreter on machines without a GPU, the gpu marker."""

import os

# Two pytest-xdist workers share two cores: one BLAS thread each (set before numpy loads),
# or the many small tile products of the reference oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# In CI, hypothesis draws the same examples every run (seeded, reproducible); locally it
# explores new ones each time.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", "triton"])
def device(request, monkeypatch):
    """Run a public-API test on each backend: the torch tiles on the CPU, and the Triton
    kernels on the GPU when there is one (else on CPU tensors in Triton's interpreter)."""
    if request.param == "triton" and HAS_CUDA:
        return "cuda"
    monkeypatch.setenv("TILEATTN_BACKEND", request.param)
    return "cpu"
