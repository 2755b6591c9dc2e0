// SPDX-License-Identifier: Apache-2.0
//
// A small NIXL stand-in for sanitizer and valgrind runs of the FFI boundary: it loads the plugin
// .so with dlopen, gets the nixlBackendPlugin through nixl_plugin_init exactly as NIXL does, and
// drives create_engine / registerMem / prepXfer / postXfer / checkXfer / releaseReqH /
// deregisterMem / destroy_engine through the engine's vtable (nixl-headers/nixl_abi.h), with
// NIXL's own C++ objects (std::string, unordered_map, descriptor vectors) built here.
//
//   driver PLUGIN_SO WORKDIR [cycles] [thread-iterations] [concreg-reps]
//
// Phases (each prints one "phase ... ok" line; any failed check prints "FAIL ..." and the exit
// status is 1):
//   plugin     : name, version, mems, parameters
//   params     : a bad parameter fails engine creation (initErr), the engine is destroyed cleanly
//   roundtrip  : 1000 mixed descriptors WRITE + READ, buffered and O_DIRECT, byte-exact
//   errors     : exact plugin statuses for bad inputs (null or deregistered MD, deregisterMem
//                twice, mismatched lengths, zero length,
//                O_DIRECT misalignment, WRITE to a read-only fd, read past EOF, repost while
//                active, VRAM without libcuda, dram_dmabuf=on without the uAPI, closed fd)
//   inflight   : release of in-flight requests; deregisterMem while a request is in flight
//   threads    : 8 threads x mixed requests on one engine (round trips, release in flight racing
//                other threads' checkXfer, reposts, register/deregister cycles)
//   concreg    : issue 16's pattern: 4 threads registering a 16 MiB buffer and their own file at
//                once, 3 round trips of 64 x 64 KiB each, deregistering (sync mode NONE), M times
//   cycles     : N register -> transfer -> deregister cycles (default 10000)
// LeakSanitizer (ASan build) then checks the whole process at exit.

#include "nixl_abi.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

// NIXL defines these out of line in libnixl_build.so; the driver is its own "NIXL".
template<> nixlDescList<nixlMetaDesc>::~nixlDescList() {}
template<> void nixlDescList<nixlMetaDesc>::resize(size_t count) { descs.resize(count); }
template<> void nixlDescList<nixlMetaDesc>::addDesc(const nixlMetaDesc &d) { descs.push_back(d); }
template<> int nixlDescList<nixlMetaDesc>::getIndex(const nixlBasicDesc &) const { return -1; }

namespace {

std::atomic<int> g_failures{0};
const std::string kAgent = "asan-driver";

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);               \
            std::fprintf(stderr, __VA_ARGS__);                                                 \
            std::fprintf(stderr, "\n");                                                        \
            g_failures++;                                                                      \
        }                                                                                      \
    } while (0)

const char *st(nixl_status_t s) {
    switch (s) {
    case NIXL_IN_PROG: return "NIXL_IN_PROG";
    case NIXL_SUCCESS: return "NIXL_SUCCESS";
    case NIXL_ERR_INVALID_PARAM: return "NIXL_ERR_INVALID_PARAM";
    case NIXL_ERR_BACKEND: return "NIXL_ERR_BACKEND";
    case NIXL_ERR_NOT_FOUND: return "NIXL_ERR_NOT_FOUND";
    case NIXL_ERR_MISMATCH: return "NIXL_ERR_MISMATCH";
    case NIXL_ERR_NOT_ALLOWED: return "NIXL_ERR_NOT_ALLOWED";
    case NIXL_ERR_REPOST_ACTIVE: return "NIXL_ERR_REPOST_ACTIVE";
    case NIXL_ERR_NOT_SUPPORTED: return "NIXL_ERR_NOT_SUPPORTED";
    case NIXL_ERR_CANCELED: return "NIXL_ERR_CANCELED";
    default: return "other";
    }
}

nixlBackendPlugin *g_plugin = nullptr;

struct Engine {
    nixlBackendEngine *e = nullptr;
    explicit Engine(nixl_b_params_t params = {},
                    nixl_thread_sync_t sync = nixl_thread_sync_t::NIXL_THREAD_SYNC_NONE) {
        nixlBackendInitParams init{};
        init.localAgent = kAgent;
        init.type = "IO_URING_DMABUF";
        init.customParams = &params;
        init.enableProgTh = false;
        init.pthrDelay = 0;
        init.syncMode = sync;
        init.enableTelemetry_ = false;
        e = g_plugin->create_engine(&init);
    }
    ~Engine() {
        if (e) g_plugin->destroy_engine(e);
    }
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;
    nixlBackendEngine *operator->() { return e; }

