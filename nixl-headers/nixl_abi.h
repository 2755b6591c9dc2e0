// SPDX-License-Identifier: Apache-2.0
//
// The project's own declarations of NIXL's backend-plugin ABI as the releases 1.3, 1.4 and 1.5
// share it (x86-64, libstdc++ with _GLIBCXX_USE_CXX11_ABI=1, C++20). NIXL's wheels ship no
// headers; these are written from NIXL's sources and checked against the wheels' binaries. Every
// size and offset the plugin depends on is frozen by a static_assert at the end of this file: a
// change to these declarations that moves a field fails the build.
//
// Sources, cited as [src] and [probe] below (docs/nixl-releases.md has the per-release table and
// the commands):
//   [src]   ai-dynamo/nixl at v1.3.2 and release/1.4.1: src/api/cpp/backend/backend_plugin.h,
//           backend_engine.h, backend_aux.h, src/api/cpp/nixl_types.h, nixl_descriptors.h,
//           src/core/telemetry/telemetry_event.h. backend_engine.h is byte-identical from v1.3.0
//           to release/1.4.1; between v1.3.2 and release/1.4.1 the others change no layout
//           declared here (1.4 adds the agent-internal nixlStrideDesc to backend_aux.h, default
//           member initializers to nixlBackendInitParams, inline reserve()/emplace() to
//           nixlDescList, an event type to telemetry_event.h, and std::string statics inside
//           backend_plugin.h's creator template, which this plugin does not use). The 1.3.2
//           wheels embed git 75ead3d7, whose copies of these files equal v1.3.2's. No 1.5.x tag
//           or branch was in the mirror, so 1.5.0/1.5.1 rest on [probe] alone.
//   [probe] ci/nixl_abi_probe.py on the nixl-cu12 and nixl-cu13 wheels 1.3.2, 1.4.1, 1.5.0 and
//           1.5.1 in CI (and once, by hand, on cu12 1.3.0, 1.3.1, 1.4.0): libnixl.so's plugin
//           loader and plugin handle, libnixl_build.so's descriptor lists, the POSIX and GDS_MT
//           engine vtables and constructors, each compared with this plugin's binary built from
//           this file. The identical result for every wheel is why one header serves all three
//           release lines.
//
// Only what a storage plugin touches is declared. Out-of-line members of NIXL's classes (the
// descriptor constructors and serializers in libnixl_build.so, the descriptor-list virtuals) are
// declared but never called, so the plugin has no link dependency on any NIXL library.
#pragma once

#if !defined(__x86_64__)
#error "nixl-headers: layouts are verified for x86-64 only (std::mutex differs on aarch64)"
#endif
#if !defined(_GLIBCXX_USE_CXX11_ABI) || _GLIBCXX_USE_CXX11_ABI != 1
#error "nixl-headers: NIXL 1.3-1.5 wheels are built with the new libstdc++ string ABI"
#endif

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- enums (nixl_types.h) -------------------------------------------------------------------

enum nixl_mem_t { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };

enum nixl_xfer_op_t { NIXL_READ = 0, NIXL_WRITE = 1 };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

enum class nixl_thread_sync_t : int { NIXL_THREAD_SYNC_NONE = 0, NIXL_THREAD_SYNC_STRICT = 1, NIXL_THREAD_SYNC_RW = 2 };

enum class nixl_cost_t : int { ANALYTICAL_BACKEND = 0 };

// telemetry_event.h: the event type is a 32-bit enum; its values are not used by the plugin.
enum nixl_telemetry_event_type_t : uint32_t {};

// ---- typedefs ---------------------------------------------------------------------------------

using nixl_blob_t = std::string;
using nixl_backend_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;
using nixlMemViewH = void *;

namespace nixlTime {
using us_t = uint64_t;
}

// ---- descriptors (nixl_descriptors.h, backend_aux.h) ------------------------------------------

class nixlBackendMD {
public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~nixlBackendMD() = default;
    bool isPrivateMD;
};

class nixlBackendReqH {
public:
    nixlBackendReqH() = default;
    virtual ~nixlBackendReqH() = default;
};

// No vtable: addr, len, devId.
class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

class nixlRemoteMetaDesc : public nixlMetaDesc {
public:
    std::string remoteAgent;
};

// The plugin only reads lists the agent built; the virtuals below are never called or
// instantiated here (their definitions live in libnixl_build.so).
template<class T> class nixlDescList {
public:
    virtual ~nixlDescList();
    virtual void resize(size_t count);
    virtual void addDesc(const T &desc);
    virtual int getIndex(const nixlBasicDesc &query) const;

    nixl_mem_t getType() const { return type; }
    int descCount() const { return static_cast<int>(descs.size()); }
    bool isEmpty() const { return descs.empty(); }
    const T &operator[](size_t index) const { return descs[index]; }
    const T *data() const { return descs.data(); }

    nixl_mem_t type;
    std::vector<T> descs;
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;
using nixl_xfer_dlist_t = nixlDescList<nixlBasicDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;

// ---- optional args (backend_aux.h) --------------------------------------------------------------

class nixlBackendOptionalArgs {
public:
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

// The agent-level optional args only appear behind a pointer in estimateXferCost.
struct nixlAgentOptionalArgs;
using nixl_opt_args_t = nixlAgentOptionalArgs;

// ---- init params (backend_aux.h) ----------------------------------------------------------------

class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams;
    bool enableProgTh;
    nixlTime::us_t pthrDelay;
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_;
};

struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType_;
    uint64_t value_;
};

