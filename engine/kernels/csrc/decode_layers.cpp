// Every decoder layer of a decode-only step in one op (issue #13).
//
// Why: a decode step of SmolLM2-135M makes ~600 op calls from Python (30 layers of norms, four
// projections, RoPE, the KV store, attention, SiLU-and-mul). Each costs 10-20 us of interpreter,
// argument parsing and module calls on the main thread while the other OpenMP worker spins: perf and
// py-spy on a 64-sequence bf16 decode step put 21 % of the main thread's time outside the kernels, and
// the worker 34 % in libgomp's barrier (benchmarks/HISTORY.md, "Eighth pass"). Here the same kernels
// run in the same order, called through the dispatcher from C++: the results are bit for bit the
// Python path's (tests/test_decode_layers.py), only the glue between them is gone.
//
// What it covers is what engine/model/fused_decode.py sends it: a batch of one-token decodes, float32
// or bfloat16, a KV cache of the model's own dtype, the `cpu` attention backend. Each projection is
// one of these kinds, the layer classes of engine/model/packed_linear.py:
//   0 AMXLinear (amx_linear on the tile layout, an fp32 bias), 1 OneDNNLinear (oneDNN's packed GEMM),
//   2 PanelLinear in fp32 (fp32_gemm on the fp32 panel layout),
//   3 nn.Linear (at::linear), 4 AMXGateUp (gate/up only: amx_gate_up, SiLU-and-mul in its epilogue),
//   5 PanelLinear in bf16 (bf16_gemm on the bf16 panel layout, an fp32 bias),
//   6 PanelGateUp (gate/up only: fp32_gate_up_silu on the fp32 panels, SiLU-and-mul in its epilogue),
//   1000 + a ggml type: QuantLinear of engine/model/quant_linear.py (quant_linear on GGUF blocks of that type),
//   2000 + a packed ggml type: QuantGateUp (gate/up only: quant_gate_up, SiLU-and-mul on the tile pairs).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t kPerLayer = 4;     // projections per layer: qkv, o, gate_up, down
constexpr int64_t kQuantKind = 1000;        // a QuantLinear's kind: this + its ggml type
constexpr int64_t kQuantGateUpKind = 2000;  // a QuantGateUp's: this + its (packed) kernel format

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Typed handles to the ops the Python path calls (their C++ signatures, as registered).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      op("kvtop_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)> add_norm =
      op("kvtop_cpu::fused_add_rms_norm")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)> rope =
      op("kvtop_cpu::rotary_embedding")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&)>
      store_kv = op("kvtop_cpu::store_kv")
                     .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, const std::optional<at::Tensor>&,
                                      const std::optional<at::Tensor>&)>
      decode = op("kvtop_cpu::paged_decode")
                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, double, const std::optional<at::Tensor>&,
                                     const std::optional<at::Tensor>&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      op("kvtop_cpu::silu_and_mul").typed<at::Tensor(const at::Tensor&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      amx = op("kvtop_cpu::amx_linear")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                      bool)>
      gate_up = op("kvtop_cpu::amx_gate_up")
                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                      bool)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      fp32 = op("kvtop_cpu::fp32_gemm")
                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      fp32_gate_up = op("kvtop_cpu::fp32_gate_up_silu")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                           int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      bf16 = op("kvtop_cpu::bf16_gemm")
                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      const std::optional<at::Tensor>&)>
      quant = op("kvtop_cpu::quant_linear")
                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                    const std::optional<at::Tensor>&)>();
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                      const std::optional<at::Tensor>&, bool)>
      quant_gate_up = op("kvtop_cpu::quant_gate_up")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                            const std::optional<at::Tensor>&, bool)>();
};

const Ops& ops() {
  static const Ops o;  // looked up once per process, at the first call (every op is registered by then)
  return o;
}

// oneDNN's packed linear, boxed as Python calls it: (x, w, bias, "none", [], "").
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle linear = op("mkldnn::_linear_pointwise");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  linear.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor linear(int64_t kind, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t n) {
  switch (kind) {
    case 0: return ops().amx.call(x, w, bias, n);
    case 1: return onednn_linear(x, w, bias);
    case 2: return ops().fp32.call(x, w, bias, n);
    case 3: return at::linear(x, w, bias);
    case 5: return ops().bf16.call(x, w, bias, n);
    default:
      TORCH_CHECK(kind > kQuantKind && kind < kQuantGateUpKind, "decode_layers: unknown linear kind ", kind);
      return ops().quant.call(x, w, kind - kQuantKind, n, bias);
  }
}