    nixl_status_t reg(uintptr_t addr, size_t len, uint64_t dev, nixl_mem_t kind, nixlBackendMD *&md,
                      const std::string &meta = "") {
        nixlBlobDesc d;
        d.addr = addr;
        d.len = len;
        d.devId = dev;
        d.metaInfo = meta;
        md = nullptr;
        return e->registerMem(d, kind, md);
    }
};

struct Lists {
    nixl_meta_dlist_t local, remote;
    Lists(nixl_mem_t lk = DRAM_SEG, nixl_mem_t rk = FILE_SEG) {
        local.type = lk;
        remote.type = rk;
    }
    void add(uintptr_t m, nixlBackendMD *mmd, uint64_t f, size_t len, uint64_t fdev, nixlBackendMD *fmd,
             size_t rlen = 0) {
        nixlMetaDesc l;
        l.addr = m;
        l.len = len;
        l.devId = 0;
        l.metadataP = mmd;
        nixlMetaDesc r;
        r.addr = f;
        r.len = rlen ? rlen : len;
        r.devId = fdev;
        r.metadataP = fmd;
        local.addDesc(l);
        remote.addDesc(r);
    }
};

// prep + post + poll to completion + release; returns the first non-success status (or success).
nixl_status_t run(Engine &eng, nixl_xfer_op_t op, Lists &ls, nixl_status_t *stage_status = nullptr) {
    nixlBackendReqH *h = nullptr;
    nixl_status_t s = eng->prepXfer(op, ls.local, ls.remote, kAgent, h, nullptr);
    if (stage_status) *stage_status = s;
    if (s != NIXL_SUCCESS) return s;
    s = eng->postXfer(op, ls.local, ls.remote, kAgent, h, nullptr);
    while (s == NIXL_IN_PROG) s = eng->checkXfer(h);
    nixl_status_t r = eng->releaseReqH(h);
    CHECK(r == NIXL_SUCCESS, "releaseReqH gave %s", st(r));
    return s;
}

struct Buf {
    uint8_t *p = nullptr;
    size_t n = 0;
    explicit Buf(size_t len) : n(len) {
        void *v = nullptr;
        if (posix_memalign(&v, 4096, len) != 0) std::abort();
        p = static_cast<uint8_t *>(v);
        std::memset(p, 0, len);
    }
    ~Buf() { std::free(p); }
    Buf(const Buf &) = delete;
    Buf &operator=(const Buf &) = delete;
    uintptr_t a(size_t off = 0) const { return reinterpret_cast<uintptr_t>(p + off); }
    void fill(uint64_t seed) {
        std::mt19937_64 g(seed);
        for (size_t i = 0; i < n; i += 8) {
            uint64_t v = g();
            std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
        }
    }
};

std::string g_dir;

int open_file(const std::string &name, int flags, size_t size) {
    std::string path = g_dir + "/" + name;
    int fd = ::open(path.c_str(), flags | O_CREAT, 0644);
    if (fd < 0) {
        std::perror(path.c_str());
        std::exit(2);
    }
    if (size && ftruncate(fd, static_cast<off_t>(size)) != 0) std::exit(2);
    return fd;
}

// ---- phases --------------------------------------------------------------------------------------

void phase_plugin() {
    CHECK(std::string(g_plugin->get_plugin_name()) == "IO_URING_DMABUF", "name %s", g_plugin->get_plugin_name());
    CHECK(g_plugin->api_version == NIXL_PLUGIN_API_VERSION, "api %d", g_plugin->api_version);
    nixl_b_params_t p = g_plugin->get_backend_options();
    CHECK(p.count("ring_entries") == 1 && p.count("max_io_size") == 1, "params missing");
    nixl_mem_list_t m = g_plugin->get_backend_mems();
    CHECK(m.size() >= 2, "mems %zu", m.size());
    std::printf("phase plugin ok: %s %s, %zu params, %zu mems\n", g_plugin->get_plugin_name(),
                g_plugin->get_plugin_version(), p.size(), m.size());
}

void phase_params() {
    {
        Engine bad(nixl_b_params_t{{"ring_entries", "7"}});
        CHECK(bad.e && bad->getInitErr(), "ring_entries=7 accepted");
    }
    {
        Engine ok(nixl_b_params_t{{"ring_entries", "64"}, {"unknown_key", "x"}});
        CHECK(ok.e && !ok->getInitErr(), "valid params refused");
    }
    std::printf("phase params ok\n");
}