// ---- the engine base class (backend_engine.h) -------------------------------------------------
//
// The 27 vtable slots, in declaration order [src]; [probe] reads the same 27 signatures in the
// same order from every wheel's POSIX and GDS_MT vtables and from this plugin's ShimEngine vtable.
// (0.10.1 has 31: four GPU-transfer slots after releaseReqH; that is what the load-time release
// check in src/ffi/nixl_release.rs guards against.) Slot numbers are in the comments.

class nixlBackendEngine {
private:
    const nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *init_params)
        : backendType(init_params->type),
          customParams(*init_params->customParams),
          initErr(false),
          localAgent(init_params->localAgent),
          enableTelemetry_(init_params->enableTelemetry_) {}

    nixlBackendEngine(const nixlBackendEngine &) = delete;
    nixlBackendEngine &operator=(const nixlBackendEngine &) = delete;

    /* 0, 1 */ virtual ~nixlBackendEngine() = default;
    /* 2 */ virtual bool supportsRemote() const = 0;
    /* 3 */ virtual bool supportsLocal() const = 0;
    /* 4 */ virtual bool supportsNotif() const = 0;
    /* 5 */ virtual nixl_mem_list_t getSupportedMems() const = 0;
    /* 6 */ virtual nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    /* 7 */ virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    /* 8 */ virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    /* 9 */ virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    /* 10 */ virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    /* 11 */ virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation,
                                           const nixl_meta_dlist_t &local,
                                           const nixl_meta_dlist_t &remote,
                                           const std::string &remote_agent,
                                           nixlBackendReqH *&handle,
                                           const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    /* 12 */ virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation,
                                           const nixl_meta_dlist_t &local,
                                           const nixl_meta_dlist_t &remote,
                                           const std::string &remote_agent,
                                           nixlBackendReqH *&handle,
                                           const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    /* 13 */ virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    /* 14 */ virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;
    /* 15 */ virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t &,
                                              nixlMemViewH &,
                                              const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 16 */ virtual nixl_status_t
    prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 17 */ virtual void releaseMemView(nixlMemViewH) const {}
    /* 18 */ virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    /* 19 */ virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    /* 20 */ virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    /* 21 */ virtual nixl_status_t
    loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    /* 22 */ virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    /* 23 */ virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    /* 24 */ virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    /* 25 */ virtual nixl_status_t queryMem(const nixl_reg_dlist_t &,
                                           std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    /* 26 */ virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &,
                                                   const nixl_meta_dlist_t &,
                                                   const nixl_meta_dlist_t &,
                                                   const std::string &,
                                                   nixlBackendReqH *const &,
                                                   std::chrono::microseconds &,
                                                   std::chrono::microseconds &,
                                                   nixl_cost_t &,
                                                   const nixl_opt_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }

    bool getInitErr() const { return initErr; }
    const nixl_backend_t &getType() const { return backendType; }
    const nixl_b_params_t &getCustomParams() const { return customParams; }

    // Offsets of the protected members, for the static_asserts below.
    static constexpr size_t initErrOffset();
    static constexpr size_t localAgentOffset();
    static constexpr size_t enableTelemetryOffset();
};

// ---- the plugin struct (backend_plugin.h) -------------------------------------------------------

#define NIXL_PLUGIN_API_VERSION 1

