/*
 * A host-memory stand-in for the parts of Ascend's ACL runtime that the
 * reference's C++ examples call (device selection, device malloc, memcpy
 * between host and device), so that programs written that way build and
 * run on llmdd without an NPU. Test tree only: "device" memory is host
 * memory, and a copy in any direction is a memcpy.
 */
#ifndef LLMDD_TESTS_COMPAT_ACL_H
#define LLMDD_TESTS_COMPAT_ACL_H

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

using aclError = int;
constexpr aclError ACL_SUCCESS = 0;
constexpr aclError ACL_ERROR_NONE = 0;
constexpr aclError ACL_ERROR_INVALID_PARAM = 100000;
constexpr aclError ACL_ERROR_BAD_ALLOC = 200000;

enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
};

enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
};

inline aclError
aclInit(const char *config)
{
    (void)config;
    return ACL_SUCCESS;
}

inline aclError
aclFinalize()
{
    return ACL_SUCCESS;
}

inline aclError
aclrtSetDevice(int32_t device_id)
{
    return device_id >= 0 ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}

inline aclError
aclrtResetDevice(int32_t device_id)
{
    return device_id >= 0 ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}

/* "Device" memory: page-aligned host memory, not zeroed (as on a device). */
inline aclError
aclrtMalloc(void **dev_ptr, size_t size, aclrtMemMallocPolicy policy)
{
    (void)policy;
    if (dev_ptr == nullptr || size == 0)
        return ACL_ERROR_INVALID_PARAM;
    size_t rounded = (size + 4095) / 4096 * 4096;
    *dev_ptr = std::aligned_alloc(4096, rounded);
    if (*dev_ptr == nullptr)
        return ACL_ERROR_BAD_ALLOC;
    std::memset(*dev_ptr, 0xA5, rounded); /* garbage, visibly */
    return ACL_SUCCESS;
}

inline aclError
aclrtFree(void *dev_ptr)
{
    std::free(dev_ptr);
    return ACL_SUCCESS;
}

inline aclError
aclrtMemcpy(void *dst, size_t dest_max, const void *src, size_t count,
            aclrtMemcpyKind kind)
{
    (void)kind;
    if (dst == nullptr || src == nullptr || count > dest_max)
        return ACL_ERROR_INVALID_PARAM;
    std::memmove(dst, src, count);
    return ACL_SUCCESS;
}

inline aclError
aclrtMemset(void *dev_ptr, size_t max_count, int32_t value, size_t count)
{
    if (dev_ptr == nullptr || count > max_count)
        return ACL_ERROR_INVALID_PARAM;
    std::memset(dev_ptr, value, count);
    return ACL_SUCCESS;
}

inline const char *
aclGetRecentErrMsg()
{
    return nullptr;
}

#endif
