// Native because: PyTorch only accepts a DeviceGuardImplInterface registered from C++
// (C10_REGISTER_GUARD_IMPL); it is called on every operator that guards a device.
//
// The guard is how device-generic code (DeviceGuard, StreamGuard, autograd, torch.Stream and
// torch.Event, torch.accelerator) reaches the openreg runtime: current device, streams, events.
#include "runtime/faults.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "adapters/autograd.h"
#include "adapters/device_allocator.h"
#include "adapters/gpu_trace.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace openreg {
namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;

c10::Stream to_c10(int device, int64_t id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, static_cast<c10::DeviceIndex>(device)),
                     static_cast<c10::StreamId>(id));
}

Stream* from_c10(const c10::Stream& s) { return get_stream(s.device_index(), s.id()); }

// [docs:start GUARD_NO_INDEX]
// A device without an index (torch.Stream(device="openreg")) means the current device, as
// everywhere in PyTorch (CUDA's stream pool treats -1 so).
int index_of(c10::Device d) { return d.has_index() ? d.index() : current_device(); }
// [docs:end GUARD_NO_INDEX]

EventPtr& as_event(void* handle) { return *static_cast<EventPtr*>(handle); }

struct OpenRegGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "openreg guard got a ", d.type(), " device");
    auto old = getDevice();
    if (old.index() != d.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(kType, static_cast<c10::DeviceIndex>(current_device()));
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType, "openreg guard got a ", d.type(), " device");
    set_current_device(d.index());
    note_current_device_set(d.index());  // the autograd engine's worker threads start here
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) set_current_device(d.index());
  }

  // [docs:start GUARD_STREAMS]
  c10::Stream getStream(c10::Device d) const override {
    const int device = index_of(d);
    check_device(device);
    return to_c10(device, current_stream_id(device));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    const int device = index_of(d);
    check_device(device);
    return to_c10(device, 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    const int device = index_of(d);
    return to_c10(device,
                  stream_from_pool(device, high_priority ? kHighestPriority : kLowestPriority));
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    const int device = index_of(d);
    return to_c10(device, stream_from_pool(device, priority));
  }
  void* getStreamNativeHandle(const c10::Stream s) const override { return from_c10(s); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    set_current_stream_id(s.device_index(), s.id());
    return old;
  }
  // [docs:end GUARD_STREAMS]

  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }

  // [docs:start GUARD_CAPABILITY]
  // torch.accelerator.get_device_capability(): the dtypes a tensor of the device can have and
  // be converted between. Every dtype of the CPU (the device runs CPU kernels on its memory)
  // except the quantized ones: a quantized tensor has its own dispatch key (QuantizedPrivateUse1)
  // and openreg registers no kernel for it, so not even empty() works.
  c10::DeviceCapability getDeviceCapability(c10::Device d) const override {
    check_device(index_of(d));
    c10::DeviceCapability cap;  // all dtypes
    for (auto q : {c10::kIndex_QInt8, c10::kIndex_QUInt8, c10::kIndex_QInt32,
                   c10::kIndex_QUInt4x2, c10::kIndex_QUInt2x4})
      cap.capability_data.capability_bits &= ~(uint64_t(1) << q);
    return cap;
  }
  // [docs:end GUARD_CAPABILITY]

  // [docs:start GUARD_EVENTS]
  // Events: the opaque handle is a heap-allocated shared pointer to the runtime event, so that
  // work queued on a stream can keep the event alive after PyTorch destroys its handle.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "Event device index ", device_index, " does not match recording stream's device "
                "index ", stream.device_index(), ".");
    if (*event == nullptr)
      *event = new EventPtr(event_create(stream.device_index(),
                                         flag == c10::EventFlag::BACKEND_DEFAULT));
    event_record(as_event(*event), from_c10(stream));
    gpu_trace::event_record(*event, stream.device_index(), stream.id());
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;
    event_block(as_event(event), from_c10(stream));
    gpu_trace::event_wait(event, stream.device_index(), stream.id());
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    check_device_fault(event_device(as_event(event)));  // runtime/faults.h
    return event_query(as_event(event));
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    event_synchronize(as_event(event));
    check_device_fault(event_device(as_event(event)));
    gpu_trace::event_synchronization(event);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    if (event != nullptr) gpu_trace::event_deletion(event);
    delete static_cast<EventPtr*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK_VALUE(start && end, "openreg: both events must be recorded before measuring "
                                    "elapsed time");
    return event_elapsed_ms(as_event(start), as_event(end));
  }
  // [docs:end GUARD_EVENTS]

  // [docs:start GUARD_SYNC]
  bool queryStream(const c10::Stream& s) const override { return stream_query(from_c10(s)); }
  // [docs:start GUARD_IS_CAPTURING]
  bool isStreamCapturing(const c10::Stream& s) const override {
    return stream_capture(from_c10(s)) != nullptr;
  }
  // [docs:end GUARD_IS_CAPTURING]
  void synchronizeStream(const c10::Stream& s) const override {
    stream_synchronize(from_c10(s));
    gpu_trace::stream_synchronization(s.device_index(), s.id());
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    const int device = device_index < 0 ? current_device() : device_index;
    device_synchronize(device);
    gpu_trace::device_synchronization(device);
  }
  // [docs:end GUARD_SYNC]
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const c10::Stream& s) const override {
    device_allocator()->recordStream(ptr, s);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, OpenRegGuardImpl);

}  // namespace
}  // namespace openreg
