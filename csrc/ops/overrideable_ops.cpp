// Native because: PyTorch only accepts these kernels as C++ registrations (and the SDPA backend
// choice as a C++ DispatchStub), and they sit on the training hot path (RNN cells run once per
// time step).
//
// Operators that ATen calls only for accelerators. Some composite ATen functions check "is the
// device the CPU?" and, for any other device, call kernels that have no CPU implementation:
//   - convolution: `_convolution` selects ConvBackend::Overrideable for an out-of-tree device and
//     calls convolution_overrideable / convolution_backward_overrideable;
//   - RNN cells (LSTM, GRU): the cell calls _thnn_fused_lstm_cell / _thnn_fused_gru_cell on CUDA,
//     XPU and PrivateUse1; autograd calls their backward kernels;
//   - scaled_dot_product_attention asks the device's _fused_sdp_choice_stub which backend to run,
//     and the "overrideable" backend is _scaled_dot_product_fused_attention_overrideable;
//   - dropout calls native_dropout on accelerators; its CPU kernel would draw from the CPU
//     generator instead of the device's.
// The generic fallback runs CPU kernels, so it cannot serve them: openreg implements each one
// here, as a real backend would, on the device memory itself (HostKernel, ops/cpu_kernel.h).
#include "adapters/graph.h"
#include "adapters/generator.h"
#include "ops/cpu_kernel.h"
#include "routes/call_counter.h"
#include "runtime/device.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <mutex>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// The device of an operator: every defined tensor must be on the same openreg device (the
// dispatcher picks the openreg kernel as soon as one argument is an openreg tensor).
int op_device(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  int device = -1;
  for (const at::Tensor* t : tensors) {
    if (!t->defined() || t->device().type() != kOpenReg) continue;
    const int index = t->device().index();
    if (device < 0) device = index;
    TORCH_CHECK(index == device, "Expected all tensors to be on the same device, but found at "
                "least two devices, openreg:", device, " and openreg:", index, "! (in ", op, ")");
  }
  TORCH_CHECK(device >= 0, op, ": expected openreg tensors");
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(!t->defined() || t->device().type() == kOpenReg,
                "Expected all tensors to be on the same device, but found at least two devices, "
                "openreg:", device, " and ", t->device(), "! (in ", op, ")");
  check_device(device);
  return device;
}

std::optional<at::Tensor> alias_optional(HostKernel& k, const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return k.alias(*t);
}

// Rows of a [rows, cols] loop, split across threads only when the work is large enough.
template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, f);
}

// ---------------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------------

// [docs:start CONVOLUTION_LAYOUT]
// The layouts of the results are the CPU kernel's: the kernels below return what the CPU's
// convolution returns, and where a layout must be known without running the kernel (graph
// capture), it is predicted as FakeTensor predicts the CPU's (torch/_subclasses/fake_impls.py,
// `conv`), with the backend ATen would choose for CPU tensors of the same metadata. ATen's own
// choice for an openreg tensor, ConvBackend::Overrideable, would say NCHW whatever the inputs'
// layouts (docs/privateuse1_gaps.md); FakeTensor is given the CPU's prediction in Python
// (torch_openreg/compile.py, FAKE_CONVOLUTION).

// A CPU tensor with `t`'s dtype and sizes, the given strides and no memory: ATen's functions that
// choose a convolution backend read nothing else.
at::Tensor cpu_metadata(const at::Tensor& t, c10::IntArrayRef strides) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, at::DataPtr(nullptr, at::kCPU));
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), strides);
  return at::Tensor(std::move(impl));
}

// The memory format of the output and of the input and weight gradients on the CPU.
at::MemoryFormat cpu_conv_memory_format(const at::Tensor& input, const at::Tensor& weight,
                                        const at::Tensor& bias, c10::IntArrayRef stride,
                                        c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                        bool transposed, c10::IntArrayRef output_padding,
                                        int64_t groups, at::OptionalIntArrayRef bias_sizes) {
  // Unbatched: the CPU batches it with a view and runs a kernel that returns contiguous results.
  if (input.dim() == weight.dim() - 1) return at::MemoryFormat::Contiguous;
  at::Tensor in = cpu_metadata(input, input.strides()), w = cpu_metadata(weight, weight.strides());
  const std::optional<at::Tensor> b =
      bias.defined() ? std::optional<at::Tensor>(cpu_metadata(bias, bias.strides())) : std::nullopt;
  const auto backend = at::native::select_conv_backend(
      in, w, b, c10::fromIntArrayRefSlow(stride), c10::fromIntArrayRefSlow(padding),
      c10::fromIntArrayRefSlow(dilation), transposed, c10::fromIntArrayRefSlow(output_padding),
      groups, bias_sizes.has_value()
                  ? at::OptionalSymIntArrayRef(c10::fromIntArrayRefSlow(*bias_sizes))
                  : at::OptionalSymIntArrayRef(std::nullopt));
  if (weight.dim() == 3) {  // 1d runs as 2d, on a contiguous input
    in = cpu_metadata(input, c10::contiguous_strides(input.sizes())).unsqueeze(2);
    w = w.unsqueeze(2);
  }
  return at::native::_determine_backend_memory_format(in, w, backend);
}

// `t` (a fresh meta result) in `format`; a 1d result channels-last as the 2d one it was.
at::Tensor in_format(const at::Tensor& t, at::MemoryFormat format) {
  if (t.dim() == 3 && format == at::MemoryFormat::ChannelsLast)
    return t.unsqueeze(2).contiguous(format).squeeze(2);
  return t.contiguous(format);
}
// [docs:end CONVOLUTION_LAYOUT]

// Output shapes for graph capture (the overrideable ops have no Meta kernel): `convolution`
// takes the same arguments and has one; the backward's gradients have the inputs' shapes. Both
// in the CPU's layout, as the kernels return them.
void convolution_meta(c10::Stack* stack) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  // (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
  const c10::Stack& a = *stack;
  const at::Tensor bias = a[2].isTensor() ? a[2].toTensor() : at::Tensor();
  const auto format = cpu_conv_memory_format(
      a[0].toTensor(), a[1].toTensor(), bias, a[3].toIntVector(), a[4].toIntVector(),
      a[5].toIntVector(), a[6].toBool(), a[7].toIntVector(), a[8].toInt(), std::nullopt);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  (*stack)[0] = in_format((*stack)[0].toTensor(), format);
}

void convolution_backward_meta(c10::Stack* stack) {
  // (grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
  //  output_mask)
  const c10::Stack& a = *stack;
  const auto mask = a[9].to<std::array<bool, 3>>();
  const at::Tensor grad_output = a[0].toTensor();
  const at::Tensor input = a[1].toTensor(), weight = a[2].toTensor();
  const int64_t bias_size[] = {grad_output.size(1)};
  const auto format = cpu_conv_memory_format(
      input, weight, at::Tensor(), a[3].toIntVector(), a[4].toIntVector(), a[5].toIntVector(),
      a[6].toBool(), a[7].toIntVector(), a[8].toInt(), c10::IntArrayRef(bias_size));
  auto grad = [&](bool wanted, const at::Tensor& like, at::MemoryFormat f) {
    return wanted ? in_format(at::empty(like.sizes(), like.options()), f) : at::Tensor();
  };
  at::Tensor gi = grad(mask[0], input, format), gw = grad(mask[1], weight, format);
  at::Tensor gb = mask[2] ? at::empty({grad_output.size(1)}, grad_output.options()) : at::Tensor();
  stack->clear();
  stack->emplace_back(std::move(gi));
  stack->emplace_back(std::move(gw));
  stack->emplace_back(std::move(gb));
}

