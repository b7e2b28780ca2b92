"""Shared test setup: Triton's interpreter on machines without a GPU, the gpu marker."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere: the kernels then run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
