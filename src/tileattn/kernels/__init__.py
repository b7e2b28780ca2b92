"""@triton.jit code only: no torch logic here (launchers live in ``tileattn.gpu``)."""