void roundtrip(Engine &eng, bool direct, uint64_t seed) {
    const size_t total = 32 << 20;
    Buf src(total), dst(total);
    src.fill(seed);
    int fd = open_file(direct ? "rt-direct.bin" : "rt.bin", O_RDWR | (direct ? O_DIRECT : 0), total);
    nixlBackendMD *ms = nullptr, *md = nullptr, *mf = nullptr;
    CHECK(eng.reg(src.a(), total, 0, DRAM_SEG, ms) == NIXL_SUCCESS, "reg src");
    CHECK(eng.reg(dst.a(), total, 0, DRAM_SEG, md) == NIXL_SUCCESS, "reg dst");
    CHECK(eng.reg(0, total, fd, FILE_SEG, mf) == NIXL_SUCCESS, "reg file");
    std::mt19937_64 g(seed);
    // 1000 descriptors: sizes 4 KiB .. 64 KiB (multiples of 4 KiB), file order reversed in memory
    std::vector<std::pair<size_t, size_t>> d;  // (offset, len), same offset in memory and file
    size_t off = 0;
    while (d.size() < 1000 && off < total) {
        size_t len = 4096 * (1 + g() % 16);
        if (off + len > total) break;
        d.push_back({off, len});
        off += len + 4096 * (g() % 2);
    }
    Lists w, r;
    for (auto it = d.rbegin(); it != d.rend(); ++it) {
        w.add(src.a(it->first), ms, it->first, it->second, fd, mf);
        r.add(dst.a(it->first), md, it->first, it->second, fd, mf);
    }
    nixl_status_t s = run(eng, NIXL_WRITE, w);
    CHECK(s == NIXL_SUCCESS, "WRITE %s", st(s));
    s = run(eng, NIXL_READ, r);
    CHECK(s == NIXL_SUCCESS, "READ %s", st(s));
    size_t bad = 0;
    for (auto &[o, n] : d) bad += std::memcmp(src.p + o, dst.p + o, n) != 0;
    CHECK(bad == 0, "%zu descriptors differ (direct=%d)", bad, direct);
    CHECK(eng->deregisterMem(ms) == NIXL_SUCCESS, "dereg");
    CHECK(eng->deregisterMem(md) == NIXL_SUCCESS, "dereg");
    CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "dereg");
    ::close(fd);
}

void phase_roundtrip() {
    Engine eng;
    roundtrip(eng, false, 1);
    roundtrip(eng, true, 2);
    Engine small(nixl_b_params_t{{"max_io_size", "4096"}, {"ring_entries", "16"}, {"inline_write_max", "0"}});
    roundtrip(small, false, 3);
    std::printf("phase roundtrip ok: 3 x 1000 descriptors\n");
}

void expect(const char *what, nixl_status_t got, nixl_status_t want) {
    CHECK(got == want, "%s: got %s, expected %s", what, st(got), st(want));
    std::printf("  %-48s %s\n", what, st(got));
}

