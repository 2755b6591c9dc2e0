/*
 * A stand-in for libhsa-runtime64.so.1 (ROCR-Runtime) for tests on machines without an AMD GPU.
 *
 * It implements the handful of HSA entry points the plugin's ROCm provider calls, over host
 * memory: one CPU agent and one GPU agent; "VRAM" allocations are memfd-backed shared mappings
 * made by fake_hsa_alloc_vram(); hsa_amd_pointer_info answers for them (and for locked host
 * memory); DMA-BUF export returns a dup of the allocation's memfd with the allocation-wide offset
 * of the requested pointer (as ROCr does: the DMA-BUF may describe the whole allocation), so the
 * caller's offset arithmetic is exercised for real; copies run memcpy on a detached thread and
 * decrement the completion signal.
 *
 * Written from the declarations in ROCR-Runtime's hsa.h and hsa_ext_amd.h (types, numbers,
 * documented behaviour); no ROCr code. Not thread-hostile: one mutex guards the tables.
 *
 * Build variants (the tests compile each):
 *   (default)             everything, including hsa_amd_portable_export_dmabuf_v2
 *   -DFAKE_HSA_NO_V2      no _v2 export symbol (ROCm before 7.1): the caller must fall back to v1
 *   -DFAKE_HSA_NO_EXPORT  no export/close symbols and HSA_AMD_SYSTEM_INFO_DMABUF_SUPPORTED is an
 *                         unknown attribute (old ROCm, e.g. Debian bookworm's 5.2)
 *
 * Fault injection: FAKE_HSA_FAIL="hsa_amd_memory_lock=0x1008,hsa_init=0x1000" in the environment
 * (read at the first call) or fake_hsa_fail("name", status) makes that entry point return the
 * status (0 clears). fake_hsa_set_dmabuf_supported(0) makes the support query answer false;
 * fake_hsa_set_copy_error(1) makes copies complete with a negative signal value.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef uint32_t hsa_status_t;
typedef struct { uint64_t handle; } hsa_agent_t;
typedef struct { uint64_t handle; } hsa_signal_t;
typedef int64_t hsa_signal_value_t;

enum {
    ST_SUCCESS = 0x0,
    ST_INFO_BREAK = 0x1,
    ST_ERROR = 0x1000,
    ST_INVALID_ARGUMENT = 0x1001,
    ST_INVALID_ALLOCATION = 0x1003,
    ST_INVALID_AGENT = 0x1004,
    ST_INVALID_SIGNAL = 0x1006,
    ST_OUT_OF_RESOURCES = 0x1008,
    ST_NOT_INITIALIZED = 0x100B,
};

enum { PTR_UNKNOWN = 0, PTR_HSA = 1, PTR_LOCKED = 2 };

typedef struct {
    uint32_t size;
    uint32_t type;
    void *agentBaseAddress;
    void *hostBaseAddress;
    size_t sizeInBytes;
    void *userData;
    hsa_agent_t agentOwner;
    uint32_t global_flags;
} pointer_info_t;

#define CPU_AGENT 0xC0C0ull
#define GPU_AGENT 0x6060ull

struct vram { uint8_t *base; size_t size; int memfd; };
struct locked { uint8_t *base; size_t size; };
struct fail { char name[64]; hsa_status_t status; };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static struct vram vrams[64];
static struct locked locks[64];
static int exported[256] __attribute__((unused));
static int n_exported;
static struct fail fails[32];
static bool env_read;
static bool dmabuf_supported = true;
static bool copy_error;
static atomic_int copies_in_flight;

/* ---- fault injection ------------------------------------------------------------------- */

static void set_fail_locked(const char *name, hsa_status_t status) {
    for (int i = 0; i < 32; i++) {
        if (fails[i].name[0] && strcmp(fails[i].name, name) == 0) {
            fails[i].status = status;
            return;
        }
    }
    for (int i = 0; i < 32; i++) {
        if (!fails[i].name[0]) {
            snprintf(fails[i].name, sizeof fails[i].name, "%s", name);
            fails[i].status = status;
            return;
        }
    }
}

static void read_env_locked(void) {
    if (env_read) return;
    env_read = true;
    const char *spec = getenv("FAKE_HSA_FAIL");
    if (!spec) return;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) continue;
        *eq = 0;
        set_fail_locked(tok, (hsa_status_t)strtoul(eq + 1, NULL, 0));
    }
}

