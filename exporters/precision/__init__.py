"""Reduced-precision ONNX graphs: fp16, int8 (static, symmetric Q/DQ for TensorRT) and int8-dynamic (ONNX Runtime CPU).

Every variant starts from the verified fp32 export and is checked against it with ONNX Runtime on the CPU before
it is written: a random multi-segment stream with the memory threaded through (max |log-prob difference|,
top-1 agreement) and a streaming evaluation of held-out text (the change in bits per character or perplexity).
Both go into the file's metadata (`txl_deploy.export`: `precision` and `precision_report`).

- fp16: every float tensor in FP16, the memory state included, except what measurably loses accuracy in FP16:
  the log-softmax of the adaptive softmax and everything after it run in FP32, so `log_probs` stays float32.
  LayerNormalization keeps its statistics in FP32 by its own definition (`stash_type` = 1) and ONNX Runtime's
  and TensorRT's FP16 MatMul/Softmax accumulate in FP32; `-inf` (the attention mask) is exact in FP16.
  Measured on a small trained character model (24k held-out characters): fp16 with only the log-softmax in FP32
  changed bits per character by -5e-6 relative, also keeping Softmax and LayerNormalization in FP32 by -7e-7;
  both far inside the 0.2% target, so they run in FP16 (`keep_fp32_ops` selects otherwise).
- int8: QuantizeLinear/DequantizeLinear pairs with zero-points of 0 (symmetric activations and weights,
  per-channel weights) around the MatMuls that multiply by a weight matrix, calibrated by streaming the user's
  data through the fp32 graph *with its memory*, so the activation ranges are those of steady-state inputs
  (a full ring buffer), not of a cold start. TensorRT builds int8 kernels from this (trt_compat checks it).
  The attention MatMuls (activation x activation: queries x cached keys, probabilities x values, queries x
  the positional table) stay in float: their operands' ranges change with the content of the memory.
- int8-dynamic: ONNX Runtime's dynamic MatMul quantization (per-token activation scales computed at run time,
  MatMulInteger / DynamicQuantizeLinear), the fast path on x86 VNNI/AMX and ARM64 CPUs. TensorRT cannot load it.
- int4: weight-only, block-wise 4-bit weights through ONNX Runtime's MatMulNBits (com.microsoft contrib op; see
  `quantize_int4`), for CPUs and browsers where memory and bandwidth are tight. Activations and the memory state
  stay fp32. TensorRT cannot load it.
"""
