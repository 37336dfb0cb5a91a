// Native because: c10d's ProcessGroup routes a device's tensors to a c10d::Backend, a C++ class
// with no Python trampoline (a Python ProcessGroup replaces the whole group: docs/distributed.md).
//
// Optional mechanism of minidev: torch.distributed on minidev tensors (docs/distributed.md).
// setup.py builds it as its own extension, minidev._distributed; minidev/__init__.py imports it
// when it is there. Without it, collectives on minidev tensors raise and the core still passes
// every required check.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/extension.h>

namespace {

// [docs:start DISTRIBUTED]
// The backend "minidev": each collective hands torch's gloo backend CPU tensors that alias the
// device tensors (minidev's device memory is host memory), so gloo communicates between the
// processes and writes the results into device memory in place. A real device hands its own
// communication library the device pointers here.
at::Tensor on_host(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

std::vector<at::Tensor> on_host(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> host;
  for (const auto& t : tensors) host.push_back(on_host(t));
  return host;
}

struct MinidevBackend final : c10d::Backend {
  c10::intrusive_ptr<c10d::Backend> gloo;

  explicit MinidevBackend(c10::intrusive_ptr<c10d::Backend> gloo)
      : Backend(gloo->getRank(), gloo->getSize()), gloo(std::move(gloo)) {}
  const std::string getBackendName() const override { return "minidev"; }

  // The Work gloo returns completes when the result is in the (aliased) device memory.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto host = on_host(tensors);
    return gloo->allreduce(host, opts);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto host = on_host(tensors);
    return gloo->broadcast(host, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    std::vector<std::vector<at::Tensor>> host_outputs;
    for (const auto& out : outputs) host_outputs.push_back(on_host(out));
    auto host_inputs = on_host(inputs);
    return gloo->allgather(host_outputs, host_inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    auto host = on_host(tensors);
    return gloo->send(host, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    auto host = on_host(tensors);
    return gloo->recv(host, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return gloo->barrier(opts);
  }
};
// [docs:end DISTRIBUTED]

}  // namespace

// [docs:start DISTRIBUTED_REGISTRATION]
// The backend as a Python type (a subclass of torch's Backend, torch/csrc/utils/pybind.h gives
// the intrusive_ptr holder), and its creator registered for the device: init_process_group()
// then uses "minidev" for minidev tensors and gloo for CPU tensors.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<MinidevBackend, c10d::Backend, c10::intrusive_ptr<MinidevBackend>>(m, "Backend")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>(), py::arg("gloo"));
  auto dist = py::module_::import("torch.distributed");
  py::object gloo = dist.attr("ProcessGroupGloo"), backend = m.attr("Backend");
  auto create = [gloo, backend](py::object store, int rank, int size, py::object timeout) {
    return backend(gloo(store, rank, size, timeout));
  };
  std::vector<std::string> devices{"minidev"};
  dist.attr("Backend").attr("register_backend")("minidev", py::cpp_function(create),
                                                py::arg("devices") = devices);
}
// [docs:end DISTRIBUTED_REGISTRATION]