/* The injected status of `name`, or 0. */
static hsa_status_t injected(const char *name) {
    pthread_mutex_lock(&mu);
    read_env_locked();
    hsa_status_t st = 0;
    for (int i = 0; i < 32; i++)
        if (fails[i].name[0] && strcmp(fails[i].name, name) == 0) st = fails[i].status;
    pthread_mutex_unlock(&mu);
    return st;
}

#define ENTRY()                                        \
    do {                                               \
        hsa_status_t inj_ = injected(__func__);        \
        if (inj_) return inj_;                         \
        if (!initialized()) return ST_NOT_INITIALIZED; \
    } while (0)

static bool initialized(void) {
    pthread_mutex_lock(&mu);
    bool ok = refcount > 0;
    pthread_mutex_unlock(&mu);
    return ok;
}

/* ---- lookups (mu held) ------------------------------------------------------------------ */

static struct vram *vram_of(const void *p, size_t len) {
    const uint8_t *q = p;
    for (int i = 0; i < 64; i++)
        if (vrams[i].base && q >= vrams[i].base && q + len <= vrams[i].base + vrams[i].size &&
            q < vrams[i].base + vrams[i].size)
            return &vrams[i];
    return NULL;
}

static struct locked *lock_of(const void *p, size_t len) {
    const uint8_t *q = p;
    for (int i = 0; i < 64; i++)
        if (locks[i].base && q >= locks[i].base && q + len <= locks[i].base + locks[i].size &&
            q < locks[i].base + locks[i].size)
            return &locks[i];
    return NULL;
}

/* ---- control API for the tests ------------------------------------------------------------ */

EXPORT void fake_hsa_fail(const char *name, uint32_t status) {
    pthread_mutex_lock(&mu);
    read_env_locked();
    set_fail_locked(name, status);
    pthread_mutex_unlock(&mu);
}

EXPORT void fake_hsa_set_dmabuf_supported(int yes) { dmabuf_supported = yes != 0; }
EXPORT void fake_hsa_set_copy_error(int yes) { copy_error = yes != 0; }

/* A fake VRAM allocation of `size` bytes (page-rounded), zero-filled; NULL on failure. */
EXPORT void *fake_hsa_alloc_vram(size_t size) {
    size_t len = (size + 4095) & ~(size_t)4095;
    int fd = memfd_create("fake-hsa-vram", MFD_CLOEXEC);
    if (fd < 0) return NULL;
    if (ftruncate(fd, (off_t)len) != 0) { close(fd); return NULL; }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { close(fd); return NULL; }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++) {
        if (!vrams[i].base) {
            vrams[i] = (struct vram){p, len, fd};
            pthread_mutex_unlock(&mu);
            return p;
        }
    }
    pthread_mutex_unlock(&mu);
    munmap(p, len);
    close(fd);
    return NULL;
}

EXPORT int fake_hsa_free_vram(void *p) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++) {
        if (vrams[i].base == p) {
            munmap(vrams[i].base, vrams[i].size);
            close(vrams[i].memfd);
            vrams[i] = (struct vram){0};
            pthread_mutex_unlock(&mu);
            return 0;
        }
    }
    pthread_mutex_unlock(&mu);
    return -1;
}

