/* SPDX-License-Identifier: Apache-2.0
 *
 * The flat C bridge between the C++ shim (which owns NIXL's vtable and every std:: object) and
 * the Rust engine (which owns all state). Only plain C types cross it. bindgen turns this header
 * into Rust types at build time, so both sides compile against the same definitions.
 *
 * Rust hands the shim one table of function pointers (iud_rust_api) when nixl_plugin_init runs;
 * no Rust symbol besides the two NIXL entry points is exported from the plugin.
 *
 * Status values are NIXL's nixl_status_t numbers: iud_status names the ones the engine returns;
 * engine.cpp static_asserts each against nixl_abi.h, and Rust takes them from here (bindgen).
 */
#ifndef IUD_BRIDGE_H
#define IUD_BRIDGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The nixl_status_t numbers the engine returns (checked against nixl_abi.h in engine.cpp). */
typedef enum iud_status {
    IUD_IN_PROG = 1,
    IUD_SUCCESS = 0,
    IUD_ERR_INVALID_PARAM = -2,
    IUD_ERR_BACKEND = -3,
    IUD_ERR_NOT_FOUND = -4,
    IUD_ERR_MISMATCH = -5,
    IUD_ERR_NOT_ALLOWED = -6,
    IUD_ERR_REPOST_ACTIVE = -7,
    IUD_ERR_NOT_SUPPORTED = -9,
    IUD_ERR_CANCELED = -11,
} iud_status;

/* One transfer descriptor. Same layout as NIXL's nixlMetaDesc (addr, len, devId, MD pointer), so
 * the shim passes the agent's descriptor vector straight through without copying. `md` is the
 * opaque pointer the shim returned from registerMem for the covering registration. */
typedef struct iud_desc {
    uint64_t addr;
    uint64_t len;
    uint64_t dev_id;
    const void *md;
} iud_desc;

typedef struct iud_desc_list {
    int32_t mem_kind; /* nixl_mem_t */
    uint32_t count;
    const iud_desc *descs;
} iud_desc_list;

/* A borrowed string: not NUL-terminated, valid only during the call. */
typedef struct iud_str {
    const char *ptr;
    size_t len;
} iud_str;

typedef struct iud_kv {
    iud_str key;
    iud_str value;
} iud_kv;

/* One registration descriptor (NIXL's nixlBlobDesc). */
typedef struct iud_reg_desc {
    uint64_t addr;
    uint64_t len;
    uint64_t dev_id;
    iud_str meta_info;
} iud_reg_desc;

typedef struct iud_engine_config {
    iud_str local_agent;
    iud_str backend_type; /* the name create_backend used (the plugin file's name); src/ffi/alias.rs */
    const iud_kv *params;
    uint32_t param_count;
    int32_t sync_mode; /* nixl_thread_sync_t */
    bool enable_prog_thread;
} iud_engine_config;

/* A static (name, default value) pair from the plugin manifest, NUL-terminated. */
typedef struct iud_param_default {
    const char *name;
    const char *default_value;
} iud_param_default;

/* What stat() says about the file a FILE descriptor's metaInfo names (queryMem). */
typedef struct iud_file_info {
    uint64_t size;
    uint32_t mode;
    int64_t mtime;
} iud_file_info;

/* Everything the shim calls in Rust. Every function is panic-safe: a panic becomes
 * NIXL_ERR_BACKEND (or a no-op for void functions) and one log line. `engine` is the pointer
 * engine_create returned; `md`/`req` are pointers register_mem/prep_xfer returned. */
typedef struct iud_rust_api {
    const char *plugin_name;
    const char *plugin_version;
    const int32_t *mems; /* nixl_mem_t values */
    uint32_t mem_count;
    const iud_param_default *params;
    uint32_t param_count;

    int32_t (*engine_create)(const iud_engine_config *config, void **engine_out);
    void (*engine_destroy)(void *engine);
    int32_t (*register_mem)(void *engine, const iud_reg_desc *desc, int32_t mem_kind, void **md_out);
    int32_t (*deregister_mem)(void *engine, void *md);
    int32_t (*prep_xfer)(void *engine,
                         int32_t op,
                         const iud_desc_list *local,
                         const iud_desc_list *remote,
                         iud_str remote_agent,
                         void **req_out);
    int32_t (*post_xfer)(void *engine,
                         void *req,
                         int32_t op,
                         const iud_desc_list *local,
                         const iud_desc_list *remote);
    int32_t (*check_xfer)(void *engine, void *req);
    int32_t (*release_req)(void *engine, void *req);
    /* Logs one line at error level from the C++ side (caught exceptions). */
    void (*log_error)(const char *message);
    /* The memory kinds an engine created as `backend_type` reports (*mems_out: static array). */
    uint32_t (*engine_mems)(iud_str backend_type, const int32_t **mems_out);
    /* queryMem for one descriptor: 1 with *info_out filled when metaInfo names an existing file,
     * 0 when it names none. */
    int32_t (*query_file)(iud_str meta_info, iud_file_info *info_out);
} iud_rust_api;

/* Implemented by the shim: returns the process-wide nixlBackendPlugin (as void*), built on the
 * first call from `api`, which must stay valid for the life of the process. Idempotent. */
void *iud_shim_plugin(const iud_rust_api *api);

#ifdef __cplusplus
}
#endif

#endif /* IUD_BRIDGE_H */