void phase_errors() {
    Engine eng;
    const size_t n = 1 << 20;
    Buf buf(n);
    int fd = open_file("err.bin", O_RDWR, 64 << 10);  // 64 KiB of file, 1 MiB registered
    int dfd = open_file("err-direct.bin", O_RDWR | O_DIRECT, n);
    int rofd = ::open((g_dir + "/err.bin").c_str(), O_RDONLY);
    nixlBackendMD *mb, *mf, *md, *mr;
    CHECK(eng.reg(buf.a(), n, 0, DRAM_SEG, mb) == NIXL_SUCCESS, "reg");
    CHECK(eng.reg(0, n, fd, FILE_SEG, mf) == NIXL_SUCCESS, "reg");
    CHECK(eng.reg(0, n, dfd, FILE_SEG, md) == NIXL_SUCCESS, "reg");
    CHECK(eng.reg(0, n, rofd, FILE_SEG, mr) == NIXL_SUCCESS, "reg");
    std::printf("phase errors (plugin statuses):\n");
    {
        Lists l;
        // MDs are hints: the descriptor's range lies in a live DRAM registration (mb).
        l.add(buf.a(), nullptr, 0, 4096, fd, mf);
        expect("null local MD, range registered", run(eng, NIXL_READ, l), NIXL_SUCCESS);
    }
    {
        Buf other(4096);
        Lists l;
        l.add(other.a(), nullptr, 0, 4096, fd, mf);
        expect("null local MD, range not registered", run(eng, NIXL_READ, l), NIXL_ERR_NOT_FOUND);
    }
    {
        Lists l;
        l.add(buf.a(), mb, 0, 4096, fd, mf, 8192);
        expect("local/remote length mismatch", run(eng, NIXL_READ, l), NIXL_ERR_MISMATCH);
    }
    {
        Lists l;
        l.add(buf.a(), mb, 0, 4096, fd, mf);
        l.local.addDesc(l.local.descs[0]);
        expect("list count mismatch", run(eng, NIXL_READ, l), NIXL_ERR_MISMATCH);
    }
    {
        Lists l;
        l.add(buf.a(), mb, 0, 0, fd, mf);
        expect("zero length", run(eng, NIXL_READ, l), NIXL_ERR_INVALID_PARAM);
    }
    {
        Lists l;
        l.add(buf.a(), mb, n - 4096, 8192, fd, mf);
        expect("file range outside registration", run(eng, NIXL_READ, l), NIXL_ERR_NOT_FOUND);
    }
    {
        Lists l(DRAM_SEG, DRAM_SEG);
        l.add(buf.a(), mb, buf.a(), 4096, 0, mb);
        expect("DRAM -> DRAM lists", run(eng, NIXL_READ, l), NIXL_ERR_INVALID_PARAM);
    }
    {
        Lists l;
        l.add(buf.a(1), mb, 0, 4096, dfd, md);
        expect("O_DIRECT misaligned memory", run(eng, NIXL_READ, l), NIXL_ERR_INVALID_PARAM);
    }
    {
        Lists l;
        l.add(buf.a(), mb, 0, 4096, rofd, mr);
        expect("WRITE to a read-only fd", run(eng, NIXL_WRITE, l), NIXL_ERR_INVALID_PARAM);
    }
    {
        Lists l;
        l.add(buf.a(), mb, 0, 128 << 10, fd, mf);
        nixl_status_t prep;
        expect("read past end of file", run(eng, NIXL_READ, l, &prep), NIXL_ERR_BACKEND);
    }
    {
        std::string remote = "someone-else";
        Lists l;
        l.add(buf.a(), mb, 0, 4096, fd, mf);
        nixlBackendReqH *h = nullptr;
        expect("remote agent is not this agent", eng->prepXfer(NIXL_READ, l.local, l.remote, remote, h, nullptr),
               NIXL_ERR_INVALID_PARAM);
    }
    {
        // repost while active: a 32 MiB O_DIRECT write in 1 MiB pieces stays in flight for a moment
        const size_t big = 32 << 20;
        Buf bb(big);
        int bfd = open_file("repost-direct.bin", O_RDWR | O_DIRECT, big);
        nixlBackendMD *bm, *bf;
        CHECK(eng.reg(bb.a(), big, 0, DRAM_SEG, bm) == NIXL_SUCCESS, "reg");
        CHECK(eng.reg(0, big, bfd, FILE_SEG, bf) == NIXL_SUCCESS, "reg");
        Lists l;
        for (size_t o = 0; o < big; o += 1 << 20) l.add(bb.a(o), bm, o, 1 << 20, bfd, bf);
        nixlBackendReqH *h = nullptr;
        CHECK(eng->prepXfer(NIXL_WRITE, l.local, l.remote, kAgent, h, nullptr) == NIXL_SUCCESS, "prep");
        bool seen = false;
        for (int attempt = 0; attempt < 20 && !seen; ++attempt) {
            nixl_status_t s = eng->postXfer(NIXL_WRITE, l.local, l.remote, kAgent, h, nullptr);
            if (s == NIXL_IN_PROG) {
                expect("repost while in flight", eng->postXfer(NIXL_WRITE, l.local, l.remote, kAgent, h, nullptr),
                       NIXL_ERR_REPOST_ACTIVE);
                seen = true;
            }
            while (s == NIXL_IN_PROG) s = eng->checkXfer(h);
            CHECK(s == NIXL_SUCCESS, "in-flight write %s", st(s));
        }
        if (!seen) std::printf("  %-48s (always finished inside postXfer; not exercised)\n", "repost while in flight");
        expect("repost after completion", [&] {
            nixl_status_t r = eng->postXfer(NIXL_WRITE, l.local, l.remote, kAgent, h, nullptr);
            while (r == NIXL_IN_PROG) r = eng->checkXfer(h);
            return r;
        }(), NIXL_SUCCESS);
        CHECK(eng->releaseReqH(h) == NIXL_SUCCESS, "release");
        CHECK(eng->deregisterMem(bm) == NIXL_SUCCESS, "dereg");
        CHECK(eng->deregisterMem(bf) == NIXL_SUCCESS, "dereg");
        ::close(bfd);
    }
    {
        nixlBackendMD *x = nullptr;
        nixl_status_t s = eng.reg(buf.a(), n, 0, VRAM_SEG, x);
        CHECK(s != NIXL_SUCCESS || dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "VRAM registered without libcuda");
        std::printf("  %-48s %s\n", "VRAM registration without libcuda", st(s));
        if (s == NIXL_SUCCESS) eng->deregisterMem(x);
    }
    {
        Engine on(nixl_b_params_t{{"dram_dmabuf", "on"}});
        nixlBackendMD *x = nullptr;
        nixl_status_t s = on.reg(buf.a(), n, 0, DRAM_SEG, x);
        std::printf("  %-48s %s\n", "dram_dmabuf=on (kernel without the uAPI)", st(s));
        if (s == NIXL_SUCCESS) on->deregisterMem(x);
        else CHECK(s == NIXL_ERR_NOT_SUPPORTED, "dram_dmabuf=on gave %s", st(s));
    }
    {
        int cfd = open_file("closed.bin", O_RDWR, n);
        nixlBackendMD *cm = nullptr;
        CHECK(eng.reg(0, n, cfd, FILE_SEG, cm) == NIXL_SUCCESS, "reg");
        ::close(cfd);
        Lists l;
        l.add(buf.a(), mb, 0, 4096, cfd, cm);
        nixl_status_t s = run(eng, NIXL_READ, l);
        CHECK(s != NIXL_SUCCESS, "READ through a closed fd succeeded");
        std::printf("  %-48s %s\n", "fd closed while registered", st(s));
        CHECK(eng->deregisterMem(cm) == NIXL_SUCCESS, "dereg closed");
    }
    {
        nixlBackendMD *x = nullptr;
        expect("FILE registration with a bad fd", eng.reg(0, n, 987654, FILE_SEG, x), NIXL_ERR_BACKEND);
        expect("path mode, missing file", eng.reg(0, n, 77, FILE_SEG, x, "rw:/nonexistent/x"), NIXL_ERR_BACKEND);
        expect("DRAM with zero length", eng.reg(buf.a(), 0, 0, DRAM_SEG, x), NIXL_ERR_INVALID_PARAM);
        expect("OBJ_SEG registration", eng.reg(buf.a(), 4096, 0, OBJ_SEG, x), NIXL_ERR_NOT_SUPPORTED);
        expect("deregisterMem(nullptr)", eng->deregisterMem(nullptr), NIXL_ERR_INVALID_PARAM);
        expect("releaseReqH(nullptr)", eng->releaseReqH(nullptr), NIXL_SUCCESS);
    }
    {
        // An MD handed back after its deregistration (what NIXL's unlocked lists do in sync mode
        // NONE) is never dereferenced or released a second time: the descriptor resolves by its
        // range (here still covered by mb), and where no live registration covers it, it is
        // refused.
        nixlBackendMD *gone = nullptr;
        CHECK(eng.reg(buf.a(), n, 0, DRAM_SEG, gone) == NIXL_SUCCESS, "reg");
        CHECK(eng->deregisterMem(gone) == NIXL_SUCCESS, "dereg");
        Lists l;
        l.add(buf.a(), gone, 0, 4096, fd, mf);
        expect("deregistered local MD, range still registered", run(eng, NIXL_READ, l), NIXL_SUCCESS);
        Buf lone(4096);
        nixlBackendMD *lone_md = nullptr;
        CHECK(eng.reg(lone.a(), 4096, 0, DRAM_SEG, lone_md) == NIXL_SUCCESS, "reg");
        CHECK(eng->deregisterMem(lone_md) == NIXL_SUCCESS, "dereg");
        Lists l2;
        l2.add(lone.a(), lone_md, 0, 4096, fd, mf);
        expect("deregistered local MD, range not registered", run(eng, NIXL_READ, l2), NIXL_ERR_NOT_FOUND);
        expect("deregisterMem twice", eng->deregisterMem(gone), NIXL_ERR_NOT_FOUND);
    }
    for (auto *m : {mb, mf, md, mr}) CHECK(eng->deregisterMem(m) == NIXL_SUCCESS, "dereg");
    ::close(fd);
    ::close(dfd);
    ::close(rofd);
    std::printf("phase errors ok\n");
}

