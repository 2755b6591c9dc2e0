"""What clients wait for (issue 26): the per-request table and the prep profile of
bench/gpu_vram_bench.py (imported by it; `g` below is that module, for torch, NIXL and the
memory classes).

Per request, as vLLM and LMCache drive NIXL: `make_prepped_xfer` over lists prepped once per
point (NIXL calls the backend's prepXfer every time), post, poll to DONE, release; the time
split into prep / post to DONE / release. Beside it the same request by `initialize_xfer`
(NIXL prepares both lists and the request every time) and today's repost figure (one request
posted again and again: post to DONE only). GB/s = bytes / the summed time of the requests
(what their callers waited), not wall time: every request is verified byte for byte after it
returned, outside its timed span (READ: the destinations are poisoned before the request and
compared with the file's bytes after it; WRITE: every block's first 8 bytes carry the request's
number, so every request writes data the file does not hold yet, and the file is read back and
compared after it).

Points: scattered KV blocks (16 KiB x 8192, 32 KiB x 8192, 64 KiB x 4096, 256 KiB x 2048,
2 MiB x 512: random region slots against random, pairwise non-adjacent file offsets) READ and
WRITE, plus per size a contiguous READ of the same descriptors laid end to end in memory and
in the file (the "80 % of contiguous" target), and with --req_slot_pages P the vLLM connector's
layout: blocks of P descriptors scattered in memory but end to end in the file. Backends alternate: per round each backend runs
in its own process(es), the order rotated every round; with --req_processes N every backend
runs N processes at once, each with its own agent and its own file (GB/s = all their bytes /
the longest timed loop), started on every point together.

The prep profile (--tables prep) times make_prepped_xfer + release and initialize_xfer +
release with no post, for lists of --prep_descs descriptors, per backend.
"""

import json
import os
import subprocess
import sys
import time

MiB = 1 << 20
MODES = ("prepped", "init", "repost")


def parse_points(s):
    """'16K:8192,2M:512' -> [(16384, 8192), (2097152, 512)]."""
    out = []
    for item in s.split(","):
        b, n = item.split(":")
        out.append((parse_size(b), int(n)))
    blocks = [b for b, _ in out]
    dup = sorted({b for b in blocks if blocks.count(b) > 1})
    if dup:
        # The tables have a row per block size: a second count of one size would overwrite the first.
        raise SystemExit(
            f"--req_points: block size {dup[0]} appears more than once ({s}); give each size one count"
        )
    return out


def parse_size(x):
    x = x.strip().upper()
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(x[-1:], 1)
    return int(x[:-1] if mult > 1 else x) * mult


def points(args):
    """[(op, layout, block, n)] in table order: READ and WRITE scattered, then READ contiguous."""
    pts = []
    for op in args.req_ops.split(","):
        for b, n in args.req_points:
            pts.append((op, "kv", b, n))
    if "READ" in args.req_ops.split(",") and args.req_contig:
        for b, n in args.req_points:
            pts.append(("READ", "contig", b, n))
    for op in args.req_ops.split(",") if args.req_slot_pages else ():
        for b, n in args.req_points:
            if n % args.req_slot_pages == 0:
                pts.append((op, "slots", b, n))
    return pts