// [docs:start CONVOLUTION]
// The CPU has every convolution (1d/2d/3d, transposed, grouped, dilated): run it on the device
// memory, and return its results as they are, in the CPU kernel's layouts.
// `_convolution` has already checked the arguments and chosen this backend.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  const at::Tensor b = or_undefined(bias);
  const int device = op_device("aten::convolution_overrideable", {&input, &weight, &b});
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call_meta<at::Tensor>(c, device, "aten::convolution_overrideable", "",
                                         &convolution_meta, input, weight, bias, stride, padding,
                                         dilation, transposed, output_padding, groups);
  HostKernel k(device);
  at::Tensor out = at::convolution(k.alias(input), k.alias(weight), alias_optional(k, bias), stride,
                                   padding, dilation, transposed, output_padding, groups);
  return k.result(std::move(out));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  const int device = op_device("aten::convolution_backward_overrideable",
                               {&grad_output, &input, &weight});
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call_meta<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        c, device, "aten::convolution_backward_overrideable", "", &convolution_backward_meta,
        grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups,
        output_mask);
  HostKernel k(device);
  // The bias, when there is one, has one value per output channel.
  const int64_t bias_size[] = {grad_output.size(1)};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward(
      k.alias(grad_output), k.alias(input), k.alias(weight), c10::IntArrayRef(bias_size), stride,
      padding, dilation, transposed, output_padding, groups, output_mask);
  // Some CPU kernels compute more than asked; return exactly what the mask asks for.
  auto wanted = [&](at::Tensor& g, bool w) { return w ? k.result(std::move(g)) : at::Tensor(); };
  return {wanted(grad_input, output_mask[0]), wanted(grad_weight, output_mask[1]),
          wanted(grad_bias, output_mask[2])};
}
// [docs:end CONVOLUTION]

// ---------------------------------------------------------------------------------------------
// RNN cells
// ---------------------------------------------------------------------------------------------
//
// The cell receives the two matrix products (input_gates = x W_ih^T, hidden_gates = h W_hh^T) and
// does the rest in one kernel: plain loops over contiguous rows (the compiler vectorizes them:
// `OPENREG_SIMD` promises that outputs and inputs do not overlap), and ATen's vectorized CPU
// kernels, in place, for the transcendental functions. The forward saves a "workspace" with the
// activated gates, from which the backward needs no transcendental function but tanh(cy). The
// workspace layouts are CUDA's, so code that calls these operators directly sees the same thing:
//   LSTM workspace [B, 4H]: sigmoid(i) | sigmoid(f) | tanh(g) | sigmoid(o)
//   GRU  workspace [B, 5H]: sigmoid(r) | sigmoid(z) | tanh(n) | hx | hidden_gates_n + bias_n

#define OPENREG_SIMD _Pragma("omp simd")

