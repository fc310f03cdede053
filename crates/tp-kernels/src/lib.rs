//! tp-kernels: matrix-vector and small matrix-matrix products over GGUF quantized blocks.