def file_bytes(args):
    """What the largest scattered point needs with no two blocks adjacent."""
    need = max((2 * n - 1) * b for b, n in args.req_points)
    return -(-need // MiB) * MiB


def check_fit(args):
    """None when every point fits the regions, else why not."""
    for b, n in args.req_points:
        if args.kv_region_bytes % b:
            return f"--kv_region_mib {args.kv_region_mib} is not a multiple of block {b}"
        if n * b > args.kv_region_bytes:
            return f"{b} x {n} does not fit one region of {args.kv_region_mib} MiB (the contiguous READ needs it)"
    return None


def req_file(args, proc):
    return os.path.join(args.dir, f"iud-req-bench.p{proc}.bin")


def prefill(path, nbytes, write_size=64 * MiB):
    """One random 64 MiB chunk repeated, every 4 KiB page stamped with its own file offset (so a
    block read from or written to a wrong place never matches), written through the page cache
    in writes of `write_size` bytes. The write size decides the page cache's folio sizes: on
    Linux 6.18's ext4 a 16 KiB write into a file written in 64 MiB writes (large folios) cost
    13x one into a file written 4 KiB at a time (bench/results/2026-12-02-per-request-cpu.md)."""
    import numpy as np

    chunk = 64 * MiB
    base = np.frombuffer(np.random.default_rng(0xF11E).bytes(chunk), dtype=np.uint8).copy()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < nbytes:
            k = min(chunk, nbytes - off)
            buf = base[:k].copy()
            stamps = buf.view(np.uint64).reshape(-1, 512)
            stamps[:, 0] = np.arange(off, off + k, 4096, dtype=np.uint64)
            mv = memoryview(buf)
            for o in range(0, k, write_size):
                os.pwrite(fd, mv[o : o + write_size], off + o)
            off += k
    finally:
        os.close(fd)


def layout(g, args, layout_kind, block, n):
    """(region index, slot, file offset) per descriptor."""
    import numpy as np

    if layout_kind == "contig":
        return (
            np.zeros(n, dtype=np.int64),
            np.arange(n, dtype=np.int64),
            np.arange(n, dtype=np.int64) * block,
        )
    ridx, slot, foff = g.kv_layout(
        args.seed, block, n, args.kv_region_bytes, args.kv_regions, args.req_file_bytes
    )
    if layout_kind == "slots":
        # The vLLM connector's files: a block's pages (one per layer) scattered in VRAM but end to
        # end in the block's file slot; slots in random order with a gap after each.
        pages = args.req_slot_pages
        k = n // pages
        rng = np.random.default_rng([args.seed, block, n, pages])
        slots = 2 * rng.permutation(k)
        foff = (np.repeat(slots, pages) * pages + np.tile(np.arange(pages), k)) * block
    return ridx, slot, foff.astype(np.int64)


class Point:
    """One point in one process: its prepped lists, and the verification of every request."""

    def __init__(self, g, args, agent, name, mem, regions, fd, vfd, op, lay, block, n):
        import numpy as np

        self.g, self.args, self.agent, self.name, self.mem = g, args, agent, name, mem
        self.op, self.block, self.n, self.fd, self.vfd = op, block, n, fd, vfd
        self.ridx, self.slot, self.foff = layout(g, args, lay, block, n)
        self.regions = regions
        self.parts = {}
        for r in range(len(regions)):
            sel = np.nonzero(self.ridx == r)[0]
            if len(sel):
                self.parts[r] = (mem.index(sel), mem.index(self.slot[sel]))
        base = np.array([mem.ptr(r) for r in regions], dtype=np.uint64)
        addrs = base[self.ridx] + (self.slot * block).astype(np.uint64)
        self.local_np = np.stack(
            [addrs, np.full(n, block, dtype=np.uint64), np.zeros(n, dtype=np.uint64)], axis=1
        )
        self.remote_np = np.stack(
            [
                self.foff.astype(np.uint64),
                np.full(n, block, dtype=np.uint64),
                np.full(n, fd, dtype=np.uint64),
            ],
            axis=1,
        )
        self.lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.local_np, mem.kind, backends=[name])
        self.rh = agent.prep_xfer_dlist(agent.name, self.remote_np, "FILE", backends=[name])
        self.idx = np.arange(n, dtype=np.int32)
        self.local = agent.get_xfer_descs(self.local_np, mem.kind)
        self.remote = agent.get_xfer_descs(self.remote_np, "FILE")
        self.seq = 0
        if op == "READ":
            self.expected = self.read_file()
            self.expected_dev = mem.to_device(self.expected)
        else:
            seed = (args.seed * 1000003 + block * 7 + n) * 131 + os.getpid() % 97
            for r, (_pos, idx) in self.parts.items():
                mem.fill_slots(regions[r], block, idx, seed + r)
        mem.sync()

    def read_file(self):
        import numpy as np

        out = np.empty((self.n, self.block), dtype=np.uint8)
        for i in range(self.n):
            if os.preadv(self.vfd, [out[i]], int(self.foff[i])) != self.block:
                raise RuntimeError(f"short verification read at {self.foff[i]}")
        return out

    def before(self):
        """Untimed: READ poisons the destinations; WRITE stamps every block with a new number."""
        self.seq += 1
        for r, (_pos, idx) in self.parts.items():
            if self.op == "READ":
                self.mem.poison_slots(self.regions[r], self.block, idx, self.seq & 0xFF)
            else:
                self.mem.stamp_slots(self.regions[r], self.block, idx, self.seq)
        self.mem.sync()

    def after(self):
        """Untimed: every byte of the request against the file. Returns None or the mismatch."""
        self.mem.sync()
        got = self.mem.gather(self.regions, self.block, self.n, self.parts)
        want = self.expected_dev if self.op == "READ" else self.read_file()
        if self.mem.equal(got, want):
            return None
        d, j = self.mem.first_diff(got, want)
        return (
            f"request {self.seq}: descriptor {d} (region {self.ridx[d]} slot {self.slot[d]}, file offset "
            f"{self.foff[d]}) first difference at byte {j}"
        )

    def wait(self, h):
        s = self.agent.transfer(h)
        while s == "PROC":
            s = self.agent.check_xfer_state(h)
        if s != "DONE":
            raise RuntimeError(f"{self.op} ended in {s}")

    def request(self, mode, held=None):
        """One request; returns (prep, post to DONE, release) seconds."""
        a, name = self.agent, self.name
        t0 = time.perf_counter()
        if mode == "repost":
            h = held
        elif mode == "prepped":
            h = a.make_prepped_xfer(self.op, self.lh, self.idx, self.rh, self.idx, backends=[name])
        else:
            h = a.initialize_xfer(self.op, self.local, self.remote, a.name, backends=[name])
        t1 = time.perf_counter()
        try:
            self.wait(h)
        finally:
            t2 = time.perf_counter()
            if mode != "repost":
                a.release_xfer_handle(h)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def close(self):
        for h in (self.lh, self.rh):
            try:
                self.agent.release_dlist_handle(h)
            except Exception:  # noqa: BLE001
                pass


