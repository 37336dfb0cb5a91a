// Native because: the Python extension module torch_openreg._C, exposing the native runtime to
// torch_openreg/openreg (the torch.openreg device module). Grouped by mechanism.
#include "adapters/autograd.h"
#include "adapters/distributed.h"
#include "adapters/device_allocator.h"
#include "adapters/generator.h"
#include "adapters/host_allocator.h"
#include "ops/fallback.h"
#include "routes/call_counter.h"
#include "routes/op_fallback.h"
#include "runtime/device.h"
#include "runtime/stream.h"

#include <torch/csrc/Generator.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native core of torch_openreg: the simulated device runtime and its PyTorch adapters";

  // ---- operators (ops/fallback.cpp): after every static registration of the process
  openreg::route_composites_to_fallback();

  // ---- operator routes (routes/): per-route call counters, for tests; sync debug mode
  m.def("_route_calls", [](const std::string& route) { return openreg::call_counter(route).load(); });
  m.def("_set_sync_debug_mode", &openreg::set_sync_debug_mode);
  m.def("_get_sync_debug_mode", &openreg::get_sync_debug_mode);

  // ---- device (runtime/device.cpp)
  m.def("_device_count", &openreg::device_count);
  m.def("_current_device", &openreg::current_device);
  m.def("_set_device", &openreg::set_current_device);
  m.def("_init", &openreg::lazy_init);
  m.def("_is_initialized", &openreg::is_initialized);
  m.def("_is_in_bad_fork", &openreg::in_bad_fork);
  m.def("_device_capacity", &openreg::device_capacity);
  m.def("_get_device_properties", [](int device) {
    auto p = openreg::device_properties(device);
    return py::make_tuple(p.name, p.total_memory, p.major, p.minor, p.multi_processor_count);
  });

  // ---- streams (runtime/stream.cpp); streams themselves are torch.Stream objects
  m.def("_synchronize", [](int device) {
    py::gil_scoped_release no_gil;
    openreg::device_synchronize(device);
  });
  m.def("_synchronize_all", [] {
    py::gil_scoped_release no_gil;
    openreg::synchronize_all();
  });
  m.def("_stream_priority", &openreg::stream_priority);
  m.def("_stream_priority_range",
        [] { return py::make_tuple(openreg::kLowestPriority, openreg::kHighestPriority); });
  m.def("_get_copy_timing", [] {
    auto t = openreg::copy_timing();
    return py::make_tuple(t.latency_us, t.bandwidth_gbps);
  });
  m.def("_set_copy_timing", [](double latency_us, double bandwidth_gbps) {
    openreg::set_copy_timing({latency_us, bandwidth_gbps});
  });
  m.def("_stream_inject_error", [](int device, int64_t stream_id, const std::string& message) {
    openreg::stream_inject_error(openreg::get_stream(device, stream_id), message);
  });
  py::class_<openreg::StreamHold, std::shared_ptr<openreg::StreamHold>>(m, "_StreamHold");
  m.def("_stream_hold", [](int device, int64_t stream_id, double timeout_s) {
    return openreg::stream_hold(openreg::get_stream(device, stream_id), timeout_s);
  });
  m.def("_stream_release", &openreg::stream_release);
  m.def("_drain_at_exit", [] {
    py::gil_scoped_release no_gil;
    openreg::drain_at_exit();
  });

  // ---- autograd (adapters/autograd.cpp)
  m.def("_release_autograd_graphs", [] {
    py::gil_scoped_release no_gil;
    openreg::release_autograd_graphs();
  });

  // ---- memory (adapters/device_allocator.cpp); statistics go through torch.accelerator
  m.def("_set_memory_fraction", &openreg::set_memory_fraction);

  // ---- pinned host memory (adapters/host_allocator.cpp)
  m.def("_host_memory_stats", [] {
    at::HostStats s = openreg::host_allocator()->get_stats();
    auto stat = [](const c10::CachingAllocator::Stat& st) {
      py::dict d;
      d["current"] = st.current;
      d["peak"] = st.peak;
      d["allocated"] = st.allocated;
      d["freed"] = st.freed;
      return d;
    };
    auto duration = [](const c10::CachingAllocator::DurationStat& st) {
      py::dict d;
      d["total"] = st.total;
      d["max"] = st.max;
      d["min"] = st.min;
      d["count"] = st.count;
      d["avg"] = st.count == 0 ? 0 : st.total / st.count;
      return d;
    };
    py::dict result;
    result["allocations"] = stat(s.allocations);
    result["allocated_bytes"] = stat(s.allocated_bytes);
    result["active_requests"] = stat(s.active_requests);
    result["active_bytes"] = stat(s.active_bytes);
    result["num_host_alloc"] = s.num_host_alloc;
    result["num_host_free"] = s.num_host_free;
    result["host_alloc_time"] = duration(s.host_alloc_time);
    result["host_free_time"] = duration(s.host_free_time);
    return result;
  });
  m.def("_host_reset_accumulated_stats", [] { openreg::host_allocator()->reset_accumulated_stats(); });
  m.def("_host_reset_peak_stats", [] { openreg::host_allocator()->reset_peak_stats(); });
  m.def("_is_pinned_pointer", [](uintptr_t ptr) {
    return openreg::is_pinned_pointer(reinterpret_cast<void*>(ptr));
  });

  // ---- distributed (adapters/distributed.cpp): the occl c10d backend over a gloo backend
  m.def("_occl_backend", &openreg::make_occl_backend);

  // ---- random (adapters/generator.cpp)
  m.def("_default_generator", [](int device) {
    return py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(openreg::default_generator(device)));
  });
}
