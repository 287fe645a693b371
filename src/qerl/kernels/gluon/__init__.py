"""The Gluon backends (Triton's lower-level Gluon language) of `qerl.kernels.nvfp4_matmul` and
`qerl.kernels.bf16_matmul`: the swap-AB decode kernels (`nvfp4`, its sm_90 wgmma form `nvfp4_wgmma`, `bf16`),
the warp-specialized sm_90 forward (`nvfp4_wgmma_ws`) and input-gradient (`nvfp4_grad_input`) kernels, and
what they share (`common`). GPU-only (Gluon does not run under the Triton interpreter); import lazily."""