def run_mode(p, mode, seconds, go=None, every=True):
    """Requests of one mode for `seconds` of summed request time (at least 3), each verified
    (every=False: back to back, the warm-up and the last one verified; for --req_processes,
    whose GB/s is over the wall time of the loop). Returns the sample: GB/s over the summed
    request time and the mean split in ms."""
    held = None
    if mode == "repost":
        held = p.agent.make_prepped_xfer(p.op, p.lh, p.idx, p.rh, p.idx, backends=[p.name])
    try:
        p.before()
        p.request(mode, held)  # warm-up, verified too
        bad = p.after()
        if go is not None:
            go()
        prep = post = rel = 0.0
        k = 0
        w0 = time.perf_counter()
        while bad is None and (k < 3 or prep + post + rel < seconds):
            p.before()
            a, b, c = p.request(mode, held)
            prep, post, rel, k = prep + a, post + b, rel + c, k + 1
            if every:
                bad = p.after()
        wall = time.perf_counter() - w0
        if not every:
            bad = p.after()  # the last request: it carries its own number (WRITE) / poison (READ)
    finally:
        if held is not None:
            p.agent.release_xfer_handle(held)
    total = prep + post + rel
    nbytes = k * p.n * p.block
    return {
        "gbps": nbytes / total / 1e9 if total else 0.0,
        "prep_ms": prep / max(k, 1) * 1e3,
        "post_ms": post / max(k, 1) * 1e3,
        "release_ms": rel / max(k, 1) * 1e3,
        "requests": k,
        "bytes": nbytes,
        "req_s": total,
        "wall_s": wall,
        "verified": True if bad is None else bad,
    }