/* DMA-BUF fds handed out by export and not yet given back through close_dmabuf. */
EXPORT int fake_hsa_open_exports(void) {
    pthread_mutex_lock(&mu);
    int n = n_exported;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Host ranges currently locked. */
EXPORT int fake_hsa_locked_ranges(void) {
    pthread_mutex_lock(&mu);
    int n = 0;
    for (int i = 0; i < 64; i++) n += locks[i].base != NULL;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT int fake_hsa_refcount(void) { return refcount; }

/* ---- init and system --------------------------------------------------------------------- */

EXPORT hsa_status_t hsa_init(void) {
    hsa_status_t inj = injected(__func__);
    if (inj) return inj;
    pthread_mutex_lock(&mu);
    refcount++;
    pthread_mutex_unlock(&mu);
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_shut_down(void) {
    ENTRY();
    pthread_mutex_lock(&mu);
    refcount--;
    pthread_mutex_unlock(&mu);
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_status_string(hsa_status_t status, const char **out) {
    if (!out) return ST_INVALID_ARGUMENT;
    switch (status) {
    case ST_INVALID_ALLOCATION: *out = "fake-hsa: the requested allocation is not valid"; break;
    case ST_OUT_OF_RESOURCES: *out = "fake-hsa: out of resources"; break;
    default: return ST_INVALID_ARGUMENT;
    }
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_system_get_info(uint32_t attribute, void *value) {
    ENTRY();
    if (!value) return ST_INVALID_ARGUMENT;
    switch (attribute) {
    case 0: *(uint16_t *)value = 1; return ST_SUCCESS;           /* VERSION_MAJOR */
    case 1: *(uint16_t *)value = 1; return ST_SUCCESS;           /* VERSION_MINOR */
    case 0x200: *(const char **)value = "fake-hsa (tests/rocm_double)"; return ST_SUCCESS;
#ifndef FAKE_HSA_NO_EXPORT
    case 0x204: *(bool *)value = dmabuf_supported; return ST_SUCCESS; /* DMABUF_SUPPORTED */
#endif
    default: return ST_INVALID_ARGUMENT;
    }
}

EXPORT hsa_status_t hsa_iterate_agents(hsa_status_t (*cb)(hsa_agent_t, void *), void *data) {
    ENTRY();
    if (!cb) return ST_INVALID_ARGUMENT;
    hsa_agent_t agents[2] = {{CPU_AGENT}, {GPU_AGENT}};
    for (int i = 0; i < 2; i++) {
        hsa_status_t st = cb(agents[i], data);
        if (st != ST_SUCCESS) return st;
    }
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_agent_get_info(hsa_agent_t agent, uint32_t attribute, void *value) {
    ENTRY();
    if (agent.handle != CPU_AGENT && agent.handle != GPU_AGENT) return ST_INVALID_AGENT;
    if (!value) return ST_INVALID_ARGUMENT;
    bool gpu = agent.handle == GPU_AGENT;
    switch (attribute) {
    case 0: /* NAME, char[64] */
        snprintf(value, 64, "%s", gpu ? "gfx-fake" : "fake-cpu");
        return ST_SUCCESS;
    case 17: /* DEVICE */
        *(uint32_t *)value = gpu ? 1 : 0;
        return ST_SUCCESS;
    case 0xA009: /* AMD PRODUCT_NAME, char[64] */
        snprintf(value, 64, "%s", gpu ? "Fake Instinct (host memory)" : "Fake CPU");
        return ST_SUCCESS;
    default:
        return ST_INVALID_ARGUMENT;
    }
}

/* ---- pointers and export ----------------------------------------------------------------- */

EXPORT hsa_status_t hsa_amd_pointer_info(const void *ptr, pointer_info_t *info, void *(*alloc)(size_t),
                                         uint32_t *num_accessible, hsa_agent_t **accessible) {
    ENTRY();
    if (!ptr || !info) return ST_INVALID_ARGUMENT;
    pointer_info_t out = {0};
    out.size = sizeof out;
    pthread_mutex_lock(&mu);
    struct vram *v = vram_of(ptr, 1);
    struct locked *l = v ? NULL : lock_of(ptr, 1);
    if (v) {
        out.type = PTR_HSA;
        out.agentBaseAddress = out.hostBaseAddress = v->base;
        out.sizeInBytes = v->size;
        out.agentOwner.handle = GPU_AGENT;
        out.global_flags = 4; /* COARSE_GRAINED */
    } else if (l) {
        out.type = PTR_LOCKED;
        out.agentBaseAddress = out.hostBaseAddress = l->base;
        out.sizeInBytes = l->size;
        out.agentOwner.handle = CPU_AGENT;
    } else {
        out.type = PTR_UNKNOWN;
    }
    pthread_mutex_unlock(&mu);
    /* Only the members the caller's structure has room for (the size field is the version). */
    uint32_t room = info->size < sizeof out ? info->size : (uint32_t)sizeof out;
    if (room < 8) return ST_INVALID_ARGUMENT;
    memcpy((char *)info + 4, (char *)&out + 4, room - 4);
    info->size = room;
    if (alloc && num_accessible && accessible) {
        *num_accessible = out.type == PTR_UNKNOWN ? 0 : 1;
        *accessible = alloc(sizeof(hsa_agent_t));
        if (*accessible) (*accessible)[0] = out.agentOwner;
    }
    return ST_SUCCESS;
}

#ifndef FAKE_HSA_NO_EXPORT
static hsa_status_t export_dmabuf(const void *ptr, size_t size, int *dmabuf, uint64_t *offset, uint64_t flags) {
    if (!ptr || !size || !dmabuf || !offset || flags > 1) return ST_INVALID_ARGUMENT;
    pthread_mutex_lock(&mu);
    struct vram *v = vram_of(ptr, size);
    if (!v) {
        /* ROCr: INVALID_AGENT for memory not from a GPU pool, INVALID_ALLOCATION otherwise. */
        bool host = lock_of(ptr, 1) != NULL;
        pthread_mutex_unlock(&mu);
        return host ? ST_INVALID_AGENT : ST_INVALID_ALLOCATION;
    }
    if (n_exported == 256) { pthread_mutex_unlock(&mu); return ST_OUT_OF_RESOURCES; }
    int fd = dup(v->memfd);
    if (fd < 0) { pthread_mutex_unlock(&mu); return ST_OUT_OF_RESOURCES; }
    exported[n_exported++] = fd;
    *dmabuf = fd;
    *offset = (uint64_t)((const uint8_t *)ptr - v->base);
    pthread_mutex_unlock(&mu);
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_amd_portable_export_dmabuf(const void *ptr, size_t size, int *dmabuf, uint64_t *offset) {
    ENTRY();
    return export_dmabuf(ptr, size, dmabuf, offset, 0);
}

#ifndef FAKE_HSA_NO_V2
EXPORT hsa_status_t hsa_amd_portable_export_dmabuf_v2(const void *ptr, size_t size, int *dmabuf,
                                                      uint64_t *offset, uint64_t flags) {
    ENTRY();
    return export_dmabuf(ptr, size, dmabuf, offset, flags);
}
#endif

EXPORT hsa_status_t hsa_amd_portable_close_dmabuf(int dmabuf) {
    ENTRY();
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_exported; i++) {
        if (exported[i] == dmabuf) {
            exported[i] = exported[--n_exported];
            pthread_mutex_unlock(&mu);
            close(dmabuf);
            return ST_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return ST_INVALID_ARGUMENT;
}
#endif

/* ---- pinning ------------------------------------------------------------------------------ */

EXPORT hsa_status_t hsa_amd_memory_lock(void *host_ptr, size_t size, hsa_agent_t *agents, int num_agent,
                                        void **agent_ptr) {
    ENTRY();
    if (!agent_ptr) return ST_INVALID_ARGUMENT;
    *agent_ptr = NULL;
    if (!size || !host_ptr || (agents && num_agent == 0) || (!agents && num_agent != 0))
        return ST_INVALID_ARGUMENT;
    if ((uintptr_t)host_ptr % 64) return ST_INVALID_ARGUMENT; /* ROCr wants cache-line alignment */
    for (int i = 0; i < num_agent; i++)
        if (agents[i].handle != GPU_AGENT && agents[i].handle != CPU_AGENT) return ST_INVALID_AGENT;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++) {
        if (!locks[i].base) {
            locks[i] = (struct locked){host_ptr, size};
            pthread_mutex_unlock(&mu);
            *agent_ptr = host_ptr; /* system memory: the agents see it at the same address */
            return ST_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return ST_OUT_OF_RESOURCES;
}

EXPORT hsa_status_t hsa_amd_memory_unlock(void *host_ptr) {
    ENTRY();
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++) {
        if (locks[i].base == host_ptr) {
            locks[i] = (struct locked){0};
            pthread_mutex_unlock(&mu);
            return ST_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return ST_INVALID_ARGUMENT;
}

/* ---- signals ------------------------------------------------------------------------------ */

struct signal { _Atomic hsa_signal_value_t value; uint64_t magic; };
#define SIGNAL_MAGIC 0x5167a1ull

static struct signal *signal_of(hsa_signal_t s) {
    struct signal *p = (struct signal *)(uintptr_t)s.handle;
    return p && p->magic == SIGNAL_MAGIC ? p : NULL;
}

EXPORT hsa_status_t hsa_signal_create(hsa_signal_value_t initial, uint32_t num_consumers,
                                      const hsa_agent_t *consumers, hsa_signal_t *signal) {
    ENTRY();
    if (!signal || (num_consumers && !consumers)) return ST_INVALID_ARGUMENT;
    struct signal *p = calloc(1, sizeof *p);
    if (!p) return ST_OUT_OF_RESOURCES;
    atomic_store(&p->value, initial);
    p->magic = SIGNAL_MAGIC;
    signal->handle = (uint64_t)(uintptr_t)p;
    return ST_SUCCESS;
}

EXPORT hsa_status_t hsa_signal_destroy(hsa_signal_t s) {
    ENTRY();
    struct signal *p = signal_of(s);
    if (!p) return ST_INVALID_SIGNAL;
    p->magic = 0;
    free(p);
    return ST_SUCCESS;
}

EXPORT hsa_signal_value_t hsa_signal_load_scacquire(hsa_signal_t s) {
    struct signal *p = signal_of(s);
    return p ? atomic_load_explicit(&p->value, memory_order_acquire) : 0;
}

/* Conditions: EQ 0, NE 1, LT 2, GTE 3. May return early (the spec allows spurious wake-ups). */
EXPORT hsa_signal_value_t hsa_signal_wait_scacquire(hsa_signal_t s, uint32_t cond, hsa_signal_value_t cmp,
                                                    uint64_t timeout_hint, uint32_t wait_state) {
    (void)wait_state;
    struct signal *p = signal_of(s);
    if (!p) return 0;
    for (uint64_t spins = 0;; spins++) {
        hsa_signal_value_t v = atomic_load_explicit(&p->value, memory_order_acquire);
        bool met = (cond == 0 && v == cmp) || (cond == 1 && v != cmp) || (cond == 2 && v < cmp) ||
                   (cond == 3 && v >= cmp);
        if (met || spins >= timeout_hint) return v;
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* ---- copies ------------------------------------------------------------------------------- */

struct copy { void *dst; const void *src; size_t size; struct signal *done; bool fail; };

static void *copy_thread(void *arg) {
    struct copy *c = arg;
    if (!c->fail) memcpy(c->dst, c->src, c->size);
    if (c->fail)
        atomic_store_explicit(&c->done->value, -1, memory_order_release);
    else
        atomic_fetch_sub_explicit(&c->done->value, 1, memory_order_release);
    atomic_fetch_sub(&copies_in_flight, 1);
    free(c);
    return NULL;
}

/* Memory a copy may touch: fake VRAM, or host memory locked for the agents. */
static bool reachable(const void *p, size_t n) {
    pthread_mutex_lock(&mu);
    bool ok = vram_of(p, n) || lock_of(p, n);
    pthread_mutex_unlock(&mu);
    return ok;
}

EXPORT hsa_status_t hsa_amd_memory_async_copy(void *dst, hsa_agent_t dst_agent, const void *src,
                                              hsa_agent_t src_agent, size_t size, uint32_t num_dep,
                                              const hsa_signal_t *deps, hsa_signal_t completion) {
    ENTRY();
    (void)deps;
    if (!dst || !src || completion.handle == 0 || num_dep) return ST_INVALID_ARGUMENT;
    struct signal *done = signal_of(completion);
    if (!done) return ST_INVALID_SIGNAL;
    hsa_agent_t agents[2] = {dst_agent, src_agent};
    for (int i = 0; i < 2; i++)
        if (agents[i].handle != GPU_AGENT && agents[i].handle != CPU_AGENT) return ST_INVALID_AGENT;
    if (size == 0) {
        atomic_fetch_sub(&done->value, 1);
        return ST_SUCCESS;
    }
    /* Unlocked pageable memory is not reachable by the copy engines (no SVM in this double). */
    if (!reachable(dst, size) || !reachable(src, size)) return ST_INVALID_ARGUMENT;
    struct copy *c = malloc(sizeof *c);
    if (!c) return ST_OUT_OF_RESOURCES;
    *c = (struct copy){dst, src, size, done, copy_error};
    atomic_fetch_add(&copies_in_flight, 1);
    pthread_t t;
    if (pthread_create(&t, NULL, copy_thread, c) != 0) {
        atomic_fetch_sub(&copies_in_flight, 1);
        free(c);
        return ST_OUT_OF_RESOURCES;
    }
    pthread_detach(t);
    return ST_SUCCESS;
}