void phase_inflight() {
    Engine eng;
    const size_t n = 64 << 20;
    Buf buf(n);
    int fd = open_file("inflight.bin", O_RDWR | O_DIRECT, n);
    nixlBackendMD *mb, *mf;
    int proc = 0;
    for (int round = 0; round < 20; ++round) {
        CHECK(eng.reg(buf.a(), n, 0, DRAM_SEG, mb) == NIXL_SUCCESS, "reg");
        CHECK(eng.reg(0, n, fd, FILE_SEG, mf) == NIXL_SUCCESS, "reg");
        Lists l;
        for (size_t o = 0; o < n; o += 1 << 20) l.add(buf.a(o), mb, o, 1 << 20, fd, mf);
        nixlBackendReqH *h = nullptr;
        nixl_xfer_op_t op = round % 2 ? NIXL_WRITE : NIXL_READ;
        CHECK(eng->prepXfer(op, l.local, l.remote, kAgent, h, nullptr) == NIXL_SUCCESS, "prep");
        nixl_status_t s = eng->postXfer(op, l.local, l.remote, kAgent, h, nullptr);
        proc += s == NIXL_IN_PROG;
        if (round % 4 >= 2) {
            // deregister both registrations while the request is in flight, then finish it
            CHECK(eng->deregisterMem(mb) == NIXL_SUCCESS, "dereg in flight");
            CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "dereg in flight");
            while (s == NIXL_IN_PROG) s = eng->checkXfer(h);
            CHECK(s == NIXL_SUCCESS, "request across deregistration: %s", st(s));
            CHECK(eng->releaseReqH(h) == NIXL_SUCCESS, "release");
        } else {
            CHECK(eng->releaseReqH(h) == NIXL_SUCCESS, "release in flight");
            CHECK(eng->deregisterMem(mb) == NIXL_SUCCESS, "dereg");
            CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "dereg");
        }
    }
    ::close(fd);
    CHECK(proc > 0, "never in flight");
    std::printf("phase inflight ok: 20 rounds, %d posted in flight\n", proc);
}