void check_cell(const char* op, const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                const at::Tensor& input_bias, const at::Tensor& hidden_bias, int64_t factor,
                const at::Tensor& prev) {
  TORCH_CHECK(input_gates.dim() == 2, op, ": expected input_gates to be 2-D, got ",
              input_gates.dim(), "-D");
  TORCH_CHECK(hidden_gates.sizes() == input_gates.sizes(), op,
              ": expected input_gates and hidden_gates of the same size, got ",
              input_gates.sizes(), " and ", hidden_gates.sizes());
  const int64_t gates = input_gates.size(1);
  TORCH_CHECK(gates % factor == 0, op, ": the gate dimension ", gates, " is not a multiple of ",
              factor);
  TORCH_CHECK(input_bias.defined() == hidden_bias.defined(), op,
              ": expected both biases or none");
  if (input_bias.defined()) {
    TORCH_CHECK(input_bias.dim() == 1 && input_bias.numel() == gates &&
                    hidden_bias.dim() == 1 && hidden_bias.numel() == gates,
                op, ": expected biases of size [", gates, "], got ", input_bias.sizes(), " and ",
                hidden_bias.sizes());
  }
  TORCH_CHECK(prev.dim() == 2 && prev.size(0) == input_gates.size(0) &&
                  prev.size(1) == gates / factor,
              op, ": expected the previous state of size [", input_gates.size(0), ", ",
              gates / factor, "], got ", prev.sizes());
  for (const at::Tensor* t : {&hidden_gates, &input_bias, &hidden_bias, &prev})
    TORCH_CHECK(!t->defined() || t->scalar_type() == input_gates.scalar_type(), op,
                ": expected all tensors to have dtype ", input_gates.scalar_type(), ", got ",
                t->scalar_type());
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// A contiguous CPU alias of an (optional) device tensor, or an undefined tensor.
at::Tensor contiguous_alias(HostKernel& k, const at::Tensor& t) {
  return t.defined() ? k.alias(t).contiguous() : at::Tensor();
}

// out[j] = factor * (a[j] + b[j] (+ bias1[j] + bias2[j])) for j < cols: one row of gates.
template <typename scalar_t>
void sum_gates(scalar_t* out, const scalar_t* a, const scalar_t* b, const scalar_t* bias1,
               const scalar_t* bias2, int64_t cols, at::opmath_type<scalar_t> factor) {
  using acc_t = at::opmath_type<scalar_t>;
  if (bias1 != nullptr) {
    OPENREG_SIMD
    for (int64_t j = 0; j < cols; ++j)
      out[j] = scalar_t(factor * (acc_t(a[j]) + acc_t(b[j]) + acc_t(bias1[j]) + acc_t(bias2[j])));
  } else {
    OPENREG_SIMD
    for (int64_t j = 0; j < cols; ++j) out[j] = scalar_t(factor * (acc_t(a[j]) + acc_t(b[j])));
  }
}

// Output shapes for graph capture (the GRU cell has no Meta kernel in torch): hy has hx's shape,
// the workspace keeps 5 values per hidden unit; the backward returns the gates' gradients.
void gru_cell_meta(c10::Stack* stack) {
  // (input_gates, hidden_gates, hx, input_bias, hidden_bias)
  const at::Tensor hx = (*stack)[2].toTensor();
  stack->clear();
  stack->emplace_back(at::empty_like(hx, at::MemoryFormat::Contiguous));
  stack->emplace_back(at::empty({hx.size(0), 5 * hx.size(1)}, hx.options()));
}

void gru_cell_backward_meta(c10::Stack* stack) {
  // (grad_hy, workspace, has_bias)
  const at::Tensor g = (*stack)[0].toTensor();
  const bool has_bias = (*stack)[2].toBool();
  const int64_t B = g.size(0), H = g.size(1);
  stack->clear();
  stack->emplace_back(at::empty({B, 3 * H}, g.options()));
  stack->emplace_back(at::empty({B, 3 * H}, g.options()));
  stack->emplace_back(at::empty({B, H}, g.options()));
  stack->emplace_back(has_bias ? at::empty({3 * H}, g.options()) : at::Tensor());
  stack->emplace_back(has_bias ? at::empty({3 * H}, g.options()) : at::Tensor());
}

// [docs:start LSTM_CELL]
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  const char* op = "aten::_thnn_fused_lstm_cell";
  const at::Tensor bi_dev = or_undefined(input_bias), bh_dev = or_undefined(hidden_bias);
  const int device = op_device(op, {&input_gates, &hidden_gates, &cx, &bi_dev, &bh_dev});
  check_cell(op, input_gates, hidden_gates, bi_dev, bh_dev, 4, cx);
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        c, device, op, "", input_gates, hidden_gates, cx, input_bias, hidden_bias);
  HostKernel k(device);
  const at::Tensor ig = k.alias(input_gates).contiguous(), hg = k.alias(hidden_gates).contiguous();
  const at::Tensor c = k.alias(cx).contiguous();
  const at::Tensor bi = contiguous_alias(k, bi_dev), bh = contiguous_alias(k, bh_dev);
  const int64_t B = c.size(0), H = c.size(1);

  at::Tensor workspace = at::empty({B, 4 * H}, ig.options());
  at::Tensor cy = at::empty({B, H}, ig.options());
  // Pre-activations. In float32/64 the cell candidate is doubled: tanh(x) = 2 sigmoid(2x) - 1, so
  // that a single vectorized sigmoid over the whole workspace activates the four gates (in 16-bit
  // types, 2 sigmoid - 1 would lose too much precision near 0: a separate tanh there).
  const bool tanh_by_sigmoid = ig.scalar_type() == at::kFloat || ig.scalar_type() == at::kDouble;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ig.scalar_type(), "lstm_cell", [&] {
    const scalar_t *pi = ig.const_data_ptr<scalar_t>(), *ph = hg.const_data_ptr<scalar_t>();
    const scalar_t *pbi = data_or_null<scalar_t>(bi), *pbh = data_or_null<scalar_t>(bh);
    scalar_t* w = workspace.data_ptr<scalar_t>();
    for_rows(B, 4 * H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t gate = 0; gate < 4; ++gate) {
          const int64_t o = b * 4 * H + gate * H, ob = gate * H;
          sum_gates<scalar_t>(w + o, pi + o, ph + o, pbi ? pbi + ob : nullptr,
                              pbh ? pbh + ob : nullptr, H, gate == 2 && tanh_by_sigmoid ? 2 : 1);
        }
    });
  });
  if (tanh_by_sigmoid) {
    workspace.sigmoid_();
  } else {
    workspace.narrow(1, 0, 2 * H).sigmoid_();
    workspace.narrow(1, 2 * H, H).tanh_();
    workspace.narrow(1, 3 * H, H).sigmoid_();
  }
  at::Tensor hy;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ig.scalar_type(), "lstm_cell", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* w = workspace.data_ptr<scalar_t>();
    const scalar_t* pc = c.const_data_ptr<scalar_t>();
    scalar_t* py = cy.data_ptr<scalar_t>();
    for_rows(B, H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* row = w + b * 4 * H;
        const scalar_t* cb = pc + b * H;
        scalar_t* yb = py + b * H;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) {  // g = tanh(x); cy = f * cx + i * g
          const acc_t s = row[2 * H + j];
          const acc_t g = tanh_by_sigmoid ? acc_t(2) * s - acc_t(1) : s;
          row[2 * H + j] = scalar_t(g);
          yb[j] = scalar_t(acc_t(row[H + j]) * acc_t(cb[j]) + acc_t(row[j]) * g);
        }
      }
    });
    hy = at::tanh(cy);
    scalar_t* ph = hy.data_ptr<scalar_t>();
    for_rows(B, H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* o = w + b * 4 * H + 3 * H;
        scalar_t* hb = ph + b * H;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) hb[j] = scalar_t(acc_t(o[j]) * acc_t(hb[j]));  // o*tanh(cy)
      }
    });
  });
  return {k.result(hy), k.result(cy), k.result(workspace)};
}
// [docs:end LSTM_CELL]

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward_impl(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  const char* op = "aten::_thnn_fused_lstm_cell_backward_impl";
  const at::Tensor ghy_dev = or_undefined(grad_hy), gcy_dev = or_undefined(grad_cy);
  if (!ghy_dev.defined() && !gcy_dev.defined()) return {};
  const int device = op_device(op, {&ghy_dev, &gcy_dev, &cx, &cy, &workspace});
  if (Capture* c = capturing(device))
    return capture_call<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
        c, device, op, "", grad_hy, grad_cy, cx, cy, workspace, has_bias);
  HostKernel k(device);
  const at::Tensor c = k.alias(cx).contiguous(), ws = k.alias(workspace).contiguous();
  const int64_t B = c.size(0), H = c.size(1);
  TORCH_CHECK(ws.dim() == 2 && ws.size(0) == B && ws.size(1) == 4 * H, op,
              ": expected a workspace of size [", B, ", ", 4 * H, "], got ", ws.sizes());
  // A missing gradient is zero.
  const at::Tensor ghy = ghy_dev.defined() ? k.alias(ghy_dev).contiguous() : at::zeros_like(c);
  const at::Tensor gcy = gcy_dev.defined() ? k.alias(gcy_dev).contiguous() : at::zeros_like(c);
  const at::Tensor tanh_cy = at::tanh(k.alias(cy)).contiguous();

  at::Tensor grad_gates = at::empty({B, 4 * H}, ws.options());
  at::Tensor grad_cx = at::empty({B, H}, ws.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ws.scalar_type(), "lstm_cell", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *w = ws.const_data_ptr<scalar_t>(), *pc = c.const_data_ptr<scalar_t>();
    const scalar_t* tc = tanh_cy.const_data_ptr<scalar_t>();
    const scalar_t *pghy = ghy.const_data_ptr<scalar_t>(), *pgcy = gcy.const_data_ptr<scalar_t>();
    scalar_t *gg = grad_gates.data_ptr<scalar_t>(), *gcx = grad_cx.data_ptr<scalar_t>();
    for_rows(B, 4 * H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* row = w + b * 4 * H;
        scalar_t* grow = gg + b * 4 * H;
        const int64_t e0 = b * H;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) {
          const acc_t i = row[j], f = row[H + j], g = row[2 * H + j], o = row[3 * H + j];
          const acc_t t = tc[e0 + j], dh = pghy[e0 + j];
          // d(loss)/d(cy), through hy = o * tanh(cy) and directly.
          const acc_t dc = dh * o * (acc_t(1) - t * t) + acc_t(pgcy[e0 + j]);
          grow[j] = scalar_t(dc * g * i * (acc_t(1) - i));
          grow[H + j] = scalar_t(dc * acc_t(pc[e0 + j]) * f * (acc_t(1) - f));
          grow[2 * H + j] = scalar_t(dc * i * (acc_t(1) - g * g));
          grow[3 * H + j] = scalar_t(dh * t * o * (acc_t(1) - o));
          gcx[e0 + j] = scalar_t(dc * f);
        }
      }
    });
  });
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {k.result(grad_gates), k.result(grad_cx), k.result(grad_bias)};
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(const at::Tensor& input_gates,
                                                  const at::Tensor& hidden_gates,
                                                  const at::Tensor& hx,
                                                  const std::optional<at::Tensor>& input_bias,
                                                  const std::optional<at::Tensor>& hidden_bias) {
  const char* op = "aten::_thnn_fused_gru_cell";
  const at::Tensor bi_dev = or_undefined(input_bias), bh_dev = or_undefined(hidden_bias);
  const int device = op_device(op, {&input_gates, &hidden_gates, &hx, &bi_dev, &bh_dev});
  check_cell(op, input_gates, hidden_gates, bi_dev, bh_dev, 3, hx);
  if (Capture* c = capturing(device))
    return capture_call_meta<std::tuple<at::Tensor, at::Tensor>>(
        c, device, op, "", &gru_cell_meta, input_gates, hidden_gates, hx, input_bias, hidden_bias);
  HostKernel k(device);
  const at::Tensor ig = k.alias(input_gates).contiguous(), hg = k.alias(hidden_gates).contiguous();
  const at::Tensor h = k.alias(hx).contiguous();
  const at::Tensor bi = contiguous_alias(k, bi_dev), bh = contiguous_alias(k, bh_dev);
  const int64_t B = h.size(0), H = h.size(1);

  at::Tensor workspace = at::empty({B, 5 * H}, ig.options());
  at::Tensor hy = at::empty({B, H}, ig.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ig.scalar_type(), "gru_cell", [&] {
    const scalar_t *pi = ig.const_data_ptr<scalar_t>(), *ph = hg.const_data_ptr<scalar_t>();
    const scalar_t *pbi = data_or_null<scalar_t>(bi), *pbh = data_or_null<scalar_t>(bh);
    scalar_t* w = workspace.data_ptr<scalar_t>();
    for_rows(B, 2 * H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)  // reset and update gates, before the sigmoid
        sum_gates<scalar_t>(w + b * 5 * H, pi + b * 3 * H, ph + b * 3 * H, pbi, pbh, 2 * H, 1);
    });
  });
  workspace.narrow(1, 0, 2 * H).sigmoid_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ig.scalar_type(), "gru_cell", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *pi = ig.const_data_ptr<scalar_t>(), *ph = hg.const_data_ptr<scalar_t>();
    const scalar_t *pbi = data_or_null<scalar_t>(bi), *pbh = data_or_null<scalar_t>(bh);
    const scalar_t* ph0 = h.const_data_ptr<scalar_t>();
    const scalar_t zeros[1] = {scalar_t(0)};
    scalar_t* w = workspace.data_ptr<scalar_t>();
    for_rows(B, H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* row = w + b * 5 * H;
        const scalar_t* in = pi + b * 3 * H + 2 * H;
        const scalar_t* hn = ph + b * 3 * H + 2 * H;
        const scalar_t* h0 = ph0 + b * H;
        const scalar_t* bin = pbi ? pbi + 2 * H : zeros;
        const scalar_t* bhn = pbh ? pbh + 2 * H : zeros;
        const int64_t bias_step = pbi ? 1 : 0;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) {
          // n before the tanh: in + r * hn; hn (with its bias) and hx are saved for the backward.
          const acc_t x = acc_t(in[j]) + acc_t(bin[j * bias_step]);
          const acc_t hnb = acc_t(hn[j]) + acc_t(bhn[j * bias_step]);
          row[2 * H + j] = scalar_t(x + acc_t(row[j]) * hnb);
          row[3 * H + j] = h0[j];
          row[4 * H + j] = scalar_t(hnb);
        }
      }
    });
  });
  workspace.narrow(1, 2 * H, H).tanh_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ig.scalar_type(), "gru_cell", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* w = workspace.const_data_ptr<scalar_t>();
    scalar_t* py = hy.data_ptr<scalar_t>();
    for_rows(B, H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* row = w + b * 5 * H;
        scalar_t* yb = py + b * H;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) {  // hy = n + z * (hx - n)
          const acc_t n = row[2 * H + j];
          yb[j] = scalar_t(n + acc_t(row[H + j]) * (acc_t(row[3 * H + j]) - n));
        }
      }
    });
  });
  return {k.result(hy), k.result(workspace)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  const char* op = "aten::_thnn_fused_gru_cell_backward";
  if (!grad_hy.defined()) return {};
  const int device = op_device(op, {&grad_hy, &workspace});
  if (Capture* c = capturing(device))
    return capture_call_meta<
        std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>>(
        c, device, op, "", &gru_cell_backward_meta, grad_hy, workspace, has_bias);
  HostKernel k(device);
  const at::Tensor ws = k.alias(workspace).contiguous(), g = k.alias(grad_hy).contiguous();
  TORCH_CHECK(g.dim() == 2 && ws.dim() == 2 && ws.size(0) == g.size(0) &&
                  ws.size(1) == 5 * g.size(1),
              op, ": expected a workspace of size [", g.size(0), ", ", 5 * g.size(1), "], got ",
              ws.sizes());
  TORCH_CHECK(g.scalar_type() == ws.scalar_type(), op, ": expected grad_hy of dtype ",
              ws.scalar_type(), ", got ", g.scalar_type());
  const int64_t B = g.size(0), H = g.size(1);
  at::Tensor grad_input_gates = at::empty({B, 3 * H}, ws.options());
  at::Tensor grad_hidden_gates = at::empty({B, 3 * H}, ws.options());
  at::Tensor grad_hx = at::empty({B, H}, ws.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ws.scalar_type(), "gru_cell", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t *w = ws.const_data_ptr<scalar_t>(), *pg = g.const_data_ptr<scalar_t>();
    scalar_t* gi = grad_input_gates.data_ptr<scalar_t>();
    scalar_t* gh = grad_hidden_gates.data_ptr<scalar_t>();
    scalar_t* ghx = grad_hx.data_ptr<scalar_t>();
    for_rows(B, 3 * H, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* row = w + b * 5 * H;
        const scalar_t* gb = pg + b * H;
        scalar_t *gib = gi + b * 3 * H, *ghb = gh + b * 3 * H, *ghxb = ghx + b * H;
        OPENREG_SIMD
        for (int64_t j = 0; j < H; ++j) {
          const acc_t r = row[j], z = row[H + j], n = row[2 * H + j], h = row[3 * H + j],
                      hn = row[4 * H + j];
          const acc_t go = gb[j];
          const acc_t dz = go * (h - n) * z * (acc_t(1) - z);
          const acc_t dn = go * (acc_t(1) - z) * (acc_t(1) - n * n);
          const acc_t dr = dn * hn * r * (acc_t(1) - r);
          gib[j] = scalar_t(dr);
          gib[H + j] = scalar_t(dz);
          gib[2 * H + j] = scalar_t(dn);
          ghb[j] = scalar_t(dr);
          ghb[H + j] = scalar_t(dz);
          ghb[2 * H + j] = scalar_t(dn * r);
          ghxb[j] = scalar_t(go * z);
        }
      }
    });
  });
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {k.result(grad_input_gates), k.result(grad_hidden_gates), k.result(grad_hx),
          k.result(grad_input_bias), k.result(grad_hidden_bias)};
}

