"""Shared test setup: Triton's interpreter on machines without a GPU, the gpu marker, and
every workspace the library allocates poisoned with NaN."""

import os
import sys

# Two pytest-xdist workers share two cores: one BLAS thread each (set before numpy loads),
# or the many small tile products of the reference oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import functools  # noqa: E402

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

from interpreter_rounding import round_like_the_gpu  # noqa: E402

round_like_the_gpu()  # the interpreter's bf16 casts round as a GPU's do (see its module)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", "triton"])
def device(request, monkeypatch):
    """Run a public-API test on each backend: the torch tiles on the CPU, and the Triton
    kernels on the GPU when there is one (else on CPU tensors in Triton's interpreter).

    On the GPU the value checks run synchronously (``TILEATTN_DEBUG_CHECKS=1``), as on the CPU:
    these tests expect a bad value to raise an exception that names it, while the default,
    asynchronous device check ends in a device-side assertion that leaves the process's CUDA
    context unusable for every later test. tests/test_sync.py tests the asynchronous checks,
    the failing one in a subprocess of its own."""
    if request.param == "triton" and HAS_CUDA:
        monkeypatch.setenv("TILEATTN_DEBUG_CHECKS", "1")
        return "cuda"
    monkeypatch.setenv("TILEATTN_BACKEND", request.param)
    return "cpu"


@pytest.fixture
def split_launches(monkeypatch) -> list:
    """A list that grows by one entry per forward or combine launch (``gpu._launch.Launch``) from
    now on: the forward's ``MERGE_SPLITS`` (True where it merges its own splits), False for the combine."""
    from tileattn.gpu import _launch

    seen, call = [], _launch.Launch.__call__

    def counted(self, *args):
        if "MERGE_SPLITS" in self.constexprs or "SKIP_MARKED" in self.constexprs:
            seen.append(self.constexprs.get("MERGE_SPLITS", False))
        return call(self, *args)

    monkeypatch.setattr(_launch.Launch, "__call__", counted)
    return seen


# ------------------------------------------------------------------ poisoned allocations


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what no kernel could mistake for a result: NaN for floating point, the
    largest value of an integer dtype (an index far out of range), True for bool."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


def _poisoning(allocate):
    """``allocate`` (torch.empty and kin), poisoning what tileattn's own code allocates: a kernel
    that reads memory it never wrote then gives NaN (or an index out of range) and its test fails.
    Allocations by the tests, torch or other libraries are left as they are; so is what
    torch.compile traces (the fake tensors of a traced graph carry no values)."""

    @functools.wraps(allocate)
    def poisoned(*args, **kwargs):
        t = allocate(*args, **kwargs)
        if torch.compiler.is_compiling() or not t.numel():  # first: dynamo cannot trace sys._getframe
            return t
        if sys._getframe(1).f_globals.get("__name__", "").split(".")[0] == "tileattn":
            with torch.no_grad():
                poison_(t)
        return t

    return poisoned


@pytest.fixture(autouse=True)
def poison_library_allocations(monkeypatch):
    """Every test (interpreter, GPU and CPU-path alike) runs with the library's torch.empty,
    torch.empty_like, torch.empty_strided and Tensor.new_empty returning poisoned memory."""
    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"),
                        (torch.Tensor, "new_empty")):
        monkeypatch.setattr(owner, name, _poisoning(getattr(owner, name)))


# ------------------------------------------------------------------ the device checks' logic, on the CPU


@pytest.fixture
def device_checks(monkeypatch):
    """The asynchronous checks run on CPU tensors: torch._assert_async then raises at once."""
    from tileattn.ops import _validate

    monkeypatch.setattr(_validate, "value_mode", lambda t: "device")


@pytest.fixture
def asserting_interpreter(monkeypatch):
    """Triton's interpreter keeping device assertions, as the ``debug`` option keeps them when compiling:
    a failed one raises (InterpreterError, with the assertion's message), and the ops layer relies on
    them as on a GPU (``kernel_asserts``)."""
    from triton.runtime import interpreter

    from tileattn.gpu import combine
    from tileattn.gpu._tuning import interpreting
    from tileattn.ops import _validate

    if not interpreting():
        pytest.skip("Triton's interpreter only")
    monkeypatch.setattr(interpreter.interpreter_builder, "options",
                        interpreter.InterpreterOptions(debug=True, sanitize_overflow=False))
    monkeypatch.setattr(_validate, "kernel_asserts", lambda t: True)
    # a merged launch that fails part-way leaves its arrival counters counted (on a GPU the context
    # goes with them): this test's own, so that later tests find the cached ones at zero
    monkeypatch.setattr(combine, "_COUNTERS", {})
