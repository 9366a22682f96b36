// inferd's CPU kernels in one extension: the quantized matmuls (quant_gemm.h, int8_dot.h), paged
// attention for short queries (paged_attention.h), prefill chunks' attention (prefill_attention.h) and the decode step's decoder layers
// (decoder_layers.h), which call the other two directly. One build for all three: the layers'
// bits must equal what the Python path gets from the same kernels, so both use one compiled copy.
#include <pybind11/functional.h>
#include <torch/extension.h>

#include "decoder_layers.h"
#include "dense_gemv.h"
#include "eagle_draft.h"
#include "gguf_blocks.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "quant_gemm.h"
#include "sampling_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // int8_x: quantize x to int8 per 32-block and use integer dot products (int8_dot.h).
  m.def("q8_linear", &quant_gemm::q8_linear, "x[M,K] · dequant(int8 blocks)^T", py::arg("x"),
        py::arg("q"), py::arg("scale"), py::arg("group"), py::arg("int8_x") = false);
  m.def("q4_linear", &quant_gemm::q4_linear, "x[M,K] · dequant(int4 blocks with scale and min)^T",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("mins"), py::arg("group"),
        py::arg("int8_x") = false);
  // With an empty x [0, K] each returns the dequantised weight [N, K] instead.
  m.def("fp8_linear", &quant_gemm::fp8_linear, "x[M,K] · dequant(E4M3 with a scale per group)^T");
  // Whether many-row calls have integer tiles (AVX512-VNNI): without, int8 activations make
  // prefill ~2x slower, so they are not the default there.
#ifdef INT8DOT_ZMM
  m.attr("has_int8_gemm") = true;
#else
  m.attr("has_int8_gemm") = false;
