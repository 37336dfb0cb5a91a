// Native because: PyTorch accepts backend metadata serializers only as C++ functions
// (torch::jit::TensorBackendMetaRegistry), and the metadata lives on the C++ TensorImpl.
//
// Backend metadata: per-tensor information private to the backend (on real accelerators, for
// example, the internal layout a tensor's memory is kept in) that must survive torch.save /
// torch.load and torch._utils.get_tensor_metadata / set_tensor_metadata. PyTorch stores it on the
// TensorImpl as a c10::BackendMeta and, when a serializer pair is registered for the device type,
// adds it to the dict of flags it pickles next to each tensor (a dict of str -> bool, beside the
// "conj" and "neg" bits).
//
// openreg keeps the flags it is given, under any name the caller chooses, and gives them back:
// what a vendor would put here is its own layout information; openreg has none of its own, so it
// stores what the user sets. The flags follow the tensor's TensorImpl (shallow copies such as
// detach() keep them through BackendMeta::clone) and the pickled form.
#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>

#include <map>
#include <string>
#include <unordered_map>

namespace openreg {
namespace {

// [docs:start BACKEND_META]
struct OpenRegBackendMeta : c10::BackendMeta {
  std::map<std::string, bool> flags;

  c10::intrusive_ptr<c10::BackendMeta> clone(
      const c10::intrusive_ptr<c10::BackendMeta>& /*ptr*/) const override {
    auto copy = c10::make_intrusive<OpenRegBackendMeta>();
    copy->flags = flags;
    return copy;
  }
};

// Called by getTensorMetadata (torch.save, torch._utils.get_tensor_metadata).
void serialize_backend_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& out) {
  auto* meta = dynamic_cast<OpenRegBackendMeta*>(t.unsafeGetTensorImpl()->get_backend_meta());
  if (meta == nullptr) return;
  for (const auto& [name, value] : meta->flags) out[name] = value;
}

// Called by setTensorMetadata (torch.load, torch._utils.set_tensor_metadata) with the flags that
// are not PyTorch's own ("conj" and "neg" were consumed before).
void deserialize_backend_meta(const at::Tensor& t, std::unordered_map<std::string, bool>& in) {
  if (in.empty()) return;
  auto* impl = t.unsafeGetTensorImpl();
  auto meta = c10::make_intrusive<OpenRegBackendMeta>();
  if (auto* old = dynamic_cast<OpenRegBackendMeta*>(impl->get_backend_meta())) meta->flags = old->flags;
  for (const auto& [name, value] : in) meta->flags[name] = value;
  impl->set_backend_meta(meta);
}

struct RegisterBackendMeta {
  RegisterBackendMeta() {
    torch::jit::TensorBackendMetaRegistry(
        c10::DeviceType::PrivateUse1, &serialize_backend_meta, &deserialize_backend_meta);
  }
} register_backend_meta;
// [docs:end BACKEND_META]

}  // namespace
}  // namespace openreg
