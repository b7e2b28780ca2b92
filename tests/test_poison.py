"""The conftest's poisoning is on: what tileattn allocates with torch.empty and kin comes back
full of NaN (integers: their largest value), so a kernel reading memory it never wrote fails."""

import torch


def _allocate_as(module_name: str):
    """torch.empty, empty_like, empty_strided and new_empty called from code whose module is ``module_name``."""
    namespace = {"__name__": module_name, "torch": torch}
    exec(
        "def allocate(like):\n"
        "    return (torch.empty(3, 2), torch.empty_like(like), torch.empty_strided((2, 2), (1, 2)),\n"
        "            like.new_empty(4), torch.empty(5, dtype=torch.int32), torch.empty(2, dtype=torch.bool))\n",
        namespace)
    return namespace["allocate"](torch.zeros(2, 3, dtype=torch.bfloat16))


def test_library_allocations_are_poisoned():
    *floats, ints, bools = _allocate_as("tileattn.gpu.attention")
    assert all(bool(t.isnan().all()) for t in floats)
    assert floats[1].dtype == torch.bfloat16
    assert bool((ints == torch.iinfo(torch.int32).max).all()) and bool(bools.all())