void phase_threads(int iters) {
    Engine eng({}, nixl_thread_sync_t::NIXL_THREAD_SYNC_RW);
    const int T = 8;
    const size_t region = 8 << 20;
    int fd = open_file("threads.bin", O_RDWR, T * region);
    int dfd = ::open((g_dir + "/threads.bin").c_str(), O_RDWR | O_DIRECT);
    nixlBackendMD *mf, *mdf;
    CHECK(eng.reg(0, T * region, fd, FILE_SEG, mf) == NIXL_SUCCESS, "reg");
    CHECK(eng.reg(0, T * region, dfd, FILE_SEG, mdf) == NIXL_SUCCESS, "reg");
    std::atomic<long> ops{0}, released_inflight{0};
    std::vector<std::thread> th;
    for (int t = 0; t < T; ++t) {
        th.emplace_back([&, t] {
            std::mt19937_64 g(100 + t);
            Buf src(region), dst(region);
            nixlBackendMD *ms, *md;
            CHECK(eng.reg(src.a(), region, 0, DRAM_SEG, ms) == NIXL_SUCCESS, "reg");
            CHECK(eng.reg(dst.a(), region, 0, DRAM_SEG, md) == NIXL_SUCCESS, "reg");
            const size_t base = t * region;
            for (int i = 0; i < iters; ++i) {
                int kind = g() % 4;
                bool direct = g() % 2;
                int f = direct ? dfd : fd;
                nixlBackendMD *fm = direct ? mdf : mf;
                if (kind <= 1) {  // round trip with random descriptors
                    src.fill(g());
                    Lists w, r;
                    size_t off = 0;
                    std::vector<std::pair<size_t, size_t>> d;
                    while (off < region) {
                        size_t len = 4096 * (1 + g() % 64);
                        if (off + len > region) break;
                        d.push_back({off, len});
                        off += len;
                    }
                    for (auto &[o, len] : d) {
                        w.add(src.a(o), ms, base + o, len, f, fm);
                        r.add(dst.a(o), md, base + o, len, f, fm);
                    }
                    nixl_status_t s = run(eng, NIXL_WRITE, w);
                    CHECK(s == NIXL_SUCCESS, "thread WRITE %s", st(s));
                    s = run(eng, NIXL_READ, r);
                    CHECK(s == NIXL_SUCCESS, "thread READ %s", st(s));
                    CHECK(std::memcmp(src.p, dst.p, off) == 0, "thread %d iteration %d bytes differ", t, i);
                } else if (kind == 2) {  // release in flight while other threads check theirs
                    Lists l;
                    for (size_t o = 0; o < region; o += 1 << 20) l.add(dst.a(o), md, base + o, 1 << 20, dfd, mdf);
                    nixlBackendReqH *h = nullptr;
                    CHECK(eng->prepXfer(NIXL_READ, l.local, l.remote, kAgent, h, nullptr) == NIXL_SUCCESS, "prep");
                    nixl_status_t s = eng->postXfer(NIXL_READ, l.local, l.remote, kAgent, h, nullptr);
                    if (s == NIXL_IN_PROG) released_inflight++;
                    if (g() % 2) s = eng->checkXfer(h);
                    CHECK(eng->releaseReqH(h) == NIXL_SUCCESS, "release in flight");
                } else {  // repost the same request 3 times; register/deregister a scratch buffer
                    Buf scratch(1 << 20);
                    nixlBackendMD *sm;
                    CHECK(eng.reg(scratch.a(), 1 << 20, 0, DRAM_SEG, sm) == NIXL_SUCCESS, "reg scratch");
                    Lists l;
                    l.add(scratch.a(), sm, base, 1 << 20, fd, mf);
                    nixlBackendReqH *h = nullptr;
                    CHECK(eng->prepXfer(NIXL_READ, l.local, l.remote, kAgent, h, nullptr) == NIXL_SUCCESS, "prep");
                    for (int k = 0; k < 3; ++k) {
                        nixl_status_t s = eng->postXfer(NIXL_READ, l.local, l.remote, kAgent, h, nullptr);
                        while (s == NIXL_IN_PROG) s = eng->checkXfer(h);
                        CHECK(s == NIXL_SUCCESS, "repost %d: %s", k, st(s));
                    }
                    CHECK(eng->releaseReqH(h) == NIXL_SUCCESS, "release");
                    CHECK(eng->deregisterMem(sm) == NIXL_SUCCESS, "dereg scratch");
                }
                ops++;
            }
            CHECK(eng->deregisterMem(ms) == NIXL_SUCCESS, "dereg");
            CHECK(eng->deregisterMem(md) == NIXL_SUCCESS, "dereg");
        });
    }
    for (auto &x : th) x.join();
    CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "dereg");
    CHECK(eng->deregisterMem(mdf) == NIXL_SUCCESS, "dereg");
    ::close(fd);
    ::close(dfd);
    std::printf("phase threads ok: %d threads, %ld operations, %ld releases in flight\n", T, ops.load(),
                released_inflight.load());
}