struct nixlBackendPlugin {
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

// ---- layout guards (x86-64, NIXL 1.3-1.5) -------------------------------------------------------
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"

constexpr size_t nixlBackendEngine::initErrOffset() { return offsetof(nixlBackendEngine, initErr); }
constexpr size_t nixlBackendEngine::localAgentOffset() {
    return offsetof(nixlBackendEngine, localAgent);
}
constexpr size_t nixlBackendEngine::enableTelemetryOffset() {
    return offsetof(nixlBackendEngine, enableTelemetry_);
}

// libstdc++'s CXX11 ABI on x86-64 (the containers inside NIXL's classes); [probe]: the offsets
// below, read from NIXL's binaries, are consistent only with these sizes.
static_assert(sizeof(std::string) == 32, "CXX11 std::string is 32 bytes");
static_assert(sizeof(nixl_b_params_t) == 56, "std::unordered_map is 56 bytes");
static_assert(sizeof(std::mutex) == 40, "std::mutex is 40 bytes on x86-64 glibc");

// [src] nixl_types.h: plain enums of int range.
static_assert(sizeof(nixl_status_t) == 4 && sizeof(nixl_mem_t) == 4 && sizeof(nixl_xfer_op_t) == 4);

// [src] backend_plugin.h; [probe] nixlBackendPluginHandle::createEngine/destroyEngine/getName/
// getVersion/getBackendOptions/getBackendMems load their pointer from 8/16/24/32/40/48, and the
// loader (backendLoader) compares api_version at 0 with 1, in every wheel.
static_assert(sizeof(nixlBackendPlugin) == 56);
static_assert(offsetof(nixlBackendPlugin, api_version) == 0);
static_assert(offsetof(nixlBackendPlugin, create_engine) == 8);
static_assert(offsetof(nixlBackendPlugin, destroy_engine) == 16);
static_assert(offsetof(nixlBackendPlugin, get_plugin_name) == 24);
static_assert(offsetof(nixlBackendPlugin, get_plugin_version) == 32);
static_assert(offsetof(nixlBackendPlugin, get_backend_options) == 40);
static_assert(offsetof(nixlBackendPlugin, get_backend_mems) == 48);

// [src] backend_engine.h; [probe] the base constructor inlined into POSIX's, GDS_MT's and this
// plugin's engine constructors writes backendType at 8, customParams at 40, telemetryEvents_ at
// 96, the mutex at 120, initErr at 160, localAgent at 168, enableTelemetry_ at 200 and nothing
// from 208 on; nixlAgent::createBackend reads initErr at 160 (getInitErr).
static_assert(sizeof(nixlBackendEngine) == 208);
static_assert(nixlBackendEngine::initErrOffset() == 160);
static_assert(nixlBackendEngine::localAgentOffset() == 168);
static_assert(nixlBackendEngine::enableTelemetryOffset() == 200);

// [src] backend_aux.h; [probe] the engine constructors read localAgent at 0, type at 32,
// customParams at 64, enableTelemetry_ at 92. enableProgTh (72), pthrDelay (80) and syncMode (88)
// are [src] only (by hand: UCX's create reads 72 in every wheel, 1.3.x POSIX reads 88); the
// plugin only logs them.
static_assert(sizeof(nixlBackendInitParams) == 96);
static_assert(offsetof(nixlBackendInitParams, localAgent) == 0);
static_assert(offsetof(nixlBackendInitParams, type) == 32);
static_assert(offsetof(nixlBackendInitParams, customParams) == 64);
static_assert(offsetof(nixlBackendInitParams, enableProgTh) == 72);
static_assert(offsetof(nixlBackendInitParams, pthrDelay) == 80);
static_assert(offsetof(nixlBackendInitParams, syncMode) == 88);
static_assert(offsetof(nixlBackendInitParams, enableTelemetry_) == 92);

// [src] backend_aux.h only: the shim never reads the optional args (it ignores notifMsg and
// customParam), so no release's layout of them can reach the plugin.
static_assert(sizeof(nixlBackendOptionalArgs) == 72);
static_assert(offsetof(nixlBackendOptionalArgs, notifMsg) == 0);
static_assert(offsetof(nixlBackendOptionalArgs, hasNotif) == 32);
static_assert(offsetof(nixlBackendOptionalArgs, customParam) == 40);

// [src] nixl_descriptors.h, backend_aux.h; [probe] nixlDescList<T>::descCount divides by 24, 56,
// 32 and 64 for nixlBasicDesc, nixlBlobDesc, nixlMetaDesc and nixlRemoteMetaDesc (so metaInfo and
// metadataP, the members after the 24-byte base, sit at 24), and getType/descCount read the
// list's type at 8 and its vector at 16, in every wheel.
static_assert(sizeof(nixlBasicDesc) == 24);
static_assert(offsetof(nixlBasicDesc, addr) == 0);
static_assert(offsetof(nixlBasicDesc, len) == 8);
static_assert(offsetof(nixlBasicDesc, devId) == 16);
static_assert(sizeof(nixlBlobDesc) == 56);
static_assert(offsetof(nixlBlobDesc, metaInfo) == 24);
static_assert(sizeof(nixlMetaDesc) == 32);
static_assert(offsetof(nixlMetaDesc, metadataP) == 24);
static_assert(sizeof(nixlRemoteMetaDesc) == 64);
static_assert(offsetof(nixlRemoteMetaDesc, remoteAgent) == 32);

static_assert(sizeof(nixl_meta_dlist_t) == 40);
static_assert(offsetof(nixl_meta_dlist_t, type) == 8);
static_assert(offsetof(nixl_meta_dlist_t, descs) == 16);
static_assert(sizeof(nixl_reg_dlist_t) == 40);

// [src] backend_aux.h, telemetry_event.h (1.3.0 on; 1.2.0's event also had a category). NIXL
// never dereferences MDs or request handles, and the telemetry vector stays empty (the plugin
// adds no events).
static_assert(sizeof(nixlBackendMD) == 16);
static_assert(sizeof(nixlBackendReqH) == 8);
static_assert(sizeof(nixlTelemetryEvent) == 16);

#pragma GCC diagnostic pop