def child(g, label, name, params, args):
    """One backend in one process (of --req_processes): every point, every mode; prints RESULTS."""
    mem = g.HostMem() if args.memory == "dram" else g.DeviceMem()
    extend_mem(mem)
    agent = g.nixl_agent(f"req-{label}-{os.getpid()}", g.nixl_agent_config(backends=[]))
    agent.create_backend(name, params)
    regions = [mem.alloc(args.kv_region_bytes) for _ in range(args.kv_regions)]
    regs = [
        agent.register_memory(
            [(mem.ptr(r), args.kv_region_bytes, 0, "")], mem.kind, backends=[name]
        )
        for r in regions
    ]
    path = req_file(args, args.req_proc)
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if args.direct else 0))
    vfd = os.open(path, os.O_RDONLY)
    regs.append(agent.register_memory([(0, args.req_file_bytes, fd, "")], "FILE", backends=[name]))
    nprocs = args.req_processes
    modes = (
        ("prepped",) if nprocs > 1 else tuple(m for m in MODES if m in args.req_modes.split(","))
    )

    def go():
        # --req_processes: every process starts a point's timed loop together.
        if nprocs > 1:
            print("READY", flush=True)
            if sys.stdin.readline().strip() != "GO":
                raise RuntimeError("no GO from the parent")

    results = {}
    try:
        for op, lay, block, n in points(args):
            p = None
            for mode in modes:
                key = f"{op}:{lay}:{block}:{mode}"
                try:
                    if p is None:
                        p = Point(g, args, agent, name, mem, regions, fd, vfd, op, lay, block, n)
                    results[key] = run_mode(p, mode, args.req_seconds, go, every=nprocs == 1)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    results[key] = {"error": f"{type(e).__name__}: {e}"}
                    if nprocs > 1:
                        go()  # keep the handshake in step with the other processes
                r = results[key]
                msg = r.get("error") or (
                    f"{r['gbps']:.3f} GB/s prep {r['prep_ms']:.3f} post->DONE {r['post_ms']:.3f} "
                    f"release {r['release_ms']:.3f} ms {r['requests']} req "
                    f"{'ok' if r['verified'] is True else r['verified']}"
                )
                print(
                    f"req {label} proc {args.req_proc} round {args.kv_round} {op} {lay} {block} x {n} {mode}: {msg}",
                    file=sys.stderr,
                    flush=True,
                )
            if p is not None:
                p.close()
            if op == "WRITE" and not args.direct:
                os.fdatasync(fd)  # not timed: one point's dirty pages stay out of the next
    finally:
        g.deregister_all(agent, name, regs)
        os.close(fd)
        os.close(vfd)
    print("RESULTS " + json.dumps(results), flush=True)


def extend_mem(mem):
    """The per-request verification's slot operations, for DeviceMem (torch) and HostMem (numpy)."""
    if mem.kind == "VRAM":
        import torch

        def poison(region, block, idx, v):
            region.view(-1, block)[idx] = v

        def stamp(region, block, idx, seq):
            region.view(-1, block)[idx, :8] = torch.tensor(
                list(int(seq).to_bytes(8, "little")), dtype=torch.uint8, device="cuda"
            )

        mem.to_device = lambda a: torch.from_numpy(a).to("cuda")
        mem.equal = lambda got, want: bool(
            torch.equal(
                got, want if isinstance(want, torch.Tensor) else torch.from_numpy(want).to("cuda")
            )
        )

        def first_diff(got, want):
            w = want if isinstance(want, torch.Tensor) else torch.from_numpy(want).to("cuda")
            ne = (got != w).nonzero()
            return tuple(int(x) for x in ne[0]) if len(ne) else (-1, -1)

        mem.first_diff = first_diff
    else:
        import numpy as np

        def poison(region, block, idx, v):
            region.reshape(-1, block)[idx] = v

        def stamp(region, block, idx, seq):
            region.reshape(-1, block)[idx, :8] = np.frombuffer(
                int(seq).to_bytes(8, "little"), dtype=np.uint8
            )

        mem.to_device = lambda a: a
    mem.poison_slots = poison
    mem.stamp_slots = stamp