void phase_cycles(long cycles) {
    Engine eng;
    Buf b(64 << 10), back(64 << 10);
    b.fill(7);
    std::string path = g_dir + "/cycles.bin";
    int keep = open_file("cycles.bin", O_RDWR, 64 << 10);
    for (long c = 0; c < cycles; ++c) {
        nixlBackendMD *mb, *mk, *mf;
        CHECK(eng.reg(b.a(), b.n, 0, DRAM_SEG, mb) == NIXL_SUCCESS, "reg");
        CHECK(eng.reg(back.a(), back.n, 0, DRAM_SEG, mk) == NIXL_SUCCESS, "reg");
        int fd = -1;
        uint64_t dev;
        if (c % 2) {
            fd = ::open(path.c_str(), O_RDWR);
            dev = fd;
            CHECK(eng.reg(0, 64 << 10, dev, FILE_SEG, mf) == NIXL_SUCCESS, "reg fd");
        } else {
            dev = 5;
            CHECK(eng.reg(0, 64 << 10, dev, FILE_SEG, mf, "rw:" + path) == NIXL_SUCCESS, "reg path");
        }
        size_t n = 4096 * (1 + c % 16);
        Lists w, r;
        w.add(b.a(), mb, 0, n, dev, mf);
        r.add(back.a(), mk, 0, n, dev, mf);
        CHECK(run(eng, NIXL_WRITE, w) == NIXL_SUCCESS, "cycle WRITE");
        CHECK(run(eng, NIXL_READ, r) == NIXL_SUCCESS, "cycle READ");
        if (c % 64 == 0) CHECK(std::memcmp(b.p, back.p, n) == 0, "cycle %ld bytes", c);
        CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "dereg");
        CHECK(eng->deregisterMem(mk) == NIXL_SUCCESS, "dereg");
        CHECK(eng->deregisterMem(mb) == NIXL_SUCCESS, "dereg");
        if (fd >= 0) ::close(fd);
    }
    ::close(keep);
    std::printf("phase cycles ok: %ld register/transfer/deregister cycles\n", cycles);
}