// ---------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------

// [docs:start NATIVE_DROPOUT]
// at::dropout calls native_dropout on every accelerator. The CPU kernel would draw the mask from
// the CPU generator; here it comes from the device's generator (torch.openreg.manual_seed).
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p,
                                                  std::optional<bool> train) {
  const int device = op_device("aten::native_dropout", {&input});
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call<std::tuple<at::Tensor, at::Tensor>>(c, device, "aten::native_dropout", "",
                                                            input, p, train);
  HostKernel k(device);
  // As the CPU kernel: an empty input comes back itself (with an empty mask of its dtype); the
  // mask is boolean and in the input's layout; a p outside [0, 1] is refused by bernoulli_.
  if (input.numel() == 0) return {input, at::empty_like(input)};
  const at::Tensor x = k.alias(input);
  if (train.has_value() && !*train) {
    return {k.result(x.clone()), k.result(at::ones_like(x, x.options().dtype(at::kBool)))};
  }
  const double keep = 1. - p;
  at::Tensor mask = at::empty_like(x, x.options().dtype(at::kBool));
  mask.bernoulli_(keep, cpu_generator_for(std::nullopt, k.device()));
  at::Tensor out = x.mul(mask).mul_(keep == 0 ? 0. : 1. / keep);
  return {k.result(out), k.result(mask)};
}
// [docs:end NATIVE_DROPOUT]

