// Native because: PyTorch only accepts device generators as C++ c10::GeneratorImpl objects.
//
// An openreg generator owns a CPU (mt19937) generator: random kernels, which run on the CPU
// through the generic fallback, draw from it. Each device has its own default generator, so
// devices are independent and each is reproducible from its seed and state.
#include "adapters/generator.h"

#include "runtime/device.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <vector>

namespace openreg {
namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;

class OpenRegGeneratorImpl final : public c10::GeneratorImpl {
 public:
  OpenRegGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
      : c10::GeneratorImpl(c10::Device(kType, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  void set_current_seed(uint64_t seed) override { cpu_.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu_.set_offset(offset); }
  uint64_t get_offset() const override { return cpu_.get_offset(); }
  uint64_t current_seed() const override { return cpu_.current_seed(); }
  uint64_t seed() override { return cpu_.seed(); }
  void set_state(const c10::TensorImpl& new_state) override {
    cpu_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu_.unsafeGetGeneratorImpl()->get_state();
  }
  static c10::DeviceType device_type() { return kType; }

  const at::Generator& cpu() const { return cpu_; }

 private:
  OpenRegGeneratorImpl* clone_impl() const override {
    auto* copy = new OpenRegGeneratorImpl(device().index(), 0);
    copy->cpu_ = cpu_.clone();
    return copy;
  }

  at::Generator cpu_;
};

std::vector<at::Generator>& defaults() {
  static auto* gens = [] {
    auto* v = new std::vector<at::Generator>();  // leaked: generators live until exit
    for (int d = 0; d < device_count(); ++d)
      v->push_back(at::make_generator<OpenRegGeneratorImpl>(
          static_cast<c10::DeviceIndex>(d), c10::default_rng_seed_val));
    return v;
  }();
  return *gens;
}

}  // namespace

const at::Generator& default_generator(int device) {
  if (device < 0) device = current_device();
  check_device(device);
  return defaults()[device];
}

at::Generator new_generator(int device) {
  if (device < 0) device = current_device();
  check_device(device);
  return at::make_generator<OpenRegGeneratorImpl>(static_cast<c10::DeviceIndex>(device),
                                                  c10::default_rng_seed_val);
}

at::Generator cpu_generator_for(const std::optional<at::Generator>& gen, int device) {
  const at::Generator& g = (gen.has_value() && gen->defined()) ? *gen : default_generator(device);
  TORCH_CHECK(g.device().type() == kType,
              "Expected an openreg generator for an operator on openreg:", device, ", but got a ",
              g.device().type(), " generator");
  TORCH_CHECK(g.device().index() == device,
              "Expected a generator of openreg:", device, ", but got one of openreg:",
              static_cast<int>(g.device().index()));
  return static_cast<OpenRegGeneratorImpl*>(g.unsafeGetGeneratorImpl())->cpu();
}

}  // namespace openreg