// Issue 16's pattern straight on the engine, without NIXL's agent maps in between: T threads
// released at once, each opening its own file, registering a 16 MiB DRAM buffer and the file,
// running 3 WRITE/READ round trips of 64 x 64 KiB descriptors (random 64 KiB slots, source in the
// lower half of the buffer, destination in the upper half, bytes compared), deregistering both.
// `reps` repetitions on one engine created in sync mode NONE (the plugin takes its own locks in
// every mode). Through NIXL's agent this pattern corrupts NIXL's unlocked section maps in sync
// mode NONE; here ASan/valgrind see only the plugin's side.
void phase_concreg(int reps) {
    Engine eng;
    const int T = 4, rounds = 3, descs = 64;
    const size_t buf = 16 << 20, half = buf / 2, desc = 64 << 10;
    long transfers = 0;
    for (int rep = 0; rep < reps; ++rep) {
        std::atomic<int> ready{0};
        std::atomic<long> done{0};
        std::vector<std::thread> th;
        for (int t = 0; t < T; ++t) {
            th.emplace_back([&, t] {
                std::mt19937_64 g(1000 * rep + t);
                Buf b(buf);
                int fd = open_file("concreg-" + std::to_string(t) + ".bin", O_RDWR | O_TRUNC, 0);
                ready++;
                while (ready.load() < T) std::this_thread::yield();
                nixlBackendMD *mm = nullptr, *mf = nullptr;
                CHECK(eng.reg(b.a(), buf, 0, DRAM_SEG, mm) == NIXL_SUCCESS, "concreg reg DRAM");
                CHECK(eng.reg(0, buf, fd, FILE_SEG, mf) == NIXL_SUCCESS, "concreg reg FILE");
                for (int r = 0; r < rounds && mm && mf; ++r) {
                    b.fill(g());
                    std::vector<size_t> slots(half / desc);
                    for (size_t i = 0; i < slots.size(); ++i) slots[i] = i;
                    std::shuffle(slots.begin(), slots.end(), g);
                    Lists w, rd;
                    for (int i = 0; i < descs; ++i) {
                        w.add(b.a(slots[i] * desc), mm, i * desc, desc, fd, mf);
                        rd.add(b.a(half + slots[i] * desc), mm, i * desc, desc, fd, mf);
                    }
                    nixl_status_t s = run(eng, NIXL_WRITE, w);
                    CHECK(s == NIXL_SUCCESS, "concreg WRITE %s", st(s));
                    s = run(eng, NIXL_READ, rd);
                    CHECK(s == NIXL_SUCCESS, "concreg READ %s", st(s));
                    int bad = 0;
                    for (int i = 0; i < descs; ++i)
                        bad += std::memcmp(b.p + slots[i] * desc, b.p + half + slots[i] * desc, desc) != 0;
                    CHECK(bad == 0, "concreg rep %d thread %d round %d: %d descriptors differ", rep, t, r, bad);
                    done += 2;
                }
                if (mf) CHECK(eng->deregisterMem(mf) == NIXL_SUCCESS, "concreg dereg FILE");
                if (mm) CHECK(eng->deregisterMem(mm) == NIXL_SUCCESS, "concreg dereg DRAM");
                ::close(fd);
            });
        }
        for (auto &x : th) x.join();
        transfers += done.load();
    }
    std::printf("phase concreg ok: %d x %d threads registering at once, %ld transfers of %d x 64 KiB\n",
                reps, T, transfers, descs);
}

int count_fds() {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) n += fcntl(fd, F_GETFD) != -1;
    return n;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 3) {
        std::fprintf(stderr, "usage: %s PLUGIN_SO WORKDIR [cycles] [thread-iterations] [concreg-reps]\n",
                     argv[0]);
        return 2;
    }
    g_dir = argv[2];
    long cycles = argc > 3 ? std::atol(argv[3]) : 10000;
    int iters = argc > 4 ? std::atoi(argv[4]) : 40;
    int concreg = argc > 5 ? std::atoi(argv[5]) : 20;
    void *so = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!so) {
        std::fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    using init_t = nixlBackendPlugin *(*)();
    using fini_t = void (*)();
    auto init = reinterpret_cast<init_t>(dlsym(so, "nixl_plugin_init"));
    auto fini = reinterpret_cast<fini_t>(dlsym(so, "nixl_plugin_fini"));
    if (!init || !fini) {
        std::fprintf(stderr, "nixl_plugin_init/fini not exported\n");
        return 2;
    }
    // NIXL calls init and fini repeatedly (plugin discovery, then use)
    for (int i = 0; i < 3; ++i) {
        g_plugin = init();
        fini();
    }
    g_plugin = init();
    if (!g_plugin) {
        std::fprintf(stderr, "nixl_plugin_init returned null\n");
        return 2;
    }
    int fds0 = count_fds();
    phase_plugin();
    phase_params();
    phase_roundtrip();
    phase_errors();
    phase_inflight();
    phase_threads(iters);
    phase_concreg(concreg);
    phase_cycles(cycles);
    int fds1 = count_fds();
    CHECK(fds1 == fds0, "fds %d before the phases, %d after", fds0, fds1);
    fini();
    // NIXL dlopens plugins with RTLD_NODELETE; dlclose here only drops our reference.
    dlclose(so);
    std::printf("driver: %d failures\n", g_failures.load());
    return g_failures.load() ? 1 : 0;
}
