"""``tileattn._env.getenv``: what ``os.environ.get`` returns, call after call, as the variables change."""

import os

import pytest

from tileattn._env import getenv


@pytest.mark.parametrize("value", ["triton", "", "0", "ünï cödé", "a=b c"])
def test_getenv_follows_os_environ(monkeypatch, value):
    name = "TILEATTN_TEST_ENV_VARIABLE"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name, "unset") == os.environ.get(name, "unset") == "unset"
    monkeypatch.setenv(name, value)
    assert getenv(name, "unset") == os.environ.get(name, "unset") == value
    os.environ[name] = value + "!"  # a plain assignment, as scripts make
    assert getenv(name, "unset") == value + "!"
    del os.environ[name]
    assert getenv(name, "unset") == "unset"


def test_a_switch_changed_between_calls_takes_effect(monkeypatch):
    """The backend variable, read through ``getenv`` on every call, picks the backend of the next call."""
    import torch

    from tileattn.ops.backend import backend_name

    monkeypatch.setenv("TILEATTN_BACKEND", "cpu")
    assert backend_name(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("TILEATTN_BACKEND", "triton")
    assert backend_name(torch.device("cpu")) == "triton"


def test_getenv_follows_a_replaced_os_environ(monkeypatch):
    """``os.environ`` replaced by another mapping (``mock.patch("os.environ", {...})``,
    ``monkeypatch.setattr(os, "environ", ...)``): ``getenv`` reads that mapping, as ``os.environ.get`` does."""
    name = "TILEATTN_TEST_ENV_VARIABLE"
    monkeypatch.setenv(name, "outer")
    monkeypatch.setattr(os, "environ", {name: "replaced"})
    assert getenv(name, "unset") == os.environ.get(name, "unset") == "replaced"
    monkeypatch.setattr(os, "environ", {})
    assert getenv(name, "unset") == os.environ.get(name, "unset") == "unset"
