// The qops operator schemas: the one place where every op is defined.
//
// Implementations live elsewhere: the reference (CPU) and fake (meta) implementations are
// registered from Python (python/qops/), the CUDA implementations from the per-family files in
// ops/ (TORCH_LIBRARY_IMPL(qops, CUDA, m)). docs/ops.md states each op's numerical contract.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(qops, m) {
  // ---- symmetric int8 quantization --------------------------------------------------------
  m.def("quant_per_token(Tensor input, *, bool enable_pdl=True) -> (Tensor, Tensor)");
  m.def("quant_per_tensor(Tensor input, Tensor scale, *, bool enable_pdl=True) -> Tensor");

  // ---- RMSNorm (+ residual add) + int8 quant ----------------------------------------------
  // Keyword-only launch options (qops.NormTuning; 0 / "auto" = the kernel's own choice).
  m.def(
      "rms_norm_quant(Tensor input, Tensor weight, float epsilon, Tensor? scale=None, *,"
      " bool enable_pdl=True, str variant=\"auto\", int pipe_stages=0,"
      " int threads_per_row=0, int cluster=0) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm_quant(Tensor input, Tensor(a!) residual, Tensor weight,"
      " float epsilon, Tensor? scale=None, *, bool enable_pdl=True, str variant=\"auto\","
      " int pipe_stages=0, int threads_per_row=0, int cluster=0) -> (Tensor, Tensor)");

  // The same norms without the quantization (activation-dtype output: W4A16 layers).
  m.def("rms_norm(Tensor input, Tensor weight, float epsilon, *, bool enable_pdl=True) -> Tensor");
  m.def(
      "fused_add_rms_norm(Tensor input, Tensor(a!) residual, Tensor weight, float epsilon, *,"
      " bool enable_pdl=True) -> Tensor");

  // ---- tensor parallelism: all-reduce + residual add + RMSNorm (+ int8 quant), one kernel ---
  // buffers: int64 [world], the device addresses of every rank's workspace buffer (symmetric
  // memory, buffer_bytes each); the CPU reference holds world 1 only.
  m.def(
      "allreduce_add_rms_norm_quant(Tensor input, Tensor(a!) residual, Tensor weight,"
      " float epsilon, Tensor? scale, Tensor buffers, int rank, int buffer_bytes)"
      " -> (Tensor, Tensor)");
  m.def(
      "allreduce_add_rms_norm(Tensor input, Tensor(a!) residual, Tensor weight, float epsilon,"
      " Tensor buffers, int rank, int buffer_bytes) -> Tensor");

  // ---- SiLU-and-mul + int8 quant ----------------------------------------------------------
  m.def(
      "silu_and_mul_quant(Tensor input, Tensor? scale=None, *, bool enable_pdl=True,"
      " int threads_per_row=0, int cluster=0) -> (Tensor, Tensor)");

  m.def("silu_and_mul(Tensor input, *, bool enable_pdl=True) -> Tensor");

  // ---- rotary position embedding (rotate-half), in place on q and k ------------------------
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos,"
      " Tensor sin, *, bool enable_pdl=True) -> ()");

  // RoPE on q and k (in place) fused with the paged int8 K/V cache write (serving path).
  m.def(
      "rope_and_cache_int8(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor value,"
      " Tensor cos, Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor(e!) k_scales,"
      " Tensor(f!) v_scales, Tensor slot_mapping, *, bool is_neox=True, bool enable_pdl=True)"
      " -> ()");

  // ---- int8 x int8 GEMM with dequantizing epilogue ----------------------------------------
  // gemv_shape / gemv_early: the decode GEMV's launch (qops.GemvTuning; [] / -1 = its choice).
  m.def(
      "w8a8_gemm(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, ScalarType out_dtype,"
      " Tensor? bias=None, *, str config=\"auto\", bool overlap_prologue=False,"
      " bool enable_pdl=True, int[] gemv_shape=[], int gemv_early=-1) -> Tensor");

  // ---- int4-weight x fp16/bf16-activation GEMM (Hopper mixed-input) -----------------------
  m.def("w4a16_prepack(Tensor weight) -> Tensor");
  m.def(
      "w4a16_gemm(Tensor a, Tensor weight_packed, Tensor scales, Tensor? zeros,"
      " int group_size, *, str config=\"auto\", bool enable_pdl=True) -> Tensor");

  // ---- paged int8 KV cache ----------------------------------------------------------------
  m.def(
      "reshape_and_cache_int8(Tensor key, Tensor value, Tensor(a!) k_cache,"
      " Tensor(b!) v_cache, Tensor(c!) k_scales, Tensor(d!) v_scales,"
      " Tensor slot_mapping, *, bool enable_pdl=True) -> ()");
  m.def(
      "paged_decode_attention_int8(Tensor query, Tensor k_cache, Tensor v_cache,"
      " Tensor k_scales, Tensor v_scales, Tensor block_tables, Tensor seq_lens,"
      " float sm_scale, Tensor? alibi_slopes=None, int num_splits=0,"
      " bool overlap_prologue=False, *, bool enable_pdl=True, str merge=\"auto\","
      " int warps=0) -> Tensor");

  // Prefill / chunked prefill over the paged int8 cache: packed queries (cu_seqlens_q) of
  // sequences whose new keys and values are already in the cache.
  m.def(
      "paged_prefill_attention_int8(Tensor query, Tensor k_cache, Tensor v_cache,"
      " Tensor k_scales, Tensor v_scales, Tensor block_tables, Tensor seq_lens,"
      " Tensor cu_seqlens_q, int max_query_len, float sm_scale, Tensor? alibi_slopes=None, *,"
      " bool enable_pdl=True) -> Tensor");

  // ---- int4 KV cache (seed 002 row layout) and the split-K GQA decode ---------------------
  m.def("quantize_kv_int4(Tensor kv, int num_groups, *, float clip_ratio=1.0) -> Tensor");
  m.def(
      "reshape_and_cache_int4(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache,"
      " Tensor slot_mapping, int num_groups, *, float clip_ratio=1.0, bool enable_pdl=True) -> ()");
  // SKVQ (seed 003): sinks and a window of recent tokens in full precision beside the int4 cache.
  m.def(
      "skvq_cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache,"
      " Tensor(c!) k_side, Tensor(d!) v_side, Tensor block_tables, Tensor side_slots,"
      " Tensor seq_lens, Tensor cu_seqlens, int num_groups, int sinks, int window, *,"
      " float clip_ratio=1.0, bool enable_pdl=True) -> ()");
  m.def(
      "int4_gqa_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables,"
      " Tensor seq_lens, float sm_scale, int num_groups, Tensor? k_side=None,"
      " Tensor? v_side=None, Tensor? side_slots=None, int sinks=0, int window=0,"
      " int num_splits=0, *, bool enable_pdl=True, str merge=\"auto\", int warps=0) -> Tensor");
}

// `import qops._C` loads this library (and with it the registrations above).
static PyModuleDef qops_c_module = {PyModuleDef_HEAD_INIT, "_C", "qops operator library", -1,
                                    nullptr};
PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&qops_c_module);
}
