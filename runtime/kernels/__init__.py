"""Every Pallas kernel (Triton on NVIDIA GPUs, Mosaic on TPUs), each with its tuning table, and the XLA reference
each must match (tests/test_attention.py, test_tpu_attention.py, test_sampler_filters.py,
test_gpu_gemv.py):

  gpu_decode_attention, gpu_ragged_attention, tpu_ragged_attention   attention/reference.py (paged_attention)
  gpu_fused_decode_attention   attention/reference.py after models/layers.py's q/k norms and rope
  gpu_sampler, gpu_mass_above   sampling/sampler.py (draw_by_candidates, mass_above)
  gpu_gemv   models/quantization.py's dense matmul of the dequantized weight

The attention kernels read FP8 pages too (attention/kv_quantization.py: upcast after the load, scales folded in).
The rooms that call them (attention/, sampling/, models/) choose a kernel by backend and shape."""
