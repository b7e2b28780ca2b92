"""Every Triton kernel variant the launchers can pick compiles for Hopper (sm_90) and fits in
its shared memory — checked on a machine without a GPU (see tests/hopper_compile.py).

Triton's interpreter, which runs the kernels elsewhere in this suite, never invokes the
compiler: a kernel the compiler rejects, or a tile too large for a block's shared memory,
would otherwise first fail on the GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(HERE / "hopper_compile.py")], env=env, capture_output=True, text=True,
                         timeout=2400)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert " 0 failed" in report.splitlines()[-1], report[-3000:]
