"""Child process of tests/test_cuda_faults.py: the ranged multi-buffer calls given
device pointers (CUDA stand-in), ``get`` or ``put``.  Exits 0 when they are refused;
a segfault (-11) means a CPU copy touched device memory."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(which: str, addr: str) -> None:
    from kvmaster import _cuda
    from kvmaster.compat import MooncakeDistributedStore
    from tests.cuda_standin import CudaStandIn
    rt = CudaStandIn()
    _cuda.use_runtime(rt)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", addr) == 0
    dev = rt.alloc(4096)
    rt.write(dev, os.urandom(4096))
    k = f"rk-{os.getpid()}"
    print("put", s.batch_put_from_multi_buffers([k], [[dev]], [[4096]]), flush=True)
    out = rt.alloc(4096)
    if which == "get":
        print("start", s.batch_get_session_start([k]), flush=True)
        print("ranges", s.batch_get_into_multi_buffer_ranges([k], [[out]], [[4096]], [[0]]),
              flush=True)
    else:
        print("pstart", s.batch_put_session_start([k + "p"], [4096]), flush=True)
        print("pranges", s.batch_put_from_multi_buffer_ranges([k + "p"], [[dev]], [[4096]],
                                                             [[0]]), flush=True)
    s.close()


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    from tests.conftest import MasterProcess
    m = MasterProcess("--shards", "2")
    try:
        r = subprocess.run([sys.executable, __file__, "child", sys.argv[1], m.addr], timeout=60)
        print("child exit", r.returncode)
    finally:
        m.stop()
    sys.exit(0 if r.returncode >= 0 else 1)
