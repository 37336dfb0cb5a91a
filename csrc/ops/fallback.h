// Native because: the generic fallback is the per-operator hot path (see fallback.cpp).
#pragma once

#include "adapters/generator.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace openreg {

// The generic fallback itself, for boxed kernels that do something first and then let the
// fallback run the operator (routes/op_fallback.cpp).
void generic_fallback(const c10::OperatorHandle& op, c10::Stack* stack);

// Registers the fallback for the aten operators whose PrivateUse1 slot holds a composite kernel
// although a CPU kernel exists (see fallback.cpp). Called once when torch_openreg._C loads.
void route_composites_to_fallback();

// ---- Shared by the dense fallback (fallback.cpp) and the layout fallback (layouts.cpp) ----------

// What a fallback needs to know about an operator's arguments, computed once per operator.
enum class ArgKind : uint8_t { Other, Tensor, TensorList, OptionalTensorList, Generator, Device };
struct ArgSummary {
  std::vector<ArgKind> kinds;
  std::vector<bool> writes;  // written in place (an alias annotation with `!`)
  bool any_writes = false;
  bool has_generator = false;
  // Index operators accept CPU index tensors with device tensors, as on CUDA.
  bool cpu_tensors_allowed = false;
  // Copy-on-write (ops/cow.h): batch norm's running statistics (at running_stats and the next
  // argument), written when the argument at `training` is true (-1: always), whatever the schema
  // says. -1: none.
  int running_stats = -1;
  int training = -1;
};
const ArgSummary& arg_summary(const c10::OperatorHandle& op);

// Calls f(tensor) for every tensor an argument of the given kind holds (undefined ones too).
template <typename F>
void for_each_tensor(const c10::IValue& v, ArgKind kind, F&& f) {
  if (kind == ArgKind::Tensor && v.isTensor()) {
    f(v.toTensor());
  } else if (kind == ArgKind::TensorList && v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (kind == ArgKind::OptionalTensorList && v.isList()) {
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) f(e.toTensor());
  }
}

// Turns the operator's arguments on the stack, from `first` on, into what its CPU kernel takes:
// each tensor t into to_cpu(t); a generator (the one passed as generator=, or None for the
// device's default) into the CPU generator inside the openreg one, since CPU kernels draw only
// from CPU generators; device=openreg into device=cpu.
template <typename ToCpu>
void arguments_to_cpu(c10::Stack& stack, size_t first, const ArgSummary& s, int device,
                      ToCpu&& to_cpu) {
  for (size_t i = 0; i < s.kinds.size(); ++i) {
    c10::IValue& v = stack[first + i];
    switch (s.kinds[i]) {
      case ArgKind::Tensor:
        if (v.isTensor()) v = to_cpu(v.toTensor());
        break;
      case ArgKind::TensorList:
        if (v.isTensorList()) {
          auto list = v.toTensorList();
          c10::List<at::Tensor> cpu;
          cpu.reserve(list.size());
          for (const at::Tensor& t : list) cpu.push_back(to_cpu(t));
          v = std::move(cpu);
        }
        break;
      case ArgKind::OptionalTensorList:
        if (v.isList()) {
          c10::List<std::optional<at::Tensor>> cpu;
          for (const c10::IValue& e : v.toListRef())
            cpu.push_back(e.isTensor() ? std::optional<at::Tensor>(to_cpu(e.toTensor()))
                                       : std::nullopt);
          v = std::move(cpu);
        }
        break;
      // [docs:start FALLBACK_GENERATOR]
      case ArgKind::Generator: {
        // CPU kernels draw from a CPU generator: hand them the one inside the openreg generator
        // (the one passed as generator=, or the device's default generator for None).
        std::optional<at::Generator> gen;
        if (v.isGenerator()) gen = v.toGenerator();
        v = cpu_generator_for(gen, device);
        break;
      }
      // [docs:end FALLBACK_GENERATOR]
      case ArgKind::Device:
        if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1)
          v = c10::Device(c10::DeviceType::CPU);
        break;
      default:
        break;
    }
  }
}

// OPENREG_ERROR_CONTEXT=1 appends where a CPU kernel's error came from, "(while running aten::mm
// on openreg:0 with its CPU kernel)", with the layout for non-strided ones; by default the error
// stays the CPU's, unchanged (fallback.cpp).
void add_error_context(c10::Error& e, const c10::OperatorHandle& op, int device,
                       const char* layout = nullptr);

// ---- Shared by the unboxed routes (routes/unboxed.cpp, ops/layouts.cpp's LAYOUT_ROUTE) -----------
// Each is an at::_ops operator's kernel template; what it needs of the operator, found once.

// The operator's handle.
template <class Op>
const c10::OperatorHandle& op_handle() {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
  return handle;
}

// Which of its N arguments the operator writes (an alias annotation with `!`), read once from its
// schema: a per-call lookup of the fallback's summary (a hash table per thread) and a
// std::vector<bool> were 5% of what a tiny add costs more than on the CPU.
template <class Op, size_t N>
const std::array<bool, N>& written_args() {
  static const std::array<bool, N> writes = [] {
    const ArgSummary& s = arg_summary(op_handle<Op>());
    TORCH_INTERNAL_ASSERT(s.writes.size() == N, "openreg: ",
                          op_handle<Op>().schema().operator_name(),
                          ": schema and signature differ");
    std::array<bool, N> out{};
    for (size_t i = 0; i < N; ++i) out[i] = s.writes[i];
    return out;
  }();
  return writes;
}

// The name a kernel of the operator registers under, "add.Tensor" (kept for the process: the
// library keeps the pointer).
template <class Op>
const char* registration_name() {
  static const std::string* name = [] {
    auto* n = new std::string(std::string(Op::name).substr(6));  // without "aten::"
    if (Op::overload_name[0] != '\0') *n += std::string(".") + Op::overload_name;
    return n;
  }();
  return name->c_str();
}

}  // namespace openreg
