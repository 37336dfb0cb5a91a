// Native because: PyTorch only accepts device generators as C++ c10::GeneratorImpl objects.
//
// An openreg generator owns a CPU (mt19937) generator: random kernels, which run on the CPU
// through the generic fallback, draw from it. Each device has its own default generator, so
// devices are independent and each is reproducible from its seed and state.
//
// Locks. Python's torch.Generator methods hold the openreg generator's `mutex_` while they call
// into it; CPU kernels hold the inner CPU generator's `mutex_` while they draw. Every method here
// that touches the inner generator takes the inner lock too, so seeding or saving the state from
// one thread while another draws never sees a half-written state. Which inner generator is in use
// may change (graphsafe_set_state); that pointer is guarded by `state_mutex_`, a leaf lock held
// for nothing but copying it.
#include "adapters/generator.h"

#include "runtime/device.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <vector>

namespace openreg {
namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;

// [docs:start GENERATOR_IMPL]
class OpenRegGeneratorImpl final : public c10::GeneratorImpl {
 public:
  OpenRegGeneratorImpl(c10::DeviceIndex device, at::Generator cpu)
      : c10::GeneratorImpl(c10::Device(kType, device),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(std::move(cpu)) {}
  OpenRegGeneratorImpl(c10::DeviceIndex device, uint64_t seed)
      : OpenRegGeneratorImpl(device, at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  void set_current_seed(uint64_t seed) override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  }
  uint64_t current_seed() const override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.current_seed();
  }
  uint64_t seed() override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.seed();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.unsafeGetGeneratorImpl()->set_state(new_state);  // checks dtype, device and size
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.unsafeGetGeneratorImpl()->get_state();
  }
  // The state is an mt19937 engine, not a (seed, offset) counter like CUDA's Philox: there is
  // no offset to read or set.
  void set_offset(uint64_t) override {
    TORCH_CHECK(false, "openreg generators are not counter-based (their state is an mt19937 "
                "engine): set_offset is not supported; save and restore the state with "
                "get_state/set_state instead");
  }
  uint64_t get_offset() const override {
    TORCH_CHECK(false, "openreg generators are not counter-based (their state is an mt19937 "
                "engine): get_offset is not supported; save and restore the state with "
                "get_state/set_state instead");
    return 0;
  }

  // Graph-safe state: a generator object that shares this generator's state (not a copy), and
  // switching this generator over to the state of another one. Random operators run between
  // graphsafe_set_state(other) and switching back advance `other`'s state only.
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override {
    return c10::make_intrusive<OpenRegGeneratorImpl>(device().index(), cpu());
  }
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) override {
    TORCH_CHECK(state, "graphsafe_set_state: expected a generator, got an undefined one");
    TORCH_CHECK_TYPE(state->device().type() == kType,
                     "graphsafe_set_state: expected an openreg generator, but got a ",
                     state->device().type(), " generator");
    TORCH_CHECK(state->device() == device(), "graphsafe_set_state: expected a generator of ",
                device(), ", but got one of ", state->device());
    at::Generator shared = static_cast<const OpenRegGeneratorImpl*>(state.get())->cpu();
    std::lock_guard<std::mutex> lock(state_mutex_);
    cpu_ = std::move(shared);
  }

  static c10::DeviceType device_type() { return kType; }

  // The CPU generator random kernels draw from.
  at::Generator cpu() const {
    std::lock_guard<std::mutex> lock(state_mutex_);
    return cpu_;
  }

 private:
  // clone_state(), copy.deepcopy of the state: an independent generator with the same state.
  OpenRegGeneratorImpl* clone_impl() const override {
    at::Generator g = cpu();
    std::lock_guard<std::mutex> lock(g.mutex());
    return new OpenRegGeneratorImpl(device().index(), g.clone());
  }

  mutable std::mutex state_mutex_;
  at::Generator cpu_;
};
// [docs:end GENERATOR_IMPL]

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

// [docs:start DEFAULT_GENERATORS]
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
// [docs:end DEFAULT_GENERATORS]

// [docs:start CPU_GENERATOR_FOR]
at::Generator cpu_generator_for(const std::optional<at::Generator>& gen, int device) {
  const at::Generator& g = (gen.has_value() && gen->defined()) ? *gen : default_generator(device);
  TORCH_CHECK(g.device().type() == kType, "Expected a 'openreg' device type for generator but "
              "found '", g.device().type(), "' (an operator on openreg:", device,
              " draws from an openreg generator)");
  TORCH_CHECK(g.device().index() == device, "Expected a generator of openreg:", device,
              " for an operator on openreg:", device, ", but got a generator of openreg:",
              static_cast<int>(g.device().index()));
  return static_cast<OpenRegGeneratorImpl*>(g.unsafeGetGeneratorImpl())->cpu();
}
// [docs:end CPU_GENERATOR_FOR]

}  // namespace openreg
