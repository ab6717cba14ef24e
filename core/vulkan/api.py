"""The Vulkan C API through ctypes on the loader (``libvulkan.so.1``): the constants, structures
and entry points Timeshare's plain-Vulkan code uses (the copy baseline, the hand-over of device
memory), bound once with their signatures. No ggml, no device choice: :mod:`.devices` builds on it.

Core Vulkan 1.1 entry points come from the loader's exports; extension entry points (such as
``vkGetMemoryFdKHR`` of ``VK_KHR_external_memory_fd``) from ``vkGetDeviceProcAddr``
(:meth:`Vk.device_function`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from ctypes import POINTER, Structure, byref, c_char, c_char_p, c_float, c_uint32, c_uint64, c_void_p
from typing import Any, ClassVar

VK_SUCCESS = 0
VK_API_VERSION_1_1 = (1 << 22) | (1 << 12)

ST_APPLICATION_INFO = 0
ST_INSTANCE_CREATE_INFO = 1
ST_DEVICE_QUEUE_CREATE_INFO = 2
ST_DEVICE_CREATE_INFO = 3
ST_SUBMIT_INFO = 4
ST_MEMORY_ALLOCATE_INFO = 5
ST_FENCE_CREATE_INFO = 8
ST_BUFFER_CREATE_INFO = 12
ST_COMMAND_POOL_CREATE_INFO = 39
ST_COMMAND_BUFFER_ALLOCATE_INFO = 40
ST_COMMAND_BUFFER_BEGIN_INFO = 42
ST_PHYSICAL_DEVICE_PROPERTIES_2 = 1000059001
ST_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES = 1000168000
ST_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT = 1000212000
# external memory (core 1.1) and VK_KHR_external_memory_fd
ST_PHYSICAL_DEVICE_EXTERNAL_BUFFER_INFO = 1000071002
ST_EXTERNAL_BUFFER_PROPERTIES = 1000071003
ST_PHYSICAL_DEVICE_ID_PROPERTIES = 1000071004
ST_EXTERNAL_MEMORY_BUFFER_CREATE_INFO = 1000072000
ST_EXPORT_MEMORY_ALLOCATE_INFO = 1000072002
ST_IMPORT_MEMORY_FD_INFO_KHR = 1000074000
ST_MEMORY_GET_FD_INFO_KHR = 1000074002
ST_MEMORY_DEDICATED_ALLOCATE_INFO = 1000127001
ST_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2 = 1000059006
ST_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT = 1000237000

#: VkExternalMemoryHandleTypeFlagBits: a POSIX fd only the same driver and device can import
HANDLE_OPAQUE_FD = 0x1
QUEUE_SPARSE_BINDING = 0x8
BUFFER_CREATE_SPARSE_BINDING = 0x1
#: VkPhysicalDeviceFeatures: 55 VkBool32s; sparseBinding is the 45th
FEATURE_COUNT = 55
FEATURE_SPARSE_BINDING = 44
#: VkExternalMemoryFeatureFlagBits
EXTERNAL_DEDICATED_ONLY = 0x1
EXTERNAL_EXPORTABLE = 0x2
EXTERNAL_IMPORTABLE = 0x4
EXT_MEMORY_FD = "VK_KHR_external_memory_fd"
EXT_MEMORY_BUDGET = "VK_EXT_memory_budget"

DEVICE_LOCAL = 0x1
HOST_VISIBLE = 0x2
HOST_COHERENT = 0x4
HOST_CACHED = 0x8
QUEUE_GRAPHICS = 0x1
QUEUE_COMPUTE = 0x2
QUEUE_TRANSFER = 0x4
POOL_RESET_COMMAND_BUFFER = 0x2
USAGE_TRANSFER_SRC = 0x1
USAGE_TRANSFER_DST = 0x2
USAGE_STORAGE = 0x20
WHOLE_SIZE = (1 << 64) - 1
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

GIB = 1 << 30


class VulkanUnavailableError(Exception):
    """No Vulkan loader, no device, or a call failed: the message says which."""


class AppInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("pApplicationName", c_char_p),
        ("applicationVersion", c_uint32),
        ("pEngineName", c_char_p),
        ("engineVersion", c_uint32),
        ("apiVersion", c_uint32),
    ]


class InstanceCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("pApplicationInfo", POINTER(AppInfo)),
        ("enabledLayerCount", c_uint32),
        ("ppEnabledLayerNames", c_void_p),
        ("enabledExtensionCount", c_uint32),
        ("ppEnabledExtensionNames", c_void_p),
    ]


class MemoryTypeStruct(Structure):
    _fields_ = [("propertyFlags", c_uint32), ("heapIndex", c_uint32)]


class MemoryHeap(Structure):
    _fields_ = [("size", c_uint64), ("flags", c_uint32)]


class MemoryProperties(Structure):
    _fields_ = [
        ("memoryTypeCount", c_uint32),
        ("memoryTypes", MemoryTypeStruct * 32),
        ("memoryHeapCount", c_uint32),
        ("memoryHeaps", MemoryHeap * 16),
    ]


class QueueFamily(Structure):
    _fields_ = [
        ("queueFlags", c_uint32),
        ("queueCount", c_uint32),
        ("timestampValidBits", c_uint32),
        ("minImageTransferGranularity", c_uint32 * 3),
    ]


class Maintenance3(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("maxPerSetDescriptors", c_uint32),
        ("maxMemoryAllocationSize", c_uint64),
    ]


class PciBusInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("pciDomain", c_uint32),
        ("pciBus", c_uint32),
        ("pciDevice", c_uint32),
        ("pciFunction", c_uint32),
    ]


class Properties2(Structure):
    # VkPhysicalDeviceProperties is 824 bytes on LP64; a larger block is harmless (the driver writes
    # the struct it knows, then follows pNext)
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("properties", ctypes.c_ubyte * 1024)]


class ExtensionProperties(Structure):
    _fields_ = [("extensionName", c_char * 256), ("specVersion", c_uint32)]


class QueueCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("queueFamilyIndex", c_uint32),
        ("queueCount", c_uint32),
        ("pQueuePriorities", POINTER(c_float)),
    ]


class DeviceCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("queueCreateInfoCount", c_uint32),
        ("pQueueCreateInfos", POINTER(QueueCreateInfo)),
        ("enabledLayerCount", c_uint32),
        ("ppEnabledLayerNames", c_void_p),
        ("enabledExtensionCount", c_uint32),
        ("ppEnabledExtensionNames", c_void_p),
        ("pEnabledFeatures", c_void_p),
    ]


class BufferCreateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("size", c_uint64),
        ("usage", c_uint32),
        ("sharingMode", c_uint32),
        ("queueFamilyIndexCount", c_uint32),
        ("pQueueFamilyIndices", c_void_p),
    ]


class MemoryRequirements(Structure):
    _fields_ = [("size", c_uint64), ("alignment", c_uint64), ("memoryTypeBits", c_uint32)]


class MemoryAllocateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("allocationSize", c_uint64),
        ("memoryTypeIndex", c_uint32),
    ]


class CommandPoolCreateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32), ("queueFamilyIndex", c_uint32)]


class CommandBufferAllocateInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("commandPool", c_uint64),
        ("level", c_uint32),
        ("commandBufferCount", c_uint32),
    ]


class CommandBufferBeginInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32), ("pInheritanceInfo", c_void_p)]


class BufferCopy(Structure):
    _fields_ = [("srcOffset", c_uint64), ("dstOffset", c_uint64), ("size", c_uint64)]


class SubmitInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("waitSemaphoreCount", c_uint32),
        ("pWaitSemaphores", c_void_p),
        ("pWaitDstStageMask", c_void_p),
        ("commandBufferCount", c_uint32),
        ("pCommandBuffers", POINTER(c_void_p)),
        ("signalSemaphoreCount", c_uint32),
        ("pSignalSemaphores", c_void_p),
    ]


class FenceCreateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("flags", c_uint32)]


class PhysicalDeviceIdProperties(Structure):
    """VkPhysicalDeviceIDProperties: an opaque fd imports only on a device of the same device and
    driver UUIDs as the one that exported it."""

    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("deviceUUID", ctypes.c_ubyte * 16),
        ("driverUUID", ctypes.c_ubyte * 16),
        ("deviceLUID", ctypes.c_ubyte * 8),
        ("deviceNodeMask", c_uint32),
        ("deviceLUIDValid", c_uint32),
    ]


class PhysicalDeviceExternalBufferInfo(Structure):
    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("flags", c_uint32),
        ("usage", c_uint32),
        ("handleType", c_uint32),
    ]


class ExternalBufferProperties(Structure):
    """VkExternalBufferProperties with its VkExternalMemoryProperties inline."""

    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("externalMemoryFeatures", c_uint32),
        ("exportFromImportedHandleTypes", c_uint32),
        ("compatibleHandleTypes", c_uint32),
    ]


class ExternalMemoryBufferCreateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("handleTypes", c_uint32)]


class ExportMemoryAllocateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("handleTypes", c_uint32)]


class ImportMemoryFdInfo(Structure):
    """VkImportMemoryFdInfoKHR: a successful import owns ``fd`` (the caller passes a dup)."""

    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("handleType", c_uint32), ("fd", ctypes.c_int)]


class MemoryGetFdInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("memory", c_uint64), ("handleType", c_uint32)]


class MemoryDedicatedAllocateInfo(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("image", c_uint64), ("buffer", c_uint64)]


class MemoryProperties2(Structure):
    _fields_ = [("sType", c_uint32), ("pNext", c_void_p), ("memoryProperties", MemoryProperties)]


class MemoryBudgetProperties(Structure):
    """VkPhysicalDeviceMemoryBudgetPropertiesEXT (VK_EXT_memory_budget)."""

    _fields_ = [
        ("sType", c_uint32),
        ("pNext", c_void_p),
        ("heapBudget", c_uint64 * 16),
        ("heapUsage", c_uint64 * 16),
    ]


#: vkGetMemoryFdKHR(device, const VkMemoryGetFdInfoKHR*, int*)
GET_MEMORY_FD = ctypes.CFUNCTYPE(ctypes.c_int, c_void_p, c_void_p, ctypes.POINTER(ctypes.c_int))


def load_loader() -> ctypes.CDLL:
    for name in ("libvulkan.so.1", ctypes.util.find_library("vulkan")):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise VulkanUnavailableError("no Vulkan loader (libvulkan.so.1) on this system")


class Vk:
    """The few core entry points, bound with their signatures (the loader exports all of 1.0/1.1)."""

    _SIGS: ClassVar[dict[str, tuple[Any, list[Any]]]] = {
        "vkCreateInstance": (ctypes.c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkDestroyInstance": (None, [c_void_p, c_void_p]),
        "vkEnumeratePhysicalDevices": (ctypes.c_int, [c_void_p, POINTER(c_uint32), c_void_p]),
        "vkGetPhysicalDeviceProperties2": (None, [c_void_p, c_void_p]),
        "vkGetPhysicalDeviceMemoryProperties": (None, [c_void_p, c_void_p]),
        "vkGetPhysicalDeviceQueueFamilyProperties": (None, [c_void_p, POINTER(c_uint32), c_void_p]),
        "vkEnumerateDeviceExtensionProperties": (
            ctypes.c_int,
            [c_void_p, c_char_p, POINTER(c_uint32), c_void_p],
        ),
        "vkCreateDevice": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkDestroyDevice": (None, [c_void_p, c_void_p]),
        "vkGetDeviceQueue": (None, [c_void_p, c_uint32, c_uint32, POINTER(c_void_p)]),
        "vkCreateBuffer": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyBuffer": (None, [c_void_p, c_uint64, c_void_p]),
        "vkGetBufferMemoryRequirements": (None, [c_void_p, c_uint64, c_void_p]),
        "vkAllocateMemory": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkFreeMemory": (None, [c_void_p, c_uint64, c_void_p]),
        "vkBindBufferMemory": (ctypes.c_int, [c_void_p, c_uint64, c_uint64, c_uint64]),
        "vkMapMemory": (ctypes.c_int, [c_void_p, c_uint64, c_uint64, c_uint64, c_uint32, POINTER(c_void_p)]),
        "vkUnmapMemory": (None, [c_void_p, c_uint64]),
        "vkCreateCommandPool": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyCommandPool": (None, [c_void_p, c_uint64, c_void_p]),
        "vkAllocateCommandBuffers": (ctypes.c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
        "vkBeginCommandBuffer": (ctypes.c_int, [c_void_p, c_void_p]),
        "vkEndCommandBuffer": (ctypes.c_int, [c_void_p]),
        "vkCmdCopyBuffer": (None, [c_void_p, c_uint64, c_uint64, c_uint32, c_void_p]),
        "vkCreateFence": (ctypes.c_int, [c_void_p, c_void_p, c_void_p, POINTER(c_uint64)]),
        "vkDestroyFence": (None, [c_void_p, c_uint64, c_void_p]),
        "vkResetFences": (ctypes.c_int, [c_void_p, c_uint32, POINTER(c_uint64)]),
        "vkWaitForFences": (ctypes.c_int, [c_void_p, c_uint32, POINTER(c_uint64), c_uint32, c_uint64]),
        "vkQueueSubmit": (ctypes.c_int, [c_void_p, c_uint32, c_void_p, c_uint64]),
        "vkDeviceWaitIdle": (ctypes.c_int, [c_void_p]),
        "vkGetDeviceProcAddr": (c_void_p, [c_void_p, c_char_p]),
        "vkGetPhysicalDeviceExternalBufferProperties": (None, [c_void_p, c_void_p, c_void_p]),
        "vkGetPhysicalDeviceMemoryProperties2": (None, [c_void_p, c_void_p]),
        "vkGetPhysicalDeviceFeatures": (None, [c_void_p, c_void_p]),
    }

    def __init__(self) -> None:
        lib = load_loader()
        for name, (res, args) in self._SIGS.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise VulkanUnavailableError(
                    f"the Vulkan loader does not export {name} (Vulkan 1.1 needed)"
                ) from exc
            fn.restype = res
            fn.argtypes = args
            setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:  # typed access to the bound functions
        raise AttributeError(name)

    def device_function(self, device: int, name: str, prototype: Any) -> Any:
        """An extension's entry point on ``device`` (``vkGetDeviceProcAddr``), cast to
        ``prototype`` (a ctypes CFUNCTYPE); raises VulkanUnavailableError when the device has none
        (the extension was not enabled)."""
        address = self.vkGetDeviceProcAddr(device, name.encode())
        if not address:
            raise VulkanUnavailableError(f"the device has no {name} (its extension is not enabled)")
        return prototype(address)

    def check(self, rc: int, what: str) -> None:
        if rc != VK_SUCCESS:
            raise VulkanUnavailableError(f"{what} failed (VkResult {rc})")


def instance(app_name: bytes) -> tuple[Vk, c_void_p]:
    vk = Vk()
    app = AppInfo(ST_APPLICATION_INFO, None, app_name, 1, b"timeshare", 1, VK_API_VERSION_1_1)
    ici = InstanceCreateInfo(ST_INSTANCE_CREATE_INFO, None, 0, ctypes.pointer(app), 0, None, 0, None)
    inst = c_void_p()
    vk.check(vk.vkCreateInstance(byref(ici), None, byref(inst)), "vkCreateInstance")
    return vk, inst
