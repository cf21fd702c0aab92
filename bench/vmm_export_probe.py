"""Can the memory of torch's expandable segments be shared with another
process? Under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torch maps
its segments with cuMemCreate/cuMemMap, which cudaIpcGetMemHandle refuses;
the driver's own way to share them is a POSIX file descriptor per physical
allocation (cuMemExportToShareableHandle), if torch asked for that handle
type when it made them. This probe says, for tensors of a few sizes:
the address range the driver reports, the physical allocation's handle
types, whether two retains give the same handle, and whether an exported
descriptor imports and maps to the same bytes.

    python3 bench/vmm_export_probe.py
"""
import ctypes
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402  (after the allocator's configuration)

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
drv = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                ("flags", ctypes.c_int)]


def call(name, *args):
    return getattr(drv, name)(*args)


def import_and_compare(fd, size, chunk_base, t):
    """Imports fd, maps it at a fresh address, compares the tensor's bytes
    inside that chunk with the original's."""
    h = u64()
    err = call("cuMemImportFromShareableHandle", ctypes.byref(h),
               ctypes.c_void_p(fd), POSIX_FD)
    if err:
        return "import error %d" % err
    va = u64()
    err = call("cuMemAddressReserve", ctypes.byref(va), u64(size), u64(0),
               u64(0), u64(0))
    err = err or call("cuMemMap", va, u64(size), u64(0), h, u64(0))
    acc = Access(1, torch.cuda.current_device(), 3)  # DEVICE, READWRITE
    err = err or call("cuMemSetAccess", va, u64(size), ctypes.byref(acc),
                      u64(1))
    if err:
        return "map error %d" % err
    off = t.data_ptr() - chunk_base
    n = min(t.numel() * t.element_size(), size - off)
    host = (ctypes.c_char * n)()
    err = call("cuMemcpyDtoH_v2", host, u64(va.value + off), u64(n))
    want = t.view(torch.uint8).flatten()[:n].cpu().numpy().tobytes()
    call("cuMemUnmap", va, u64(size))
    call("cuMemAddressFree", va, u64(size))
    call("cuMemRelease", h)
    if err:
        return "copy error %d" % err
    return "same bytes" if bytes(host) == want else "DIFFERENT bytes"


def probe(nbytes):
    t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    base, size = u64(), ctypes.c_size_t()
    err = call("cuMemGetAddressRange_v2", ctypes.byref(base),
               ctypes.byref(size), u64(t.data_ptr()))
    h1, h2 = u64(), u64()
    e1 = call("cuMemRetainAllocationHandle", ctypes.byref(h1),
              ctypes.c_void_p(t.data_ptr()))
    e2 = call("cuMemRetainAllocationHandle", ctypes.byref(h2),
              ctypes.c_void_p(t.data_ptr()))
    prop = Prop()
    e3 = call("cuMemGetAllocationPropertiesFromHandle", ctypes.byref(prop),
              h1)
    fd = ctypes.c_int(-1)
    e4 = call("cuMemExportToShareableHandle", ctypes.byref(fd), h1,
              POSIX_FD, u64(0))
    print("tensor %10d B at %#x: range err %d base %#x size %d; retain "
          "err %d/%d same handle %s; props err %d handle types %d; export "
          "err %d fd %d" % (nbytes, t.data_ptr(), err, base.value, size.value,
                            e1, e2, h1.value == h2.value, e3,
                            prop.handle_types, e4, fd.value))
    if e4 == 0 and err == 0:
        print("    imported: %s" % import_and_compare(fd.value, size.value,
                                                       base.value, t))
        os.close(fd.value)
    for h in (h1, h2):
        if h.value:
            call("cuMemRelease", h)


def main():
    torch.cuda.init()
    print("torch", torch.__version__, os.environ["PYTORCH_CUDA_ALLOC_CONF"])
    for nbytes in (1024, 1 << 20, 8 << 20, 64 << 20, 300 << 20):
        probe(nbytes)


if __name__ == "__main__":
    main()