// ---------------------------------------------------------------------------------------------
// Scaled dot product attention
// ---------------------------------------------------------------------------------------------
//
// The fused kernel never keeps the [L, S] attention matrix between forward and backward: the
// forward saves the log-sum-exp of each row and the seed of its dropout mask; the backward
// recomputes the probabilities from them, as flash attention does on GPUs. Two implementations:
// the CPU's flash-attention kernels where they apply (host_flash_supports), and openreg's own,
// written with ATen CPU operators, for everything else.
//   query [B, Hq, L, E] (or [Hq, L, E]); key [B, Hkv, S, E]; value [B, Hkv, S, Ev]
//   Hq may be a multiple of Hkv (grouped-query attention, key/value head h serves query heads
//   h*G .. h*G+G-1).

bool sdpa_dtype_supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Why the fused kernel cannot take these inputs, or nullptr when it can.
const char* fused_attention_unsupported(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const std::optional<at::Tensor>& mask,
                                        bool is_causal, bool enable_gqa) {
  if (q.is_nested() || k.is_nested() || v.is_nested()) return "nested tensors";
  if (q.dim() != k.dim() || q.dim() != v.dim() || (q.dim() != 3 && q.dim() != 4))
    return "query, key and value must all be 3-D or all 4-D";
  if (!sdpa_dtype_supported(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type())
    return "query, key and value must have the same floating point dtype";
  if (q.dim() == 4 && (k.size(0) != q.size(0) || v.size(0) != q.size(0)))
    return "batch sizes differ";
  if (k.size(-1) != q.size(-1) || v.size(-2) != k.size(-2) || k.size(-3) != v.size(-3))
    return "inconsistent key/value sizes";
  const int64_t hq = q.size(-3), hkv = k.size(-3);
  if (hq != hkv && (!enable_gqa || hkv == 0 || hq % hkv != 0))
    return "the numbers of heads differ (and enable_gqa is not set or they do not divide)";
  if (is_causal && mask.has_value() && mask->defined()) return "attn_mask with is_causal";
  if (mask.has_value() && mask->defined() && mask->scalar_type() != at::kBool &&
      mask->scalar_type() != q.scalar_type())
    return "attn_mask dtype";
  return nullptr;
}

// [docs:start SDP_CHOICE]
// scaled_dot_product_attention asks the device's _fused_sdp_choice_stub which backend to run.
// openreg has one fused backend, "overrideable"; the user can disable it (or math) with
// torch.nn.attention.sdpa_kernel. With the default settings openreg follows the CPU's own choice
// for the same inputs, so that its results are the CPU's bit for bit (docs/determinism.md): where
// the CPU runs its flash-attention kernel, openreg runs the overrideable backend, which runs that
// kernel with the same arguments on the device memory (host_flash_supports); where the CPU runs
// the math backend (dropout, a value head size of its own, a mask that requires grad, non-unit
// last strides; on torch 2.13 also unbatched inputs), so does openreg. The CPU's choice reads
// only the tensors' metadata, so it takes the device tensors as they are.
int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  auto& ctx = at::globalContext();
  if (ctx.userEnabledOverrideableSDP() && ctx.userEnabledFlashSDP() && ctx.userEnabledMathSDP()) {
    const int64_t cpu = at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p,
                                                          is_causal, scale, enable_gqa);
    if (cpu == static_cast<int64_t>(at::SDPBackend::flash_attention) &&
        fused_attention_unsupported(query, key, value, attn_mask, is_causal, enable_gqa) ==
            nullptr)
      return static_cast<int64_t>(at::SDPBackend::overrideable);
    return static_cast<int64_t>(at::SDPBackend::math);
  }
  const char* why_not = fused_attention_unsupported(query, key, value, attn_mask, is_causal,
                                                    enable_gqa);
  // The math backend refuses a bad dropout_p with the CPU's message.
  if (why_not == nullptr && !(dropout_p >= 0 && dropout_p < 1)) why_not = "dropout_p outside [0, 1)";
  if (ctx.userEnabledOverrideableSDP() && why_not == nullptr)
    return static_cast<int64_t>(at::SDPBackend::overrideable);
  if (ctx.userEnabledMathSDP()) return static_cast<int64_t>(at::SDPBackend::math);
  TORCH_WARN("openreg: the fused attention kernel cannot run: ",
             ctx.userEnabledOverrideableSDP() ? why_not : "it is disabled",
             "; and the math backend is disabled");
  return static_cast<int64_t>(at::SDPBackend::error);
}
// [docs:end SDP_CHOICE]

// Output allocated in the layout of the query (dimension order by stride), as the meta function
// of the operator does; a real kernel writes its output where the caller's layout wants it.
at::Tensor empty_like_query_layout(const at::Tensor& q, c10::IntArrayRef sizes) {
  if (q.sizes() == sizes) return at::empty_like(q);
  const int64_t n = q.dim();
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return q.stride(a) > q.stride(b); });
  std::vector<int64_t> strides(n);
  int64_t s = 1;
  for (int64_t i = n - 1; i >= 0; --i) {
    strides[order[i]] = s;
    s *= sizes[order[i]];
  }
  return at::empty_strided(sizes, strides, q.options());
}

