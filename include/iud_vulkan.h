/*
 * iud_vulkan.h - the Vulkan allocator of the IO_URING_DMABUF NIXL plugin.
 *
 * NIXL registers memory as (addr, len, devId). For gpu_provider=vulkan the plugin must map such
 * an address back to its Vulkan allocation, so applications allocate the memory they hand to
 * NIXL through these functions, which the plugin library itself exports. Load the same file that
 * NIXL loads (<NIXL_PLUGIN_DIR>/libplugin_IO_URING_DMABUF.so): dlopen returns the same library,
 * so the plugin's engines see the allocations. No header or library of Vulkan or CUDA is needed
 * to build against this API; the plugin loads libvulkan.so.1 (and libcuda.so.1) at run time.
 *
 * Each allocation is a dedicated, exportable Vulkan buffer allocation on the Vulkan device whose
 * UUID matches CUDA device `device` (when libcuda is present), else on Vulkan device `device`.
 * The address returned is where the application (and NIXL) reach the memory; which one depends
 * on the variant the driver allows (iud_vulkan_variant):
 *   "vulkan-dmabuf+cuda"  driver exports DMA_BUF_EXT and OPAQUE_FD; the address is CUDA's import
 *                         of the OPAQUE_FD (a CUdeviceptr); DMA-BUFs come from Vulkan.
 *   "opaque-fd+cuda"      driver exports OPAQUE_FD only (NVIDIA); the address is CUDA's import;
 *                         DMA-BUFs are asked from CUDA (cuMemGetHandleForAddressRange), which may
 *                         refuse imported memory: then the dmabuf path is unavailable and
 *                         staging still moves the memory.
 *   "vulkan-dmabuf+host"  DMA_BUF_EXT, no CUDA device: the address is a host mapping
 *                         (HOST_VISIBLE|HOST_COHERENT memory); DMA-BUFs come from Vulkan.
 *   "host-mapped"         no DMA_BUF_EXT, no CUDA device (e.g. Mesa lavapipe): a host mapping,
 *                         no DMA-BUF; staging moves it.
 * Register the address with NIXL as VRAM with devId = `device`, on a backend created with
 * gpu_provider=vulkan. Deregister it from NIXL before freeing it.
 *
 * Conventions: 0 on success, a negative IUD_VK_E* code on failure; the reason is then available
 * from iud_vulkan_last_error() on the same thread. Out-parameters are written only on success.
 * All functions are thread-safe.
 */
#ifndef IUD_VULKAN_H
#define IUD_VULKAN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IUD_VK_OK 0
#define IUD_VK_EINVAL (-1)    /* bad argument: NULL out-pointer, size 0, unknown address */
#define IUD_VK_ENOTSUP (-2)   /* no Vulkan loader, driver or suitable device */
#define IUD_VK_EFAIL (-3)     /* the Vulkan or CUDA driver failed (out of memory, import refused) */
#define IUD_VK_EINTERNAL (-4) /* internal error (please report) */

/* Allocates at least `size` bytes (rounded up to 4096) on `device`; writes the address. */
int iud_vulkan_alloc(int device, uint64_t size, uint64_t *out_addr);

/* Frees an allocation: `addr` exactly as iud_vulkan_alloc returned it. Releases the CUDA mapping,
 * the CUDA external-memory handle and the Vulkan memory. */
int iud_vulkan_free(uint64_t addr);

/* The variant (a static string, see above) of the allocation containing `addr`, or NULL. */
const char *iud_vulkan_variant(uint64_t addr);

/* Why this thread's last failed call failed ("" after a success). Valid until the thread's next
 * call of this API. */
const char *iud_vulkan_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* IUD_VULKAN_H */
