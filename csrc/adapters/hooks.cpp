// Native because: PyTorch only accepts the PrivateUse1 hooks as a C++ PrivateUse1HooksInterface
// (at::RegisterPrivateUse1HooksInterface).
//
// The hooks answer device-generic questions asked by PyTorch itself: is the backend available,
// how many devices, which device owns a pointer, default generators, pinned memory, lazy init,
// and storage resizing (untyped_storage().resize_()).
#include "adapters/device_allocator.h"
#include "adapters/generator.h"
#include "adapters/host_allocator.h"
#include "runtime/device.h"
#include "runtime/memory.h"
#include "runtime/stream.h"
#include "ops/minimal_ops.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>


namespace openreg {
namespace {

// [docs:start HOOKS]
struct OpenRegHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  void init() const override { lazy_init(); }
  bool hasPrimaryContext(c10::DeviceIndex device) const override {
    check_device(device);
    return is_initialized();
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(current_device());
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    auto old = getCurrentDevice();
    set_current_device(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return new_generator(device);
  }

  c10::Device getDeviceFromPtr(void* data) const override {
    int device = device_of_pointer(data);
    TORCH_CHECK(device >= 0, "openreg: pointer ", data, " is not openreg device memory");
    return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  }

  bool isPinnedPtr(const void* data) const override { return is_pinned_pointer(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return host_allocator(); }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), new_bytes);
  }
};

struct Registration {
  Registration() { at::RegisterPrivateUse1HooksInterface(new OpenRegHooks()); }
} g_registration;
// [docs:end HOOKS]

}  // namespace
}  // namespace openreg