// `o` (the attention output, or a gradient) in the layout of `like`, as the meta function says.
at::Tensor in_layout_of(const at::Tensor& o, const at::Tensor& like) {
  if (o.scalar_type() == like.scalar_type()) {
    if (o.sizes() == like.sizes() && like.is_non_overlapping_and_dense() &&
        o.strides() == like.strides())
      return o;
    if (like.is_contiguous() && o.is_contiguous()) return o;
  }
  at::Tensor r = empty_like_query_layout(like, o.sizes());
  r.copy_(o);
  return r;
}

// The CPU's flash-attention kernels (forward and backward) cover the common case: no dropout,
// query heads a multiple of key/value heads (grouped-query attention: the kernel maps them
// itself, as on the CPU), one head size. openreg runs them on the device memory; the general
// path covers the rest (dropout, a value head size of its own, the gradient of attn_bias,
// float64 gradients from the float32 log-sum-exp).
bool host_flash_supports(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         double dropout_p) {
  return dropout_p == 0 && q.size(-3) % k.size(-3) == 0 && q.size(-1) == v.size(-1) &&
         q.size(-2) > 0 && k.size(-2) > 0 && q.stride(-1) == 1 && k.stride(-1) == 1 &&
         v.stride(-1) == 1;
}

// 4-D views for the flash kernels: [B, H, L, E] inputs; a 2-D or 4-D mask.
at::Tensor as_4d(const at::Tensor& t) {
  if (!t.defined() || t.dim() == 4) return t;
  std::vector<int64_t> sizes(4 - t.dim(), 1);
  sizes.insert(sizes.end(), t.sizes().begin(), t.sizes().end());
  return t.view(sizes);
}
std::optional<at::Tensor> flash_mask(const at::Tensor& bias) {
  if (!bias.defined()) return std::nullopt;
  at::Tensor m = bias.dim() == 2 ? bias : as_4d(bias);
  return m.stride(-1) == 1 ? m : m.contiguous();
}

// Key/value heads repeated for grouped-query attention, and the reduction of their gradients.
at::Tensor repeat_heads(const at::Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  const int64_t d = t.dim() - 3;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes.insert(sizes.begin() + d + 1, groups);
  return t.unsqueeze(d + 1).expand(sizes).flatten(d, d + 1);
}
at::Tensor sum_heads(const at::Tensor& g, int64_t groups) {
  if (groups == 1) return g;
  const int64_t d = g.dim() - 3;
  return g.unflatten(d, {g.size(d) / groups, groups}).sum(d + 1);
}

at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& bias,
                            bool is_causal, double scale) {
  at::Tensor s = at::matmul(q * scale, k.transpose(-2, -1));
  if (bias.defined()) s.add_(bias);
  if (is_causal) {
    const int64_t L = q.size(-2), S = k.size(-2);
    s.masked_fill_(at::ones({L, S}, s.options().dtype(at::kBool)).triu_(1),
                   -std::numeric_limits<double>::infinity());
  }
  return s;
}

// Rows masked out entirely have a log-sum-exp of -inf; store +inf, so that exp(s - lse) is 0
// there and such rows attend to nothing (output 0), like the math backend's safe softmax.
void fix_empty_rows(at::Tensor& lse) {
  lse.masked_fill_(lse == -std::numeric_limits<double>::infinity(),
                   std::numeric_limits<double>::infinity());
}

// The dropout keep-mask of one attention call: a pure function of the seed drawn by the forward
// from the device generator, so the backward regenerates it instead of storing it.
at::Tensor dropout_keep_mask(uint64_t seed, c10::IntArrayRef sizes, double p) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::empty(sizes, at::TensorOptions().dtype(at::kBool)).bernoulli_(1. - p, gen);
}

