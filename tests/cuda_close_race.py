"""Child process of tests/test_cuda_faults.py: Client.close() in another thread while
a device put's copies run (CUDA stand-in).  Exits 0 when the process survives; a
segfault (-11) means close() unmapped the segment under the copies."""
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(addr: str) -> None:
    from kvmaster import Client, _cuda
    from tests.cuda_standin import CudaStandIn
    rt = CudaStandIn()
    _cuda.use_runtime(rt)
    c = Client()
    c.setup(addr, 16 << 20)
    src = rt.alloc(1 << 20)
    real = rt.copy_batch

    def slow(copies):
        time.sleep(0.5)  # a long copy (or a GPU busy with the caller's kernels)
        real(copies)

    rt.copy_batch = slow
    t = threading.Thread(target=lambda: (time.sleep(0.1), c.close(), print("closed", flush=True)))
    t.start()
    try:
        print("put", c.batch_put_from_device(["race"], [[src]], [[1 << 20]]), flush=True)
    except Exception as exc:  # noqa: BLE001
        print("raised", type(exc).__name__, exc, flush=True)
    t.join()


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(sys.argv[2])
        sys.exit(0)
    from tests.conftest import MasterProcess
    m = MasterProcess("--shards", "2")
    try:
        r = subprocess.run([sys.executable, __file__, "child", m.addr], timeout=60)
        print("child exit", r.returncode)
    finally:
        m.stop()
    sys.exit(0 if r.returncode >= 0 else 1)
