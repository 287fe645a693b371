"""The Triton backends of the kernel entry modules (`qerl.kernels.nvfp4_matmul`, `mxfp4_matmul`, `lora_a`,
`fused_ops`, `decode_attention`) and the sampler behind `qerl.rollout.sampling`. Every module here imports
Triton: import them lazily, only once a kernel will run. The modules import the real Triton by absolute
`import triton`; this package, `qerl.kernels.triton`, never shadows it."""