// [docs:start DRAW_SEED]
uint64_t draw_seed(int device) {
  at::Generator gen = cpu_generator_for(std::nullopt, device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}
// [docs:end DRAW_SEED]

at::ScalarType compute_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

double softmax_scale(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

void check_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& bias, bool is_causal) {
  const char* why_not = fused_attention_unsupported(q, k, v, std::nullopt, false,
                                                    /*enable_gqa=*/true);
  TORCH_CHECK(why_not == nullptr, op, ": unsupported inputs: ", why_not);
  TORCH_CHECK(!(is_causal && bias.defined()), op,
              ": Explicit attn_mask should not be set when is_causal=True");
  TORCH_CHECK(!bias.defined() || bias.scalar_type() == q.scalar_type(), op,
              ": expected attn_bias of dtype ", q.scalar_type(), ", got ", bias.scalar_type(),
              " (boolean masks are converted by scaled_dot_product_attention)");
}

// [docs:start SDPA_FORWARD]
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor,
           at::Tensor, at::Tensor>
fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                bool return_debug_mask, std::optional<double> scale) {
  const char* op = "aten::_scaled_dot_product_fused_attention_overrideable";
  const at::Tensor bias_dev = or_undefined(attn_bias);
  const int device = op_device(op, {&query, &key, &value, &bias_dev});
  check_attention(op, query, key, value, bias_dev, is_causal);
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
  if (Capture* c = capturing(device))  // graph capture: recorded, not run (adapters/graph.h)
    return capture_call<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt,
                                   c10::SymInt, at::Tensor, at::Tensor, at::Tensor>>(
        c, device, op, "", query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask,
        scale);
  const int64_t L = query.size(-2), S = key.size(-2);
  const int64_t groups = query.size(-3) / key.size(-3);
  // The seed is drawn before the kernel (host code), like a CUDA launch reading the generator.
  const uint64_t seed = dropout_p > 0 ? draw_seed(device) : 0;

  at::Tensor out, lse, debug_mask;
  {
    HostKernel k(device);
    const at::Tensor q_alias = k.alias(query);
    at::Tensor o, row_lse;  // row_lse: [.., L] or [.., L, 1]
    if (host_flash_supports(query, key, value, dropout_p)) {
      auto [o4, lse4] = at::_scaled_dot_product_flash_attention_for_cpu(
          as_4d(q_alias), as_4d(k.alias(key)), as_4d(k.alias(value)), 0.0, is_causal,
          flash_mask(bias_dev.defined() ? k.alias(bias_dev) : at::Tensor()), scale);
      o = query.dim() == 3 ? o4.squeeze(0) : o4;
      row_lse = lse4;
    } else {
      const at::ScalarType ct = compute_type(query.scalar_type());
      const at::Tensor q = q_alias.to(ct);
      const at::Tensor kk = repeat_heads(k.alias(key).to(ct), groups);
      const at::Tensor v = repeat_heads(k.alias(value).to(ct), groups);
      const at::Tensor bias = bias_dev.defined() ? k.alias(bias_dev).to(ct) : at::Tensor();

      at::Tensor p = attention_scores(q, kk, bias, is_causal, softmax_scale(query, scale));
      row_lse = at::logsumexp(p, -1, /*keepdim=*/true);
      fix_empty_rows(row_lse);
      p.sub_(row_lse).exp_();  // softmax probabilities
      if (dropout_p > 0) {
        at::Tensor keep = dropout_keep_mask(seed, p.sizes(), dropout_p);
        p.mul_(keep).mul_(1. / (1. - dropout_p));
        if (return_debug_mask) debug_mask = keep;
      }
      o = at::matmul(p, v);
    }
    // The log-sum-exp is float32 and [B, H, L] (B = 1 for 3-D inputs), as the meta function says.
    const int64_t batch = query.dim() == 4 ? query.size(0) : 1;
    at::Tensor lse_cpu =
        row_lse.reshape({batch, query.size(-3), L}).to(at::kFloat).contiguous();
    out = k.result(in_layout_of(o, q_alias));
    lse = k.result(lse_cpu);
    if (debug_mask.defined()) debug_mask = k.result(debug_mask);
  }
  // Seed and offset of the dropout mask, as host scalars (like CUDA outside graph capture).
  at::Tensor philox_seed = at::scalar_tensor(static_cast<int64_t>(seed), at::kLong);
  at::Tensor philox_offset = at::scalar_tensor(int64_t(0), at::kLong);
  return {out, lse, at::Tensor(), at::Tensor(), c10::SymInt(L), c10::SymInt(S),
          philox_seed, philox_offset, debug_mask};
}
// [docs:end SDPA_FORWARD]

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask,
    const at::Tensor& out, const at::Tensor& logsumexp, const at::Tensor& cum_seq_q,
    const at::Tensor& cum_seq_k, int64_t max_q, int64_t max_k, double dropout_p, bool is_causal,
    const at::Tensor& philox_seed, const at::Tensor& philox_offset, std::optional<double> scale) {
  const char* op = "aten::_scaled_dot_product_fused_attention_overrideable_backward";
  if (!grad_out.defined()) return {};  // autograd passes an undefined gradient for a zero one
  const int device =
      op_device(op, {&grad_out, &query, &key, &value, &attn_bias, &out, &logsumexp});
  check_attention(op, query, key, value, attn_bias, is_causal);
  if (Capture* c = capturing(device))
    return capture_call<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>>(
        c, device, op, "", grad_out, query, key, value, attn_bias, grad_input_mask, out,
        logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
        philox_offset, scale);
  const uint64_t seed =
      dropout_p > 0 ? static_cast<uint64_t>(philox_seed.item<int64_t>()) : 0;
  const int64_t groups = query.size(-3) / key.size(-3);
  const double sm_scale = softmax_scale(query, scale);
  const bool bias_grad = grad_input_mask[3] && attn_bias.defined();

  HostKernel k(device);
  at::Tensor grad_q, grad_k, grad_v, grad_bias;
  if (host_flash_supports(query, key, value, dropout_p) && !bias_grad &&
      query.scalar_type() != at::kDouble) {
    at::Tensor dout = k.alias(grad_out);
    if (dout.stride(-1) != 1) dout = dout.contiguous();
    std::tie(grad_q, grad_k, grad_v) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        as_4d(dout), as_4d(k.alias(query)), as_4d(k.alias(key)), as_4d(k.alias(value)),
        as_4d(k.alias(out)), k.alias(logsumexp), 0.0, is_causal,
        flash_mask(attn_bias.defined() ? k.alias(attn_bias) : at::Tensor()), scale);
    if (query.dim() == 3) {
      grad_q = grad_q.squeeze(0);
      grad_k = grad_k.squeeze(0);
      grad_v = grad_v.squeeze(0);
    }
  } else {
    const at::ScalarType ct = compute_type(query.scalar_type());
    const at::Tensor q = k.alias(query).to(ct);
    const at::Tensor kk = repeat_heads(k.alias(key).to(ct), groups);
    const at::Tensor v = repeat_heads(k.alias(value).to(ct), groups);
    const at::Tensor bias = attn_bias.defined() ? k.alias(attn_bias).to(ct) : at::Tensor();
    const at::Tensor dout = k.alias(grad_out).to(ct);

    // Probabilities again, from the saved log-sum-exp (float32; recomputed for float64 inputs,
    // whose gradients need the full precision).
    at::Tensor p = attention_scores(q, kk, bias, is_causal, sm_scale);
    at::Tensor row_lse;
    if (ct == at::kDouble) {
      row_lse = at::logsumexp(p, -1, /*keepdim=*/true);
      fix_empty_rows(row_lse);
    } else {
      row_lse = k.alias(logsumexp).reshape(p.sizes().slice(0, p.dim() - 1)).unsqueeze(-1);
    }
    p.sub_(row_lse).exp_();
    at::Tensor keep;
    const double keep_scale = dropout_p > 0 ? 1. / (1. - dropout_p) : 1.;
    if (dropout_p > 0) keep = dropout_keep_mask(seed, p.sizes(), dropout_p);

    if (grad_input_mask[2]) {  // dV = dropout(P)^T dO
      at::Tensor pd = dropout_p > 0 ? p.mul(keep).mul_(keep_scale) : p;
      grad_v = sum_heads(at::matmul(pd.transpose(-2, -1), dout), groups);
    }
    if (grad_input_mask[0] || grad_input_mask[1] || bias_grad) {
      at::Tensor ds = at::matmul(dout, v.transpose(-2, -1));  // d(dropout(P))
      if (dropout_p > 0) ds.mul_(keep).mul_(keep_scale);       // dP
      // Softmax backward: dS = P * (dP - rowsum(P * dP)).
      at::Tensor row_dot = (p * ds).sum(-1, /*keepdim=*/true);
      ds.sub_(row_dot).mul_(p);
      if (grad_input_mask[0]) grad_q = at::matmul(ds, kk).mul_(sm_scale);
      if (grad_input_mask[1])
        grad_k = sum_heads(at::matmul(ds.transpose(-2, -1), q).mul_(sm_scale), groups);
      if (bias_grad) grad_bias = at::sum_to(ds, bias.sizes());
    }
  }
  // The gradients asked for, each in the layout of its input (as the meta function says).
  auto finish = [&](const at::Tensor& g, const at::Tensor& like, bool wanted) {
    return g.defined() && wanted ? k.result(in_layout_of(g, k.alias(like))) : at::Tensor();
  };
  return {finish(grad_q, query, grad_input_mask[0]), finish(grad_k, key, grad_input_mask[1]),
          finish(grad_v, value, grad_input_mask[2]), finish(grad_bias, attn_bias, bias_grad)};
}