struct Shape {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
};

// DecoderLayer.forward (engine/model/llama.py) for one layer, the same ops in the same order.
// `x`: the previous layer's MLP output (or, at layer 0 with `residual` undefined, the embeddings).
at::Tensor layer(int64_t i, const at::Tensor& x, at::Tensor& residual, const at::Tensor& cos, const at::Tensor& sin,
                 at::TensorList norms, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                 at::IntArrayRef kinds, at::IntArrayRef out, const c10::List<std::optional<at::Tensor>>& qk_norms,
                 const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                 const at::Tensor& tables, const at::Tensor& lens, const Shape& s) {
  const Ops& o = ops();
  const int64_t n = x.size(0), q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const int64_t p = i * kPerLayer;
  auto proj = [&](int64_t j, const at::Tensor& in) {
    return linear(kinds[p + j], in, weights[p + j], biases.get(p + j), out[j]);
  };
  at::Tensor h;
  if (!residual.defined()) {
    residual = x;
    h = o.rms_norm.call(x, norms[2 * i], s.eps);
  } else {
    h = o.add_norm.call(x, residual, norms[2 * i], s.eps);
  }
  const std::vector<at::Tensor> qkv = proj(0, h).split_with_sizes({q_size, kv_size, kv_size}, -1);
  at::Tensor q = qkv[0].view({n, s.heads, s.head_dim});
  at::Tensor k = qkv[1].view({n, s.kv_heads, s.head_dim});
  const at::Tensor v = qkv[2].view({n, s.kv_heads, s.head_dim});
  if (!qk_norms.empty()) {
    q = o.rms_norm.call(q, *qk_norms.get(2 * i), s.eps);
    k = o.rms_norm.call(k, *qk_norms.get(2 * i + 1), s.eps);
  }
  o.rope.call(q, k, cos, sin);  // in place
  o.store_kv.call(k, v, k_cache, v_cache, slots);
  // the op takes the query as it is and answers in its dtype
  const at::Tensor attn = o.decode.call(q, k_cache, v_cache, tables, lens, s.scale, std::nullopt, std::nullopt);
  h = o.add_norm.call(proj(1, attn.reshape({n, q_size})), residual, norms[2 * i + 1], s.eps);
  // the gate/up kinds with SiLU-and-mul in their epilogue: AMXGateUp's, PanelGateUp's and QuantGateUp's silu_and_mul
  if (kinds[p + 2] == 4) return proj(3, o.gate_up.call(h, weights[p + 2], biases.get(p + 2), out[2] / 2, true));
  if (kinds[p + 2] == 6) return proj(3, o.fp32_gate_up.call(h, weights[p + 2], biases.get(p + 2), out[2] / 2));
  if (kinds[p + 2] > kQuantGateUpKind)
    return proj(3, o.quant_gate_up.call(h, weights[p + 2], kinds[p + 2] - kQuantGateUpKind, out[2] / 2, biases.get(p + 2), true));
  return proj(3, o.silu_mul.call(proj(2, h)));
}

// Layers [0, L) of a decode-only step: returns [the last layer's MLP output, the residual stream],
// what CausalLM.forward's loop leaves for its final norm.
std::vector<at::Tensor> decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList norms, at::TensorList weights,
                                      const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef kinds,
                                      at::IntArrayRef out_features, const c10::List<std::optional<at::Tensor>>& qk_norms,
                                      at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                                      int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == kPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kPerLayer * layers &&
                  static_cast<int64_t>(kinds.size()) == kPerLayer * layers &&
                  static_cast<int64_t>(out_features.size()) == kPerLayer,
              "decode_layers: per-layer lists of the wrong length");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "decode_layers: qk_norms must be empty or two per layer");
  TORCH_CHECK(x.dim() == 2 && seq_lens.numel() == x.size(0) && block_tables.size(0) == x.size(0),
              "decode_layers: one token, one table and one length per sequence");
  const Shape s{num_heads, num_kv_heads, head_dim, eps, scale};
  const at::Tensor tables = block_tables.to(at::kInt).contiguous();
  at::Tensor h = x, residual;
  for (int64_t i = 0; i < layers; ++i) {
    h = layer(i, h, residual, cos, sin, norms, weights, biases, kinds, out_features, qk_norms, k_caches[i],
              v_caches[i], slot_mapping, tables, seq_lens, s);
  }
  return {h, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtop_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor?[] biases, "
      "int[] kinds, int[] out_features, Tensor?[] qk_norms, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, "
      "float eps, float scale) -> Tensor[]",
      &decode_layers);
}
