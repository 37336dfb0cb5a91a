// Native because: torch's fork handler for device initialisation (pthread_atfork, in
// torch/csrc/utils/device_lazy_init.h) has no Python binding.
//
// Optional mechanism of minidev: refusing the device in a forked child (docs/device.md, "Fork").
// setup.py builds it as its own extension, minidev._fork; minidev/__init__.py imports it when it
// is there. Without it, a forked child can use the device and the core still passes every
// required check.
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/extension.h>

// [docs:start FORK]
// Device state (a driver context, worker threads) does not survive fork(). torch's own fork
// handler, registered on the first use of the device, marks a child forked after it "in bad
// fork" and makes torch call the device module's _lazy_init() again on the child's first device
// factory call (torch.ones(..., device=...)); _lazy_init raises there, as CUDA does.
constexpr auto kType = c10::DeviceType::PrivateUse1;

void lazy_init() {
  TORCH_CHECK(!torch::utils::is_device_in_bad_fork(kType),
              "Cannot re-initialize minidev in forked subprocess. To use minidev with "
              "multiprocessing, you must use the 'spawn' start method");
  torch::utils::register_fork_handler_for_device_init(kType);  // once; then every child is marked
}

// torch calls torch.minidev._lazy_init() before a device factory call until one succeeds, and
// torch.random asks torch.minidev._is_in_bad_fork() before it seeds the devices.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto device_module = py::module_::import("minidev");
  device_module.attr("_lazy_init") = py::cpp_function(&lazy_init);
  device_module.attr("_is_in_bad_fork") =
      py::cpp_function([] { return torch::utils::is_device_in_bad_fork(kType); });
}
// [docs:end FORK]