// [docs:start SDPA_DIFFERENTIABLE_BACKWARD]
// The gradients of attention written with differentiable ATen operators, called on the device
// tensors under autograd, so that they have a graph of their own: the second derivative
// (backward with create_graph=True, gradgradcheck) differentiates these operators. The same
// equations as the kernel's general path, with the probabilities recomputed from query, key
// and the mask alone: the saved output and log-sum-exp are functions of them, so gradients never
// flow into those. Dropout applies the forward's keep-mask again, regenerated from its seed.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> differentiable_attention_backward(
    const char* op, int device, const at::Tensor& grad_out, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& attn_bias,
    std::array<bool, 4> grad_input_mask, double dropout_p, bool is_causal,
    const at::Tensor& philox_seed, std::optional<double> scale) {
  const at::ScalarType ct = compute_type(query.scalar_type());
  const int64_t groups = query.size(-3) / key.size(-3);
  const double sm_scale = softmax_scale(query, scale);
  const bool bias_grad = grad_input_mask[3] && attn_bias.defined();
  const at::Tensor q = query.to(ct);
  const at::Tensor kk = repeat_heads(key.to(ct), groups);
  const at::Tensor v = repeat_heads(value.to(ct), groups);
  const at::Tensor dout = grad_out.to(ct);

  at::Tensor s = at::matmul(q * sm_scale, kk.transpose(-2, -1));
  if (attn_bias.defined()) s = s + attn_bias.to(ct);
  if (is_causal) {
    const int64_t L = q.size(-2), S = kk.size(-2);
    s = s.masked_fill(at::ones({L, S}, s.options().dtype(at::kBool)).triu(1),
                      -std::numeric_limits<double>::infinity());
  }
  // A row masked entirely attends to nothing (probabilities 0), as in the kernel.
  const at::Tensor p = at::_safe_softmax(s, -1);
  at::Tensor keep;  // the forward's keep-mask, scaled by 1 / (1 - dropout_p); no gradient
  if (dropout_p > 0) {
    TORCH_CHECK(philox_seed.defined() && philox_seed.device().is_cpu() && !capturing(device),
                op, ": the second derivative of attention with dropout_p > 0 needs the seed of "
                "the forward's dropout mask, which a captured graph does not have; capture "
                "attention without dropout, or run it eagerly");
    const auto seed = static_cast<uint64_t>(philox_seed.item<int64_t>());
    keep = dropout_keep_mask(seed, p.sizes(), dropout_p)
               .to(query.device(), ct)
               .mul_(1. / (1. - dropout_p));
  }

  at::Tensor grad_q, grad_k, grad_v, grad_bias;
  if (grad_input_mask[2]) {  // dV = dropout(P)^T dO
    const at::Tensor pd = keep.defined() ? p * keep : p;
    grad_v = sum_heads(at::matmul(pd.transpose(-2, -1), dout), groups);
  }
  if (grad_input_mask[0] || grad_input_mask[1] || bias_grad) {
    at::Tensor dp = at::matmul(dout, v.transpose(-2, -1));
    if (keep.defined()) dp = dp * keep;
    // Softmax backward: dS = P * (dP - rowsum(P * dP)).
    const at::Tensor ds = p * (dp - (p * dp).sum(-1, /*keepdim=*/true));
    if (grad_input_mask[0]) grad_q = at::matmul(ds, kk) * sm_scale;
    if (grad_input_mask[1])
      grad_k = sum_heads(at::matmul(ds.transpose(-2, -1), q) * sm_scale, groups);
    if (bias_grad) grad_bias = at::sum_to(ds, attn_bias.sizes());
  }
  auto finish = [](const at::Tensor& g, const at::Tensor& like) {
    return g.defined() ? g.to(like.scalar_type()) : at::Tensor();
  };
  return {finish(grad_q, query), finish(grad_k, key), finish(grad_v, value),
          finish(grad_bias, attn_bias)};
}
// [docs:end SDPA_DIFFERENTIABLE_BACKWARD]

std::atomic<int64_t>& g_backward_kernel_calls =
    call_counter("overrideable_ops.attention_backward.kernel");
std::atomic<int64_t>& g_backward_differentiable_calls =
    call_counter("overrideable_ops.attention_backward.differentiable");

bool needs_graph(std::initializer_list<const at::Tensor*> tensors) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : tensors) {
    if (!t->defined()) continue;
    if ((grad_mode && t->requires_grad()) || t->_fw_grad(/*level=*/0).defined()) return true;
  }
  return false;
}

// [docs:start SDPA_BACKWARD_AUTOGRAD]
// The autograd kernel of the fused attention's backward operator on openreg. torch has no
// derivative for it (its generated autograd kernel records "not implemented"), so a second
// derivative through the overrideable backend would fail. When the gradients must themselves
// be differentiable (grad mode on and an input requires grad: backward with create_graph=True;
// or forward-mode tangents), they are computed by differentiable_attention_backward above;
// otherwise (every ordinary backward, where the engine turns grad mode off) the call goes on to
// the kernel below autograd, unchanged: the CPU's flash kernel and its bits.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_attention_backward_autograd(
    c10::DispatchKeySet ks, const at::Tensor& grad_out, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& attn_bias,
    std::array<bool, 4> grad_input_mask, const at::Tensor& out, const at::Tensor& logsumexp,
    const at::Tensor& cum_seq_q, const at::Tensor& cum_seq_k, c10::SymInt max_q,
    c10::SymInt max_k, double dropout_p, bool is_causal, const at::Tensor& philox_seed,
    const at::Tensor& philox_offset, std::optional<double> scale) {
  const char* op = "aten::_scaled_dot_product_fused_attention_overrideable_backward";
  if (grad_out.defined() && needs_graph({&grad_out, &query, &key, &value, &attn_bias})) {
    g_backward_differentiable_calls.fetch_add(1, std::memory_order_relaxed);
    const int device = op_device(op, {&grad_out, &query, &key, &value, &attn_bias});
    check_attention(op, query, key, value, attn_bias, is_causal);
    return differentiable_attention_backward(op, device, grad_out, query, key, value, attn_bias,
                                             grad_input_mask, dropout_p, is_causal, philox_seed,
                                             scale);
  }
  g_backward_kernel_calls.fetch_add(1, std::memory_order_relaxed);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return at::_ops::_scaled_dot_product_fused_attention_overrideable_backward::redispatch(
      ks & c10::after_ADInplaceOrView_keyset, grad_out, query, key, value, attn_bias,
      grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k, std::move(max_q), std::move(max_k),
      dropout_p, is_causal, philox_seed, philox_offset, scale);
}
// [docs:end SDPA_BACKWARD_AUTOGRAD]

}  // namespace

// [docs:start REGISTRATION]
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward_impl));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
  m.impl("native_dropout", TORCH_FN(native_dropout));
  m.impl("_fused_sdp_choice", TORCH_FN(fused_sdp_choice));
  m.impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(fused_attention));
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         TORCH_FN(fused_attention_backward));
}

}  // namespace openreg

// scaled_dot_product_attention does not dispatch _fused_sdp_choice: it calls the DispatchStub of
// the query's device type directly.
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &openreg::fused_sdp_choice)
}
// [docs:end REGISTRATION]

namespace openreg {
// [docs:start AUTOGRAD_REGISTRATION]
// Only the fused attention's backward needs an autograd kernel of its own (for its second
// derivative); every other operator here keeps the one torch generates from derivatives.yaml.
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         TORCH_FN(fused_attention_backward_autograd));
}
// [docs:end AUTOGRAD_REGISTRATION]
}  // namespace openreg
