"""Starting a kernel that is slow to answer: the bridge's start-up handshake must still complete.

Runs inside a real code-interpreter sandbox, with the bridge's own Kernel class and a real ipykernel whose every
kernel_info answer comes 1.5 s late (as a kernel starved of CPU answers). The bridge asks once a second; a
handshake that only counted answers to its newest question would never see one and give up after START_TIMEOUT.
"""

from __future__ import annotations

import json

from e2b_code_interpreter import Sandbox

ROOT = "/tmp/slow-kernel"

SLOW_KERNEL = '''
import time
from ipykernel.ipkernel import IPythonKernel
from ipykernel.kernelapp import IPKernelApp


class SlowKernel(IPythonKernel):
    async def kernel_info_request(self, stream, ident, parent):
        time.sleep(1.5)  # blocks the kernel: requests queue up behind each answer
        await super().kernel_info_request(stream, ident, parent)


IPKernelApp.launch_instance(kernel_class=SlowKernel)
'''

START = '''
import asyncio, os, time
from pathlib import Path
from keepstate.agent.interpreter.kernel import Kernel, LaunchSpec

async def main():
    runtime = Path("%(root)s/run")
    runtime.mkdir(exist_ok=True)
    kernel = Kernel("slowpy", LaunchSpec(runtime_dir=runtime, cwd="/tmp", user=None, env=dict(os.environ)))
    started = time.monotonic()
    await asyncio.wait_for(kernel.start(), 60)
    print("ready after %%.1f s" %% (time.monotonic() - started))
    await kernel.shutdown()

asyncio.run(main())
''' % {"root": ROOT}


def test_a_kernel_answering_late_every_time_still_starts(sandbox: Sandbox) -> None:
    spec = {"argv": ["python3", f"{ROOT}/slow_kernel.py", "-f", "{connection_file}"],
            "display_name": "slow", "language": "python"}
    sandbox.files.write(f"{ROOT}/slow_kernel.py", SLOW_KERNEL)
    sandbox.files.write(f"{ROOT}/share/jupyter/kernels/slowpy/kernel.json", json.dumps(spec))
    sandbox.files.write(f"{ROOT}/start.py", START)
    result = sandbox.commands.run(
        f"python3 {ROOT}/start.py", user="root", timeout=120,
        envs={"JUPYTER_PATH": f"{ROOT}/share/jupyter", "PYTHONPATH": "/opt/keepstate/lib:/opt/keepstate/site"})
    seconds = float(result.stdout.split()[-2])
    assert seconds >= 1.5, result.stdout  # it was slow: the first answer alone takes 1.5 s
