"""Why does cuFileHandleRegister return 5027 on the GPU machine? Registers an O_DIRECT ext4 file
with cuFile under a private cufile.json (TRACE logging) and prints the result and the log."""

import ctypes
import json
import os
import re
import sys

src = "/etc/cufile.json"
text = open(src).read() if os.path.exists(src) else "{}"
cfg = json.loads(re.sub(r"(?m)^\s*//.*$", "", text))
print("cufile.json properties:", json.dumps(cfg.get("properties", {}), indent=1)[:1500])
print("cufile.json fs:", json.dumps(cfg.get("fs", {}), indent=1)[:800])
variant = sys.argv[1] if len(sys.argv) > 1 else "trace"
cfg.setdefault("logging", {})
cfg["logging"].update({"dir": "/tmp/cufile-log", "level": "TRACE"})
props = cfg.setdefault("properties", {})
if variant == "compat":
    props["allow_compat_mode"] = True
    props["force_compat_mode"] = True
os.makedirs("/tmp/cufile-log", exist_ok=True)
json.dump(cfg, open("/tmp/cufile-probe.json", "w"))
os.environ["CUFILE_ENV_PATH_JSON"] = "/tmp/cufile-probe.json"


class Err(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


class Descr(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("pad", ctypes.c_int),
        ("fd", ctypes.c_int),
        ("pad2", ctypes.c_int),
        ("fs_ops", ctypes.c_void_p),
    ]


lib = ctypes.CDLL("libcufile.so.0")
lib.cuFileDriverOpen.restype = Err
lib.cuFileHandleRegister.restype = Err
print("variant", variant, "driver open:", lib.cuFileDriverOpen().err)
for path, flags in (
    ("/root/cufile-probe.bin", os.O_DIRECT),
    ("/root/cufile-probe2.bin", 0),
    ("/tmp/cufile-probe3.bin", os.O_DIRECT),
):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    os.ftruncate(fd, 1 << 20)
    d = Descr(type=1, fd=fd)
    h = ctypes.c_void_p()
    r = lib.cuFileHandleRegister(ctypes.byref(h), ctypes.byref(d))
    print(path, "O_DIRECT" if flags else "buffered", "cuFileHandleRegister ->", r.err, r.cu_err)
    os.close(fd)
    os.unlink(path)
for f in os.listdir("/tmp/cufile-log"):
    print("==", f)
    print(open(os.path.join("/tmp/cufile-log", f)).read()[-4000:])