#endif
  // The packed 16-output tiles those builds run (int8_dot.h): the layout int8 / int4 weights take
  // at load there (formats.pack_tiles); elsewhere both raise.
  m.def("pack_int8_tiles", &quant_gemm::pack_int8_tiles, "[w, ws, wm]: q, scales, mins in the tiles' layout",
        py::arg("q"), py::arg("scale"), py::arg("mins"), py::arg("group"));
  m.def("tiles_linear", &quant_gemm::tiles_linear, "x[M,K] · packed tiles^T, int8 activations",
        py::arg("x"), py::arg("w"), py::arg("ws"), py::arg("wm"), py::arg("stream") = true);
  // The prefetch hint of streamed weights (stream_prefetch.h): 0 NTA, 1 T0, 2 none, 3 L2, 4 L2 for
  // passes of several fp32 rows and NTA otherwise.
  m.def("set_stream_prefetch", [](int64_t h) {
    TORCH_CHECK(h >= 0 && h <= 4, "stream prefetch hint: 0 (nta), 1 (t0), 2 (off), 3 (l2) or 4 (l2-rows), not ", h);
    stream_prefetch::hint() = static_cast<int>(h);
  }, py::arg("hint"));
  m.def("stream_prefetch", [] { return static_cast<int64_t>(stream_prefetch::hint()); });
  m.def("tiles_rows", &quant_gemm::tiles_rows, "rows of packed tiles, dequantised to fp32 [R, K]",
        py::arg("w"), py::arg("ws"), py::arg("wm"), py::arg("rows"));
  // GGUF's 5- / 6-bit and K-quant weights (gguf_blocks.h), `type` 0..4: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
  m.def("gguf_blocks_linear", &gguf_blocks::linear,
        "x[M,K] · GGUF blocks (row layout)^T; an empty x gives the dequantised weight", py::arg("x"),
        py::arg("data"), py::arg("scales"), py::arg("mins"), py::arg("type"), py::arg("int8_x") = false);
  m.def("gguf_tiles_linear", &gguf_blocks::tiles_linear, "x[M,K] · GGUF blocks (packed tiles)^T, int8 activations",
        py::arg("x"), py::arg("data"), py::arg("scales"), py::arg("mins"), py::arg("type"), py::arg("stream") = true);

  // fp32 x[M,K] · w^T (+ bias) (dense_gemv.h): the streaming kernel up to dense_max_rows rows,
  // register-blocked tiles above, one summation order, so a row's bits at any row count.
  m.attr("dense_max_rows") = dense::kMaxRows;
  m.def("dense_linear",
        [](const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
          return dense::linear(x, w, bias.has_value() ? *bias : torch::Tensor());
        },
        "x[M,K] · w[N,K]^T (+ bias), fp32", py::arg("x"), py::arg("w"), py::arg("bias") = py::none());

  // window: keys (p - window, p] for a query at p (0: all up to p); softcap: scores -> cap *
  // tanh(scores / cap) (0: none).
  m.def("paged_attention_short", &paged_attn::paged_attention_short,
        "paged attention for short queries (CPU, fp32)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("row_start"), py::arg("q_lens"), py::arg("ctx_lens"), py::arg("block_tables"), py::arg("out"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("prefill_attention", &prefill_attn::prefill_attention,
        "causal attention of a prefill chunk, head size 64: q, out [T, Hq, 64]; k, v [S >= T, Hkv, 64] "
        "(fp32); query i sees keys [0, S - T + i]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("scale"));
  m.def("paged_attention_short_quant", &paged_attn::paged_attention_short_quant,
        "paged attention for short queries over an int8 / fp8 KV cache (CPU, fp32 queries)", py::arg("q"),
        py::arg("k_data"), py::arg("v_data"), py::arg("k_scale"), py::arg("v_scale"), py::arg("code"),
        py::arg("row_start"), py::arg("q_lens"), py::arg("ctx_lens"), py::arg("block_tables"), py::arg("out"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);

  // module_local: the AVX2-only build of this file is loaded beside it (the tests run both).
  // The layers' elementwise ops on fp32 CPU rows (layer_ops.h): the Python layers call them too.
  m.def("rms_norm", &layer_ops::rms_norm, "x / sqrt(mean(x^2) + eps) * w per row");
  m.def("rms_norm_heads", &layer_ops::rms_norm_heads, "rms_norm of each head of x [T, H, D], one weight [D]");
  m.def("add_rms_norm", &layer_ops::add_rms_norm, "(x + delta, rms_norm(x + delta))");
  m.def("copy_slots", &layer_ops::copy_slots, "KV rows of flat slots src -> dst in every layer, K and V");
  m.def("rotary", &layer_ops::rotary, "x * cos + swap_halves(x) * sin for x [T, H, D]");
  m.def("silu_mul", &layer_ops::silu_mul, "silu(gu[:, :I]) * gu[:, I:]");
  m.def("gelu_tanh_mul", &layer_ops::gelu_tanh_mul, "gelu_tanh(gu[:, :I]) * gu[:, I:]");
  // The sampler's row work (sampling_ops.h).
  m.def("argmax_rows", &sampling_ops::argmax_rows, "torch.argmax(x, -1) of fp32 rows");
  m.def("runner_ups", &sampling_ops::runner_ups,
        "each row's next n likeliest after its argmax, and the probabilities of all n + 1");
  m.def("top_k_top_p", &sampling_ops::top_k_top_p, "logits outside each row's top-k / top-p set to -inf",
        py::arg("logits"), py::arg("top_k"), py::arg("top_p"));
  m.def("sample_rows", &sampling_ops::sample_rows, "one token per row of probs by inverse CDF at u",
        py::arg("probs"), py::arg("u"));

  using decoder::LayerWeights;
  using decoder::LinearWeights;
  using decoder::QuantizedCaches;
  using decoder::Shape;
  py::class_<LinearWeights>(m, "LinearWeights", py::module_local())
      .def(py::init([](int64_t kind, torch::Tensor weight, c10::optional<torch::Tensor> scales,
                       c10::optional<torch::Tensor> mins, c10::optional<torch::Tensor> bias, int64_t group,
                       bool stream) {
             return LinearWeights{kind, weight, scales.value_or(torch::Tensor()),
                                  mins.value_or(torch::Tensor()), bias.value_or(torch::Tensor()), group,
                                  stream};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
           py::arg("group"), py::arg("stream") = true);
  py::class_<decoder::MoeWeights>(m, "MoeWeights", py::module_local())
      .def(py::init([](torch::Tensor router, std::vector<LinearWeights> gate_up, std::vector<LinearWeights> down,
                       int64_t top_k, bool renormalize, int64_t activation,
                       c10::optional<LinearWeights> shared_gate_up, c10::optional<LinearWeights> shared_down,
                       c10::optional<torch::Tensor> shared_gate, c10::optional<torch::Tensor> expert_counts,
                       int64_t n_group, int64_t topk_group, double scaling) {
             TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() &&
                             (!shared_gate.has_value() || shared_gate_up.has_value()),
                         "MoeWeights: a shared expert needs its gate_up and down (and its gate, if gated)");
             TORCH_CHECK(n_group >= 1 && topk_group >= 1 && topk_group <= n_group && router.size(0) % n_group == 0,
                         "MoeWeights: 1 <= topk_group <= n_group, experts a multiple of n_group");
             TORCH_CHECK(router.scalar_type() == torch::kFloat32 && router.dim() == 2, "MoeWeights: fp32 router [E, H]");
             const LinearWeights none{0, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), 0};
             return decoder::MoeWeights{router, gate_up, down, top_k, renormalize, activation,
                                        shared_gate_up.value_or(none), shared_down.value_or(none),
                                        shared_gate.value_or(torch::Tensor()), expert_counts.value_or(torch::Tensor()),
                                        n_group, topk_group, scaling, shared_gate_up.has_value()};
           }),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("renormalize"),
           py::arg("activation"), py::arg("shared_gate_up") = py::none(), py::arg("shared_down") = py::none(),
           py::arg("shared_gate") = py::none(), py::arg("expert_counts") = py::none(), py::arg("n_group") = 1,
           py::arg("topk_group") = 1, py::arg("scaling") = 1.0);
  m.def("moe_forward", [](torch::Tensor x, const decoder::MoeWeights& moe, bool int8_activations) {
          const Shape s{0, 0, 0, 0, 0.0, 0.0, int8_activations};
          return decoder::moe_forward(x, moe, s);
        }, "a mixture-of-experts MLP over x [T, hidden]: (output, tokens routed to each expert)",
        py::arg("x"), py::arg("moe"), py::arg("int8_activations"), py::call_guard<py::gil_scoped_release>());
  py::class_<decoder::LoRAWeights>(m, "LoRAWeights", py::module_local())
      .def(py::init([](torch::Tensor a, torch::Tensor b, int64_t parts) {
             TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 && a.dim() == 2 &&
                             b.dim() == 2 && a.size(1) == b.size(0) && parts >= 1,
                         "LoRAWeights: fp32 A [in, C] and B [C, out], parts >= 1");
             return decoder::LoRAWeights{a, b, parts};
           }),
           py::arg("a"), py::arg("b"), py::arg("parts"));
  py::class_<LayerWeights>(m, "LayerWeights", py::module_local())
      .def(py::init([](torch::Tensor input_norm, torch::Tensor post_norm, LinearWeights qkv, LinearWeights o,
                       LinearWeights gate_up, LinearWeights down, c10::optional<torch::Tensor> q_norm,
                       c10::optional<torch::Tensor> k_norm, c10::optional<torch::Tensor> post_attn_norm,
                       c10::optional<torch::Tensor> post_mlp_norm, c10::optional<decoder::MoeWeights> moe,
                       c10::optional<std::vector<decoder::LoRAWeights>> lora) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "LayerWeights: q_norm and k_norm together");
             TORCH_CHECK(post_attn_norm.has_value() == post_mlp_norm.has_value(),
                         "LayerWeights: post_attn_norm and post_mlp_norm together");
             TORCH_CHECK(!lora.has_value() || lora->size() == 4, "LayerWeights: LoRA of qkv, o, gate_up and down");
             LayerWeights w{input_norm, post_norm, qkv, o, gate_up, down,
                            q_norm.value_or(torch::Tensor()), k_norm.value_or(torch::Tensor()),
                            post_attn_norm.value_or(torch::Tensor()), post_mlp_norm.value_or(torch::Tensor()),
                            moe.value_or(decoder::MoeWeights{})};
             if (lora.has_value()) {
               w.qkv_lora = (*lora)[0];
               w.o_lora = (*lora)[1];
               w.gate_up_lora = (*lora)[2];
               w.down_lora = (*lora)[3];
             }
             return w;
           }),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("post_attn_norm") = py::none(), py::arg("post_mlp_norm") = py::none(),
           py::arg("moe") = py::none(), py::arg("lora") = py::none());
  py::class_<decoder::LayerSpec>(m, "DecoderLayerSpec", py::module_local())
      .def(py::init([](int64_t rope, int64_t window, double scale, double softcap, int64_t activation,
                       bool qk_norm_all) {
             TORCH_CHECK(window >= 0 && softcap >= 0.0 && (activation == 0 || activation == 1),
                         "DecoderLayerSpec: window >= 0, softcap >= 0, activation 0 (silu) or 1 (gelu_tanh)");
             return decoder::LayerSpec{rope, window, scale, softcap, activation, qk_norm_all};
           }),
           py::arg("rope"), py::arg("window"), py::arg("scale"), py::arg("softcap"), py::arg("activation"),
           py::arg("qk_norm_all") = false);
  py::class_<Shape>(m, "DecoderShape", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, bool>(), py::arg("n_heads"),
           py::arg("n_kv"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("scale"), py::arg("int8_activations"));
  py::class_<QuantizedCaches>(m, "QuantizedCaches", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, double>(),
           py::arg("k_scales"), py::arg("v_scales"), py::arg("code"), py::arg("qmax"));
  // The GIL is released for the whole step: a server's event loop streams meanwhile (a
  // tensor-parallel rank's `reduce` takes it back for its call: pybind11's std::function wrapper).
  m.def("decode_layers", &decoder::decode_layers, "every decoder layer of a kernel-group step",
        py::call_guard<py::gil_scoped_release>());

  // A learned draft head's greedy chains (eagle_draft.h).
  py::class_<eagle::HeadWeights>(m, "EagleHeadWeights", py::module_local())
      .def(py::init([](std::vector<torch::Tensor> norms, std::vector<LinearWeights> linears,
                       torch::Tensor vocab_ids, LinearWeights embed, c10::optional<torch::Tensor> exact,
                       double exact_within, int64_t exact_max) {
             TORCH_CHECK(norms.size() == 5 && linears.size() == 6,
                         "EagleHeadWeights: 5 norms (hidden, embed, attn, mlp, out) and 6 linears "
                         "(fc, qkv, o, gate_up, down, vocab)");
             return eagle::HeadWeights{norms[0], norms[1], norms[2], norms[3], norms[4],
                                       linears[0], linears[1], linears[2], linears[3], linears[4], linears[5],
                                       vocab_ids, embed, exact.value_or(torch::Tensor()), exact_within,
                                       exact_max};
           }),
           py::arg("norms"), py::arg("linears"), py::arg("vocab_ids"), py::arg("embed"),
           py::arg("exact") = py::none(), py::arg("exact_within") = 0.0, py::arg("exact_max") = 0);
  m.def("eagle_rescore_close", &eagle::rescore_close,
        "scores within `within` of each row's max rescored against an fp32 LM head, in place");
  m.def("eagle_draft_chains", &eagle::draft_chains, "greedy draft chains of a learned head [B, k]",
        py::call_guard<py::gil_scoped_release>());
  m.def("eagle_cache_entries", &eagle::cache_entries, "(x, keys, values) of a learned head's true positions",
        py::call_guard<py::gil_scoped_release>());
}