def cut_short(label, rnd, timeout, left):
    """The note for a round that gave no result within min(`timeout`, `left`) s, `left` being what
    remained of the time budget (--budget_s): the budget ending it is not the backend hanging."""
    limit = min(timeout, left)
    if left < timeout:
        return f"{label} round {rnd + 1}: stopped after {limit:.0f} s, when the time budget (--budget_s) ran out; its results are left out"
    return f"{label} round {rnd + 1}: hung (> {limit:.0f} s)"


def run_children(label, args, extra, nprocs, timeout):
    """Runs `nprocs` children of this backend at once; the READY/GO handshake per point when
    more than one. Returns their RESULTS dicts (None for a child that gave none)."""
    procs = []
    for i in range(nprocs):
        cmd = [sys.executable] + sys.argv + ["--req_one", label, "--req_proc", str(i)] + extra
        procs.append(
            subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout
    import selectors
    import threading

    errs = [[] for _ in procs]
    outs = [[] for _ in procs]

    def drain(i, p):
        for line in p.stderr:
            errs[i].append(line)

    ts = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in ts:
        t.start()
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        sel.register(p.stdout, selectors.EVENT_READ, i)
    ready, open_ = set(), set(range(nprocs))
    hung = False
    while open_:
        left = deadline - time.monotonic()
        if left <= 0:
            hung = True
            break
        for key, _ in sel.select(timeout=min(left, 5)):
            i = key.data
            line = procs[i].stdout.readline()
            if not line:
                sel.unregister(procs[i].stdout)
                open_.discard(i)
                ready.discard(i)
                continue
            if line.strip() == "READY":
                ready.add(i)
            else:
                outs[i].append(line)
        if ready and ready == open_:
            for i in ready:
                try:
                    procs[i].stdin.write("GO\n")
                    procs[i].stdin.flush()
                except BrokenPipeError:
                    pass
            ready = set()
    for p in procs:
        if hung:
            p.kill()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    for t in ts:
        t.join(timeout=5)
    for e in errs:
        sys.stderr.write("".join(e))
    res = []
    for o in outs:
        line = next((x for x in o if x.startswith("RESULTS ")), None)
        res.append(json.loads(line[8:]) if line else None)
    return res, hung


def table(g, args, deadline):
    """Runs every round (backends rotated, each in its own processes); returns what print_table needs."""
    labels = [x for x in args.req_backends.split(",") if x]
    for l in labels:
        if not any(b[0] == l for b in g.BACKENDS):
            g.fail(f"--req_backends: unknown backend {l}")
    pts = points(args)
    nprocs = args.req_processes
    t = time.perf_counter()
    for i in range(nprocs):
        prefill(req_file(args, i), args.req_file_bytes, args.req_prefill_write)
    print(
        f"req: {nprocs} file(s) of {args.req_file_bytes} bytes written in {args.req_prefill_write}-byte writes in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    samples = {}
    notes = []
    try:
        for rnd in range(args.kv_rounds):
            for j in range(len(labels)):
                label = labels[(j + rnd) % len(labels)]
                left = deadline - time.monotonic()
                if left < 20:
                    notes.append(f"{label} round {rnd + 1}: not run (time budget --budget_s spent)")
                    continue
                res, hung = run_children(
                    label, args, ["--kv_round", str(rnd)], nprocs, min(args.kv_timeout, left)
                )
                if hung:
                    notes.append(cut_short(label, rnd, args.kv_timeout, left))
                if any(r is None for r in res):
                    notes.append(
                        f"{label} round {rnd + 1}: {sum(r is None for r in res)} process(es) gave no results"
                    )
                for op, lay, b, _n in pts:
                    for mode in MODES:
                        key = f"{op}:{lay}:{b}:{mode}"
                        got = [r.get(key) for r in res if r and r.get(key) is not None]
                        if not got:
                            continue
                        errs = [x["error"] for x in got if "error" in x]
                        if errs or len(got) < nprocs:
                            samples.setdefault((label, key), []).append(
                                {"error": errs[0] if errs else "a process gave no result"}
                            )
                            continue
                        if nprocs == 1:
                            samples.setdefault((label, key), []).append(got[0])
                            continue
                        agg = {
                            "gbps": sum(x["bytes"] for x in got)
                            / max(x["wall_s"] for x in got)
                            / 1e9,
                            "prep_ms": g.median([x["prep_ms"] for x in got]),
                            "post_ms": g.median([x["post_ms"] for x in got]),
                            "release_ms": g.median([x["release_ms"] for x in got]),
                            "requests": sum(x["requests"] for x in got),
                            "verified": next(
                                (x["verified"] for x in got if x["verified"] is not True), True
                            ),
                        }
                        samples.setdefault((label, key), []).append(agg)
    finally:
        for i in range(nprocs):
            try:
                os.unlink(req_file(args, i))
            except FileNotFoundError:
                pass
    print(
        f"req raw rounds: {json.dumps({f'{k[0]} {k[1]}': v for k, v in samples.items()})}",
        file=sys.stderr,
        flush=True,
    )
    return labels, pts, samples, notes


def _med(g, samples, key):
    ok = [s for s in samples.get(key, []) if "gbps" in s]
    if not ok:
        return None
    return {f: g.median([s[f] for s in ok]) for f in ("gbps", "prep_ms", "post_ms", "release_ms")}


def print_table(g, args, labels, pts, samples, notes):
    """The per-request table (printed first), the repost and initialize_xfer figures beside it,
    the contiguous READs; returns the number of points with a failure."""
    kind = "O_DIRECT" if args.direct else "page cache"
    nprocs = args.req_processes
    who = (
        (
            f"{nprocs} processes at once (one agent and one file each; GB/s = all bytes / longest timed loop; requests back "
            "to back, the warm-up and the last request of every loop verified byte for byte)"
        )
        if nprocs > 1
        else "one process"
    )
    print(
        f"## Table 0: per request (make_prepped_xfer + post + poll to DONE + release), {args.memory.upper()} <-> FILE ({kind}), {who}\n"
    )
    print(
        f"{args.kv_regions} {args.memory.upper()} region(s) of {args.kv_region_mib} MiB; file of {args.req_file_bytes // MiB} MiB "
        f"per process in {args.dir} (prefilled in {args.req_prefill_write}-byte writes); {'every request' if nprocs == 1 else 'requests'} verified byte for byte outside its timed span; GB/s = bytes / "
        f"{'summed request time' if nprocs == 1 else 'the longest loop'}, >= {args.req_seconds} s (>= 3 requests) per measurement after one warm-up; medians of "
        f"{args.kv_rounds} rounds, backends alternated (each round in its own processes, order rotated); "
        "prep / post->DONE / release = mean ms per request.\n"
    )
    ref = labels[1] if len(labels) > 1 else None
    failures = 0

    def cell(m):
        return (
            f" {m['gbps']:.2f} | {m['prep_ms']:.2f} / {m['post_ms']:.2f} / {m['release_ms']:.2f} |"
            if m
            else " n/a | - |"
        )

    head = "| op | block | blocks |" + "".join(
        f" {l} GB/s | {l} prep / post->DONE / release ms |" for l in labels
    )
    if ref:
        head += f" {labels[0]} / {ref} |"
    modes = ["prepped"] if nprocs > 1 else [m for m in MODES if m in args.req_modes.split(",")]
    extra = [m for m in modes if m != "prepped"]
    for m in extra:
        head += "".join(f" {m} {l} GB/s |" for l in labels) + (
            f" {m} {labels[0]} / {ref} |" if ref else ""
        )
    print(head + " verified |")
    ncol = (
        3
        + 2 * len(labels)
        + (1 if ref else 0)
        + sum(len(labels) + (1 if ref else 0) for _ in extra)
        + 1
    )
    print("|" + "---|" * 3 + "---:|" * (ncol - 4) + "---|")
    contig = {}
    for op, lay, b, n in pts:
        bad = []
        name = {"contig": " contiguous", "slots": f" slots of {args.req_slot_pages} pages"}.get(
            lay, ""
        )
        row = f"| {op}{name} | {b >> 10} KiB | {n} |"
        meds = {}
        for m in modes:
            for l in labels:
                key = (l, f"{op}:{lay}:{b}:{m}")
                meds[(l, m)] = _med(g, samples, key)
                for s in samples.get(key, []):
                    if "error" in s:
                        bad.append(f"{l} {m}: {s['error']}")
                    elif s["verified"] is not True:
                        bad.append(f"{l} {m}: {s['verified']}")
        for l in labels:
            row += cell(meds[(l, "prepped")])
        if ref:
            a, x = meds[(labels[0], "prepped")], meds[(ref, "prepped")]
            row += f" {a['gbps'] / x['gbps']:.2f}x |" if a and x and x["gbps"] else " - |"
        for m in extra:
            for l in labels:
                row += f" {meds[(l, m)]['gbps']:.2f} |" if meds[(l, m)] else " n/a |"
            if ref:
                a, x = meds[(labels[0], m)], meds[(ref, m)]
                row += f" {a['gbps'] / x['gbps']:.2f}x |" if a and x and x["gbps"] else " - |"
        if bad:
            failures += 1
            notes.extend(f"{op} {lay} {b >> 10} KiB: {x}" for x in bad)
        print(row + (" FAILED |" if bad else " yes |"))
        if lay == "contig":
            contig[b] = meds
    print()
    if contig:
        print(
            "Scattered READ per request as a share of the same run's contiguous READ (same block, same count):\n"
        )
        print("| block |" + "".join(f" {l} scattered / contiguous |" for l in labels))
        print("|---|" + "---:|" * len(labels))
        for b, _n in args.req_points:
            row = f"| {b >> 10} KiB |"
            for l in labels:
                s = _med(g, samples, (l, f"READ:kv:{b}:prepped"))
                c = contig.get(b, {}).get((l, "prepped"))
                row += (
                    f" {100 * s['gbps'] / c['gbps']:.0f} % |" if s and c and c["gbps"] else " - |"
                )
            print(row)
        print()
    for x in notes:
        print(f"- {x}")
    if notes:
        print()
    return failures


# ---------------------------------------------------------------------------------------------
# prep profile


def prep_child(g, label, name, params, args):
    """make_prepped_xfer + release and initialize_xfer + release (no post) for lists of
    --prep_descs descriptors of --prep_block bytes, scattered; prints RESULTS."""
    import numpy as np

    mem = g.HostMem() if args.memory == "dram" else g.DeviceMem()
    agent = g.nixl_agent(f"prep-{label}-{os.getpid()}", g.nixl_agent_config(backends=[]))
    agent.create_backend(name, params)
    block = args.prep_block
    top = max(args.prep_descs)
    rb = 2 * top * block
    region = mem.alloc(rb)
    regs = [agent.register_memory([(mem.ptr(region), rb, 0, "")], mem.kind, backends=[name])]
    path = os.path.join(args.dir, f"iud-prep-bench-{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, rb)
    regs.append(agent.register_memory([(0, rb, fd, "")], "FILE", backends=[name]))
    results = {}
    try:
        for n in args.prep_descs:
            rng = np.random.default_rng([args.seed, n])
            mslot = rng.choice(2 * top, size=n, replace=False).astype(np.uint64)
            fslot = rng.permutation(np.arange(n, dtype=np.uint64) * 2)
            local_np = np.stack(
                [
                    mem.ptr(region) + mslot * block,
                    np.full(n, block, dtype=np.uint64),
                    np.zeros(n, dtype=np.uint64),
                ],
                axis=1,
            )
            remote_np = np.stack(
                [
                    fslot * block,
                    np.full(n, block, dtype=np.uint64),
                    np.full(n, fd, dtype=np.uint64),
                ],
                axis=1,
            )
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_np, mem.kind, backends=[name])
            rh = agent.prep_xfer_dlist(agent.name, remote_np, "FILE", backends=[name])
            local, remote = (
                agent.get_xfer_descs(local_np, mem.kind),
                agent.get_xfer_descs(remote_np, "FILE"),
            )
            idx = np.arange(n, dtype=np.int32)
            for op in args.prep_ops.split(","):
                for mode in ("prepped", "init"):

                    def one():
                        t0 = time.perf_counter()
                        if mode == "prepped":
                            h = agent.make_prepped_xfer(op, lh, idx, rh, idx, backends=[name])
                        else:
                            h = agent.initialize_xfer(
                                op, local, remote, agent.name, backends=[name]
                            )
                        t1 = time.perf_counter()
                        agent.release_xfer_handle(h)
                        return t1 - t0, time.perf_counter() - t1

                    one()
                    times = []
                    t_end = time.perf_counter() + args.prep_seconds
                    while len(times) < 5 or time.perf_counter() < t_end:
                        times.append(one())
                    pm = g.median([a for a, _ in times]) * 1e3
                    rm = g.median([b for _, b in times]) * 1e3
                    results[f"{op}:{n}:{mode}"] = {
                        "prep_ms": pm,
                        "release_ms": rm,
                        "count": len(times),
                    }
                    print(
                        f"prep {label} {op} {n} {mode}: prep {pm:.3f} ms release {rm:.3f} ms ({len(times)} times)",
                        file=sys.stderr,
                        flush=True,
                    )
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
    finally:
        g.deregister_all(agent, name, regs)
        os.close(fd)
        os.unlink(path)
    print("RESULTS " + json.dumps(results), flush=True)


def prep_table(g, args, deadline):
    labels = [x for x in args.req_backends.split(",") if x]
    samples = {}
    for rnd in range(args.kv_rounds):
        for j in range(len(labels)):
            label = labels[(j + rnd) % len(labels)]
            left = deadline - time.monotonic()
            if left < 10:
                continue
            cmd = [sys.executable] + sys.argv + ["--prep_one", label]
            try:
                r = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=min(args.kv_timeout, left)
                )
                sys.stderr.write(r.stderr)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULTS ")), None)
                for k, v in (json.loads(line[8:]) if line else {}).items():
                    samples.setdefault((label, k), []).append(v)
            except subprocess.TimeoutExpired:
                sys.stderr.write(cut_short(f"prep {label}", rnd, args.kv_timeout, left) + "\n")
    print(
        f"## Prep profile: one request's prep and release, no post ({args.memory.upper()} <-> FILE, "
        f"{args.prep_block >> 10} KiB descriptors, scattered)\n"
    )
    print(
        f"Medians over >= {args.prep_seconds} s of requests per cell, then over {args.kv_rounds} rounds (alternated); ms per request, "
        "and in brackets us per descriptor. make_prepped_xfer includes NIXL's own work (index lookups, "
        "the backend's prepXfer); initialize_xfer also prepares both lists.\n"
    )
    print(
        "| op | descriptors | mode |"
        + "".join(f" {l} prep ms | {l} release ms |" for l in labels)
        + (f" {labels[0]} / {labels[1]} prep |" if len(labels) > 1 else "")
    )
    print("|---|---:|---|" + "---:|---:|" * len(labels) + ("---:|" if len(labels) > 1 else ""))
    for op in args.prep_ops.split(","):
        for n in args.prep_descs:
            for mode in ("prepped", "init"):
                row = f"| {op} | {n} | {'make_prepped_xfer' if mode == 'prepped' else 'initialize_xfer'} |"
                pm = {}
                for l in labels:
                    v = samples.get((l, f"{op}:{n}:{mode}"))
                    if v:
                        pm[l] = g.median([x["prep_ms"] for x in v])
                        row += f" {pm[l]:.3f} ({pm[l] * 1e3 / n:.2f} us) | {g.median([x['release_ms'] for x in v]):.3f} |"
                    else:
                        row += " n/a | n/a |"
                if len(labels) > 1:
                    row += (
                        f" {pm[labels[0]] / pm[labels[1]]:.2f}x |"
                        if labels[0] in pm and pm.get(labels[1])
                        else " - |"
                    )
                print(row)
    print()
